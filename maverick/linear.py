"""Linear layers for few-row bf16 (and fp32) inference on CPU: the weight prepacked once for oneDNN.

Decoding multiplies one row (or k+1 rows when verifying, a tree's nodes, a batch's rows) by every weight
matrix, so it is bound by how fast the weights stream. On CPU, `F.linear` on a bf16 weight hands oneDNN a
plain [out, in] matrix on every call, and oneDNN reorders it into its blocked layout each time; measured
on this repository's CPU (Xeon with AMX, 2 threads) that reorder halves the speed of a 1..25-row matmul.
`torch.ops.mkldnn._reorder_linear_weight` does the reorder once (the same op Inductor's freezing pass
uses), and `torch.ops.mkldnn._linear_pointwise` then runs the matmul on the packed copy.

Measured (576x576 .. 49152x576 weights, bf16): packed is 1.7-2x faster for 1..25 rows, gives the same bits
as `F.linear` there, and each row's result is the same whatever the row count from 1 to 64 (`F.linear`
keeps that only up to 32 rows), which greedy speculative decoding needs to be bit-exact (see the note in
model.py). Above 64 rows (prefill, training) `F.linear` is faster and is used.

The packed copy is made on first use under `torch.no_grad()` and kept per weight tensor until the weight is
written again (its version counter moves): the same numbers, at the cost of a second copy of the weights
in memory. fp32 weights are packed the same way (fp32 `F.linear` keeps a row's bits only in windows as
narrow as 2..3 rows here; the packed fp32 kernel for 2..64, and is faster). Anything else (gradients, CUDA,
`torch.compile`, no oneDNN) is plain `F.linear`.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from maverick.aot import cpu_name
from maverick.codes import CODES_MAX_ROWS, CodePack, codes_matmul, use_codes
from maverick.files import atomic_write
from maverick.q4 import Q4_MAX_ROWS, Q4Weight, group_pack, q4_matmul, use_q4

PACKED_MAX_ROWS = 64
assert Q4_MAX_ROWS == CODES_MAX_ROWS == PACKED_MAX_ROWS  # short_linear's chunks must fit every kernel

# (id of the first weight, number of weights) -> (weakref to the first weight, key, packed copy). A plain dict
# looked up by id is several us cheaper per call than a WeakIdKeyDictionary; the weakref's callback drops
# the entry when the weight dies, and `key` catches a weight that was written or replaced.
_packs: dict[tuple[int, int], tuple[weakref.ref, tuple, Tensor]] = {}


def packing_supported() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


_SUPPORTED = packing_supported()
# fp32 too: MKL's fp32 GEMM (F.linear) gives a row other bits when more rows share the call, in windows as
# narrow as 2..3 rows (AMD EPYC, 2 threads: a 9-row verify took 3 calls); oneDNN's packed fp32 kernel keeps
# them for 2..64 rows and is 1.6-2.4x faster than F.linear for 1..64 rows of SmolLM2's head
_SUPPORTED_FP32 = torch.backends.mkldnn.is_available()


def packed_weights(weights: Sequence[Tensor]) -> Tensor:
    """The packed copy of `weights` concatenated on dim 0, made on first use, remade when one was written."""
    w0 = weights[0]
    slot = (id(w0), len(weights))
    key = tuple([(id(w), w.data_ptr(), w._version) for w in weights])
    hit = _packs.get(slot)
    if hit is None or hit[0]() is not w0 or hit[1] != key:
        w = w0 if len(weights) == 1 else torch.cat(list(weights))
        ref = weakref.ref(w0, lambda _, slot=slot: _packs.pop(slot, None))
        hit = (ref, key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1))
        _packs[slot] = hit
    return hit[2]


def packed_weight(weight: Tensor) -> Tensor:
    """The oneDNN-packed copy of a 2-D bf16 or fp32 CPU weight, made on first use, remade when it was written."""
    return packed_weights([weight])


def few_row_inference(x: Tensor, weights: Sequence[Tensor]) -> bool:
    """What every row-count-safe kernel here needs: x at most PACKED_MAX_ROWS CPU rows of the weights' dtype,
    the weights on the CPU, no gradient wanted, not traced by torch.compile."""
    return (
        x.device.type == "cpu"
        and all(w.dtype == x.dtype and w.device.type == "cpu" for w in weights)
        and x.numel() <= PACKED_MAX_ROWS * x.shape[-1]
        and not (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)))
        and not torch.compiler.is_compiling()
    )


def use_packed(x: Tensor, weight: Tensor) -> bool:
    supported = _SUPPORTED if x.dtype == torch.bfloat16 else _SUPPORTED_FP32 and x.dtype == torch.float32
    return supported and few_row_inference(x, [weight])


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    """x @ W^T + bias on a packed W, no fused activation ("none", no scalars, no algorithm)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.library.custom_op("maverick::packed_matmul", mutates_args=())
def packed_matmul(x: Tensor, packed: Tensor) -> Tensor:
    """`packed_linear` without bias as an opaque op: a compiled graph calls it on a packed weight that is an
    input of the graph (inductor's own oneDNN lowering needs the weight frozen into a constant)."""
    return packed_linear(x, packed, None)


