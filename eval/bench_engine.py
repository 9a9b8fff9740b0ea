"""Eager against compiled engine on the real target, in one run: compile time, plain decoding tokens/s (and
whether the tokens agree), the cost of a verify step of k + 1 rows against a one-token step on each
engine, and speculative decoding on the compiled engine (its tokens must equal compiled plain decoding's).

    python -m eval.bench_engine --n 3 --max-new-tokens 128 --out results/engine

Prints the config first, one JSON line per measurement, a table last; writes engine.json to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from eagle3.draft import load_draft
from eagle3.lookup import LookupConfig
from eagle3.spec import SpecDecoder
from eagle3.tuner import DraftLengthTuner
from eval.bench import DEFAULT_DRAFT
from eval.prompts import BENCHMARKS, load_benchmark
from maverick.cli import (
    ArgumentParser,
    UserError,
    add_threads_option,
    output_dir,
    positive_int,
    positive_int_list,
    run_cli,
)
from maverick.compiled import CompiledTarget
from maverick.files import atomic_write
from maverick.generate import Decoder
from maverick.target import TARGET_HELP, default_target_path, load_target, load_target_tokenizer
from maverick.tokenizer import encode_chat
from train.profiling import StepProfiler
from train.profiling import describe as describe_profile


def prompt_ids(tok, bench: str, n: int) -> list[list[int]]:
    """The chat-template ids of the first user turns of a benchmark's first n prompts."""
    return [
        encode_chat(tok, [{"role": "user", "content": p["turns"][0]}]) for p in load_benchmark(bench, n=n)
    ]


def spec_decoder(
    model, draft, max_len: int, k_max: int, copy: int, streak: int, compile_draft: bool = False
) -> SpecDecoder:
    """EAGLE-3 with the tuned draft length (1..k_max tokens) and prompt lookup (`copy` tokens, streaks of up
    to max(copy, streak)): the speculative method measured on each engine."""
    return SpecDecoder(
        model,
        draft,
        max_len=max_len,
        policy=DraftLengthTuner(choices=range(1, k_max + 1)),
        lookup=LookupConfig(max_tokens=copy, streak_tokens=max(copy, streak)),
        compile_draft=compile_draft,
    )


def spec_lengths(rows: tuple[int, ...], streak_tokens: int) -> tuple[int, int, int]:
    """(longest draft, copy, streak) for the speculative rows: drafts of up to 8 tokens, copies of 10, streaks
    of `streak_tokens`, each cut to what a verify in the largest bucket holds."""
    room = rows[-1] - 1
    if room < 1:
        raise UserError(f"--rows {','.join(map(str, rows))}: the speculative rows verify 2 tokens or more; "
                        "give a bucket of 2 rows or more, or --no-spec")  # fmt: skip
    return min(8, room), min(10, room), min(streak_tokens, room)


def alternating(methods: list[str], prompts: list[list[int]]):
    """(method, prompt) pairs, prompt by prompt, each prompt starting one method later: no method always runs
    first (or right after the same other one)."""
    for i, ids in enumerate(prompts):
        k = i % len(methods)
        for m in methods[k:] + methods[:k]:
            yield m, ids


