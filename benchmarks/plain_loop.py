"""The plain PyTorch training step the single-process benchmarks compare the trainer against.

What a careful hand-written loop does with the model, batches, optimizer and clipping a ``Trainer`` has: a
fresh copy of the trainer's initial model (same seed), ``torch.optim.AdamW`` with the trainer's
hyper-parameters, the trainer's learning-rate schedule (``lr_at``), the same batches (``trainer.dataset.get``
with the trainer's sampler: the same host-to-device path), ``torch.autocast`` to bf16 when asked,
``clip_grad_norm_`` whose result is not read, and ``loss.item()`` once per step after ``opt.step()``: the
loop logs its loss every step, as the trainer does (one host-device sync per step on either side).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any


def plain_torch_step(trainer: Any, bf16: bool) -> Callable[[int], float]:
    """``step(index) -> loss``: one plain-PyTorch training step on batch ``index``, from the trainer's start."""
    import torch

    from workbench.models import build_gpt
    from workbench.train import lr_at

    cfg, pcfg = trainer.cfg, trainer.parallel_config
    model = build_gpt(cfg.gpt_config(), seed=cfg.seed, device=trainer.device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=pcfg.betas)
    device_type = torch.device(trainer.device).type
    clip = cfg.clip if cfg.clip is not None else math.inf

    def step(index: int) -> float:
        for group in opt.param_groups:
            group["lr"] = lr_at(index, cfg)
        x, y = trainer.dataset.get(trainer.sampler.indices(index), device=trainer.device)
        opt.zero_grad(set_to_none=True)
        amp = torch.autocast(device_type=device_type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with amp:
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        return loss.item()

    return step
