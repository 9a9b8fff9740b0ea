"""maverick.decode_attention's Triton kernel, run on a CPU by Triton's interpreter: each row reads only its own
keys (the slots past them hold NaN) and gets the masked grouped product's output, in fp32 and bf16.

The kernel is the one piece of hand-written GPU code the draft stage relies on (train/fastgen.py), and a GPU is
lent only now and then. Triton's interpreter runs the same kernel source with numpy, so its indexing, masking
and online softmax are checked on any machine with triton installed (`pip install -e '.[triton]'`; the pin is
the device image's version). What it cannot show, the GPU's numerics and speed, the CUDA test in
tests/test_fastgen.py checks where a GPU is present.

The interpreter must be chosen before triton is imported (TRITON_INTERPRET=1), so each check runs in a child
process: `python tests/test_decode_attention.py <check>`."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def widen_bf16_dots() -> None:
    """Triton's interpreter keeps bf16 values as their uint16 bits and hands them to numpy's matmul as integers
    (3.6 and 3.9 alike). Its dot gets them as float32 here: the exact widening a GPU's bf16 dot does before it
    accumulates in fp32."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def f32(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def widened(self, a, b, d, *rest):
        return dot(self, f32(a), f32(b), d, *rest)

    interpreter.InterpreterBuilder.create_dot = widened


def ragged_case(dtype, B=12, Hq=9, Hkv=3, D=64, S=200, seed=0):
    """q, the cache's first S slots (strided slices of a longer cache, NaN past each row's keys), the lengths
    (1, a 64-slot block's edges and the whole window among them), and the masked product over clean keys in fp32
    from the same rounded inputs."""
    import torch

    from maverick.decode_attention import grouped_decode_attention

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, 1, D, generator=g).to(dtype)
    kc, vc = (torch.randn(B, Hkv, S + 64, D, generator=g).to(dtype) for _ in range(2))
    n = torch.randint(1, S + 1, (B,), generator=g)
    n[:5] = torch.tensor([1, 63, 64, 65, S])
    mask = (torch.arange(S)[None] < n[:, None])[:, None, None]
    want = grouped_decode_attention(q.float(), kc[:, :, :S].float(), vc[:, :, :S].float(), mask)
    beyond = (torch.arange(S + 64)[None] >= n[:, None])[:, None, :, None]
    kc.masked_fill_(beyond, float("nan"))
    vc.masked_fill_(beyond, float("nan"))
    return q, kc[:, :, :S], vc[:, :, :S], n, want


def check_rows_read_their_own_keys() -> None:
    import torch

    from maverick.decode_attention import triton_decode_attention

    # bf16: the probabilities enter the second product as bf16 and the output is rounded to bf16 (the CUDA
    # torch path, grouped_decode_attention with bf16 probabilities, is 2.1e-3 off the same reference; the
    # kernel 3.2e-3)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 6e-3)):
        q, k, v, n, want = ragged_case(dtype)
        got = triton_decode_attention(q, k, v, n)
        assert got.dtype == dtype and got.shape == want.shape, (got.dtype, got.shape)
        assert torch.isfinite(got).all(), dtype
        err = float((got.float() - want).norm() / want.norm())
        print(f"{dtype}: relative error {err:.2e}")
        assert err < tol, (dtype, err)
        # one key: the output is that key's value, for each of the kv head's query heads
        v0 = v[n == 1, :, :1].float()
        assert torch.equal(got[n == 1].float().view(v0.shape[0], 3, 3, 64), v0.expand(-1, 3, 3, 64)), dtype
    # one query head per kv head (G = 1, padded to the dot's 16 rows), another head size
    q, k, v, n, want = ragged_case(torch.float32, Hq=4, Hkv=4, D=32, S=130, seed=1)
    err = float((triton_decode_attention(q, k, v, n) - want).norm() / want.norm())
    assert err < 1e-6, err


def check_self_check() -> None:
    """kernel_ok accepts the kernel, and refuses one that reads a slot too few (the stage keeps the product)."""
    import torch

    from maverick import decode_attention as da

    assert da.kernel_ok("cpu", torch.bfloat16, 9, 3, 64)
    right = da.triton_decode_attention
    da.triton_decode_attention = lambda q, k, v, n: right(q, k, v, (n - 1).clamp(min=1))
    da.kernel_ok.cache_clear()
    assert not da.kernel_ok("cpu", torch.bfloat16, 9, 3, 64)


def test_cpu_product_is_exact_to_the_rounding_of_its_output():
    """On a CPU, batched decoding's attention (grouped_decode_attention) computes in fp32 (from the fp32 cache
    a CPU keeps, or, as here, a bf16 one cast): each output is within bf16's rounding (2^-8 relative) of the
    fp64 result over the same inputs. Rounding the probabilities to bf16 first (as SDPA's CPU kernel and the
    CUDA path do) breaks that bound here."""
    import torch

    from maverick.decode_attention import grouped_decode_attention

    B, Hq, Hkv, D, S = 16, 9, 3, 64, 300
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, Hq, 1, D, generator=g).bfloat16()
    k, v = (torch.randn(B, Hkv, S, D, generator=g).bfloat16() for _ in range(2))
    n = torch.randint(1, S + 1, (B,), generator=g)
    mask = (torch.arange(S)[None] < n[:, None])[:, None, None]
    p = torch.matmul(q.double().view(B, Hkv, 3, D), k.double().transpose(-1, -2)) * D**-0.5
    p = p.masked_fill(~mask, float("-inf")).softmax(-1)
    want = torch.matmul(p, v.double()).view(B, Hq, 1, D)
    bound = want.abs() * 2.0**-8 + 1e-6
    got = grouped_decode_attention(q, k, v, mask)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - want).abs() <= bound).all(), float(((got.double() - want).abs() / bound).max())
    rounded = torch.matmul(p.bfloat16().double(), v.double()).view(B, Hq, 1, D).bfloat16()
    assert not ((rounded.double() - want).abs() <= bound).all()


needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="the Triton interpreter: pip install -e '.[triton]'"
)


@needs_triton
@pytest.mark.parametrize("check", ["check_rows_read_their_own_keys", "check_self_check"])
def test_kernel_under_the_interpreter(check):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]))
    r = subprocess.run(
        [sys.executable, __file__, check], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.strip().endswith(f"{check}: ok")


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    widen_bf16_dots()
    globals()[sys.argv[1]]()
    print(f"{sys.argv[1]}: ok")
