"""Per-rank memory of training: model states (ZeRO accounting) and activations.

Model states follow Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", §3.1 and §5.1: with Ψ parameters, mixed-precision Adam keeps 2Ψ bytes of 16-bit
parameters, 2Ψ of 16-bit gradients and KΨ = 12Ψ of optimizer state (a 4Ψ fp32 master copy plus 4Ψ
momentum and 4Ψ variance). ZeRO stage 1 shards the K term over the N data-parallel ranks, stage 2 also
the gradients, stage 3 also the parameters. Pure fp32 training has no separate master copy: 4Ψ + 4Ψ + 8Ψ.

Mixed precision has two memory layouts (``MEMORY_LAYOUTS``), and every function here takes the one it prices:
"classic" is the paper's above (16-bit parameters and gradients beside an fp32 master; Megatron, DeepSpeed);
"amp" is what ``workbench run --precision bf16|fp16`` trains (torch autocast over fp32 parameters, which are the
masters: 4Ψ + 4Ψ + 8Ψ, the fp32 bytes). Both hold 16Ψ unsharded and 16Ψ/N under ZeRO-3, but not under ZeRO-1/2:
there "amp" keeps 8Ψ replicated at stage 1 (4Ψ at stage 2) where "classic" keeps 4Ψ (2Ψ).

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", §4, which the Ultra-Scale Playbook also uses.

Everything here is plain arithmetic on ints and floats (no torch), so the trace layer, the widgets and the
tests can all call it. Bytes are per rank unless a name says otherwise.
"""

from __future__ import annotations

from workbench.theory.checks import positive_int
from workbench.theory.precisions import ACCEPTED_PRECISIONS, canonical_precision

# Every accepted name (canonical "fp32", "bf16", "fp16" and the aliases "bf16-mixed", "fp16-mixed"):
# ``theory.precisions`` is the one table, shared with `workbench run`.
PRECISIONS: frozenset[str] = frozenset(ACCEPTED_PRECISIONS)

# Where a mixed-precision run keeps its model states. fp32 runs have one layout (4 + 4 + 8), whichever is named.
MEMORY_LAYOUTS: dict[str, str] = {
    "classic": "16-bit parameters and gradients + an fp32 master copy + fp32 optimizer state (Micikevicius et al. "
               "2018, the ZeRO paper, Megatron, DeepSpeed): 2 + 2 + 4 + 8 bytes a parameter with AdamW",
    "amp": "fp32 parameters and gradients (the masters) under torch autocast + fp32 optimizer state, what "
           "`workbench run` trains: 4 + 4 + 8 bytes a parameter with AdamW",
}
DEFAULT_LAYOUT = "classic"  # the published accounting; pass memory_layout="amp" to price what the trainer holds

# Number of fp32 state tensors, each the size of the parameters, that the optimizer keeps.
# AdamW: exp_avg and exp_avg_sq (Loshchilov & Hutter 2019); SGD with momentum: the momentum buffer.
OPTIMIZERS: dict[str, int] = {"adamw": 2, "sgd-momentum": 1, "sgd": 0}

ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")

# Category names shared with the trace ledger and the figures; keep them stable.
CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "master_weights", "optimizer_state")

# Bytes per unit. Binary units (KiB, MiB, GiB) are what allocators and nvidia-smi report.
BYTE_UNITS: dict[str, float] = {
    "B": 1.0,
    "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
    "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30, "TiB": 2.0**40,
}


def to_unit(nbytes: float, unit: str = "GiB") -> float:
    """Convert a byte count to `unit` (one of BYTE_UNITS)."""
    _check_choice("unit", unit, BYTE_UNITS)
    return nbytes / BYTE_UNITS[unit]


def _check_choice(name: str, value: object, choices) -> None:
    """Raise ValueError naming the bad value and the valid ones (a learner's typo should teach)."""
    if value not in choices:
        valid = ", ".join(repr(c) for c in sorted(choices))
        raise ValueError(f"unknown {name} {value!r}; valid choices: {valid}")


