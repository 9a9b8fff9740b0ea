"""4-bit weights kept packed for few-row bf16 inference on CPU (GGUF Q4_0 / Q4_1 linears).

A GGUF Q4_1 weight holds, per 32 consecutive inputs of an output row, 4-bit codes q and an fp16 scale d
and offset m: w = d * q + m (Q4_0: w = d * (q - 8)). Decoding streams every weight once per step, so
reading 4.6 bits per weight instead of bf16's 16 is the largest saving left on this CPU. PyTorch ships the
kernel: `aten._weight_int4pack_mm_for_cpu` multiplies bf16 rows by codes packed two per byte with a bf16
scale and zero per group of 32, computing w = (q - 8) * scale + zero on the fly. Q4_1 maps onto it with
scale = d, zero = m + 8 d; Q4_0 with scale = d, zero = 0.

What it is and is not (measured on this repository's CPU, 2 threads; tests/test_q4.py):
- Not the bf16 model: scale and zero are rounded to bf16 (d is fp16 in the file), so a weight moves by up
  to about 8 * 2^-8 d + 2^-8 |m + 8 d| (the code's share of d's rounding, and zero's own): on SmolLM2's
  file up to 0.046 d (median tensor 0.036 d). The dense bf16 model rounds each weight to bf16 instead; the logits
  of both sit about as far from the fp32 model's (the test bounds both).
- Row-count invariant: each row's result has the same bits for 1..64 rows, so greedy speculative decoding
  stays bit-identical to plain decoding on these weights, as on dense ones (see the note in model.py).
- Fast for one row, slow for many: a 3072x576 weight takes ~50 us for 1 row vs ~117 us dense bf16, but
  each further row costs ~25 us (the codes are decoded again per row). Calls of more than 64 rows (prefill,
  training) use the dense weight, which `attach_q4` sets to the kernel's weights rounded to bf16.

A `Linear` carries its pack in `.q4` (not a parameter or buffer: the state dict keeps the dense weight, and
`.to()` leaves the pack alone). The pack stands for the weight it was made with: once the weight is
written or replaced (training), the layer falls back to the dense weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

GROUP = 32
Q4_MAX_ROWS = 64


class Q4Weight:
    """codes [N, K] in 0..15, scale and zero [N, K / 32] (any float dtype, rounded to bf16 here):
    w[n, k] = (codes[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]."""

    def __init__(self, codes: Tensor, scale: Tensor, zero: Tensor):
        N, K = codes.shape
        if K % GROUP or N % 16:
            raise ValueError(f"int4 packing needs K % {GROUP} == 0 and N % 16 == 0, got a [{N}, {K}] weight")
        if scale.shape != (N, K // GROUP) or zero.shape != (N, K // GROUP):
            raise ValueError(
                f"scale/zero must be [{N}, {K // GROUP}], got {tuple(scale.shape)}, {tuple(zero.shape)}"
            )
        if int(codes.min()) < 0 or int(codes.max()) > 15:
            raise ValueError("4-bit codes must lie in 0..15")
        self.shape = (N, K)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), 1
        )
        self.scale_zero = torch.stack([scale.T, zero.T], -1).to(torch.bfloat16).contiguous()  # [K/32, N, 2]
        self.key: tuple | None = None  # (data_ptr, version) of the dense weight this pack stands for
        self.groups: dict[tuple[int, ...], tuple] = {}  # group_pack's concatenations led by this pack

    def dense(self, codes: Tensor) -> Tensor:
        """The weights the kernel computes with (fp32), from the codes this pack was made of."""
        s, z = self.scale_zero.float().unbind(-1)  # [K/32, N]
        w = (codes.float() - 8).view(self.shape[0], -1, GROUP) * s.T[..., None] + z.T[..., None]
        return w.view(self.shape)

    @staticmethod
    def cat(packs: Sequence[Q4Weight]) -> Q4Weight | None:
        """The packs stacked on the output dim, or None where they do not stack. The kernel packs rows in
        blocks (64 on AVX-512, measured: a pack of 32 rows followed by another gave other numbers), so the
        stack is probed on one random row against the packs one by one, bit for bit."""
        out = Q4Weight.__new__(Q4Weight)
        out.shape = (sum(p.shape[0] for p in packs), packs[0].shape[1])
        out.packed = torch.cat([p.packed for p in packs])
        out.scale_zero = torch.cat([p.scale_zero for p in packs], 1)
        out.key, out.groups = None, {}
        x = torch.randn(1, out.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        if not torch.equal(q4_matmul(x, out), torch.cat([q4_matmul(x, p) for p in packs], -1)):
            return None
        return out


def q4_matmul(x: Tensor, w: Q4Weight) -> Tensor:
    """x [..., K] bf16 times the packed weight's transpose -> [..., N] bf16."""
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]), w.packed, GROUP, w.scale_zero)
    return y.view(*x.shape[:-1], w.shape[0])