def measure(decoder, ids: list[int], max_new_tokens: int, eos) -> dict:
    """One greedy generation: its tokens, seconds and TTFT; speculative: draft and verify seconds, tau."""
    g = decoder.generate([ids], max_new_tokens, None, eos)
    s = g.stats.get("spec")
    spec = {"draft_s": s.draft_seconds, "verify_s": s.verify_seconds, "tau": s.tau} if s else {}
    return {"tokens": g.tokens[0], "seconds": g.seconds, "ttft": g.ttft} | spec


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per method (its `measure` records): tokens/s over all its prompts, mean TTFT, tokens; how many prompts'
    tokens differ from the plain decoding of the same engine (compiled-eagle3*: compiled-plain; the others,
    compiled-plain included: eager-plain) where that ran; speculative: the draft's share of draft + verify
    seconds and the mean tau."""
    summary = {}
    for m, rs in runs.items():
        n = sum(len(r["tokens"]) for r in rs)
        sec = sum(r["seconds"] for r in rs)
        row = {"tok_s": n / sec, "ttft_s": statistics.mean(r["ttft"] for r in rs), "tokens": n}
        ref = "compiled-plain" if m.startswith("compiled-eagle3") else "eager-plain"
        if m != "eager-plain" and ref in runs:
            row["mismatches_vs_" + ref] = sum(a["tokens"] != b["tokens"] for a, b in zip(rs, runs[ref]))
        if "draft_s" in rs[0]:
            d, v = sum(r["draft_s"] for r in rs), sum(r["verify_s"] for r in rs)
            row |= {"draft_share": d / max(d + v, 1e-9), "tau": statistics.mean(r["tau"] for r in rs)}
        summary[m] = row
    return summary


def step_seconds(fn, reps: int) -> float:
    """Median seconds of fn() over reps calls (after one warm call)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def verify_costs(
    target, engine: CompiledTarget, feature_layers, ctx: list[int], reps: int, every_row: bool = False
) -> dict:
    """Milliseconds of one call of T tokens after a prompt, eager (the exact path speculative decoding takes)
    and compiled (at `engine.bucket(T)` rows), for T = 1 and every bucket (every_row: every T up to the
    largest bucket); the cache is rolled back after each call."""
    out = {}
    dev = target.device
    x = torch.tensor([ctx], device=dev)
    for name, model, cache in (
        ("eager", target, target.new_cache(1, 1024)),
        ("compiled", engine, engine.new_cache(1)),
    ):
        cache.set_window(1024) if name == "eager" else None
        model(x, cache, feature_layers=feature_layers)
        n = int(cache.lengths[0])
        for T in range(1, engine.rows[-1] + 1) if every_row else sorted({1, *engine.rows}):
            toks = torch.randint(3, 1000, (1, T), device=dev)

            def call(model=model, cache=cache, toks=toks, n=n):
                model(toks, cache, feature_layers=feature_layers)
                cache.truncate(n)

            with torch.no_grad():
                out[f"{name}_T{T}_ms"] = 1000 * step_seconds(call, reps)
        for T in sorted(engine.rows):
            out[f"{name}_T{T}_over_T1"] = out[f"{name}_T{T}_ms"] / out[f"{name}_T1_ms"]
    return out