def _check_config(n_params: int, dp: int, zero_stage: int, precision: str, optimizer: str,
                  memory_layout: str = DEFAULT_LAYOUT) -> None:
    if isinstance(n_params, bool) or not isinstance(n_params, int | float) or n_params < 0:
        raise ValueError(f"n_params must be a non-negative number, got {n_params!r}")
    positive_int("dp", dp)
    _check_choice("zero_stage", zero_stage, ZERO_STAGES)
    _check_choice("precision", precision, PRECISIONS)
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    _check_choice("memory_layout", memory_layout, MEMORY_LAYOUTS)


def state_bytes_per_param(precision: str = "fp32", optimizer: str = "adamw",
                          memory_layout: str = DEFAULT_LAYOUT) -> dict[str, float]:
    """Bytes per parameter of each model-state category, unsharded (ZeRO paper §3.1, §5.1), in ``memory_layout``.

    >>> state_bytes_per_param("bf16", memory_layout="classic")
    {'parameters': 2.0, 'gradients': 2.0, 'master_weights': 4.0, 'optimizer_state': 8.0}
    >>> state_bytes_per_param("bf16", memory_layout="amp")
    {'parameters': 4.0, 'gradients': 4.0, 'optimizer_state': 8.0}
    """
    _check_config(1, 1, 0, precision, optimizer, memory_layout)
    states = 4.0 * OPTIMIZERS[optimizer]  # fp32 states whatever the compute precision
    if canonical_precision(precision) == "fp32" or memory_layout == "amp":
        # fp32, or autocast over fp32 parameters: the parameters are the masters, gradients land in fp32 .grad
        return {"parameters": 4.0, "gradients": 4.0, "optimizer_state": states}
    # classic: 16-bit params and grads; the fp32 master copy is what the optimizer updates.
    # (The fp16 loss scaler is one scalar, so both mixed modes cost the same bytes.)
    return {"parameters": 2.0, "gradients": 2.0, "master_weights": 4.0, "optimizer_state": states}


def _sharded_categories(zero_stage: int) -> set[str]:
    """Categories that ZeRO stage `zero_stage` partitions over the dp ranks (ZeRO paper §5.1)."""
    sharded: set[str] = set()
    if zero_stage >= 1:
        sharded |= {"optimizer_state", "master_weights"}  # P_os
    if zero_stage >= 2:
        sharded.add("gradients")  # P_os+g
    if zero_stage >= 3:
        sharded.add("parameters")  # P_os+g+p
    return sharded


def _offloaded_categories(zero_stage: int, offload: bool) -> set[str]:
    """Categories that live in CPU memory under offload.

    ZeRO-Offload (Ren et al. 2021) keeps the fp32 master copy and Adam states on the CPU and runs the
    optimizer step there; ZeRO-3 with parameter offload (ZeRO-Infinity, Rajbhandari et al. 2021) also
    parks the parameter shards on the CPU and gathers them onto the device layer by layer. Gradients are
    produced on the device, so we keep them there (FSDP2's CPUOffloadPolicy also moves them; that
    difference is small beside the K term and is noted rather than modelled).
    """
    if not offload:
        return set()
    moved = {"optimizer_state", "master_weights"}
    if zero_stage == 3:
        moved.add("parameters")
    return moved


def _per_rank_bytes(n_params, dp, zero_stage, precision, optimizer, memory_layout) -> dict[str, float]:
    _check_config(n_params, dp, zero_stage, precision, optimizer, memory_layout)
    sharded = _sharded_categories(zero_stage)
    full = {k: b * float(n_params) for k, b in state_bytes_per_param(precision, optimizer, memory_layout).items()}
    return {k: (v / dp if k in sharded else v) for k, v in full.items()}


