"""Scales, saturating casts and Transformer Engine's delayed-scaling bookkeeping.

Conventions (TE's): ``scale`` multiplies a high-precision tensor on the way INTO FP8,
``q = saturate(x * scale)``; ``scale_inv = 1 / scale`` multiplies on the way out, ``x ~ q * scale_inv``.
``torch._scaled_mm`` takes the ``scale_inv`` values (dequantisation multipliers). Scales are fp32.

Why saturate: casting a value beyond the format's max to FP8 gives NaN on CUDA for E4M3 (it has no
inf), so one outlier in a delayed-scaling step would poison the GEMM. Clamping to +-fp8_max first
loses only the outlier's magnitude; NaN inputs stay NaN, which is what we want to see.
"""

from __future__ import annotations

import math

import torch

from maverick.fp8_recipe import fp8_max

_FP32_MAX = torch.finfo(torch.float32).max


def tensor_amax(t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |t| in fp32: a 0-dim tensor, or along ``dim`` with keepdim (row-wise scaling). An empty tensor
    (a batch of no tokens) has amax 0, which keeps the scale it had."""
    if t.numel() == 0:
        shape = () if dim is None else tuple(1 if i == dim % t.dim() else n for i, n in enumerate(t.shape))
        return torch.zeros(shape, dtype=torch.float32, device=t.device)
    if dim is None:
        return t.detach().abs().amax().float()
    return t.detach().abs().amax(dim=dim, keepdim=True).float()


def scale_from_amax(
    amax: torch.Tensor, dtype: torch.dtype, margin: int = 0, fallback: torch.Tensor | float = 1.0
) -> torch.Tensor:
    """TE's scale formula: (fp8_max / amax) / 2**margin, elementwise.

    Where amax is 0 or not finite the fallback is kept (delayed scaling passes the previous scale;
    current scaling passes 1.0, any scale maps an all-zero tensor exactly). An amax so small that
    the scale overflows fp32 gives fp32 max, as in TE.
    """
    amax = amax.float()
    fallback = torch.as_tensor(fallback, dtype=torch.float32, device=amax.device)
    sf = (fp8_max(dtype) / amax) / (2.0**margin)
    sf = torch.where(torch.isinf(sf), torch.full_like(sf, _FP32_MAX), sf)
    ok = (amax > 0) & torch.isfinite(amax)
    return torch.where(ok, sf, fallback)


def cast_to_fp8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast ``clamp(t * scale, -max, max).to(dtype)``; ``scale`` broadcasts (row-wise)."""
    m = fp8_max(dtype)
    return (t.float() * scale).clamp(-m, m).to(dtype)


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale_inv`` in fp32, returned as ``dtype``."""
    return (q.float() * scale_inv).to(dtype)


def quantize_current(
    t: torch.Tensor, dtype: torch.dtype, margin: int = 0, dim: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Current scaling: tensor-wise (dim=None) or per-row along the reduced ``dim`` (keepdim).

    Returns (q, scale_inv) where ``scale_inv`` is 0-dim, or has size 1 in ``dim``.
    """
    scale = scale_from_amax(tensor_amax(t, dim), dtype, margin)
    return cast_to_fp8(t, scale, dtype), scale.reciprocal()


# ---------------------------------------------------------------------------------------------
# Delayed scaling (TE DelayedScaling). Layout of a history buffer [L]: slot 0 collects the amax of
# the step in progress; the other slots hold the previous L-1 steps. The update, once per step:
#   amax = history.max() ("max") or history[0] ("most_recent")
#   scale = scale_from_amax(amax, fallback=previous scale)
#   history = roll(history, -1); history[0] = 0
# so the window is the last L steps including the one just finished (TE's
# _compute_amax_and_update_history + _default_sf_compute).
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def record_amax_(history: torch.Tensor, amax: torch.Tensor) -> None:
    """Fold this cast's amax into slot 0 (max with what the step already saw; NaN propagates)."""
    history[0] = torch.maximum(history[0], amax.to(history.dtype))


@torch.no_grad()
def update_delayed_scale_(
    history: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, margin: int, algo: str
) -> None:
    """Reduce ``history`` into a new ``scale`` (in place), then roll the window (in place)."""
    if algo == "max":
        amax = history.max()
    elif algo == "most_recent":
        amax = history[0].clone()
    else:
        raise ValueError(
            f"update_delayed_scale_: amax_compute_algo must be 'max' or 'most_recent', got {algo!r}"
        )
    scale.copy_(scale_from_amax(amax, dtype, margin, fallback=scale))
    if history.numel() > 1:
        history.copy_(torch.roll(history, -1, 0))
    history[0] = 0.0


def sqnr(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio in dB: 20 log10(||ref|| / ||ref - test||) (inf if equal)."""
    ref = ref.detach().double()
    noise = (ref - test.detach().double()).norm().item()
    if noise == 0.0:
        return math.inf
    return 20.0 * math.log10(ref.norm().item() / noise)
