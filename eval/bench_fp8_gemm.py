"""FP8 vs bf16 GEMM throughput at Maverick's linear shapes.

    python -m eval.bench_fp8_gemm [--tokens 1 8 64 512 4096] [--iters 50] [--out PATH]

y [M, N] = x [M, K] @ W^T for each layer shape (N, K) and token count M, timed three ways on CUDA:
bf16 ``x @ W.t()``, ``torch._scaled_mm`` with tensor-wise scales, and with row-wise scales (per
token x per output channel, the FP8 release's inference scheme). Operands are quantised once
outside the timed loop, so the numbers are the GEMM alone (the casts cost a memory pass each).
Each measurement: warm-up, then CUDA events around ``iters`` calls, median of 5 repeats.
Small M is weight-bandwidth bound: there FP8's gain is from reading half the bytes.

Without CUDA (sm_89+) the script runs a small correctness pass instead (emulation vs
``torch._scaled_mm`` on CPU, and SQNR vs fp32) and says that CUDA is needed for timings.
Writes JSON (atomically) and prints a table, then one JSON line.
"""

from __future__ import annotations

import functools
import json
import statistics
from pathlib import Path

import torch

from maverick.cli import (
    ArgumentParser,
    is_json_with,
    output_file,
    positive_int,
    refuse_foreign_output,
    run_cli,
)
from maverick.files import atomic_write
from maverick.fp8 import E4M3, fp8_mm, quantize_current, scaled_mm_supported, sqnr

H, I_EXPERT, I_DENSE, KV = 5120, 8192, 16384, 1024
# name: (N out_features, K in_features)
SHAPES = {
    "attn_q": (H, H),
    "attn_kv": (KV, H),
    "expert_up": (I_EXPERT, H),
    "expert_down": (H, I_EXPERT),
    "dense_up": (I_DENSE, H),
    "dense_down": (H, I_DENSE),
}


