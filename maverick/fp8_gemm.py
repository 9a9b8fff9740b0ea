"""The FP8 GEMM: ``torch._scaled_mm`` on CUDA, an exact emulation everywhere else.

    out[M, N] = (a[M, K] @ b[K, N]) * scale_a_inv * scale_b_inv        (fp32 accumulate)

Scales are DEquantisation multipliers (``1 / scale``): 0-dim for tensor-wise scaling, or
``scale_a_inv`` [M, 1] and ``scale_b_inv`` [1, N] for row-wise scaling (one per row of a, one per
column of b, i.e. along the dims that are not contracted).

Rules of ``torch._scaled_mm`` on CUDA (sm_89+) that ``_scaled_mm_padded`` takes care of: ``a``
row-major, ``b`` column-major, K and N multiples of 16 (we zero-pad: zero rows/columns add nothing
to the contraction and padded output columns are sliced off), scales fp32 and contiguous,
E5M2 x E5M2 refused. M is free.

Why emulation is exact: a product of two FP8 values has at most 4 + 4 significant bits, so the
fp32 matmul of the up-cast operands forms every product exactly and only the fp32 accumulation
rounds, as in the tensor-core kernel (which applies the scales after accumulating, as we do). The
difference to ``_scaled_mm`` is the summation order and, on Hopper, the FP8 tensor cores' accumulator,
which keeps fewer bits than fp32 (DeepSeek-V3 reports ~14): measured on an H200, K = 256, a few
outputs in a thousand differ from the emulation by up to 2e-4 of the largest output (K = 40: within
1e-4 relative). On CPU ``_scaled_mm`` exists but is thousands of times slower than this, hence
``backend="auto"`` emulates off CUDA.
"""

from __future__ import annotations

import torch

from maverick.fp8_recipe import E5M2, FP8_DTYPES


def scaled_mm_supported(device: torch.device | str) -> bool:
    """True where ``torch._scaled_mm`` runs natively: CUDA with compute capability >= 8.9."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) >= (8, 9)


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Map ``"auto"`` to ``"scaled_mm"`` on CUDA sm_89+ and ``"emulate"`` elsewhere."""
    if backend == "auto":
        return "scaled_mm" if scaled_mm_supported(device) else "emulate"
    if backend not in ("emulate", "scaled_mm"):
        raise ValueError(f"FP8 GEMM backend must be 'auto', 'emulate' or 'scaled_mm', got {backend!r}")
    return backend


def emulated_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a_inv: torch.Tensor,
    scale_b_inv: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Reference FP8 GEMM: up-cast to fp32, matmul, apply the scales, cast to ``out_dtype``."""
    with torch.autocast(a.device.type, enabled=False):  # under bf16 autocast the product came back in bf16
        acc = a.float() @ b.float()  # [M, N] fp32; every FP8 x FP8 product is exact
    out = acc * (scale_a_inv.float() * scale_b_inv.float())
    # NOTE: no `.to` when the dtype already matches. Under torch.compile on torch 2.11 (the lent GPU's
    # image), an autograd.Function whose output passed through a no-op `.to` gave zero gradients to
    # everything before the second such layer (fp32 models; tests/test_fp8.py's compiled test).
    return out if out.dtype == out_dtype else out.to(out_dtype)


def _round_up(n: int, m: int = 16) -> int:
    return (n + m - 1) // m * m


def _pad2d_fp8(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad an FP8 matrix (bit pattern 0 is +0.0 in both formats); copies through uint8."""
    if t.shape == (rows, cols):
        return t
    out = torch.zeros(rows, cols, dtype=torch.uint8, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t.view(torch.uint8)
    return out.view(t.dtype)


def _scaled_mm_padded(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a_inv: torch.Tensor,
    scale_b_inv: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``torch._scaled_mm`` with its layout, alignment and scale-shape rules satisfied."""
    if a.dtype == E5M2 and b.dtype == E5M2:
        raise ValueError("fp8_mm: torch._scaled_mm (cuBLASLt) refuses E5M2 x E5M2; make one operand E4M3")
    M, K = a.shape
    N = b.shape[1]
    Kp, Np = _round_up(K), _round_up(N)
    a = _pad2d_fp8(a, M, Kp).contiguous()  # row-major [M, Kp]
    b = _pad2d_fp8(b, Kp, Np)
    if b.stride(0) != 1:  # column-major [Kp, Np]
        b = b.t().contiguous().t()
    sa = scale_a_inv.float()
    sb = scale_b_inv.float()
    if sa.numel() == 1 and sb.numel() == 1:  # tensor-wise (or a row-wise 1 x 1 product: same thing)
        sa, sb = sa.reshape(()), sb.reshape(())
    else:  # row-wise: [M, 1] and [1, Np]
        # NOTE: rebuild from a flat copy: a transposed [1, M] view reshaped to [M, 1] keeps stride
        # (1, M), which is_contiguous() accepts but _scaled_mm's stride(1) == 1 check does not.
        sa = sa.flatten().contiguous().view(M, 1)
        sb = sb.flatten().contiguous().view(1, N)
        if Np != N:
            sb = torch.cat([sb, sb.new_ones(1, Np - N)], dim=1)
        sb = sb.contiguous()
    out = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    return out[:, :N] if Np != N else out


def fp8_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a_inv: torch.Tensor,
    scale_b_inv: torch.Tensor,
    out_dtype: torch.dtype,
    backend: str = "auto",
) -> torch.Tensor:
    """FP8 GEMM ``a [M, K] @ b [K, N]`` with dequantisation scales (see module docstring)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"fp8_mm: need a [M, K] and b [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype not in FP8_DTYPES or b.dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_mm: operands must be FP8, got {a.dtype} and {b.dtype}")
    rowwise = scale_a_inv.numel() != 1 or scale_b_inv.numel() != 1
    if rowwise and (scale_a_inv.numel() != a.shape[0] or scale_b_inv.numel() != b.shape[1]):
        raise ValueError(
            f"fp8_mm: row-wise scales must be [M, 1] = [{a.shape[0]}, 1] and [1, N] = [1, {b.shape[1]}], "
            f"got {tuple(scale_a_inv.shape)} and {tuple(scale_b_inv.shape)}"
        )
    if resolve_backend(backend, a.device) == "scaled_mm":
        return _scaled_mm_padded(a, b, scale_a_inv, scale_b_inv, out_dtype)
    if rowwise:
        scale_a_inv, scale_b_inv = scale_a_inv.reshape(-1, 1), scale_b_inv.reshape(1, -1)
    return emulated_mm(a, b, scale_a_inv, scale_b_inv, out_dtype)
