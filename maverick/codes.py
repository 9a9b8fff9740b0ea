"""fp32 decoding on the GGUF's own codes: one byte per weight streamed instead of four.

A GGUF Q4_0 / Q4_1 / Q8_0 weight is, per 32 consecutive inputs of an output row, integer codes q and an fp16
scale d (and offset m for Q4_1): w = d * q + m (Q4_0: m = -8 d; Q8_0: int8 q, m = 0). d * q needs at most
11 + 8 bits, so fp32 holds it exactly and fp32(d * q + m) is the very weight the loader dequantises (fused
multiply-add or not). The dense fp32 model streams 4 bytes per weight every decode step and is bound by
memory bandwidth; keeping the codes as one byte each (plus fp32 d and m per 32: 0.25 byte) and multiplying
through a kernel that dequantises on the fly reads ~3x fewer bytes for the same weights, in fp32
arithmetic throughout. Only the order of the dot product's additions differs from `F.linear`'s.

The kernel is `torch.compile`d: Inductor's C++ backend vectorises y[r, n] = sum_k x[r, k] * (q[n, k] *
d[n, k // 32] + m[n, k // 32]). Rows are unrolled at trace time (one reduction per row over the same
dequantised weights), so the weights are decoded once per call, not once per row: a call takes 1, 2, 4
or 8 rows (fewer are padded with zeros, more are split into calls of 8), one compiled kernel per row
count, each dynamic in the weight's shape. Each row's reduction is the same loop whatever the row count,
so a row's result has the same bits alone or among 64 (tests/test_codes.py), which keeps greedy
speculative decoding bit-exact on these weights. Measured on this repository's CPU (2 threads, weights
streamed from memory): a 3072x576 weight takes 146 us for 1 row (dense fp32 `F.linear`: 601 us), 175 us
for 2, 221 us for 4, 334 us for 8; the tied 49152x576 head 1.8-2.3 ms for 1 or 2 rows, 2.4 ms for 4
(dense: 9.6 ms for 1).

A `Linear` carries its pack in `.codes` (not a parameter or buffer: the state dict keeps the dense weight).
The pack stands for the weight it was attached to: once that weight is written or replaced, the layer
falls back to the dense weight. Calls of more than 64 rows (prefill, training), with gradients, or while
compiling take the dense weight, which holds the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from maverick.q4 import few_row_inference

GROUP = 32
CODES_MAX_ROWS = 64


class CodePack:
    """codes [N, K] uint8, scale and offset [N, K / 32] fp32: w[n, k] = codes[n, k] * scale[n, k // 32]
    + offset[n, k // 32] (see gguf_loader.codes_parts)."""

    def __init__(self, codes: Tensor, scale: Tensor, offset: Tensor):
        N, K = codes.shape
        if codes.dtype != torch.uint8:
            raise ValueError(f"codes must be uint8, not {codes.dtype}")
        if K % GROUP:
            raise ValueError(f"codes need K % {GROUP} == 0, got a [{N}, {K}] weight")
        if scale.shape != (N, K // GROUP) or offset.shape != (N, K // GROUP):
            raise ValueError(
                f"scale/offset must be [{N}, {K // GROUP}], got {tuple(scale.shape)}, {tuple(offset.shape)}"
            )
        self.shape = (N, K)
        self.codes = codes.contiguous()
        self.scale = scale.to(torch.float32).contiguous()
        self.offset = offset.to(torch.float32).contiguous()
        self.key: tuple | None = None  # (data_ptr, version) of the dense weight this pack stands for
        self.groups: dict[tuple[int, ...], tuple] = {}  # group_pack's concatenations led by this pack

    def dense(self) -> Tensor:
        """The weights the kernel computes with, fp32 [N, K]."""
        N, K = self.shape
        w = self.codes.float().view(N, K // GROUP, GROUP) * self.scale[..., None] + self.offset[..., None]
        return w.view(N, K)

    @staticmethod
    def cat(packs: Sequence[CodePack]) -> CodePack:
        """The packs stacked on the output dim (q/k/v, gate/up: one call instead of several)."""
        codes = torch.cat([p.codes for p in packs])
        return CodePack(codes, torch.cat([p.scale for p in packs]), torch.cat([p.offset for p in packs]))


def _rows_dot(x: Tensor, codes: Tensor, scale: Tensor, offset: Tensor) -> Tensor:
    """x [R, K] (R fixed when traced) times the codes' weights transposed -> [R, N] fp32."""
    N, K = codes.shape
    w = codes.to(torch.float32).view(N, K // GROUP, GROUP) * scale[..., None] + offset[..., None]
    return torch.stack([(x[r].view(1, K // GROUP, GROUP) * w).sum((-1, -2)) for r in range(x.shape[0])])


ROW_BUCKETS = (1, 2, 4, 8)
# one compiled kernel per row count (dynamo keeps at most 8 per function: 4 here), dynamic in N and K
_kernel = torch.compile(_rows_dot, dynamic=True, fullgraph=True)


def codes_matmul(x: Tensor, pack: CodePack) -> Tensor:
    """x [..., K] fp32 times the pack's weight transposed -> [..., N] fp32."""
    K = x.shape[-1]
    # a plain contiguous tensor, not a view: the compiled kernel would otherwise guard on (and recompile
    # for) the layout of x's base
    x2 = x.reshape(-1, K).contiguous().detach()
    outs = []
    for chunk in x2.split(ROW_BUCKETS[-1]) if x2.shape[0] > ROW_BUCKETS[-1] else (x2,):
        R = chunk.shape[0]
        bucket = next(b for b in ROW_BUCKETS if b >= R)
        if bucket > R:
            chunk = torch.cat([chunk, chunk.new_zeros(bucket - R, K)])
        elif chunk is not x2:
            chunk = chunk.clone()  # not a view (see above)
        outs.append(_kernel(chunk, pack.codes, pack.scale, pack.offset)[:R])
    y = outs[0] if len(outs) == 1 else torch.cat(outs)
    return y.view(*x.shape[:-1], pack.shape[0])


def use_codes(x: Tensor, layers: Sequence[nn.Module]) -> bool:
    """Whether a call of x on these layers' code packs: few fp32 CPU rows, no gradient, not compiling."""
    return few_row_inference(x, layers, torch.float32, CODES_MAX_ROWS)


@torch.no_grad()
def attach_codes(layer: nn.Module, codes: Tensor, scale: Tensor, offset: Tensor) -> None:
    """Give a bias-free fp32 CPU linear layer the code pack of its weight. The dense weight must already hold
    the pack's weights exactly (the GGUF loader's dequantisation does): a pack that stands for other numbers
    is refused rather than silently changing the model."""
    if layer.weight.dtype != torch.float32 or layer.weight.device.type != "cpu" or layer.bias is not None:
        raise ValueError("code packs are for bias-free fp32 linear layers on CPU")
    if tuple(codes.shape) != tuple(layer.weight.shape):
        raise ValueError(f"codes {tuple(codes.shape)} do not match the weight {tuple(layer.weight.shape)}")
    pack = CodePack(codes, scale, offset)
    if not torch.equal(pack.dense(), layer.weight):
        raise ValueError(
            "the codes do not give the layer's weight exactly (another file, or other rounding?)"
        )
    pack.key = (layer.weight.data_ptr(), layer.weight._version)
    layer.codes = pack
