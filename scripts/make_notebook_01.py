"""Regenerate notebooks/01_memory_anatomy.ipynb (stored without outputs): python scripts/make_notebook_01.py"""
from pathlib import Path

import nbformat as nbf


def keep_ids(cells, path):
    """Reuse the stored notebook's cell ids: a cell with unchanged source keeps its id, an edited one the id at its position."""
    if not path.exists():
        return
    old = nbf.read(path, as_version=4).cells
    by_source, used = {c.source: c.id for c in old}, set()
    for c in cells:
        if by_source.get(c.source) not in (None, *used):
            c.id = by_source[c.source]
            used.add(c.id)
    for i, c in enumerate(cells):
        if c.id not in used and i < len(old) and old[i].cell_type == c.cell_type and old[i].id not in used:
            c.id = old[i].id
            used.add(c.id)


nb = nbf.v4.new_notebook()
md = nbf.v4.new_markdown_cell
code = nbf.v4.new_code_cell
cells = [
md("""# 01 · Memory anatomy

**The question:** where do the bytes of training go on *one* device?

Before splitting a model over many GPUs it pays to know what has to be split. Training a model with Ψ
parameters keeps four kinds of tensors alive:

| category | what it is | fp32 training | bf16 mixed precision |
|---|---|---|---|
| parameters | the weights | 4Ψ | 2Ψ (16-bit copy) |
| gradients | one per weight, made by backward | 4Ψ | 2Ψ |
| optimizer state | AdamW's momentum and variance (plus, in mixed precision, the fp32 master weights) | 8Ψ | 4Ψ + 8Ψ = 12Ψ |
| activations | what the forward pass saves for backward | grows with batch × sequence length | half of fp32 |

That is **16 bytes per parameter** of model state either way (Rajbhandari et al. 2020, *ZeRO*, §3.1), before
a single activation. In this notebook we *measure* each category on a real (tiny) GPT with the workbench's
memory ledger, the same way the trainer does, and set the measurements beside the formulas."""),
code("""# Parameters (papermill can override these)
PRESET = "tiny"           # GPTConfig preset: "tiny", "small" or "bench"
BATCH_SIZES = [2, 4, 8]   # micro-batch sizes for the activation sweep
SEQ_LEN = 64              # tokens per sequence
SEED = 0
LEARNER_SEED = None  # orders the quiz options; None means $WORKBENCH_LEARNER or your login name
QUIZ_ANSWERS = {}    # headless grading: {"question id": "option text" or a number}""", metadata={"tags": ["parameters"]}),
md("""## 1. The model and Ψ

One process, no ranks: memory anatomy is a single-device question. `build_gpt` makes a small pre-LN GPT in
fp32. Its input embedding and output head share one matrix (weight tying), and `model.parameters()` yields
each shared `Parameter` once, so Ψ counts it once."""),
code("""import time

import numpy as np
import plotly.graph_objects as go
import torch

from workbench import trace
from workbench.models import GPTConfig, build_gpt
from workbench.theory.memory import activation_bytes, formula, model_state_bytes, to_unit
from workbench.viz.memory import measured_vs_theory, memory_bars

T_START = time.time()
cfg = GPTConfig.preset(PRESET, seq_len=SEQ_LEN)
model = build_gpt(cfg, seed=SEED)
params = [p for p in model.parameters() if p.requires_grad]
N_PARAMS = sum(p.numel() for p in params)
print(cfg)
print(f"Ψ = {N_PARAMS:,} parameters (analytic count: {cfg.num_params():,})")
print(f"dtype of every parameter: {sorted({str(p.dtype) for p in params})}")"""),
md("""## 2. Measuring one training step with the ledger

On CPU there is no allocator counter such as `torch.cuda.memory_allocated`, so the workbench keeps a
**memory ledger** (`trace.MemoryLedger`): code that owns memory reports its bytes under one of the
categories in `trace.MEMORY_CATEGORIES`. We do exactly what `Trainer._forward_backward` and the
single-process strategy's `record_memory` (`_record_replicated_memory`) do:

* the forward runs inside `tracer.activations()`: a *saved-tensor hook* sees every tensor autograd keeps
  for backward and adds its storage's bytes to `activations` (each storage once);
* after backward, `release_activations()` sets `activations` back to 0: backward consumed them;
* after `optimizer.step()` (before `zero_grad`, when gradients and optimizer state are both alive),
  `parameters`, `gradients` and `optimizer_state` are set from the real tensors with `trace.tensor_bytes`.

We take a snapshot of the ledger after each phase of the first step."""),
code("""def make_batch(batch_size, step=0):
    g = torch.Generator().manual_seed(SEED * 1000 + step)
    x = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len), generator=g)
    return x, y


def record_model_states(tracer, model, optimizer):
    \"\"\"What _record_replicated_memory does: measure the tensors this process really holds.\"\"\"
    ps = list(model.parameters())
    tracer.memory.set("parameters", trace.tensor_bytes(ps))
    tracer.memory.set("gradients", trace.tensor_bytes(p.grad for p in ps if p.grad is not None))
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    tracer.memory.set("optimizer_state", trace.tensor_bytes(state))


optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
snapshots = {}
with trace.tracing() as tracer:
    x, y = make_batch(BATCH_SIZES[0])
    record_model_states(tracer, model, optimizer)
    snapshots["1 · built"] = dict(tracer.memory.current)
    with tracer.activations():
        loss = model(x, y)
    record_model_states(tracer, model, optimizer)
    snapshots["2 · after forward"] = dict(tracer.memory.current)
    loss.backward()
    tracer.release_activations()
    record_model_states(tracer, model, optimizer)
    snapshots["3 · after backward"] = dict(tracer.memory.current)
    optimizer.step()
    record_model_states(tracer, model, optimizer)
    snapshots["4 · after optimizer.step"] = dict(tracer.memory.current)
    optimizer.zero_grad(set_to_none=True)
    record_model_states(tracer, model, optimizer)
    snapshots["5 · after zero_grad"] = dict(tracer.memory.current)
    ledger_peak = dict(tracer.memory.peak)

for phase, row in snapshots.items():
    cells = "  ".join(f"{k}={v / 1024:8.1f} KiB" for k, v in row.items())
    print(f"{phase:26s} {cells}")
print(f"peak total in the ledger: {tracer.memory.peak_total / 1024:.1f} KiB")
memory_bars(snapshots, title=f"Ledger through one fp32 AdamW step (batch {BATCH_SIZES[0]})", unit="KiB").show()"""),
md("""Read the bars left to right:

* **built**: only the parameters exist. AdamW creates its state *lazily*, on the first `step()`.
* **after forward**: activations appear; gradients do not exist yet.
* **after backward**: the activations were consumed (released), a gradient now sits beside every parameter.
* **after optimizer.step**: AdamW has allocated `exp_avg` and `exp_avg_sq`, each the size of the
  parameters. This is the moment the trainer records, and the peak of model state.
* **after zero_grad** (`set_to_none=True`): the gradients are freed until the next backward.

## 3. Model states: measured vs the formula

`model_state_bytes(Ψ, dp=1, zero_stage=0, precision="fp32", optimizer="adamw")` predicts 4Ψ + 4Ψ + 8Ψ."""),
code("""measured_states = {k: snapshots["4 · after optimizer.step"][k]
                   for k in ("parameters", "gradients", "optimizer_state")}
theory_fp32 = model_state_bytes(N_PARAMS, 1, 0, "fp32", "adamw")
theory_bf16 = model_state_bytes(N_PARAMS, 1, 0, "bf16-mixed", "adamw")

print(f"{'category':16s} {'measured B':>12s} {'theory B':>12s} {'B/param':>8s}")
for cat, nbytes in measured_states.items():
    print(f"{cat:16s} {nbytes:12,d} {theory_fp32[cat]:12,.0f} {nbytes / N_PARAMS:8.2f}")
total = sum(measured_states.values())
print(f"{'total':16s} {total:12,d} {sum(theory_fp32.values()):12,.0f} {total / N_PARAMS:8.2f}")
print()
print("fp32       per param:", {k: v / N_PARAMS for k, v in theory_fp32.items()}, "formula:", formula(0, "fp32"))
print("bf16-mixed per param:", {k: v / N_PARAMS for k, v in theory_bf16.items()},
      "formula:", formula(0, "bf16-mixed"))

fig = measured_vs_theory({"fp32 AdamW": measured_states},
                         {"fp32 AdamW": theory_fp32, "bf16-mixed AdamW (theory only)": theory_bf16},
                         title=f"Model states of the {PRESET} GPT (Ψ = {N_PARAMS:,})", unit="KiB")
fig.show()"""),
md("""Measured and predicted model states agree to the byte: the ledger counts the very tensors the formula
describes. The right-hand pair is what the same model would need in **bf16 mixed precision**: 16-bit
parameters and gradients (2Ψ + 2Ψ), but AdamW still updates an fp32 **master copy** (4Ψ) with fp32 moments
(8Ψ) — 16 bytes per parameter again. Mixed precision saves activation memory and compute, not model-state
memory. (Notebook 05 measures mixed precision itself; here it is theory only.)

## 4. Activations: the part that grows with the batch

Model states are fixed by Ψ. Saved activations grow with batch size *b* and sequence length *s*.
Korthikanti et al. 2022 (§4) count, per transformer layer, `sbh(34 + 5as/h)` bytes — which assumes
**16-bit** values, **dropout** masks, and an **unfused** attention that stores the *s × s* softmax
matrix. Our GPT differs on all three, so we call the formula with arguments that match it:

* `bytes_per_value=4` (fp32), `dropout=False` (our GPT has no dropout) → `16p·sbh + p·as²b` per layer;
* our attention is `F.scaled_dot_product_attention`, a fused kernel that saves Q, K, V, its output and a
  small log-sum-exp per row, and *recomputes* the s × s scores in backward (as FlashAttention does, Dao et
  al. 2022). That is exactly what Korthikanti call **selective recomputation** (§5): the `as²b` term
  disappears. So we draw both predictions: `recompute="none"` (unfused attention) and `recompute="selective"`
  (what a fused kernel keeps)."""),
code("""def measure_activations(batch_size, step):
    \"\"\"Bytes the saved-tensor hook counts for one forward, as Trainer._forward_backward records them.\"\"\"
    x, y = make_batch(batch_size, step)
    with trace.tracing() as tracer:
        with tracer.activations():
            loss = model(x, y)
        saved = tracer.memory.current.get("activations", 0)
        loss.backward()
        tracer.release_activations()
        assert tracer.memory.current["activations"] == 0
    model.zero_grad(set_to_none=True)
    return saved


def predicted(batch_size, recompute):
    return activation_bytes(batch_size, cfg.seq_len, cfg.d_model, cfg.n_layer, cfg.n_head,
                            bytes_per_value=4, recompute=recompute, dropout=False)


sweep = {b: measure_activations(b, step=i + 1) for i, b in enumerate(BATCH_SIZES)}
pred_none = {b: predicted(b, "none") for b in BATCH_SIZES}
pred_sel = {b: predicted(b, "selective") for b in BATCH_SIZES}
print(f"{'batch':>5s} {'measured KiB':>13s} {'theory none':>12s} {'theory selective':>17s} {'measured/selective':>19s}")
for b in BATCH_SIZES:
    print(f"{b:5d} {sweep[b] / 1024:13.1f} {pred_none[b] / 1024:12.1f} {pred_sel[b] / 1024:17.1f} "
          f"{sweep[b] / pred_sel[b]:19.3f}")

bs = np.array(BATCH_SIZES, dtype=float)
slope, intercept = np.polyfit(bs, [sweep[b] for b in BATCH_SIZES], 1)
print(f"\\nlinear fit of the measurement: {slope / 1024:.1f} KiB per sequence + {intercept / 1024:.1f} KiB")
print(f"theory slopes: none {pred_none[BATCH_SIZES[0]] / BATCH_SIZES[0] / 1024:.1f} KiB, "
      f"selective {pred_sel[BATCH_SIZES[0]] / BATCH_SIZES[0] / 1024:.1f} KiB per sequence (intercept 0)")

fig = go.Figure()
fig.add_scatter(x=BATCH_SIZES, y=[sweep[b] / 1024 for b in BATCH_SIZES], mode="lines+markers",
                name="measured (ledger, whole model)")
fig.add_scatter(x=BATCH_SIZES, y=[pred_none[b] / 1024 for b in BATCH_SIZES], mode="lines", line_dash="dash",
                name="Korthikanti, unfused attention (recompute='none')")
fig.add_scatter(x=BATCH_SIZES, y=[pred_sel[b] / 1024 for b in BATCH_SIZES], mode="lines", line_dash="dot",
                name="Korthikanti, fused attention (recompute='selective')")
fig.update_layout(title=f"Saved activations vs batch size ({PRESET} GPT, seq_len {cfg.seq_len}, fp32)",
                  xaxis_title="micro-batch size (sequences)", yaxis_title="KiB saved for backward",
                  yaxis_rangemode="tozero")
fig.show()"""),
md("""Both are straight lines in the batch size: every sequence brings its own copy of every intermediate.
(Doubling the sequence length would double the `sbh` terms and *quadruple* the `as²b` term of an unfused
attention.) But the lines do not coincide: the measured slope is steeper. Rather than
fudge the formula, let us find out which saved tensors make the difference.

### Where the gap comes from

We run one more forward with our own saved-tensor hook that, for every storage autograd keeps, notes
*where* in the model it was saved and whether it is really a parameter seen through a view (for example
the `weight.t()` that a `Linear` saves to compute its input gradient)."""),
code("""param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
where = ["embeddings"]


def tag(name):
    def hook(_module, _args, _output=None):
        where[0] = name
    return hook


handles = []
for block in model.blocks:
    handles.append(block.register_forward_pre_hook(tag("transformer blocks")))
    handles.append(block.register_forward_hook(tag("head + loss (ln_f, lm_head, cross-entropy)")))

breakdown, seen = {}, set()


def pack(t):
    key = t.untyped_storage().data_ptr()
    if key in seen:
        return t
    seen.add(key)
    if key in param_storages:
        kind = "parameters and their views (weight.t()), not counted"
    else:
        kind = where[0]
    breakdown[kind] = breakdown.get(kind, 0) + t.untyped_storage().nbytes()
    return t


B = BATCH_SIZES[-1]
x, y = make_batch(B, step=99)
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    loss = model(x, y)
loss.backward()
model.zero_grad(set_to_none=True)
for h in handles:
    h.remove()

measured_b = measure_activations(B, step=99)
counted = sum(v for k, v in breakdown.items() if "not counted" not in k)
print(f"batch {B}: the ledger counted {measured_b:,} B; this breakdown's counted part sums to {counted:,} B")
for kind, nbytes in breakdown.items():
    print(f"  {kind:44s} {nbytes:10,d} B  {nbytes / measured_b:6.1%}")
blocks = breakdown.get("transformer blocks", 0)
sbh = B * cfg.seq_len * cfg.d_model
print(f"\\ntransformer blocks: {blocks:,} B = {blocks / (4 * sbh * cfg.n_layer):.2f} p·sbh per layer "
      f"(selective theory: 16 p·sbh = {pred_sel[B]:,.0f} B; unfused: {pred_none[B]:,.0f} B)")
print(f"parameter bytes for comparison: {snapshots['4 · after optimizer.step']['parameters']:,} B")"""),
md("""What the breakdown shows (the numbers are above; the reasons are these):

1. **Transformer blocks ≈ 16 p·sbh per layer**, the `recompute="selective"` prediction, plus a sliver: LayerNorm
   saves a mean and a reciprocal standard deviation per token, and the fused attention a log-sum-exp per row
   and head. No s × s matrix is saved, so the unfused prediction overestimates.
2. **Head and loss**: the formula counts the transformer layers only. Our model also saves the final
   LayerNorm's input and output and the cross-entropy's log-softmax, a `b·s·V` tensor (vocabulary `V`). With
   a 256-symbol vocabulary and 2 layers this is a large share; in a 32-layer model with `V` = 32k it is a few
   per cent, which is why Korthikanti et al. treat it separately. It also grows linearly with the batch.
3. **Parameter views**: `Linear` saves `weight.t()` for backward. It is not a leaf, but it shares its storage
   with the parameter, so its bytes already sit under `parameters`: the ledger skips parameters *and views of
   them*, and the breakdown lists them apart, as not counted.
4. **The intercept** of the fit: tensors saved once per forward whatever the batch (the causal mask, small
   bookkeeping); it is small next to the per-sequence slope.

So on one device: model states are fixed at 16 B/param, and activations are a per-token cost that you
control with the micro-batch size, the sequence length, and recomputation (notebook 06).

## 5. Exercise: GPU memory math

Time to scale up. A Llama-2-7B-sized model has Ψ ≈ 6.7 billion parameters. Does it train on **one 80 GB
GPU**? First predict with the table at the top (16 B/param), then check with the calculator, which uses the
same `workbench.theory.memory` functions."""),
code("""from workbench.widgets.memory_calculator import calculator_table, memory_calculator

for precision in ("fp32", "bf16-mixed"):
    t = calculator_table("llama-7B", dp=1, zero_stage=0, precision=precision, device_gb=80)
    parts = ", ".join(f"{k} {to_unit(v, 'GiB'):.1f}" for k, v in t["per_rank"].items())
    print(f"{precision:10s} Ψ = {t['n_params'] / 1e9:.2f} B: {t['total_gib']:6.1f} GiB of model states "
          f"({t['formula']}) -> fits 80 GiB: {t['fits']}")
    print(f"{'':10s} {parts}")
t = calculator_table("llama-7B", dp=1, precision="bf16-mixed", batch=1, seq_len=4096, device_gb=80)
print(f"\\nbf16-mixed + activations of ONE 4096-token sequence: {to_unit(t['per_rank']['activations'], 'GiB'):.1f} "
      f"GiB more, {t['total_gib']:.1f} GiB in all")"""),
md("""Neither fits: ~100 GiB of model states alone, in fp32 *or* bf16-mixed, before any activation. That is
the motivation for the rest of the course: ZeRO/FSDP (notebook 04) shard these 16Ψ bytes across
data-parallel ranks, offload moves the optimizer state to CPU memory, tensor and pipeline parallelism
split the model itself.

Play with the calculator: which ZeRO stage and how many GPUs make llama-7B fit? What does turning on
activations with a long sequence do? Which optimizer would fit on one GPU (and why would you not want it)?"""),
code("""memory_calculator("llama-7B")"""),
md("""## What just happened

* We built a small GPT and trained one step in a single process, measuring each category with the same
  ledger calls the trainer makes: saved-tensor hooks for **activations**, `tensor_bytes` of the real tensors
  for **parameters**, **gradients** and **optimizer state**.
* Model states matched `model_state_bytes` exactly: 4 + 4 + 8 = **16 B/param** in fp32 with AdamW. Mixed
  precision rearranges them (2 + 2 + 12) without shrinking them. AdamW's state only appears after the first
  `step()`, and the gradients only between backward and `zero_grad`.
* Activations grew linearly with the batch. The Korthikanti formula, called with our dtype, no dropout, and
  selective (fused) attention, matches the transformer blocks; the rest of the measurement is the
  embeddings/head/loss that the formula leaves out.
* A 7B model needs ~100 GiB of model states on one device: it does not fit an 80 GB GPU without sharding."""),
md("""## Knowledge check

Answer each question and press **check**. Every option has its own explanation, the tempting wrong ones too, shown
once you have answered. The options are shuffled for your `LEARNER_SEED`, and the answers are stored only as salted
hashes, so the collapsed cell below does not give them away (its feedback strings are best read after answering)."""),
code("""from workbench.widgets.quiz import Choice, Numeric, QuizBook

QUIZ = QuizBook("01 · memory anatomy", seed=LEARNER_SEED)
QUIZ.show(
    Choice("nb01.activations-linear",
           "Why do saved activations grow linearly with batch size and sequence length?",
           {
               "the optimizer keeps one moment estimate per sample of the batch":
                   "AdamW's state is per parameter, 8Ψ bytes in fp32, whatever the batch.",
               "each token of each sequence has its own intermediates that backward needs":
                   "LayerNorm inputs, Q/K/V, the MLP hidden layer: each saved intermediate is a b×s×h (or "
                   "b×s×4h) tensor, the sbh terms of the formula. An unfused attention also saves the a×s×s "
                   "scores, quadratic in s.",
               "backward stores one gradient per sample before summing them over the batch":
                   "Backward sums every sample's contribution into one gradient per parameter as it goes: the "
                   "gradients are Ψ-sized whatever the batch.",
               "the weights are copied once per sequence so sequences can run in parallel":
                   "The weights exist once per device; every sequence of the batch uses the same tensors.",
           },
           key="a73df2001f980b77293f"),
    Numeric("nb01.adam-bytes",
            "A 7-billion-parameter model is trained with AdamW in plain fp32 on one device. How many GB (10⁹ "
            "bytes) do Adam's two moment tensors take?",
            unit="GB", rel_tol=0.03, key="num:MOCwi8zEqW_JZXzu",
            why="AdamW keeps exp_avg and exp_avg_sq, one fp32 number (4 bytes) each per parameter: count the "
                "bytes per parameter, then multiply by Ψ = 7×10⁹. Weights and gradients are not part of the "
                "question."),
    Choice("nb01.bf16-16bytes",
           "Why does bf16 mixed precision still need about 16 bytes of model state per parameter?",
           {
               "the gradients are accumulated in fp64, so rounding errors cannot build up over many "
               "micro-batches":
                   "Gradients are bf16 here, 2 bytes each; nothing is fp64.",
               "a bf16 value is padded to 4 bytes in memory for alignment on GPUs":
                   "A bf16 value is stored in 2 bytes: 1 sign, 8 exponent and 7 mantissa bits.",
               "it does not: 8 bytes per parameter, since every tensor is half the size of fp32":
                   "Only the weights and gradients are bf16 (4 bytes per parameter together); the fp32 master "
                   "weights and Adam's two moments add 12.",
               "the update runs on fp32 master weights and fp32 Adam moments, kept beside the bf16 copies":
                   "2Ψ bf16 weights + 2Ψ bf16 gradients + 4Ψ fp32 master weights + 8Ψ fp32 moments = 16Ψ "
                   "(ZeRO §3.1): an update much smaller than its weight would vanish in bf16's 8-bit "
                   "significand. Mixed precision saves activation memory and time, not model state.",
           },
           key="6cb1da9019be7c8121a1"),
    Choice("nb01.bf16-vs-fp16",
           "Why do large language model trainings prefer bf16 to fp16 for mixed precision?",
           {
               "bf16 has fp32's exponent range, so no loss scaling is needed":
                   "bf16 keeps fp32's 8-bit exponent and reaches ~3.4×10³⁸; fp16 tops out at 65504 and "
                   "flushes values below ~6×10⁻⁸ to zero, so fp16 training needs a dynamic loss scaler, and "
                   "large models still hit overflows on loss spikes.",
               "bf16 has more mantissa bits than fp16, so its rounding error is smaller":
                   "The opposite: bf16 has 7 mantissa bits to fp16's 10, so it is less precise. What it has "
                   "more of is exponent: 8 bits to 5.",
               "bf16 takes half the memory of fp16 for activations and gradients":
                   "Both are 16-bit formats, 2 bytes per value: the memory is the same.",
               "fp16 arithmetic is not supported by GPU tensor cores, only bf16 is":
                   "fp16 tensor cores have existed since the V100 (bf16 only since the A100); fp16 training "
                   "works, with a loss scaler to keep small gradients from underflowing.",
           },
           key="1ba33478850686cc04a0"),
    Choice("nb01.zero-grad",
           "After optimizer.zero_grad(set_to_none=True), what does the memory ledger hold?",
           {
               "parameters, gradients and optimizer state":
                   "set_to_none=True releases the .grad tensors: the gradient bytes are gone until the next "
                   "backward.",
               "only the parameters":
                   "AdamW's moments persist from step to step; only the gradients are dropped.",
               "parameters and optimizer state":
                   "The .grad tensors are dropped until the next backward makes them again; AdamW's moments "
                   "persist from step to step.",
               "only the optimizer state":
                   "The parameters are never freed: the next forward needs them.",
           },
           key="3ccc8ea64fd29f2cb761"),
    Choice("nb01.selective",
           "Why did the measured block activations match recompute='selective' rather than 'none'?",
           {
               "the model's dropout masks replace the attention matrix in memory":
                   "Dropout adds saved masks rather than removing anything.",
               "the attention kernel is fused and does not save the s×s score matrix":
                   "scaled_dot_product_attention (FlashAttention-style) keeps Q, K, V, the output and a "
                   "log-sum-exp and recomputes the scores in backward, which is what selective recomputation "
                   "keeps (Korthikanti et al. 2022, §5).",
               "the ledger's saved-tensor hooks cannot see tensors saved inside attention":
                   "The saved-tensor hooks see every tensor autograd saves, attention's included.",
               "fp32 stores the attention scores at half the size of bf16":
                   "It is the other way round: fp32 is 4 bytes per value, bf16 2.",
           },
           key="134a5d68afd622f2b838"),
)""", metadata={'jupyter': {'source_hidden': True}, 'tags': ['quiz']}),
md("""### Score

The score below updates as you answer. In a headless run (papermill), pass your answers as the `QUIZ_ANSWERS`
parameter, `{"question id": "option text" or a number}`; the ids are printed with the questions."""),
code("""QUIZ.answer_all(QUIZ_ANSWERS)  # answers given as a parameter (headless runs); the widgets above add yours
QUIZ.scoreboard()
print(f"\\nnotebook experiments took {time.time() - T_START:.1f} s")"""),
]
nb.cells = cells
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
OUT = Path(__file__).resolve().parent.parent / "notebooks" / "01_memory_anatomy.ipynb"
keep_ids(nb.cells, OUT)
nbf.write(nb, OUT)
