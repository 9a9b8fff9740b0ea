"""Float8Linear: nn.Linear whose three GEMMs run in FP8 (Transformer Engine style).

    forward   y [M, N]  = x [M, K]  @ W^T        x: E4M3, W: E4M3
    backward  dx [M, K] = dy [M, N] @ W [N, K]   dy: E5M2 (hybrid) or E4M3
              dW [N, K] = dy^T [N, M] @ x [M, K]
    (M = tokens, K = in_features, N = out_features; bias added in high precision)

Scaling (``Fp8Recipe.scaling``):
- ``delayed``: per role (input, weight, grad_output) a persistent ``scale_<role>`` and
  ``amax_history_<role>`` [L] buffer. A cast uses the scale as it stands (computed from earlier
  steps) and folds this tensor's amax into slot 0 of the history. THE UPDATE IS EXPLICIT: call
  ``sync_float8_amax_and_scale_history(model)`` once per training step (after ``optimizer.step()``;
  anywhere after the backward works). Why explicit rather than at the next forward: a module that runs
  several times per step (EAGLE's unrolled draft, activation-checkpoint recompute, an eval forward
  between steps) would otherwise advance its window per call, and its backward passes would read
  scales that a later forward had already replaced. With an explicit sync every call in a step uses
  the same scales and the step's amax is the max over all its calls, as in TE's fp8_autocast. If
  you never sync, the scales stay at their initial 1.0 (correct but poorly scaled).
- ``current``: tensor-wise scale from this tensor's amax now; no state.
- ``rowwise``: per-row scales along each GEMM's contraction dim, no state. The backward GEMMs
  contract over different dims than the forward, so x and W are re-quantised from high precision
  there (x is saved in high precision, as nn.Linear does anyway).

Tensor-wise recipes save the FP8 copies of x and W for backward (half the memory of bf16 x).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from maverick.fp8_cast import (
    cast_to_fp8,
    quantize_current,
    record_amax_,
    tensor_amax,
    update_delayed_scale_,
)
from maverick.fp8_gemm import fp8_mm, resolve_backend
from maverick.fp8_recipe import Fp8Recipe

ROLES = ("input", "weight", "grad_output")


def _cast_delayed(t: torch.Tensor, scale: torch.Tensor, history: torch.Tensor, dtype: torch.dtype):
    """Delayed-scaling cast: use the standing scale, record this tensor's amax for the next update."""
    record_amax_(history, tensor_amax(t))
    return cast_to_fp8(t, scale, dtype), scale.reciprocal()