def main(argv=None) -> int:
    ap = ArgumentParser(
        prog="python -m eval.bench_engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--bench", choices=[b for b in BENCHMARKS if b != "jsonl"], default="mtbench")
    ap.add_argument("--n", type=positive_int, default=3, help="prompts (first turns)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=128)
    ap.add_argument("--max-len", type=positive_int, default=1024, help="the compiled engine's cache length")
    ap.add_argument("--rows", type=positive_int_list, default="2,4,8,12,24",
                    help="verify buckets (the decode bucket is added)")  # fmt: skip
    ap.add_argument("--autotune", action="store_true", help="inductor max_autotune (long compiles)")
    ap.add_argument("--reps", type=positive_int, default=20, help="calls per step timing")
    ap.add_argument("--every-row", action="store_true", help="step times for every row count, not buckets")
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--target", "--gguf", dest="target", default=None, help=TARGET_HELP)
    ap.add_argument("--no-spec", action="store_true")
    ap.add_argument(
        "--lookup-streak-tokens", type=positive_int, default=20, help="LookupConfig.streak_tokens (10 = off)"
    )
    ap.add_argument("--compile-draft", action="store_true", help="compile the eager engine's draft too")
    ap.add_argument("--profile", action="store_true", help="profile 20 compiled decode steps (top ops)")
    add_threads_option(ap)
    ap.add_argument(
        "--out", type=output_dir, default=None, help="result directory (default results/engine-<time>)"
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gguf = str(args.target or default_target_path())
    config = vars(args) | {"gguf": gguf, "torch": torch.__version__, "threads": torch.get_num_threads()}
    out = Path(args.out or f"results/engine-{time.strftime('%Y%m%d-%H%M%S')}")
    print(json.dumps(config), flush=True)

    tok = load_target_tokenizer(gguf)
    prompts = prompt_ids(tok, args.bench, args.n)
    longest = max(map(len, prompts))
    if longest + args.max_new_tokens > args.max_len:
        raise UserError(
            f"--max-len {args.max_len} holds no {longest}-token prompt (the longest of --n {args.n}) and "
            f"--max-new-tokens {args.max_new_tokens}: give --max-len {longest + args.max_new_tokens} or more"
        )
    out.mkdir(parents=True, exist_ok=True)  # before the minutes of work whose result goes there
    target = load_target(gguf, dtype=torch.bfloat16)
    draft = load_draft(args.draft, dtype=torch.bfloat16)
    feats = tuple(draft.config.feature_layers)
    rows = tuple(args.rows)
    t0 = time.perf_counter()
    engine = CompiledTarget(target, args.max_len, feats, rows=rows, autotune=args.autotune)
    lengths = None if args.no_spec else spec_lengths(engine.rows, args.lookup_streak_tokens)
    secs = engine.compile()
    result: dict = {
        "rows": list(engine.rows),
        "compile_s": secs,  # per bucket: compiled, or its AOT package loaded (`loaded`)
        "loaded": engine.loaded,
        "compile_total_s": time.perf_counter() - t0,
    }
    print(json.dumps({"compile": result}), flush=True)

    eos = target.config.eos_ids
    result |= verify_costs(target, engine, feats, prompts[0], args.reps, args.every_row)
    print(json.dumps({k: round(v, 3) for k, v in result.items() if k.endswith(("ms", "T1"))}), flush=True)

    decoders = {
        "eager-plain": Decoder(target, max_len=args.max_len),
        "compiled-plain": Decoder(engine, max_len=args.max_len),
    }
    if not args.no_spec:
        k_max, copy, streak = lengths
        for name, model in (("eager", target), ("compiled", engine)):  # the same drafting on both engines
            decoders[f"{name}-eagle3-tuned+lookup"] = spec_decoder(
                model, draft, args.max_len, k_max, copy, streak, args.compile_draft or name == "compiled"
            )
    runs = {m: [] for m in decoders}
    for m, ids in alternating(list(decoders), prompts):
        runs[m].append(measure(decoders[m], ids, args.max_new_tokens, eos))
    summary = summarize(runs)
    base = summary["eager-plain"]["tok_s"]
    for row in summary.values():
        row["x_eager_plain"] = row["tok_s"] / base
    result["decode"] = summary

    if args.profile:
        result["profile"] = profile_steps(engine, prompts[0])
    atomic_write(out / "engine.json", json.dumps(result, indent=1))
    print(f"\n{'method':32s} {'tok/s':>8s} {'x eager':>8s} {'TTFT s':>7s} {'draft %':>8s} mismatches")
    for m, r in summary.items():
        mm = next(
            (f"{v} vs {k.removeprefix('mismatches_vs_')}" for k, v in r.items() if k.startswith("mism")), "-"
        )
        share = f"{100 * r['draft_share']:.1f}" if "draft_share" in r else "-"
        print(f"{m:32s} {r['tok_s']:8.2f} {r['x_eager_plain']:7.2f}x {r['ttft_s']:7.3f} {share:>8s} {mm}")
    print(f"compile {result['compile_total_s']:.0f} s; verify/decode step: " + ", ".join(
        f"T={T} eager {result[f'eager_T{T}_over_T1']:.2f}x compiled {result[f'compiled_T{T}_over_T1']:.2f}x" for T in engine.rows))  # fmt: skip
    print(json.dumps({m: round(r["tok_s"], 2) for m, r in summary.items()}))
    return 0


def profile_steps(engine: CompiledTarget, ids: list[int], steps: int = 20) -> dict | None:
    """torch.profiler over `steps` compiled decode steps after a prefill and 2 unrecorded steps
    (train/profiling.py's StepProfiler: wall and CPU ms per step, the top 15 ops by their own time)."""
    prof = StepProfiler(2, steps, torch.device("cpu"))
    cache = engine.new_cache(1)
    engine(torch.tensor([ids]), cache)
    tok = torch.tensor([[5]])
    for _ in range(2 + steps):
        engine(tok, cache)
        prof.step()
    summary = prof.summary()
    print(describe_profile("compiled decode", summary), file=sys.stderr)
    return summary


if __name__ == "__main__":
    run_cli(main)
