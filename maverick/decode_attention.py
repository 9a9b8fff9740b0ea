"""One-query attention over a cache that reads only each row's own keys: a Triton kernel for batched GPU decoding.

Batched greedy regeneration (train/fastgen.py) decodes hundreds of rows of different lengths on one static
cache. Masked attention over the cache's first n slots reads n slots of every row, n set by the longest row:
at 512 rows and 1,536 slots that is ~18 GB of keys and values per step for SmolLM2 (23 KB per token), which
bounds the step at ~6-7 ms on an H100 however short most rows are. This kernel reads row b's first
n_valid[b] slots only (flash-decoding's online softmax, one program per (row, kv head), the G query heads of
a kv head as the rows of one product), so a step costs what the rows hold.

`decode_attention` checks the kernel once per process against `grouped_decode_attention` (below) on
random data and falls back to it (with a warning) when Triton is missing, fails to compile or disagrees:
a stage on a lent GPU must not die or go wrong on a kernel that could only be tested there. Its indexing, masks
and online softmax are also checked on a CPU, under Triton's interpreter (tests/test_decode_attention.py, with
the `triton` extra installed).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

if triton is not None:

    @triton.jit
    def _decode_kernel(Q, K, V, O, N, sqb, sqh, skb, skh, sks, svb, svh, svs, sob, soh, scale,
                       G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        b = tl.program_id(0)
        h = tl.program_id(1)
        n = tl.load(N + b)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        qmask = (g < G)[:, None]
        q = tl.load(Q + b * sqb + (h * G + g)[:, None] * sqh + d[None, :], mask=qmask, other=0.0)  # [GP, D]
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for s0 in range(0, n, BLOCK):
            s = s0 + tl.arange(0, BLOCK)
            smask = s < n
            kb = tl.load(
                K + b * skb + h * skh + s[:, None] * sks + d[None, :], mask=smask[:, None], other=0.0
            )
            sc = tl.dot(q, tl.trans(kb)) * scale  # [GP, BLOCK] fp32
            sc = tl.where(smask[None, :], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            p = tl.exp(sc - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            vb = tl.load(
                V + b * svb + h * svh + s[:, None] * svs + d[None, :], mask=smask[:, None], other=0.0
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
            m = m_new
        o = acc / l[:, None]
        tl.store(O + b * sob + (h * G + g)[:, None] * soh + d[None, :], o.to(O.dtype.element_ty), mask=qmask)


def triton_decode_attention(q: Tensor, k: Tensor, v: Tensor, n_valid: Tensor, block: int = 64) -> Tensor:
    """q [B, Hq, 1, D], k/v [B, Hkv, S, D] (last dim contiguous), n_valid [B] int: row b attends to slots
    0..n_valid[b]-1 -> [B, Hq, 1, D]."""
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=q.device)
    GP = max(16, triton.next_power_of_2(G))
    _decode_kernel[(B, Hkv)](
        q, k, v, out, n_valid.to(torch.int32),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), D**-0.5, G=G, GP=GP, D=D, BLOCK=block,
    )  # fmt: skip
    return out


def grouped_decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """One query per row over a cache: q [B, Hq, 1, D], k/v [B, Hkv, S, D] (may be a strided slice of the
    cache), mask [B, 1, 1, S] bool -> [B, Hq, 1, D]. The G = Hq // Hkv query heads of a kv head are the G rows
    of one product, so the keys and values are read once; SDPA with a mask and GQA may take its math path
    on CUDA, which repeats them per query head first (G times the memory traffic of the step's largest
    read). Scores and softmax in fp32; on CUDA the value product in the cache's dtype (the probabilities
    rounded to it, as flash kernels do), on a CPU in fp32 too, from the fp32 cache a CPU keeps
    (`Llama4.new_cache`; a bf16 one is cast): there the whole product is as exact as the output's rounding
    allows and, measured on AMD EPYC Zen 4, 2.5-7x faster than SDPA with a mask (16-32 rows, 256-1,536
    slots, SmolLM2's heads)."""
    B, Hq, _, D = q.shape
    Hkv, dtype = k.shape[1], q.dtype
    if not q.is_cuda:
        q, k, v = q.float(), k.float(), v.float()
    scores = (
        torch.matmul(q.view(B, Hkv, Hq // Hkv, D), k.transpose(-1, -2)).float() * D**-0.5
    )  # [B, Hkv, G, S]
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype)
    return torch.matmul(probs, v).to(dtype).view(B, Hq, 1, D)


@functools.cache
def kernel_ok(device: str, dtype: torch.dtype, Hq: int, Hkv: int, D: int) -> bool:
    """Whether the Triton kernel runs here and agrees with `grouped_decode_attention` (random data, ragged
    lengths, a strided cache slice); False (logged) otherwise."""
    if triton is None or D & (D - 1) or D < 16:
        return False
    try:
        g = torch.Generator(device=device).manual_seed(0)
        B, S = 37, 300
        q = torch.randn(B, Hq, 1, D, device=device, generator=g).to(dtype)
        cache_k = torch.randn(B, Hkv, S + 64, D, device=device, generator=g).to(dtype)
        cache_v = torch.randn(B, Hkv, S + 64, D, device=device, generator=g).to(dtype)
        k, v = cache_k[:, :, :S], cache_v[:, :, :S]
        n = torch.randint(1, S + 1, (B,), device=device, generator=g)
        mask = (torch.arange(S, device=device)[None, :] < n[:, None])[:, None, None]
        want = grouped_decode_attention(q, k, v, mask).float()
        got = triton_decode_attention(q, k, v, n).float()
        err = float((got - want).abs().max())
        ok = err <= (2e-2 if dtype != torch.float32 else 1e-4)
    except Exception as exc:  # a compile or launch failure: keep the plain path
        log.warning(
            "Triton decode attention unavailable (%s: %s); using the masked product", type(exc).__name__, exc
        )
        return False
    if not ok:
        log.warning("Triton decode attention differs from the masked product by %.3g; not used", err)
    return ok


def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, n_valid: Tensor | None) -> Tensor:
    """The Triton kernel where it works (CUDA, n_valid given, the self-check passed), else the masked grouped
    product. mask [B, 1, 1, S] must equal slot < n_valid[b]."""
    if (
        n_valid is not None
        and q.is_cuda
        and kernel_ok(str(q.device), q.dtype, q.shape[1], k.shape[1], q.shape[3])
    ):
        return triton_decode_attention(q, k, v, n_valid)
    return grouped_decode_attention(q, k, v, mask)
