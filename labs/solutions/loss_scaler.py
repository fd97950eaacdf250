"""Reference solution of lab 05 (``labs/05_dynamic_loss_scaler.ipynb``): a dynamic loss scaler for fp16
(Micikevicius et al. 2018, §3.2; the schedule of ``torch.amp.GradScaler``).

    loss ──×S──► backward (fp16 grads = dL/dw·S) ──► fp32, ÷S ──► any inf/NaN on ANY rank? ──► skip + S·½
                                                                                  no ──► step; S·2 after N clean

The library's version, used by the trainer with every DDP/ZeRO variant, is ``workbench.precision.DynamicLossScaler``.
"""

from __future__ import annotations

from typing import Any

import torch

from workbench import comm


class LossScaler:
    """Scale the loss so fp16 gradients do not underflow; skip and back off when they overflow."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        if not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError(f"need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval "
                             f">= 1; got {init_scale}, {growth_factor}, {backoff_factor}, {growth_interval}")
        self._scale = float(init_scale)  # a python float: powers of two, so ×S and ÷S are exact
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self._clean = 0  # clean steps in a row since the last growth or backoff

    def get_scale(self) -> float:
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale

    def unscale(self, grads: list[torch.Tensor], group: Any = None) -> tuple[list[torch.Tensor], bool]:
        """fp32 gradients ÷ scale, and whether any rank of ``group`` saw an inf/NaN (the same answer on all)."""
        local = any(not bool(torch.isfinite(g).all()) for g in grads)  # isfinite: inf AND NaN
        flag = torch.tensor([1.0 if local else 0.0], device=grads[0].device)
        comm.all_reduce(flag, op="max", group=group, tag="amp")  # one rank's overflow is every rank's
        # Cast first: ÷S in fp16 would round the (true) tiny gradients to zero again.
        return [g.float() / self._scale for g in grads], bool(flag.item() > 0)

    def update(self, found_inf: bool) -> bool:
        """Advance the schedule; True if the step should be taken."""
        if found_inf:
            self._scale *= self.backoff_factor
            self._clean = 0
            return False
        self._clean += 1
        if self._clean >= self.growth_interval:
            self._scale *= self.growth_factor
            self._clean = 0
        return True

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self._scale, "clean": self._clean, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = float(state["scale"])
        self._clean = int(state["clean"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])


__all__ = ["LossScaler"]