class _Fp8LinearFn(torch.autograd.Function):
    """y = x W^T with all three GEMMs in FP8. ``state`` tensors are the delayed-scaling buffers
    (scale_in, scale_w, scale_go, hist_in, hist_w, hist_go), all None for current / rowwise."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,  # [M, K]
        weight: torch.Tensor,  # [N, K]
        scaling: str,
        fwd_dtype: torch.dtype,
        bwd_dtype: torch.dtype,
        margin: int,
        backend: str,
        scale_in,
        scale_w,
        scale_go,
        hist_in,
        hist_w,
        hist_go,
    ) -> torch.Tensor:
        ctx.scaling, ctx.fwd_dtype, ctx.bwd_dtype = scaling, fwd_dtype, bwd_dtype
        ctx.margin, ctx.backend = margin, backend
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        if scaling == "rowwise":
            xq, xs = quantize_current(x, fwd_dtype, margin, dim=-1)  # [M, K], [M, 1]
            wq, ws = quantize_current(weight, fwd_dtype, margin, dim=-1)  # [N, K], [N, 1]
            ctx.save_for_backward(x, weight)
            return fp8_mm(xq, wq.t(), xs, ws.t(), x.dtype, backend)  # [M, N]
        if scaling == "current":
            xq, xs = quantize_current(x, fwd_dtype, margin)
            wq, ws = quantize_current(weight, fwd_dtype, margin)
        else:  # delayed
            xq, xs = _cast_delayed(x, scale_in, hist_in, fwd_dtype)
            wq, ws = _cast_delayed(weight, scale_w, hist_w, fwd_dtype)
            # NOTE: ctx attributes, not save_for_backward: a backward records into hist_go in place,
            # which would trip autograd's version check when the module ran more than once this step.
            ctx.scale_go, ctx.hist_go = scale_go, hist_go
        ctx.save_for_backward(xq, wq, xs, ws)
        return fp8_mm(xq, wq.t(), xs, ws, x.dtype, backend)  # [M, N]

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # dy [M, N]
        dy = dy.contiguous()
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = dw = None
        if ctx.scaling == "rowwise":
            x, weight = ctx.saved_tensors
            if need_dx:
                dyq, dys = quantize_current(dy, ctx.bwd_dtype, ctx.margin, dim=-1)  # [M, N], [M, 1]
                wq, ws = quantize_current(weight, ctx.fwd_dtype, ctx.margin, dim=0)  # [N, K], [1, K]
                dx = fp8_mm(dyq, wq, dys, ws, ctx.x_dtype, ctx.backend)  # [M, K]
            if need_dw:
                dyq, dys = quantize_current(dy, ctx.bwd_dtype, ctx.margin, dim=0)  # [M, N], [1, N]
                xq, xs = quantize_current(x, ctx.fwd_dtype, ctx.margin, dim=0)  # [M, K], [1, K]
                dw = fp8_mm(dyq.t(), xq, dys.t(), xs, ctx.w_dtype, ctx.backend)  # [N, K]
        else:
            xq, wq, xs, ws = ctx.saved_tensors
            if ctx.scaling == "current":
                dyq, dys = quantize_current(dy, ctx.bwd_dtype, ctx.margin)
            else:
                dyq, dys = _cast_delayed(dy, ctx.scale_go, ctx.hist_go, ctx.bwd_dtype)
            if need_dx:
                dx = fp8_mm(dyq, wq, dys, ws, ctx.x_dtype, ctx.backend)  # [M, N] @ [N, K]
            if need_dw:
                dw = fp8_mm(dyq.t(), xq, dys, xs, ctx.w_dtype, ctx.backend)  # [N, M] @ [M, K]
        return (dx, dw) + (None,) * 11


class Float8Linear(nn.Linear):
    """Drop-in nn.Linear computing its forward and backward GEMMs in FP8 (see module docstring).

    ``fp8_enabled = False`` (set by ``fp8_disabled(model)``) makes forward exactly ``F.linear``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        recipe: Fp8Recipe | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe if recipe is not None else Fp8Recipe()
        self.fp8_enabled = True
        self._init_fp8_state(self.weight.device)

    def _init_fp8_state(self, device: torch.device) -> None:
        """(Re)create the delayed-scaling buffers on ``device``: scales 1.0, histories 0 (TE init)."""
        if self.recipe.scaling != "delayed":
            return
        L = self.recipe.amax_history_len
        for role in ROLES:
            self.register_buffer(f"amax_history_{role}", torch.zeros(L, dtype=torch.float32, device=device))
            self.register_buffer(f"scale_{role}", torch.ones((), dtype=torch.float32, device=device))

    @classmethod
    def from_float(cls, linear: nn.Linear, recipe: Fp8Recipe | None = None) -> Float8Linear:
        """Wrap ``linear`` without copying: the new module holds the SAME weight/bias Parameters,
        so optimizer state and tied references stay valid."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, recipe=recipe)
        new.weight = linear.weight
        new.bias = linear.bias
        new._init_fp8_state(linear.weight.device)
        new.train(linear.training)
        return new

    @torch.no_grad()
    def update_scales(self) -> None:
        """Delayed scaling: reduce each role's history into its scale and roll (no-op otherwise)."""
        if self.recipe.scaling != "delayed":
            return
        r = self.recipe
        dtypes = {"input": r.fwd_dtype, "weight": r.fwd_dtype, "grad_output": r.bwd_dtype}
        for role in ROLES:
            update_delayed_scale_(
                getattr(self, f"amax_history_{role}"),
                getattr(self, f"scale_{role}"),
                dtypes[role],
                r.margin,
                r.amax_compute_algo,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8_enabled:
            return F.linear(x, self.weight, self.bias)
        r = self.recipe
        if r.scaling == "delayed":
            state = tuple(getattr(self, f"scale_{role}") for role in ROLES) + tuple(
                getattr(self, f"amax_history_{role}") for role in ROLES
            )
        else:
            state = (None,) * 6
        x2d = x.reshape(-1, self.in_features)  # [M, K]
        y = _Fp8LinearFn.apply(
            x2d,
            self.weight,
            r.scaling,
            r.fwd_dtype,
            r.bwd_dtype,
            r.margin,
            resolve_backend(r.backend, x.device),
            *state,
        )
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        r = self.recipe
        return (
            f"{super().extra_repr()}, scaling={r.scaling}, format={r.format}, fp8_enabled={self.fp8_enabled}"
        )


def sync_float8_amax_and_scale_history(model: nn.Module) -> None:
    """Once per training step (after ``optimizer.step()``): update every delayed-scaling
    Float8Linear's scales from its amax history and roll the history. No-op for other recipes.

    Under torch.distributed (DDP: every rank holds the whole model) the step's amaxes are first reduced
    to their maximum over the ranks, as Transformer Engine's ``reduce_amax`` does: each rank saw its own
    batch, and a scale from one rank's amax alone clips another rank's larger values (DDP broadcasts rank
    0's buffers at each forward, so the other ranks' amaxes were lost)."""
    delayed = [m for m in model.modules() if isinstance(m, Float8Linear) and m.recipe.scaling == "delayed"]
    if delayed and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        histories = [getattr(m, f"amax_history_{role}") for m in delayed for role in ROLES]
        now = torch.stack([h[0] for h in histories])
        dist.all_reduce(now, op=dist.ReduceOp.MAX)
        for h, amax in zip(histories, now):
            h[0] = amax
    for module in delayed:
        module.update_scales()
