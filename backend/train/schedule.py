"""Learning-rate schedules (cosine with warmup, constant, resume re-warm) and the Grokfast-EMA gradient filter."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    import torch


class LRSchedule:
    """lr(step) for step = 0, 1, ...: linear warmup, then cosine down to min_lr_ratio * lr, or constant.

    `rewarm_from` / `rewarm_steps`: after a resume at step s0 the rate ramps linearly from ~0 back to the
    scheduled value over rewarm_steps, so Adam's fresh-looking moments do not meet the full rate at once.
    """

    def __init__(
        self,
        base_lr: float,
        schedule: str,
        warmup_steps: int,
        total_steps: int,
        min_lr_ratio: float = 0.0,
        rewarm_from: int | None = None,
        rewarm_steps: int = 0,
    ):
        if schedule not in ("cosine", "constant"):
            raise ValueError(f"unknown schedule {schedule!r}: expected 'cosine' or 'constant'")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must lie in [0, 1], got {min_lr_ratio}")
        self.base_lr = base_lr
        self.schedule = schedule
        self.warmup_steps = max(0, warmup_steps)
        self.total_steps = max(1, total_steps)
        self.min_lr_ratio = min_lr_ratio
        self.rewarm_from = rewarm_from
        self.rewarm_steps = max(0, rewarm_steps)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            value = (step + 1) / self.warmup_steps
        elif self.schedule == "constant":
            value = 1.0
        else:
            span = max(1, self.total_steps - self.warmup_steps)
            progress = min(1.0, (step - self.warmup_steps) / span)
            value = self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
        if self.rewarm_from is not None and self.rewarm_steps and self.rewarm_from <= step < self.rewarm_from + self.rewarm_steps:
            value *= (step - self.rewarm_from + 1) / self.rewarm_steps
        return value

    def lr_at(self, step: int) -> float:
        return self.base_lr * self.factor(step)

    def describe(self) -> dict:
        return {
            "base_lr": self.base_lr,
            "schedule": self.schedule,
            "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps,
            "min_lr_ratio": self.min_lr_ratio,
            "rewarm_from": self.rewarm_from,
            "rewarm_steps": self.rewarm_steps,
        }


class TimeBudget:
    """`train --max-seconds`: the run ends at a wall-clock deadline, and its cosine is re-fitted to end there.

    The steps a second are measured from the `settle`-th step of the run on (its first steps compile); a fit makes
    the cosine's length the steps done plus that rate times the seconds left, never past `cap`.
    """

    def __init__(self, seconds: float, start_step: int, started: float, cap: int, settle: int = 10):
        if seconds <= 0:
            raise ValueError(f"a time budget must be positive, got {seconds:g} s")
        self.seconds, self.start_step, self.cap, self.settle = seconds, start_step, cap, settle
        self.deadline = started + seconds
        self.reference: tuple[int, float] | None = None

    def observe(self, step: int, now: float) -> None:
        """Called after every step: the rate is measured from the first step past `settle`."""
        if self.reference is None and step - self.start_step >= self.settle:
            self.reference = (step, now)

    def fitted_total(self, step: int, now: float) -> int | None:
        """The cosine's length that ends at the deadline at the measured rate (None while there is no rate yet)."""
        self.observe(step, now)
        if self.reference is None or step <= self.reference[0] or now <= self.reference[1]:
            return None
        rate = (step - self.reference[0]) / (now - self.reference[1])
        return min(self.cap, step + max(1, round(rate * max(0.0, self.deadline - now))))

    def expired(self, now: float) -> bool:
        return now >= self.deadline


class GrokfastEMA:
    """Grokfast-EMA (Lee et al. 2024): mu <- alpha*mu + (1-alpha)*g (mu starts at the first g); g <- g + lambda*mu.

    Applied between backward() and the optimizer step (before clipping, so clipping bounds what is applied).
    """

    def __init__(self, alpha: float = 0.98, lamb: float = 2.0):
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"grokfast alpha must lie in (0, 1), got {alpha}")
        self.alpha = alpha
        self.lamb = lamb
        self.ema: dict[str, torch.Tensor] = {}

    def apply(self, named_parameters: Iterable) -> None:
        import torch

        with torch.no_grad():
            for name, param in named_parameters:
                if param.grad is None:
                    continue
                grad = param.grad
                mu = self.ema.get(name)
                if mu is None:
                    mu = grad.detach().float().clone()
                    self.ema[name] = mu
                else:
                    mu.mul_(self.alpha).add_(grad.float(), alpha=1.0 - self.alpha)
                grad.add_(mu.to(grad.dtype), alpha=self.lamb)

    def state_dict(self) -> dict:
        return {"alpha": self.alpha, "lamb": self.lamb, "ema": {k: v.cpu() for k, v in self.ema.items()}}

    def load_state_dict(self, state: dict, device=None) -> None:
        self.ema = {k: (v.to(device) if device is not None else v) for k, v in state.get("ema", {}).items()}
