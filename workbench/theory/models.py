"""Parameter counts and named model sizes for the memory calculator and the notebooks.

`gpt_param_count` is exact for the course's GPT (nanoGPT-shaped, Radford et al. 2019): pre-LN blocks,
learned positional embedding, final LayerNorm, LM head tied to the token embedding. The llama-like
presets carry the published parameter counts (Touvron et al. 2023, Llama 2) and shapes; their blocks
(RMSNorm, SwiGLU, grouped-query attention) are not this GPT, so only their totals are used.
"""

from __future__ import annotations

from workbench.theory.checks import positive_int
from workbench.theory.memory import activation_bytes


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


# Named sizes. "exact" says whether n_params is our own GPT's count or a published approximate total; "arch"
# says how the parameters are laid out ("gpt": ours, LayerNorm + biases, learned positions, tied head;
# "llama": RMSNorm, no biases, rotary positions, untied head), which `theory.parallelism` needs to place
# them on tensor- and pipeline-parallel ranks.
MODEL_PRESETS: dict[str, dict] = {
    "tiny-gpt": _gpt_preset(2, 64, 4, 256, 64, "the course's smallest GPT: tests and labs"),
    "bench-gpt": _gpt_preset(6, 384, 6, 256, 128, "the course's benchmark GPT"),
    "gpt2-124M": _gpt_preset(12, 768, 12, 50257, 1024, "GPT-2 small (Radford et al. 2019)"),
    # Published totals: 6,738,415,616 / 13,015,864,320 / 68,976,648,192 (Llama 2 7B, 13B, 70B).
    "llama-7B": _llama_preset(32, 4096, 32, 6_738_415_616, "Llama-2-7B-like, SwiGLU MLP 11008"),
    "llama-13B": _llama_preset(40, 5120, 40, 13_015_864_320, "Llama-2-13B-like, SwiGLU MLP 13824"),
    "llama-70B": _llama_preset(80, 8192, 64, 68_976_648_192, "Llama-2-70B-like, GQA with 8 KV heads", n_kv_head=8),
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

    `model` is a MODEL_PRESETS name or a dict with d_model, n_head (and optionally seq_len, dropout).
    For the llama-like presets this is the GPT estimate with a 4h MLP: roughly a lower bound, since a SwiGLU
    MLP saves about four 2.7h-wide tensors where a GeLU MLP saves two 4h ones.
    """
    shape = resolve_preset(model)
    s = seq_len if seq_len is not None else shape["seq_len"]
    return activation_bytes(batch, s, shape["d_model"], 1, shape["n_head"], bytes_per_value, recompute,
                            dropout=shape.get("dropout", True))


__all__ = ["MODEL_PRESETS", "activation_bytes_per_layer", "gpt_param_count", "resolve_preset"]
