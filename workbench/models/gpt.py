"""A small pre-LN GPT, read in one sitting.

The shape follows GPT-2 (Radford et al., 2019) as re-told by nanoGPT: token + position embeddings,
a stack of pre-LayerNorm blocks (attention then MLP, each added back to the residual stream), a final
LayerNorm, and a language-model head that shares its weight with the token embedding.

Nothing here knows about parallelism. Tensor parallelism is applied from outside by swapping the
q/k/v/fc Linears for column-sharded ones and proj for row-sharded ones; attention therefore derives its
number of heads from the width q actually produces, not from the config. Context parallelism is applied from
outside too: it sets ``CausalSelfAttention.attend`` (a callable ``(q, k, v) -> y`` used instead of causal
``scaled_dot_product_attention``) to ring attention, and passes each rank's token ``positions`` to ``forward``.

With ``moe_experts`` E > 0 every block's MLP is a mixture of E experts of the MLP's shape (``models/moe.py``), and
the loss adds ``moe_aux_loss_coef`` times the layers' load-balancing losses. E = 0 (the default) is the dense GPT,
built and initialised exactly as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from workbench.models.moe import MoEConfig, MoEMLP

# Named sizes. "tiny" keeps unit tests fast; "bench" is about 10.8M parameters, big enough that
# communication and memory effects are visible, small enough for a laptop CPU.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=2, n_head=2, d_model=64, seq_len=64),
    "small": dict(n_layer=4, n_head=4, d_model=128, seq_len=128),
    "bench": dict(n_layer=6, n_head=6, d_model=384, seq_len=128, vocab_size=256),
}


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    mlp_ratio: int = 4
    tie_embeddings: bool = True
    # Mixture of experts (models/moe.py): 0 experts is the dense GPT; capacity None drops no token.
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_capacity_factor: float | None = None
    moe_aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "tie_embeddings" and not f.name.startswith("moe_") and (not isinstance(value, int)
                                                                                 or value <= 0):
                raise ValueError(f"GPTConfig.{f.name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head != 0:
            valid = [h for h in range(1, self.d_model + 1) if self.d_model % h == 0]
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} is not divisible by n_head={self.n_head}; "
                f"each head needs d_model / n_head channels. n_head values that divide d_model: {valid}"
            )
        if isinstance(self.moe_experts, bool) or not isinstance(self.moe_experts, int) or self.moe_experts < 0:
            raise ValueError(f"GPTConfig.moe_experts must be an int >= 0 (0: a dense MLP), got {self.moe_experts!r}")
        _ = self.moe  # the MoE fields' own checks (top-k <= experts, capacity > 0) when MoE is on

    @property
    def moe(self) -> MoEConfig | None:
        """The MoE layers' config, or None for the dense GPT."""
        if not self.moe_experts:
            return None
        return MoEConfig(self.moe_experts, self.moe_top_k, self.moe_capacity_factor, self.moe_aux_loss_coef)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @classmethod
    def preset(cls, name: str, **overrides) -> GPTConfig:
        """A named configuration ("tiny", "small", "bench"), with any field overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; valid presets: {sorted(PRESETS)}")
        return replace(cls(), **{**PRESETS[name], **overrides})

    def num_params(self) -> int:
        """Analytic parameter count; equals the real model's count of unique parameters."""
        d, hidden = self.d_model, self.mlp_ratio * self.d_model
        layer_norm = 2 * d  # weight + bias
        attn = 4 * (d * d + d)  # q, k, v, proj, each with bias
        mlp = (d * hidden + hidden) + (hidden * d + d)
        if self.moe_experts:
            mlp = self.moe_experts * mlp + d * self.moe_experts  # E experts and the router's gate (no bias)
        block = 2 * layer_norm + attn + mlp
        embeddings = self.vocab_size * d + self.seq_len * d
        head = 0 if self.tie_embeddings else self.vocab_size * d  # tied head adds nothing
        return embeddings + self.n_layer * block + layer_norm + head


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_head = cfg.n_head
        self.head_dim = cfg.head_dim
        # Separate q/k/v (rather than one fused qkv) so that column-sharding each one keeps whole heads.
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        # None: causal scaled_dot_product_attention. Else a callable (q, k, v) -> y on [B, H_local, T, hd]
        # tensors, e.g. context parallelism's ring attention over the ranks that hold the rest of the sequence.
        self.attend = None

    def _split_heads(self, t: torch.Tensor) -> torch.Tensor:
        # [B, T, H_local*hd] -> [B, H_local, T, hd]; H_local may be n_head / tp under tensor parallelism.
        b, t_len, width = t.shape
        return t.view(b, t_len, width // self.head_dim, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (self._split_heads(lin(x)) for lin in (self.q, self.k, self.v))
        if self.attend is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H_local, T, hd]
        else:
            y = self.attend(q, k, v)
        b, h_local, t_len, hd = y.shape
        return self.proj(y.transpose(1, 2).reshape(b, t_len, h_local * hd))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.fc = nn.Linear(cfg.d_model, hidden)
        self.act = nn.GELU(approximate="tanh")  # GPT-2's GELU approximation
        self.proj = nn.Linear(hidden, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """Pre-LN residual block: normalising before each sublayer keeps the residual path an identity,
    which is what lets GPT-2-style stacks train without warm-up tricks."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg) if cfg.moe is None else MoEMLP(cfg.d_model, cfg.mlp_ratio * cfg.d_model, cfg.moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            # Weight tying (as in GPT-2): input and output embeddings are one matrix, saving V*d params.
            self.lm_head.weight = self.wte.weight
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 init: N(0, 0.02) everywhere, zero biases, and residual projections scaled down by
        # sqrt(2 * n_layer) because each block adds two contributions to the residual stream.
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                residual = name.endswith(("attn.proj", "mlp.proj")) or (".experts." in name and name.endswith(".proj"))
                std = residual_std if residual else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """idx [B, T] token ids -> logits [B, T, V], or the mean cross-entropy (over these T tokens) if targets
        [B, T] given. ``positions`` [T]: the tokens' positions in the sequence (default 0..T-1; a context-parallel
        rank holds some positions of a longer sequence)."""
        t_len = idx.shape[1]
        if t_len > self.cfg.seq_len:
            raise ValueError(f"sequence length {t_len} exceeds the model's seq_len={self.cfg.seq_len}")
        pos = torch.arange(t_len, device=idx.device) if positions is None else positions
        x = self.wte(idx) + self.wpe(pos)  # [B, T, d]
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # [B, T, V]
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        if self.cfg.moe is not None:  # Switch's load-balancing loss, summed over the MoE layers
            loss = loss + self.cfg.moe_aux_loss_coef * sum(b.mlp.aux_loss for b in self.blocks)
        return loss


def build_gpt(cfg: GPTConfig, seed: int = 0, device: str | torch.device = "cpu") -> GPT:
    """Build a GPT in fp32 on `device` with parameters fixed by `seed` alone.

    Every rank calls this with the same seed and gets the same weights, so no initial broadcast is
    needed. The weights are drawn on the CPU's generator and then moved, so a GPU rank starts from exactly
    the weights a CPU rank does. fork_rng restores the caller's global RNG afterwards, so building a model
    never changes the data order or dropout masks of the code around it.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg).to(device=device, dtype=torch.float32)