def live_pack(layer: nn.Module, attr: str = "q4"):
    """The layer's pack (`.q4`, or `.codes`: maverick/codes.py) if it still stands for the layer's weight."""
    pack = getattr(layer, attr, None)
    if pack is None or pack.key != (layer.weight.data_ptr(), layer.weight._version):
        return None
    return pack


def few_row_inference(x: Tensor, layers: Sequence[nn.Module], dtype: torch.dtype, max_rows: int) -> bool:
    """x is at most `max_rows` CPU rows of `dtype`, no gradient is wanted (the pack kernels have none), and
    nothing is being compiled (a compiled step traces the dense weights)."""
    return (
        x.dtype == dtype
        and x.device.type == "cpu"
        and x.numel() <= max_rows * x.shape[-1]
        and not (torch.is_grad_enabled() and (x.requires_grad or any(m.weight.requires_grad for m in layers)))
        and not torch.compiler.is_compiling()
    )


def use_q4(x: Tensor, layers: Sequence[nn.Module]) -> bool:
    """Whether a call of x on these layers' 4-bit packs: few bf16 CPU rows, no gradient, not compiling."""
    return few_row_inference(x, layers, torch.bfloat16, Q4_MAX_ROWS)


def group_pack(layers: Sequence[nn.Module], attr: str = "q4"):
    """One pack for several layers' outputs side by side (q/k/v, gate/up), made on first use and kept on the
    first layer's pack; None when a layer has no live pack (`attr` as in live_pack) or the 4-bit packs do
    not stack (`Q4Weight.cat`)."""
    packs = [live_pack(m, attr) for m in layers]
    if any(p is None for p in packs):
        return None
    if len(packs) == 1:
        return packs[0]
    slot = tuple(id(p) for p in packs)
    hit = packs[0].groups.get(slot)
    if hit is None or any(a is not b for a, b in zip(hit[0], packs)):
        hit = (tuple(packs), type(packs[0]).cat(packs))
        packs[0].groups[slot] = hit
    return hit[1]


@torch.no_grad()
def attach_q4(layer: nn.Module, codes: Tensor, scale: Tensor, zero: Tensor) -> None:
    """Give a bias-free bf16 CPU linear layer a 4-bit pack and set its dense weight to the pack's weights
    (rounded to bf16), so that calls of any row count compute with (nearly) the same numbers."""
    if layer.weight.dtype != torch.bfloat16 or layer.weight.device.type != "cpu" or layer.bias is not None:
        raise ValueError("4-bit packs are for bias-free bf16 linear layers on CPU")
    if tuple(codes.shape) != tuple(layer.weight.shape):
        raise ValueError(f"codes {tuple(codes.shape)} do not match the weight {tuple(layer.weight.shape)}")
    w4 = Q4Weight(codes, scale, zero)
    layer.weight.copy_(w4.dense(codes).to(torch.bfloat16))
    w4.key = (layer.weight.data_ptr(), layer.weight._version)
    layer.q4 = w4
