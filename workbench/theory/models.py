"""Parameter counts and named model sizes for the memory calculator and the notebooks.

`gpt_param_count` is exact for the course's GPT (nanoGPT-shaped, Radford et al. 2019): pre-LN blocks,
learned positional embedding, final LayerNorm, LM head tied to the token embedding. The "llama-*" presets are
Llama-shaped (Touvron et al. 2023, Llama 2): RMSNorm, no biases, a SwiGLU MLP of three matrices of width
``llama_ffn_hidden(d)`` (about 8h/3, rounded as Llama's code does), grouped-query attention with ``n_kv_head``
K/V heads, an untied head; ``llama_param_count`` gives their published totals exactly (tests/test_theory.py).
"gpt-70B" is the same depth and width GPT-shaped (4h GeLU MLP, full multi-head attention, tied head), for
comparison: what "a 70B model" meant in the course before the Llama shapes.
"""

from __future__ import annotations

from workbench.theory.checks import positive_int
from workbench.theory.memory import activation_bytes, llama_activation_bytes


def _block_params(d_model: int, mlp_ratio: int, biases: bool) -> int:
    """One pre-LN block: ln1, attention (q, k, v, proj), ln2, MLP (fc d→r·d, proj r·d→d)."""
    hidden = mlp_ratio * d_model
    ln = 2 * d_model if biases else d_model  # LayerNorm weight (+ bias)
    qkv = 3 * d_model * d_model + (3 * d_model if biases else 0)
    attn_proj = d_model * d_model + (d_model if biases else 0)
    fc = d_model * hidden + (hidden if biases else 0)
    mlp_proj = hidden * d_model + (d_model if biases else 0)
    return 2 * ln + qkv + attn_proj + fc + mlp_proj


def gpt_param_count(
    n_layer: int,
    d_model: int,
    vocab_size: int,
    seq_len: int,
    mlp_ratio: int = 4,
    tied: bool = True,
    biases: bool = True,
) -> int:
    """Exact number of parameters of the course GPT (equals sum(p.numel() for p in model.parameters())).

    Per block with biases and mlp_ratio 4: 12·d² + 13·d. Plus wte (V·d), wpe (T·d), ln_f (2·d) and,
    when untied, an lm_head of V·d without bias. `biases=False` removes linear and LayerNorm biases
    (nanoGPT's `bias=False`).
    """
    for name, value in (("n_layer", n_layer), ("d_model", d_model), ("vocab_size", vocab_size),
                        ("seq_len", seq_len), ("mlp_ratio", mlp_ratio)):
        positive_int(name, value)
    embeddings = vocab_size * d_model + seq_len * d_model
    ln_f = 2 * d_model if biases else d_model
    lm_head = 0 if tied else vocab_size * d_model
    return n_layer * _block_params(d_model, mlp_ratio, biases) + embeddings + ln_f + lm_head