def model_state_bytes(
    n_params: int,
    dp: int = 1,
    zero_stage: int = 0,
    precision: str = "fp32",
    optimizer: str = "adamw",
    offload: bool = False,
    memory_layout: str = DEFAULT_LAYOUT,
) -> dict[str, float]:
    """Device bytes per rank for parameters, gradients, optimizer_state (and master_weights in the classic
    mixed layout): the one model-state price, used by ``theory.parallelism``, the calculator, `workbench calc`, the
    notebooks and the tests that hold the trainer's ledger to it. ``memory_layout`` is one of ``MEMORY_LAYOUTS``: "amp"
    for what `workbench run` holds, "classic" (the default) for the ZeRO paper's 16-bit parameters and gradients.

    With `offload=True` the categories moved to the CPU are still present, as 0.0, so a figure keeps the
    same stack; `offloaded_bytes` returns what went to the CPU instead.

    >>> model_state_bytes(10**9)["optimizer_state"]  # fp32 Adam: 8 bytes per parameter
    8000000000.0
    """
    per_rank = _per_rank_bytes(n_params, dp, zero_stage, precision, optimizer, memory_layout)
    moved = _offloaded_categories(zero_stage, offload)
    return {k: (0.0 if k in moved else v) for k, v in per_rank.items()}


def offloaded_bytes(
    n_params: int,
    dp: int = 1,
    zero_stage: int = 0,
    precision: str = "fp32",
    optimizer: str = "adamw",
    offload: bool = True,
    memory_layout: str = DEFAULT_LAYOUT,
) -> dict[str, float]:
    """CPU bytes per rank under offload, same keys as `model_state_bytes` (0.0 where nothing moved)."""
    per_rank = _per_rank_bytes(n_params, dp, zero_stage, precision, optimizer, memory_layout)
    moved = _offloaded_categories(zero_stage, offload)
    return {k: (v if k in moved else 0.0) for k, v in per_rank.items()}


def total_bytes(
    n_params: int,
    dp: int = 1,
    zero_stage: int = 0,
    precision: str = "fp32",
    optimizer: str = "adamw",
    offload: bool = False,
    activations: float = 0.0,
    memory_layout: str = DEFAULT_LAYOUT,
) -> float:
    """Device bytes per rank: model states plus `activations` (e.g. from `activation_bytes`)."""
    states = model_state_bytes(n_params, dp, zero_stage, precision, optimizer, offload, memory_layout)
    return sum(states.values()) + activations


def _coeff(x: float) -> str:
    return f"{x:g}Ψ"


def formula(zero_stage: int, precision: str = "fp32", optimizer: str = "adamw", offload: bool = False,
            memory_layout: str = DEFAULT_LAYOUT) -> str:
    """Human-readable per-rank formula in the ZeRO paper's notation, e.g. "2Ψ + 2Ψ + 12Ψ/N".

    Terms are parameters + gradients + K (master copy and optimizer states); terms sharded by ZeRO are
    merged into one "/N" term, as in the paper's Figure 1. Offloaded terms are shown after "CPU:".
    """
    per_param = state_bytes_per_param(precision, optimizer, memory_layout)
    _check_config(1, 1, zero_stage, precision, optimizer, memory_layout)
    sharded = _sharded_categories(zero_stage)
    moved = _offloaded_categories(zero_stage, offload)
    k = per_param.get("master_weights", 0.0) + per_param["optimizer_state"]
    terms = [("parameters", per_param["parameters"]), ("gradients", per_param["gradients"]), ("K", k)]
    dev, cpu = _formula_side(terms, sharded, moved, on_cpu=False), _formula_side(terms, sharded, moved, True)
    return dev if not cpu else f"{dev}  (CPU: {cpu})"


def _formula_side(terms, sharded: set[str], moved: set[str], on_cpu: bool) -> str:
    """Join the replicated terms and one merged sharded term for the device or the CPU side."""
    shard_names = {"K" if n in ("optimizer_state", "master_weights") else n for n in sharded}
    moved_names = {"K" if n in ("optimizer_state", "master_weights") else n for n in moved}
    picked = [(n, c) for n, c in terms if c > 0 and ((n in moved_names) == on_cpu)]
    whole = [_coeff(c) for n, c in picked if n not in shard_names]
    split = sum(c for n, c in picked if n in shard_names)
    if split:
        whole.append(f"{_coeff(split)}/N")
    return " + ".join(whole) if whole else ("0" if not on_cpu else "")