@packed_matmul.register_fake
def _(x: Tensor, packed: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0])


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear`, through the packed weight when `use_packed` says so (same result, see module docstring),
    row-count safe (`row_safe`) as `fused_linear` is: layers with a bias, FP8 weight-only layers (on AMD EPYC
    a [576, 1536] weight's one-row calls take another kernel than calls of 2 or more), fp32 layers."""
    if use_packed(x, weight):
        packed = packed_weight(weight)
        kind = "packed" if bias is None else "packed+bias"
        return row_safe(lambda c: packed_linear(c, packed, bias), kind, tuple(weight.shape), x.dtype)(x)
    if use_fp32_rows(x, [weight]):
        kind = "fp32" if bias is None else "fp32+bias"
        return row_safe(lambda c: F.linear(c, weight, bias), kind, tuple(weight.shape), x.dtype)(x)
    return F.linear(x, weight, bias)


def weight_matmul(x: Tensor, w: Tensor) -> Tensor:
    """x @ w for a [K, N] weight (the MoE's experts, stored [E, K, N] as HF stores them), row-count safe
    (`row_safe`) in few-row CPU inference: an expert's rows of a verify must have the bits they have alone
    (fp32: 14 of 32 tiny-MoE verifies differed from decoding their tokens one by one)."""
    if x.dtype in (torch.float32, torch.bfloat16) and x.numel() > 0 and few_row_inference(x, [w]):
        return row_safe(lambda c: c @ w, "matmul", (w.shape[1], w.shape[0]), x.dtype)(x)
    return x @ w


def use_fp32_rows(x: Tensor, weights: Sequence[Tensor]) -> bool:
    """Whether a few-row fp32 CPU inference call goes through `row_safe` `F.linear`: MKL's fp32 GEMM gives a
    row other bits in a call of 9 rows than alone (every shape tried, up to 6e-6), so an fp32 target's
    verify would not be its decoding, and greedy speculative decoding not plain decoding's tokens."""
    return x.dtype == torch.float32 and few_row_inference(x, weights)


def group_linear(x: Tensor, weights: Sequence[Tensor]) -> Tensor:
    """x times the bias-free weights stacked on dim 0: one matmul on their concatenated packed copy when
    `use_packed` holds for each (q/k/v, gate/up: fewer, larger calls, and each output column has the bits of
    its own weight, tests/test_linear.py), else `F.linear` per weight, concatenated."""
    if all(use_packed(x, w) for w in weights):
        return packed_linear(x, packed_weights(weights), None)
    if len(weights) == 1:
        return F.linear(x, weights[0])
    return torch.cat([F.linear(x, w) for w in weights], dim=-1)


def fused_linear(x: Tensor, layers: Sequence[nn.Module]) -> Tensor:
    """`torch.cat([layer(x) for layer in layers], -1)`, through one call when every layer is a bias-free
    `Linear`: on their 4-bit packs (maverick/q4.py) when they all have one and `use_q4` holds, on their
    code packs (maverick/codes.py) when `use_codes` does, else `group_linear` (other layers, e.g. FP8,
    compute themselves). A decode step makes ~120 of these calls, so the choice is remembered
    (`_remembered`) and only re-checked, saving ~10 us of a ~35 us call."""
    fast = _remembered(x, layers)
    if fast is not None:
        return fast(x)
    if all(type(layer) is Linear and layer.bias is None for layer in layers):
        fn = None
        if layers[0].q4 is not None and use_q4(x, layers):
            w4 = group_pack(layers)
            if w4 is not None:
                fn = row_safe(lambda x: q4_matmul(x, w4), "q4", w4.shape, x.dtype)
        if fn is None and layers[0].codes is not None and use_codes(x, layers):
            pack = group_pack(layers, "codes")
            if pack is not None:
                fn = row_safe(lambda x: codes_matmul(x, pack), "codes", pack.shape, x.dtype)
        weights = [layer.weight for layer in layers]
        shape = (sum(w.shape[0] for w in weights), weights[0].shape[1])
        if fn is None and all(use_packed(x, w) for w in weights):
            packed = packed_weights(weights)
            fn = row_safe(lambda x: packed_linear(x, packed, None), "packed", shape, x.dtype)
        if fn is None and use_fp32_rows(x, weights):
            kind = "fp32" if len(weights) == 1 else f"fp32x{len(weights)}"  # a group: a call per weight
            fn = row_safe(lambda x: group_linear(x, weights), kind, shape, x.dtype)
        if fn is not None:
            _remember(x, layers, fn)
            return fn(x)
        return group_linear(x, weights)
    return torch.cat([layer(x) for layer in layers], dim=-1)


# (kernel, N, K, dtype, threads) -> (lo, hi): calls of lo..hi rows give every row the same bits
_row_windows: dict[tuple, tuple[int, int]] = {}
# the probed windows, kept for later processes (a process's first decoding step spent ~2 s probing SmolLM2's
# shapes on 2 cores), per CPU and software: the repository's .cache, beside the AOT packages
WINDOWS_FILE = Path(__file__).resolve().parent.parent / ".cache" / "row_windows.json"


def _windows_key(kind: str, shape: tuple[int, int], dtype: torch.dtype) -> str:
    """What a kernel's choice of code path may depend on besides its shape: torch (and its oneDNN), the CPU
    and its vector ISA, the thread count."""
    cpu = (torch.backends.cpu.get_cpu_capability(), cpu_name())
    return repr((kind, *shape, str(dtype), torch.__version__, cpu, torch.get_num_threads(), PROBE))


def _saved_windows() -> dict[str, list[int]]:
    """WINDOWS_FILE's windows that are windows: 1 <= lo <= hi <= PACKED_MAX_ROWS (the rest are probed again,
    as is every window of a missing or damaged file)."""
    try:
        saved = json.loads(WINDOWS_FILE.read_text())
    except (OSError, ValueError):
        return {}
    windows = {}
    for key, w in saved.items() if isinstance(saved, dict) else ():
        if isinstance(w, list) and len(w) == 2 and all(type(r) is int for r in w):
            if 1 <= w[0] <= w[1] <= PACKED_MAX_ROWS:
                windows[key] = w
    return windows


def _save_window(key: str, window: tuple[int, int]) -> None:
    """Add a probed window to WINDOWS_FILE (written under a temporary name and renamed)."""
    saved = _saved_windows() | {key: list(window)}
    try:
        atomic_write(WINDOWS_FILE, json.dumps(saved, indent=0, sort_keys=True))
    except OSError:  # a read-only checkout: probed again next time
        pass


PROBE = 2  # the probe's version, in WINDOWS_FILE's keys (1: one input of N(0, 1) rows, which missed some)


def _probe_inputs(k: int, dtype: torch.dtype) -> list[Tensor]:
    """The probe's inputs, 64 rows of k each: N(0, 1), and N(0, 1) scaled by powers of two from 2^-10 to 2^10
    per element and per column. Another order of accumulation rounds differently only where terms of unlike
    size meet: on a [192, 1152] bf16 weight (AMD EPYC), one N(0, 1) input showed no row count differing from
    one-row calls where five others showed 9 to 59 of 63; each wide input showed 47 to 63 of them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(PACKED_MAX_ROWS, k, generator=g)
    per_element = torch.exp2(torch.randint(-10, 11, (PACKED_MAX_ROWS, k), generator=g).float())
    per_column = torch.exp2(torch.randint(-10, 11, (1, k), generator=g).float())
    return [x.to(dtype), (x * per_element).to(dtype), (x * per_column).to(dtype)]


def invariant_rows(fn, kind: str, shape: tuple[int, int], dtype: torch.dtype) -> tuple[int, int]:
    """The row counts lo <= r <= hi (hi <= 64) for which `fn` (a matmul by an [N, K] weight) gives every row
    the same bits whatever r, calls of fewer than lo rows being padded with zero rows up to lo. Kernels
    choose their code path by shape, not by values, so this is probed once per (kernel, shape, dtype): 64
    random rows of each of `_probe_inputs`, in calls of r rows for every r (a differing accumulation order
    shows in only a few of the 64 x N results, and on some inputs in none), first with lo = 1, then (if
    some count differs) lo = 2, 4, 8, keeping the widest window. (1, 64) for every SmolLM2 shape on the Xeon
    with AMX this was written on; (2, 64) for oneDNN's bf16 kernel on a [576, 1536] weight on AMD EPYC (Zen
    4), where one row takes another kernel than two.
    A window probed once is read back from WINDOWS_FILE by later processes on the same CPU and software."""
    key = (kind, *shape, dtype, torch.get_num_threads())  # windows differ by thread count (fp32 GEMMs)
    window = _row_windows.get(key)
    if window is None:
        disk_key = _windows_key(kind, shape, dtype)
        saved = _saved_windows().get(disk_key)
        if saved is not None:
            window = _row_windows[key] = tuple(saved)
            return window
        xs = _probe_inputs(shape[1], dtype)
        window = (1, 1)
        with torch.no_grad():
            for lo in (1, 2, 4, 8):
                rows = [in_row_chunks(fn, x, lo, lo) for x in xs]
                hi = lo
                while hi < PACKED_MAX_ROWS and all(
                    torch.equal(in_row_chunks(fn, x, hi + 1, lo), r) for x, r in zip(xs, rows)
                ):
                    hi += 1
                if hi - lo > window[1] - window[0]:
                    window = (lo, hi)
                if hi == PACKED_MAX_ROWS:
                    break
        _row_windows[key] = window
        _save_window(disk_key, window)
    return window


def row_safe(fn, kind: str, shape: tuple[int, int], dtype: torch.dtype):
    """`fn`, run on lo..hi rows per call (`invariant_rows`: fewer are padded, more are split into several
    calls), so that a row's result never depends on how many rows share the call: what keeps verifying
    k + 1 tokens bit-identical to decoding them one by one."""
    lo, hi = invariant_rows(fn, kind, shape, dtype)
    if lo == 1 and hi >= PACKED_MAX_ROWS:
        return fn
    return lambda x: in_row_chunks(fn, x, hi, lo)


def in_row_chunks(fn, x: Tensor, rows: int, min_rows: int = 1) -> Tensor:
    """fn(x) for x [..., K], computed on calls of min_rows..rows rows (a shorter chunk is padded with zero
    rows, whose outputs are dropped)."""
    R = x.numel() // x.shape[-1]
    if min_rows <= R <= rows:
        return fn(x)
    outs = []
    for c in x.reshape(R, x.shape[-1]).split(rows):
        n = c.shape[0]
        outs.append(fn(F.pad(c, (0, 0, 0, min_rows - n)))[:n] if n < min_rows else fn(c))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.view(*x.shape[:-1], out.shape[-1])


def _remember(x: Tensor, layers: Sequence[nn.Module], fn) -> None:
    """Keep on the first layer the kernel call chosen for these layers and x's dtype, with the weights it
    stands for."""
    weights = tuple(layer.weight for layer in layers)
    plans = layers[0].__dict__.setdefault("_plans", {})
    plans[len(layers), x.dtype, torch.get_num_threads()] = (
        tuple(layers),
        weights,
        tuple((w._version, w.data_ptr()) for w in weights),
        fn,
    )


def _remembered(x: Tensor, layers: Sequence[nn.Module]):
    """The remembered kernel call for these layers and x's dtype if it still applies: the same layers and
    weight tensors, unwritten and holding the same storage (`weight.data = ...`, as `Module.to` does), and
    x a few CPU rows with no gradient wanted (what every kernel's conditions share; anything else takes the
    full checks)."""
    plans = layers[0].__dict__.get("_plans")
    if (
        plans is None
        or torch.is_grad_enabled()
        or not x.is_cpu
        or x.numel() > PACKED_MAX_ROWS * x.shape[-1]
        or torch.compiler.is_compiling()
    ):
        return None
    plan = plans.get((len(layers), x.dtype, torch.get_num_threads()))
    if plan is None:
        return None
    for layer, was, w, v in zip(layers, plan[0], plan[1], plan[2]):
        # (`weight.data = ...` keeps the tensor and its version, but moves its storage)
        if layer is not was or layer.weight is not w or (w._version, w.data_ptr()) != v:
            return None
    return plan[3]


def short_linear(x: Tensor, layers: Sequence[nn.Module]) -> Tensor:
    """`fused_linear` with at most PACKED_MAX_ROWS rows per call, for short calls (decode, verify): every row
    then runs on the row-count-invariant packed (or 4-bit) kernel whatever the batch size, so a batch that
    verifies B * (k + 1) > 64 rows keeps the bits of decoding its B rows (one call of 80 rows would take
    `F.linear`, whose bits differ)."""
    return in_row_chunks(lambda c: fused_linear(c, layers), x, PACKED_MAX_ROWS)


class Linear(nn.Linear):
    """nn.Linear (same parameters, state-dict keys and training behaviour) whose few-row bf16 inference on
    CPU runs on the packed weight, or on its 4-bit pack `q4` when it has one (`maverick.q4.attach_q4`), and
    whose few-row fp32 inference runs on its code pack `codes` when it has one (`maverick.codes`), else on
    the packed fp32 weight."""

    q4: Q4Weight | None = None
    codes: CodePack | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.bias is None and type(self) is Linear:  # packs are attached to bias-free layers only
            return fused_linear(x, (self,))  # its kernel choice, remembered, and row-count safe
        return linear(x, self.weight, self.bias)
