"""The FP8 recipe: which formats, which scaling, how scales follow the data.

A recipe is a small frozen dataclass so it can be shared by every converted layer, hashed, and
printed into a run's config. Field names follow Transformer Engine's ``DelayedScaling`` where they
mean the same thing (``amax_history_len``, ``amax_compute_algo``, ``margin``).

Formats (``torch.finfo``): E4M3 (``float8_e4m3fn``, max 448, 3 mantissa bits) has the precision
that activations and weights need; E5M2 (``float8_e5m2``, max 57344, 2 mantissa bits) has the range
that gradients need. ``"hybrid"`` = E4M3 forward, E5M2 for grad_output (TE's default); ``"e4m3"``
uses E4M3 for all three tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)

Scaling = Literal["delayed", "current", "rowwise"]
Format = Literal["hybrid", "e4m3"]
AmaxAlgo = Literal["max", "most_recent"]
Backend = Literal["auto", "emulate", "scaled_mm"]

_SCALINGS = ("delayed", "current", "rowwise")
_FORMATS = ("hybrid", "e4m3")
_ALGOS = ("max", "most_recent")
_BACKENDS = ("auto", "emulate", "scaled_mm")


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_max: {dtype} is not one of {FP8_DTYPES}")
    return float(torch.finfo(dtype).max)


@dataclass(frozen=True)
class Fp8Recipe:
    """How a Float8Linear quantises its three GEMM operands.

    scaling:
      ``"delayed"``  TE DelayedScaling: one scale per tensor role (input, weight, grad_output) taken
                     from an amax history of earlier steps; cheap (no reduction before the cast) but
                     one step stale, so a sudden outlier saturates for one step.
      ``"current"``  tensor-wise scale from this tensor's amax now (TE Float8CurrentScaling).
      ``"rowwise"``  one scale per row of each GEMM operand along the contraction dim (per token for
                     activations, per output channel for weights); most accurate, needs the
                     high-precision input saved for backward since each GEMM reduces along a
                     different axis.
    format: ``"hybrid"`` (E4M3 forward, E5M2 grad_output) or ``"e4m3"`` throughout.
    amax_history_len: length of the delayed-scaling history window (TE default 1024).
    amax_compute_algo: ``"max"`` over the window or ``"most_recent"`` entry.
    margin: scale = (fp8_max / amax) / 2**margin; a positive margin leaves headroom for growth.
    backend: ``"auto"`` uses ``torch._scaled_mm`` on CUDA sm_89+ and exact emulation elsewhere;
      ``"emulate"`` and ``"scaled_mm"`` force one (``"scaled_mm"`` on CPU is for tests only: it is
      thousands of times slower than emulation there).
    """

    scaling: Scaling = "delayed"
    format: Format = "hybrid"
    amax_history_len: int = 1024
    amax_compute_algo: AmaxAlgo = "max"
    margin: int = 0
    backend: Backend = "auto"

    def __post_init__(self):
        if self.scaling not in _SCALINGS:
            raise ValueError(f"Fp8Recipe.scaling must be one of {_SCALINGS}, got {self.scaling!r}")
        if self.format not in _FORMATS:
            raise ValueError(f"Fp8Recipe.format must be one of {_FORMATS}, got {self.format!r}")
        if self.amax_compute_algo not in _ALGOS:
            raise ValueError(
                f"Fp8Recipe.amax_compute_algo must be one of {_ALGOS}, got {self.amax_compute_algo!r}"
            )
        if self.backend not in _BACKENDS:
            raise ValueError(f"Fp8Recipe.backend must be one of {_BACKENDS}, got {self.backend!r}")
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"Fp8Recipe.amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        if not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"Fp8Recipe.margin must be an int >= 0, got {self.margin!r}")

    @property
    def fwd_dtype(self) -> torch.dtype:
        """FP8 dtype of the input and weight casts."""
        return E4M3

    @property
    def bwd_dtype(self) -> torch.dtype:
        """FP8 dtype of the grad_output cast."""
        return E5M2 if self.format == "hybrid" else E4M3
