"""The one EMA: debiased exponential smoothing for the grokking signals (agent) and the console's curves; standard library only."""

from __future__ import annotations

import math
from typing import Any, Sequence, TypeGuard

# The EMA factors of the train and the val curves wherever they are smoothed: the host's grokking signals, the Grokking
# screen's curves, the Training screen's EMA key. Train records come per log interval; val points are sparse.
TRAIN_EMA_BETA = 0.9
VAL_EMA_BETA = 0.3


def is_finite(value: Any) -> TypeGuard[float]:
    """A real number (bool excluded) that is neither NaN nor infinite."""
    kind = type(value)
    if kind is float or kind is int:
        return math.isfinite(value)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def debiased_ema(values: Sequence[float], beta: float) -> list[float]:
    """TensorBoard classic smoothing: m_n = beta*m_{n-1} + (1-beta)*x_n, m_0 = 0, x̂_n = m_n / (1 - beta^n); beta 0 = raw.

    n counts finite points only; non-finite points pass through unchanged (they never poison what follows);
    a constant series is returned as is. A beta outside [0, 1) is refused with ValueError.
    """
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"EMA factor must be in [0, 1), got {beta}; nothing was smoothed")
    values = list(values)
    if not values or all(v == values[0] for v in values):
        return [float(v) if isinstance(v, (int, float)) else math.nan for v in values]
    keep = 1.0 - beta
    isfinite = math.isfinite
    out: list[float] = []
    append = out.append
    mean, count = 0.0, 0
    for value in values:
        kind = type(value)
        if not (isfinite(value) if kind is float or kind is int else is_finite(value)):
            append(float(value) if isinstance(value, (int, float)) else math.nan)
            continue
        mean = beta * mean + keep * value
        count += 1
        append(mean / (1.0 - beta**count))
    return out
