"""Weight-only FP8 for inference: E4M3 weight + one scale per output channel.

Halves weight memory and bandwidth against bf16, which is what decode (M = 1..64 tokens) is bound
by. Layout and names follow compressed-tensors (the format of Meta's Maverick FP8 release):
``weight`` float8_e4m3fn [out, in] and ``weight_scale`` float32 [out, 1], a DEquantisation
multiplier (w ~ weight * weight_scale = amax_row / 448 per row), so such a checkpoint's linear
keys load into this module unchanged.

Forward backends:
- ``"dequant"``: w = weight * weight_scale in the activation dtype, then F.linear; activations
  stay high precision (weight-only proper). Used off CUDA.
- ``"scaled_mm"``: activations quantised on the fly to E4M3 with one scale per token (dynamic,
  like the release's ``input_activations: strategy token, dynamic true``), then a row-wise
  ``torch._scaled_mm``; the tensor-core path on CUDA sm_89+ (W8A8, slightly less accurate).
- ``"auto"``: ``scaled_mm`` on CUDA sm_89+, ``dequant`` elsewhere.

In eager mode the ``dequant`` backend keeps the dequantised weight of the last dtype it was asked for and
reuses it until ``weight`` or ``weight_scale`` is written again (their version counters change): the
same numbers as dequantising every call, at the speed of a plain linear (`maverick.linear.linear`, which
also packs the cached weight for few-row bf16 calls on CPU). (It emulates FP8 numerics; it
saves no memory, which only the ``scaled_mm`` backend does.)
"""

from __future__ import annotations

import torch
from torch import nn

from maverick.fp8_cast import dequantize, quantize_current
from maverick.fp8_gemm import fp8_mm, scaled_mm_supported
from maverick.fp8_recipe import E4M3
from maverick.linear import linear

_WO_BACKENDS = ("auto", "dequant", "scaled_mm")


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (E4M3 [out, in], weight_scale float32 [out, 1] = amax_row / 448)."""
    if weight.dim() != 2:
        raise ValueError(
            f"quantize_weight_per_channel: need a 2-D [out, in] weight, got {tuple(weight.shape)}"
        )
    return quantize_current(weight, E4M3, margin=0, dim=-1)


class Float8WeightOnlyLinear(nn.Module):
    """Inference linear with an FP8 E4M3 weight and per-output-channel scales (no gradients)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, backend: str = "auto", device=None
    ):
        super().__init__()
        if backend not in _WO_BACKENDS:
            raise ValueError(f"Float8WeightOnlyLinear.backend must be one of {_WO_BACKENDS}, got {backend!r}")
        self.in_features, self.out_features, self.backend = in_features, out_features, backend
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=E4M3, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, 1, dtype=torch.float32, device=device))
        self.bias = (
            nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None
        )
        self._dequant_cache: tuple[tuple, torch.Tensor] | None = None

    @classmethod
    def from_float(cls, linear: nn.Linear, backend: str = "auto") -> Float8WeightOnlyLinear:
        """Quantise ``linear.weight`` per output channel; the bias (if any) is kept as is."""
        w = linear.weight.detach()
        new = cls(linear.in_features, linear.out_features, bias=False, backend=backend, device=w.device)
        q, s = quantize_weight_per_channel(w)
        new.weight.copy_(q)
        new.weight_scale.copy_(s)
        if linear.bias is not None:
            new.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return new

    # a state dict's weight of another dtype is refused, not cast (a bf16 weight, E5M2, raw bytes as uint8
    # each loaded silently, 0.4 dB to -4.8 dB from the layer meant); scales of a wider float type are read
    # as fp32 (some compressed-tensors checkpoints store bf16 scales: the upcast is exact)
    _DTYPES = {"weight": E4M3, "weight_scale": torch.float32}
    _SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected, errors
    ):
        w, s = state_dict.get(prefix + "weight"), state_dict.get(prefix + "weight_scale")
        if w is not None and w.dtype != E4M3:
            raise ValueError(f"{prefix}weight: {w.dtype}, expected {E4M3} (FP8 weight-only layout)")
        if s is not None and s.dtype not in self._SCALE_DTYPES:
            raise ValueError(f"{prefix}weight_scale: {s.dtype}, expected float32 (FP8 weight-only layout)")
        # upcast here, not by the copy into the buffer: a load with assign=True keeps the tensor it is given
        if s is not None and s.dtype != torch.float32:
            state_dict[prefix + "weight_scale"] = s.float()
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected, errors
        )

    def _apply(self, fn, recurse=True):
        """`Module.to(dtype)` (`.half()`, ...) casts every floating tensor: the E4M3 weight and its fp32 scales
        keep their dtypes (scales cast to bf16 are rounded for good) and only follow a device move."""
        kept = {name: getattr(self, name) for name in self._DTYPES}
        super()._apply(fn, recurse)
        for name, t in kept.items():
            if getattr(self, name).dtype != t.dtype:
                setattr(self, name, t.to(getattr(self, name).device))
        return self

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[out, in] weight in ``dtype``."""
        return dequantize(self.weight, self.weight_scale, dtype)

    def _dequant_weight_cached(self, dtype: torch.dtype) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self.dequantized_weight(dtype)
        w, s = self.weight, self.weight_scale
        key = (dtype, w.device, w.data_ptr(), w._version, s.data_ptr(), s._version)
        if self._dequant_cache is None or self._dequant_cache[0] != key:
            self._dequant_cache = (key, self.dequantized_weight(dtype))
        return self._dequant_cache[1]

    def _use_scaled_mm(self, device: torch.device) -> bool:
        if self.backend == "auto":
            return scaled_mm_supported(device)
        return self.backend == "scaled_mm"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._use_scaled_mm(x.device):
            x2d = x.reshape(-1, self.in_features)  # [M, K]
            xq, xs = quantize_current(x2d, E4M3, margin=0, dim=-1)  # per-token: [M, K], [M, 1]
            y = fp8_mm(xq, self.weight.t(), xs, self.weight_scale.t(), x.dtype, "scaled_mm")  # [M, N]
            y = y.reshape(*x.shape[:-1], self.out_features)
        else:
            y = linear(x, self._dequant_weight_cached(x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, backend={self.backend}"
        )