def activation_bytes(
    batch: int,
    seq_len: int,
    d_model: int,
    n_layer: int,
    n_head: int,
    bytes_per_value: float = 4,
    recompute: str = "none",
    dropout: bool = True,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> float:
    """Saved-activation bytes per rank for the transformer blocks (Korthikanti et al. 2022, §4).

    The paper counts, per layer, sbh(34 + 5as/h) bytes for 16-bit activations with s = seq_len,
    b = batch, h = d_model, a = n_head. Splitting that count into values and 1-byte dropout masks
    (so it scales with `bytes_per_value` = p instead of assuming p = 2):

    - attention: QKV input, Q, K, V, output-projection input = 5p·sbh; softmax output and its dropout
      output = 2p·as²b; two dropout masks (attention probs, output) = as²b + sbh
    - MLP: fc input p·sbh, GeLU input 4p·sbh, GeLU output 4p·sbh, dropout mask sbh
    - two LayerNorm inputs: 2p·sbh

    total per layer = (16p + 2)·sbh + (2p + 1)·as²b, which is 34·sbh + 5·as²b at p = 2.
    `dropout=False` (nanoGPT with p_drop = 0, llama) drops the mask bytes and the dropout output:
    16p·sbh + p·as²b.

    Assumptions: a 4h MLP; embeddings, final LayerNorm, logits and the loss are not counted (the paper
    treats them separately, they are small for many layers); no allocator fragmentation; one micro-batch
    in flight (pipeline schedules multiply this).

    recompute: "none" keeps everything; "selective" recomputes the attention core, dropping the as²b
    terms (paper §5); "full" keeps only each layer's input, p·sbh per layer (the transient activations of
    the one layer being recomputed in the backward pass are not included).
    tp/sequence_parallel: tensor parallelism splits all but the LayerNorm inputs, the linear inputs that
    follow them and the 2 dropout masks (4p + 2)·sbh; sequence parallelism splits those too (paper §4.2).
    """
    for name, value in (("batch", batch), ("seq_len", seq_len), ("d_model", d_model),
                        ("n_layer", n_layer), ("n_head", n_head), ("tp", tp)):
        positive_int(name, value)
    _check_choice("recompute", recompute, RECOMPUTE_MODES)
    if bytes_per_value <= 0:
        raise ValueError(f"bytes_per_value must be > 0, got {bytes_per_value!r}")
    sbh = float(seq_len) * batch * d_model
    if recompute == "full":
        per_layer = bytes_per_value * sbh / (tp if sequence_parallel else 1)
        return n_layer * per_layer
    per_layer = _layer_linear_bytes(sbh, bytes_per_value, dropout, tp, sequence_parallel)
    if recompute == "none":
        per_layer += _attention_core_bytes(batch, seq_len, n_head, bytes_per_value, dropout) / tp
    return n_layer * per_layer


def _attention_core_bytes(batch: int, seq_len: int, n_head: int, p: float, dropout: bool) -> float:
    """The as²b part of one layer: softmax output (+ dropout mask and output when dropout is on)."""
    per_score = 2.0 * p + 1.0 if dropout else p
    return per_score * n_head * float(seq_len) ** 2 * batch


def _layer_linear_bytes(sbh: float, p: float, dropout: bool, tp: int, sp: bool) -> float:
    """The sbh-proportional part of one layer: (16p + 2)·sbh with dropout, 16p·sbh without."""
    masks = 2.0 if dropout else 0.0
    unsplit = 4.0 * p + masks  # LayerNorm inputs, the linear inputs after them, two dropout masks
    split = 12.0 * p  # everything else is partitioned by tensor parallelism
    if sp:
        return (unsplit + split) * sbh / tp
    return (unsplit + split / tp) * sbh


def kv_heads_per_rank(n_head: int, n_kv_head: int, tp: int) -> float:
    """K/V heads one tensor-parallel rank holds under grouped-query attention (Ainslie et al. 2023).

    Up to tp = n_kv_head the K/V heads split like the query heads; past it a rank still needs the one K/V head
    its query heads read, so each K/V head is *replicated* on tp / n_kv_head ranks (as Megatron-LM does):
    1 head per rank, not n_kv_head / tp. ValueError when neither of tp and n_kv_head divides the other."""
    _check_sizes(n_head=n_head, n_kv_head=n_kv_head, tp=tp)
    if n_head % n_kv_head:
        raise ValueError(f"n_kv_head={n_kv_head} must divide n_head={n_head} (each K/V head serves a group)")
    if n_kv_head % tp and tp % n_kv_head:
        raise ValueError(f"tp={tp} with n_kv_head={n_kv_head}: tp must divide the K/V heads or be a multiple of "
                         f"them (then each K/V head is replicated on tp / n_kv_head ranks)")
    return n_kv_head / tp if tp <= n_kv_head else 1.0


def llama_activation_bytes(
    batch: int,
    seq_len: int,
    d_model: int,
    n_layer: int,
    n_head: int,
    n_kv_head: int,
    ffn_hidden: int,
    bytes_per_value: float = 2,
    recompute: str = "none",
    tp: int = 1,
    sequence_parallel: bool = False,
) -> float:
    """Saved-activation bytes per rank of Llama-shaped blocks (RMSNorm, grouped-query attention, SwiGLU MLP).

    Korthikanti et al. 2022's count (``activation_bytes``, no dropout) with the two changes Llama makes, p bytes
    a value, f = ``ffn_hidden``, g = n_kv_head / n_head:

    - attention: the two RMSNorm inputs and the q/k/v input 3p·sbh; Q p·sbh; K and V 2g·p·sbh (GQA keeps
      only the n_kv_head heads, the groups share them); the out-projection's input p·sbh; softmax output p·as²b;
    - SwiGLU MLP: its input p·sbh, then four f-wide tensors, 4p·sbf: the gate's output (SiLU's input), SiLU's
      output and the up projection's output (both inputs of the product), the product (the down projection's
      input). At Llama-2-70B's f = 3.5h that is 14p·sbh where a 4h GeLU MLP keeps 8p·sbh.

    tp splits everything but the norm inputs and the inputs of q/k/v and the MLP (4p·sbh; sp splits those too);
    K and V split by tp only up to n_kv_head, past it each rank keeps one K/V head (``kv_heads_per_rank``).
    recompute: "selective" drops the as²b term, "full" keeps each layer's input p·sbh. The attention core as
    PyTorch's fused kernel runs it saves no as²b; "selective" prices that case.
    """
    _check_sizes(batch=batch, seq_len=seq_len, d_model=d_model, n_layer=n_layer, ffn_hidden=ffn_hidden)
    _check_choice("recompute", recompute, RECOMPUTE_MODES)
    if bytes_per_value <= 0:
        raise ValueError(f"bytes_per_value must be > 0, got {bytes_per_value!r}")
    kv = kv_heads_per_rank(n_head, n_kv_head, tp)
    p, sb = float(bytes_per_value), float(seq_len) * batch
    sbh = sb * d_model
    if recompute == "full":
        return n_layer * p * sbh / (tp if sequence_parallel else 1)
    unsplit = 4 * p * sbh / (tp if sequence_parallel else 1)
    split = (2 * p * sbh + 4 * p * sb * ffn_hidden) / tp + 2 * p * sb * (d_model // n_head) * kv
    core = p * n_head * float(seq_len) ** 2 * batch / tp if recompute == "none" else 0.0
    return n_layer * (unsplit + split + core)


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        positive_int(name, value)


def gpt_block_activation_bytes(
    batch: int,
    seq_len: int,
    d_model: int,
    n_head: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    bytes_per_value: float = 4,
) -> float:
    """Bytes autograd saves for one block of ``workbench.models.gpt`` on one rank: what the ledger's
    ``activations`` category measures (saved-tensor hooks, one count per storage, parameters excluded).

    Korthikanti et al. 2022, §4.2.2 count per layer sbh(10 + 24/t + 5as/(ht)) with tensor parallelism and
    sbh(34/t + 5as/(ht)) with sequence parallelism too, for 2-byte activations and dropout
    (``activation_bytes``). Adapted to this GPT, which has no dropout and runs attention in the fused
    scaled-dot-product kernel PyTorch uses on the CPU, with p = ``bytes_per_value`` and t = ``tp``:

    - kept whole by TP, split by SP: the two LayerNorm inputs 2p·sbh, their outputs (the q/k/v and fc
      inputs; under SP the column layers store this rank's shard) 2p·sbh, and each LayerNorm's fp32 mean
      and 1/std per position, 2·2·4·sb;
    - split by TP: q, k, v 3p·sbh; the attention output (the out-projection's input is a view of it)
      p·sbh; the GeLU's input and output 8p·sbh; the kernel's fp32 log-sum-exp per head and position 4·asb,
      in place of the paper's 5as²b (softmax, its dropout and the mask: the fused kernel recomputes them).

    TP: (4p·sbh + 16sb) + (12p·sbh + 4asb)/t; TP+SP: (16p·sbh + 16sb + 4asb)/t. At p = 2 the sbh part is
    the paper's sbh(10 + 24/t) less the two 1-byte dropout masks: sbh(8 + 24/t), and 32/t with SP.
    """
    _check_sizes(batch=batch, seq_len=seq_len, d_model=d_model, n_head=n_head, tp=tp)
    sbh, sb = float(seq_len) * batch * d_model, float(seq_len) * batch
    whole = 4 * bytes_per_value * sbh + 16 * sb  # LayerNorm inputs, outputs, statistics
    split = 12 * bytes_per_value * sbh + 4 * n_head * sb  # q, k, v, attention output, GeLU in/out, lse
    return (whole + split) / tp if sequence_parallel else whole + split / tp


def gpt_activation_bytes(
    batch: int,
    seq_len: int,
    d_model: int,
    n_layer: int,
    n_head: int,
    vocab_size: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    bytes_per_value: float = 4,
) -> dict[str, float]:
    """Saved-activation bytes of one forward of the tensor-parallel GPT (``apply_tensor_parallel`` or
    ``apply_sequence_parallel``) on one rank, by part, with "total"; what ``Tracer.activations`` measures.

    - "blocks": n_layer × ``gpt_block_activation_bytes``;
    - "final_norm_and_head": the final LayerNorm's input p·sbh and statistics 8sb, the head's input p·sbh
      (split by SP: the LayerNorm runs on the shard, the head stores it);
    - "embedding_and_loss", the same with and without SP: token ids (int64, 8sb) and the ownership mask
      (bool, sb) of the vocab-parallel lookup, the position ids (8s), and the vocab-parallel loss's softmax
      over this rank's vocabulary slice (fp32, 4sb·V/t), target ids (8sb) and ownership mask (sb).

    The unsplit model's ``F.cross_entropy`` saves other tensors, so "embedding_and_loss" describes the
    vocab-parallel path only (tp = 1 included).
    """
    _check_sizes(n_layer=n_layer, vocab_size=vocab_size, tp=tp, batch=batch, seq_len=seq_len)
    sbh, sb = float(seq_len) * batch * d_model, float(seq_len) * batch
    block = gpt_block_activation_bytes(batch, seq_len, d_model, n_head, tp, sequence_parallel, bytes_per_value)
    ends = 2 * bytes_per_value * sbh + 8 * sb
    parts = {
        "blocks": n_layer * block,
        "final_norm_and_head": ends / tp if sequence_parallel else ends,
        "embedding_and_loss": 9 * sb + 8.0 * seq_len + 4 * sb * vocab_size / tp + 9 * sb,
    }
    return {**parts, "total": sum(parts.values())}


__all__ = [
    "BYTE_UNITS", "CATEGORIES", "DEFAULT_LAYOUT", "MEMORY_LAYOUTS", "OPTIMIZERS", "PRECISIONS", "RECOMPUTE_MODES",
    "ZERO_STAGES", "activation_bytes", "formula", "gpt_activation_bytes", "gpt_block_activation_bytes",
    "kv_heads_per_rank", "llama_activation_bytes", "model_state_bytes", "offloaded_bytes", "state_bytes_per_param",
    "to_unit", "total_bytes",
]