def llama_ffn_hidden(d_model: int, multiple_of: int = 256, ffn_dim_multiplier: float | None = None) -> int:
    """The SwiGLU width Llama's code picks: 2/3 of 4h (so three matrices cost what a 4h MLP's two do), times
    ``ffn_dim_multiplier`` (1.3 for Llama-2-70B), rounded up to a multiple of ``multiple_of`` (256, 4096 for 70B).

    >>> [llama_ffn_hidden(4096), llama_ffn_hidden(5120), llama_ffn_hidden(8192, 4096, 1.3)]
    [11008, 13824, 28672]
    """
    positive_int("d_model", d_model)
    positive_int("multiple_of", multiple_of)
    hidden = int(2 * 4 * d_model / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * -(-hidden // multiple_of)


def llama_param_count(n_layer: int, d_model: int, n_head: int, n_kv_head: int, ffn_hidden: int,
                      vocab_size: int) -> int:
    """Parameters of a Llama-shaped model: per block q and o (d² each), k and v (d · n_kv_head · d/n_head each:
    grouped-query attention), SwiGLU's gate, up and down (3 · d · f) and two RMSNorm weights (2d); an untied
    embedding and head (V·d each) and a final RMSNorm (d). No biases, rotary positions (no parameters)."""
    for name, value in (("n_layer", n_layer), ("d_model", d_model), ("n_head", n_head), ("n_kv_head", n_kv_head),
                        ("ffn_hidden", ffn_hidden), ("vocab_size", vocab_size)):
        positive_int(name, value)
    if d_model % n_head or n_head % n_kv_head:
        raise ValueError(f"n_head={n_head} must divide d_model={d_model} and n_kv_head={n_kv_head} divide n_head")
    kv_width = n_kv_head * (d_model // n_head)
    block = 2 * d_model * d_model + 2 * d_model * kv_width + 3 * d_model * ffn_hidden + 2 * d_model
    return n_layer * block + 2 * vocab_size * d_model + d_model


def _gpt_preset(n_layer: int, d_model: int, n_head: int, vocab_size: int, seq_len: int, note: str) -> dict:
    return {
        "n_layer": n_layer, "d_model": d_model, "n_head": n_head, "vocab_size": vocab_size,
        "seq_len": seq_len, "dropout": False, "exact": True, "note": note, "arch": "gpt",
        "n_params": gpt_param_count(n_layer, d_model, vocab_size, seq_len),
    }


def _llama_preset(n_layer: int, d_model: int, n_head: int, n_params: int, note: str,
                  n_kv_head: int | None = None) -> dict:
    # vocab 32000 and a 4096 context as in Llama 2; no dropout in these models. n_kv_head: the heads K and V have
    # (grouped-query attention, Ainslie et al. 2023); what context parallelism's ring carries.
    return {
        "n_layer": n_layer, "d_model": d_model, "n_head": n_head, "n_kv_head": n_kv_head or n_head,
        "vocab_size": 32000, "seq_len": 4096, "dropout": False, "exact": False, "note": note, "n_params": n_params,
        "arch": "llama",
    }


def _llama2_preset(n_layer: int, d_model: int, n_head: int, n_kv_head: int, ffn_hidden: int, note: str) -> dict:
    """A Llama-2 shape whose count is computed (``llama_param_count``), its activations SwiGLU and GQA."""
    n_params = llama_param_count(n_layer, d_model, n_head, n_kv_head, ffn_hidden, 32000)
    return {**_llama_preset(n_layer, d_model, n_head, n_params, note, n_kv_head), "ffn_hidden": ffn_hidden,
            "mlp": "swiglu", "exact": True}


# Named sizes. "exact" says whether n_params is computed from the shape (our GPT's count, or a Llama shape's) or a
# published total taken as given; "mlp": "swiglu" marks Llama-shaped activations (``preset_activation_bytes``); "arch"
# says how the parameters are laid out ("gpt": ours, LayerNorm + biases, learned positions, tied head;
# "llama": RMSNorm, no biases, rotary positions, untied head), which `theory.parallelism` needs to place
# them on tensor- and pipeline-parallel ranks.
MODEL_PRESETS: dict[str, dict] = {
    "tiny-gpt": _gpt_preset(2, 64, 4, 256, 64, "the course's smallest GPT: tests and labs"),
    "bench-gpt": _gpt_preset(6, 384, 6, 256, 128, "the course's benchmark GPT"),
    "gpt2-124M": _gpt_preset(12, 768, 12, 50257, 1024, "GPT-2 small (Radford et al. 2019)"),
    # Llama 2 shapes; published totals 6,738,415,616 / 13,015,864,320 / 68,976,648,192, which llama_param_count
    # reproduces exactly (tests/test_theory.py).
    "llama-7B": _llama2_preset(32, 4096, 32, 32, llama_ffn_hidden(4096), "Llama-2-7B shape: SwiGLU MLP 11008"),
    "llama-13B": _llama2_preset(40, 5120, 40, 40, llama_ffn_hidden(5120), "Llama-2-13B shape: SwiGLU MLP 13824"),
    "llama-70B": _llama2_preset(80, 8192, 64, 8, llama_ffn_hidden(8192, 4096, 1.3),
                                "Llama-2-70B shape: SwiGLU MLP 28672, GQA with 8 KV heads"),
    "gpt-70B": _gpt_preset(80, 8192, 64, 32000, 4096, "GPT-shaped 70B: Llama-2-70B's depth and width with a 4h "
                           "GeLU MLP, 64 K/V heads and a tied head (64.7B parameters)"),
    # Mixtral 8x7B (Jiang et al. 2024): Mistral-7B's shape with every MLP a mixture of 8 SwiGLU experts of 14336,
    # top-2; 46.7B parameters in all (about 12.9B active per token). moe_* and ffn_hidden: theory.expert's rows.
    "mixtral-8x7B": {**_llama_preset(32, 4096, 32, 46_702_792_704, "Mixtral-8x7B-like: 8 SwiGLU experts of 14336, "
                                     "top-2, GQA with 8 KV heads", n_kv_head=8),
                     "moe_experts": 8, "moe_top_k": 2, "ffn_hidden": 14336},
}


def resolve_preset(model: str | dict) -> dict:
    """A model's shape: ``model`` itself when it is a dict, else ``MODEL_PRESETS[model]`` (ValueError if unknown)."""
    if isinstance(model, dict):
        return model
    if model not in MODEL_PRESETS:
        raise ValueError(f"unknown model {model!r}; valid choices: {', '.join(sorted(MODEL_PRESETS))}")
    return MODEL_PRESETS[model]


def activation_bytes_per_layer(
    model: str | dict,
    batch: int,
    seq_len: int | None = None,
    bytes_per_value: float = 2,
    recompute: str = "none",
) -> float:
    """Saved-activation bytes of one transformer layer of a preset (Korthikanti et al. 2022).

    `model` is a MODEL_PRESETS name or a dict with d_model, n_head (and optionally seq_len, dropout); see
    ``preset_activation_bytes`` for which count a shape gets.
    """
    shape = resolve_preset(model)
    s = seq_len if seq_len is not None else shape["seq_len"]
    return preset_activation_bytes(shape, batch, s, bytes_per_value, recompute)


def preset_activation_bytes(shape: dict, batch: int, seq_len: int, bytes_per_value: float = 2,
                            recompute: str = "none", tp: int = 1, sequence_parallel: bool = False,
                            n_layer: int = 1) -> float:
    """``n_layer`` layers of ``shape`` on one rank: ``llama_activation_bytes`` (SwiGLU, GQA) for a Llama-shaped
    preset ("mlp": "swiglu"), else Korthikanti's GPT count ``activation_bytes`` (4h GeLU MLP; also a mixture of
    experts' dense estimate)."""
    if shape.get("mlp") == "swiglu":
        return llama_activation_bytes(batch, seq_len, shape["d_model"], n_layer, shape["n_head"],
                                      shape["n_kv_head"], shape["ffn_hidden"], bytes_per_value, recompute, tp,
                                      sequence_parallel)
    return activation_bytes(batch, seq_len, shape["d_model"], n_layer, shape["n_head"], bytes_per_value, recompute,
                            dropout=shape.get("dropout", True), tp=tp, sequence_parallel=sequence_parallel)


__all__ = ["MODEL_PRESETS", "activation_bytes_per_layer", "gpt_param_count", "llama_ffn_hidden", "llama_param_count",
           "preset_activation_bytes", "resolve_preset"]
