"""How far each of the target's faster forms moves its next-token distributions: bf16, the packed 4-bit
linears, FP8 weight-only layers, against the same weights computed in fp32.

    python -m eval.quality                          # MT-bench's 80 first turns, every variant
    python -m eval.quality --variants q4,fp8 --n 20

Speculative decoding is lossless, so our methods' quality is their target's: what changes the output is
the form the target computes in. Each variant scores the same text, the bf16 target's greedy answers to
the benchmark's first turns (kept in .cache/answers and shared with eval.acceptance), teacher-forced: one
forward of prompt + answer per prompt and variant, compared at every answer position with the fp32
forward of the same weights (the GGUF's values dequantised, the reference):

    KL mean / p99 / max   KL(fp32 || variant) of the next-token distributions, in nats
    top-1                 the share of positions where the variant's most likely token is fp32's
    ppl                   the perplexity of the answer tokens under the variant (fp32's on its own row;
                          the text is bf16's own greedy answer, so bf16 may score it below fp32)

Variants (maverick/): `bf16` the model in bf16; `q4` the GGUF's Q4/Q8 linears packed for torch's int4
kernel, bf16 (maverick/q4.py; what eval.bench's +q4 methods run); `fp8` bf16 with FP8 (e4m3, a scale per output
row) weight-only linears, the head and embedding kept in bf16 (maverick/fp8_weight_only.py and its default
filter; eval.bench's +fp8); `codes` fp32 with the quantised linears as one-byte
codes (maverick/codes.py): the same values as the reference, so its row is the control, ~0 (a variant
that computed something else would show there). llama.cpp's `llama-perplexity --kl-divergence` reports
the same kind of numbers for its own quantisations.

Output: the config first, a progress bar, a table (with each variant's forward seconds), then one JSON
line; `--out` writes the JSON (with every variant's numbers per benchmark category).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from eval.acceptance import first_turns, target_answers
from eval.prompts import BENCHMARKS, check_prompts_option, load_benchmark
from maverick.cli import (
    ArgumentParser,
    UserError,
    add_threads_option,
    is_json_with,
    output_file,
    positive_int,
    refuse_foreign_output,
    run_cli,
)
from maverick.files import atomic_write
from maverick.model import Llama4
from maverick.target import TARGET_HELP, default_target_path, load_target, load_target_tokenizer

VARIANTS = ("bf16", "q4", "fp8", "codes")


def build_variant(name: str, target: str | os.PathLike, bf16: Llama4) -> Llama4:
    """The target in the form `name` (see the module docstring); `bf16` is the loaded bf16 model, shared."""
    if name == "bf16":
        return bf16
    if name == "q4":
        return load_target(target, dtype=torch.bfloat16, q4=True)
    if name == "fp8":
        from maverick.fp8 import convert_to_fp8_weight_only

        return convert_to_fp8_weight_only(copy.deepcopy(bf16))
    if name == "codes":
        return load_target(target, dtype=torch.float32, q4=True)
    raise UserError(f"--variants: unknown variant {name!r}; choose from {', '.join(VARIANTS)}")


@torch.no_grad()
def answer_logprobs(model: Llama4, prompt: Sequence[int], answer: Sequence[int]) -> Tensor:
    """log-softmax [len(answer), V] (fp32) of `model`'s next-token distributions at the positions that
    predict each answer token (teacher-forced: one forward of prompt + answer[:-1])."""
    ids = torch.tensor([list(prompt) + list(answer[:-1])])
    logits = model(ids, logits="all").logits[0, len(prompt) - 1 :]
    return torch.log_softmax(logits.float(), dim=-1)


def compare(ref: Tensor, var: Tensor, answer: Sequence[int]) -> dict[str, Tensor]:
    """Per position: KL(ref || var) in nats, whether the top tokens agree, and the answer token's
    negative log-likelihood under each. ref, var: log-probabilities [T, V]."""
    tokens = torch.tensor(list(answer))[:, None]
    return {
        "kl": (ref.exp() * (ref - var)).sum(-1).clamp_min(0.0),  # >= 0 up to rounding
        "top1": (ref.argmax(-1) == var.argmax(-1)).float(),
        "nll": -var.gather(-1, tokens)[:, 0],
        "nll_ref": -ref.gather(-1, tokens)[:, 0],
    }


def summarize(per_position: dict[str, Tensor]) -> dict[str, float]:
    kl = per_position["kl"].double()
    return {
        "positions": int(kl.numel()),
        "kl_mean": kl.mean().item(),
        "kl_p99": torch.quantile(kl, 0.99).item(),
        "kl_max": kl.max().item(),
        "top1": per_position["top1"].double().mean().item(),
        "ppl": per_position["nll"].double().mean().exp().item(),
        "ppl_ref": per_position["nll_ref"].double().mean().exp().item(),
    }


def is_results(path: Path) -> bool:
    """Whether `path` holds this command's --out: a JSON object with "answers_kept" and "variants" (written
    since the first version)."""
    return is_json_with(path, ("answers_kept", "variants"))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = ArgumentParser(
        prog="python -m eval.quality",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
    ap.add_argument("--bench", choices=BENCHMARKS, default="mtbench")
    ap.add_argument("--prompts", default=None, help="JSONL of prompts for --bench jsonl")
    ap.add_argument("--n", type=positive_int, default=80, help="number of prompts")
    ap.add_argument("--max-new-tokens", type=positive_int, default=128, help="answer length scored")
    ap.add_argument("--target", "--gguf", dest="target", default=None, help=TARGET_HELP)
    ap.add_argument("--fresh-answers", action="store_true",
                    help="generate the bf16 target's answers again instead of reading them from .cache/answers")  # fmt: skip
    add_threads_option(ap)
    ap.add_argument("--out", type=output_file, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise UserError(f"--variants: unknown {', '.join(map(repr, unknown)) or 'none given'}; "
                        f"choose from {', '.join(VARIANTS)}")  # fmt: skip
    check_prompts_option(args.bench, args.prompts)
    if args.out is not None:  # an earlier run's results are replaced; a chat file or a user's notes are not
        refuse_foreign_output(args.out, is_results, "eval.quality's results")
    if args.threads:
        torch.set_num_threads(args.threads)
    target = args.target or default_target_path()
    packed = [v for v in variants if v in ("q4", "codes")]
    if packed and Path(target).is_dir():
        raise UserError(f"--variants {','.join(packed)}: {target} is an HF directory; the packed forms are a GGUF "
                        "file's quantised linears (give a .gguf --target, or --variants bf16,fp8)")  # fmt: skip
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config |= {"variants": variants, "target": str(target), "torch": torch.__version__}
    print(json.dumps(config), flush=True)

    tok = load_target_tokenizer(target)
    bench = load_benchmark(args.bench, args.n, args.prompts)
    prompts = first_turns(tok, bench)
    categories = [p.get("category", args.bench) for p in bench]
    bf16 = load_target(target, dtype=torch.bfloat16)
    answers, kept = target_answers(bf16, target, "bf16", prompts, args.max_new_tokens, args.fresh_answers)
    cached = kept is not None
    print(f"{len(prompts)} {args.bench} prompts, {sum(map(len, answers))} answer tokens of the bf16 target"
          + (" (kept from an earlier run)" if cached else ""), flush=True)  # fmt: skip

    reference = load_target(target, dtype=torch.float32)
    models = {name: build_variant(name, target, bf16) for name in variants}
    # prompt by prompt, every variant against the reference's distributions of that prompt alone (a prompt's
    # are [answer tokens, vocabulary] in fp32: 25 MB for 128 SmolLM2 tokens, 2 GB for all 80 at once)
    rows: dict[str, list[dict[str, Tensor]]] = {name: [] for name in variants}
    seconds = dict.fromkeys(["fp32", *variants], 0.0)
    for p, a in tqdm(list(zip(prompts, answers)), desc="prompts", file=sys.stderr):
        t0 = time.perf_counter()
        ref = answer_logprobs(reference, p, a)
        seconds["fp32"] += time.perf_counter() - t0
        for name, model in models.items():
            t0 = time.perf_counter()
            rows[name].append(compare(ref, answer_logprobs(model, p, a), a))
            seconds[name] += time.perf_counter() - t0
    result: dict[str, Any] = {"config": config, "answers_kept": cached, "seconds": seconds, "variants": {}}
    for name, per_prompt in rows.items():
        keys = per_prompt[0]
        s = summarize({k: torch.cat([r[k] for r in per_prompt]) for k in keys})
        s["categories"] = {
            c: summarize(
                {k: torch.cat([r[k] for r, c2 in zip(per_prompt, categories) if c2 == c]) for k in keys}
            )
            for c in dict.fromkeys(categories)
        }
        result["variants"][name] = s

    print(
        f"\nagainst fp32 on the same weights, {args.bench} {len(prompts)} first turns, teacher-forced answers"
    )
    print(f"{'variant':8s} {'positions':>9s} {'KL mean':>9s} {'KL p99':>9s} {'KL max':>9s} {'top-1':>7s} "
          f"{'ppl':>7s} {'ppl fp32':>8s} {'s':>6s}")  # fmt: skip
    for name, s in result["variants"].items():
        print(f"{name:8s} {s['positions']:9d} {s['kl_mean']:9.5f} {s['kl_p99']:9.5f} {s['kl_max']:9.4f} "
              f"{s['top1']:7.4f} {s['ppl']:7.3f} {s['ppl_ref']:8.3f} {seconds[name]:6.1f}")  # fmt: skip
    if args.out is not None:
        atomic_write(args.out, json.dumps(result, indent=1) + "\n")
    print(
        json.dumps({n: {"kl_mean": s["kl_mean"], "top1": s["top1"]} for n, s in result["variants"].items()})
    )
    return result


if __name__ == "__main__":
    run_cli(main)