def _time_ms(fn, iters: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean time per call (ms) of ``iters`` back-to-back calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def _gemms(x: torch.Tensor, w: torch.Tensor) -> dict[str, functools.partial]:
    """The three timed GEMMs for x [M, K] bf16 and W [N, K] bf16, operands prepared up front."""
    N = w.shape[0]
    xq_t, xs_t = quantize_current(x, E4M3)  # tensor-wise
    wq_t, ws_t = quantize_current(w, E4M3)
    xq_r, xs_r = quantize_current(x, E4M3, dim=-1)  # per token [M, 1]
    wq_r, ws_r = quantize_current(w, E4M3, dim=-1)  # per output channel [N, 1]
    mm = functools.partial(torch._scaled_mm, out_dtype=torch.bfloat16)
    return {
        "bf16": functools.partial(torch.matmul, x, w.t()),
        # W^T of a row-major [N, K] W is the column-major [K, N] that _scaled_mm wants: no copy
        "fp8_tensorwise": functools.partial(
            mm, xq_t, wq_t.t(), scale_a=xs_t.float().reshape(()), scale_b=ws_t.float().reshape(())
        ),
        "fp8_rowwise": functools.partial(
            mm,
            xq_r,
            wq_r.t(),
            scale_a=xs_r.float().contiguous(),
            scale_b=ws_r.float().reshape(1, N).contiguous(),
        ),
    }


def bench_cuda(tokens: list[int], iters: int) -> list[dict]:
    rows = []
    dev = torch.device("cuda")
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K**-0.5
        for M in tokens:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ w.float().t()
            flops = 2.0 * M * N * K
            row = {"shape": name, "M": M, "N": N, "K": K}
            for kind, fn in _gemms(x, w).items():
                ms = _time_ms(fn, iters)
                row[f"{kind}_ms"] = ms
                row[f"{kind}_tflops"] = flops / (ms * 1e-3) / 1e12
                row[f"{kind}_sqnr_db"] = sqnr(ref, fn().float())
            rows.append(row)
            print(
                f"  {name:12s} M={M:5d}  bf16 {row['bf16_tflops']:7.1f}  "
                f"fp8-t {row['fp8_tensorwise_tflops']:7.1f}  fp8-r {row['fp8_rowwise_tflops']:7.1f} TFLOP/s",
                flush=True,
            )
        torch.cuda.empty_cache()
    return rows


def check_cpu() -> list[dict]:
    """Small shapes (scaled-down Maverick aspect ratios, K/N not all multiples of 16)."""
    rows = []
    g = torch.Generator().manual_seed(0)
    for name, (N, K) in SHAPES.items():
        N, K = max(N // 128, 8), max(K // 128, 8) + 3  # +3: exercise the K padding
        for M in (1, 8, 64):
            x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
            ref = x @ w.t()
            row = {"shape": name, "M": M, "N": N, "K": K}
            for kind, dims in (("tensorwise", (None, None)), ("rowwise", (-1, -1))):
                xq, xs = quantize_current(x, E4M3, dim=dims[0])
                wq, ws = quantize_current(w, E4M3, dim=dims[1])
                emu = fp8_mm(xq, wq.t(), xs, ws.t() if dims[1] else ws, torch.float32, "emulate")
                smm = fp8_mm(xq, wq.t(), xs, ws.t() if dims[1] else ws, torch.float32, "scaled_mm")
                row[f"{kind}_max_abs_diff_vs_scaled_mm"] = (emu - smm).abs().max().item()
                row[f"{kind}_sqnr_db"] = sqnr(ref, emu)
            rows.append(row)
    return rows


def is_results(path: Path) -> bool:
    """Whether `path` holds this command's --out: a JSON object with "mode" and "rows" (timings or the CPU
    correctness pass, written since the first version)."""
    return is_json_with(path, ("mode", "rows"))


def main(argv: list[str] | None = None) -> dict:
    p = ArgumentParser(prog="python -m eval.bench_fp8_gemm", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=positive_int, nargs="+", default=[1, 8, 64, 512, 4096])
    p.add_argument("--iters", type=positive_int, default=50)
    p.add_argument("--out", type=output_file, default=Path("eval/results/bench_fp8_gemm.json"))
    args = p.parse_args(argv)
    # an earlier run's results are replaced; a user's notes, or another command's JSON, are not
    refuse_foreign_output(args.out, is_results, "eval.bench_fp8_gemm's results")
    cuda = torch.cuda.is_available() and scaled_mm_supported("cuda")
    config = {
        "tokens": args.tokens,
        "iters": args.iters,
        "shapes": {k: {"N": n, "K": k_} for k, (n, k_) in SHAPES.items()},
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
    }
    print("config:", json.dumps(config), flush=True)

    if cuda:
        rows = bench_cuda(args.tokens, args.iters)
        result = {"config": config, "mode": "timing", "rows": rows}
        atomic_write(args.out, json.dumps(result, indent=2))
        print(
            f"\n{'shape':12s} {'M':>5s} {'N':>6s} {'K':>6s} | TFLOP/s: {'bf16':>7s} {'fp8-t':>7s} {'fp8-r':>7s} | x bf16"
        )
        for r in rows:
            print(
                f"{r['shape']:12s} {r['M']:5d} {r['N']:6d} {r['K']:6d} | {r['bf16_tflops']:16.1f} "
                f"{r['fp8_tensorwise_tflops']:7.1f} {r['fp8_rowwise_tflops']:7.1f} | "
                f"{r['bf16_ms'] / r['fp8_tensorwise_ms']:.2f} {r['bf16_ms'] / r['fp8_rowwise_ms']:.2f}"
            )
        summary = {
            "mode": "timing",
            "device": config["device"],
            "best_fp8_speedup": max(
                r["bf16_ms"] / min(r["fp8_tensorwise_ms"], r["fp8_rowwise_ms"]) for r in rows
            ),
            "out": str(args.out),
        }
    else:
        print("CUDA with compute capability >= 8.9 is needed for timings; running a CPU correctness pass.")
        rows = check_cpu()
        result = {"config": config, "mode": "cpu_correctness", "rows": rows}
        atomic_write(args.out, json.dumps(result, indent=2))
        print(
            f"\n{'shape':12s} {'M':>3s} {'N':>4s} {'K':>4s} | SQNR dB: {'tensor':>6s} {'row':>6s} | max |emu - _scaled_mm|"
        )
        for r in rows:
            print(
                f"{r['shape']:12s} {r['M']:3d} {r['N']:4d} {r['K']:4d} | {r['tensorwise_sqnr_db']:15.1f} "
                f"{r['rowwise_sqnr_db']:6.1f} | {max(r['tensorwise_max_abs_diff_vs_scaled_mm'], r['rowwise_max_abs_diff_vs_scaled_mm']):.2e}"
            )
        summary = {
            "mode": "cpu_correctness",
            "min_sqnr_db": min(min(r["tensorwise_sqnr_db"], r["rowwise_sqnr_db"]) for r in rows),
            "max_abs_diff_vs_scaled_mm": max(
                max(r["tensorwise_max_abs_diff_vs_scaled_mm"], r["rowwise_max_abs_diff_vs_scaled_mm"])
                for r in rows
            ),
            "out": str(args.out),
        }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    run_cli(main)
