"""The learning-rate schedule and the parameter hash, shared by the trainer's loop and the parameter server's
(``training.param_server_run``), which runs servers and workers instead of one step for all ranks."""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch


def lr_at(step: int, cfg: Any) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup - 1)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def params_sha256(named_params: dict[str, torch.Tensor]) -> str:
    """SHA-256 over (name, fp32 little-endian bytes) of every parameter, names sorted."""
    digest = hashlib.sha256()
    for name in sorted(named_params):
        digest.update(name.encode())
        digest.update(named_params[name].detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()
