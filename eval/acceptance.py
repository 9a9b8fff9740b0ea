"""Teacher-forced acceptance of EAGLE-3 drafts: what a greedy chain would accept, from one target forward
per answer instead of a decoding run (seconds per draft instead of a benchmark's minutes).

A chain cycle that starts after the committed token x_m drafts x_{m+1}, x_{m+2}, ... and keeps its tokens
while they equal the target's greedy ones. While they do, the draft's state at its step j is exactly the
training-time-test state at index m - 1, unroll step j (train/ttt.py: true features up to m - 1, then its
own outputs). So over the target's own greedy answer, run(t) = the number of leading unroll steps at
index t whose argmax is the target's, and a cycle starting there accepts min(run(t), k) tokens: exactly,
for every cycle start (tests/test_acceptance.py checks it against SpecDecoder cycle by cycle). Averaged
over all answer positions (a decoding run visits only the cycle starts):

    P(run >= i)   the share of positions whose first i draft tokens are right (i = 1..steps)
    tau(k)        = 1 + sum_{i <= k} P(run >= i), the chain acceptance length at draft length k

Where the acceptance comes from (same positions, the first draft token only):

    in vocab      the share of positions whose next target token is in the draft vocabulary: the ceiling
                  of P(run >= 1), since a draft never proposes a token outside it
    confident     the share of positions where the target gives its token probability >= 0.9, and
                  P(run >= 1) there: what the draft gets right where the target itself is sure

and every number per category of the benchmark (MT-bench has eight).

Trees and sampling are not covered (a tree accepts what its top-k branches hold; use eval.bench).

    python -m eval.acceptance --draft eagle3/drafts/smollm2-135m-instruct --draft runs/draft-v6 --n 80
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eagle3.draft import Eagle3Draft, check_feature_layers, load_draft
from maverick.cli import positive_int, run_cli
from maverick.generate import Decoder
from maverick.model import Llama4
from train.dump import run_target
from train.ttt import ttt_unroll


def greedy_answers(
    model: Llama4, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int = 16
) -> list[list[int]]:
    """The target's greedy answers (up to and including a stop token), in batches."""
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        dec = Decoder(
            model, max_len=max(map(len, chunk)) + max_new_tokens + 8, batch_size=len(chunk), exact=False
        )
        out += dec.generate(chunk, max_new_tokens, stop_ids=model.config.eos_ids).tokens
    return out


def target_fields(
    model: Llama4, prompt: Sequence[int], answer: Sequence[int], feature_layers: Sequence[int]
) -> dict[str, Tensor]:
    """The target's forward over prompt + answer: its features and greedy choices (train.dump.run_target)."""
    sample = {"input_ids": list(prompt) + list(answer), "loss_mask": [0] * len(prompt) + [1] * len(answer)}
    return run_target(model, [sample], feature_layers, model.dtype)[0]


@torch.no_grad()
def run_lengths(
    model: Llama4,
    draft: Eagle3Draft,
    prompt: Sequence[int],
    answer: Sequence[int],
    steps: int,
    fields: dict[str, Tensor] | None = None,
) -> Tensor:
    """run[t] (capped at `steps`) for every index t at which a decoding cycle can start: t >= P - 1 for a
    prompt of P tokens (the first answer token comes from the prefill, so the first cycle starts at
    x_P, index P - 1), up to the last index that can score all `steps` steps. Element j is index P - 1 + j.
    fields: `target_fields` of this prompt and answer for the draft's feature layers, if already computed."""
    ids = list(prompt) + list(answer)
    T = len(ids)
    f = fields if fields is not None else target_fields(model, prompt, answer, draft.config.feature_layers)
    target = f["target_argmax"].long().to(model.device)  # target[t]: its greedy choice for x_{t+1}
    x = torch.as_tensor(ids, device=model.device)[None]
    ok = torch.zeros(steps, T, dtype=torch.bool, device=model.device)
    for i, logits in ttt_unroll(
        draft, model.model.embed_tokens, x, f["features"][None].to(model.device), steps
    ):
        pred = draft.draft_to_target_ids[logits[0].argmax(-1)]  # index t, step i predicts x_{t+2+i}
        ok[i, : T - 1 - i] = pred[: T - 1 - i] == target[1 + i :]
    # leading correct steps: cumprod along the steps
    run = ok.long().cumprod(0).sum(0)
    first = len(prompt) - 1
    last = T - 1 - steps  # index t scores steps 0..steps-1 only if t + steps <= T - 1
    return run[first:last].cpu()


CONFIDENT = 0.9  # the target's probability of its own token from which a position counts as confident


def _first_draft_targets(prompt: Sequence[int], answer: Sequence[int], steps: int) -> slice:
    """The indices t + 1 of the target's choices for x_{t+2}, the first draft token of a cycle starting at
    index t, for the positions of `run_lengths`."""
    first, last = len(prompt) - 1, len(prompt) + len(answer) - 1 - steps
    return slice(first + 1, last + 1)


@torch.no_grad()
def target_probs(
    model: Llama4, prompt: Sequence[int], answer: Sequence[int], steps: int, fields: dict[str, Tensor]
) -> Tensor:
    """For the positions of `run_lengths`: the target's probability of its greedy choice for the cycle's
    first draft token x_{t+2} (fp32 softmax over the full vocabulary from the stored final hidden state).
    The same for every draft, so computed once per answer."""
    at = _first_draft_targets(prompt, answer, steps)
    target = fields["target_argmax"].long()[at]
    hidden = fields["hidden"][at].to(model.device).float()
    head = model.lm_head.weight.float()
    p = torch.zeros(len(target))
    for i in range(0, len(target), 512):  # [512, V] fp32 probabilities at a time
        probs = (hidden[i : i + 512] @ head.T).softmax(-1)
        p[i : i + 512] = probs.gather(1, target[i : i + 512, None].to(probs.device))[:, 0].cpu()
    return p


def target_detail(
    draft: Eagle3Draft,
    prompt: Sequence[int],
    answer: Sequence[int],
    steps: int,
    fields: dict[str, Tensor],
    target_p: Tensor,
) -> dict[str, Tensor]:
    """For the positions of `run_lengths`: whether the target's greedy choice for x_{t+2} is in the draft
    vocabulary, and its probability (`target_probs`)."""
    target = fields["target_argmax"].long()[_first_draft_targets(prompt, answer, steps)]
    return {"in_vocab": draft.t2d[target.to(draft.t2d.device)].cpu(), "target_p": target_p}


def summarize(runs: Tensor, steps: int, detail: dict[str, Tensor] | None = None) -> dict[str, Any]:
    """P(run >= i), tau(k) and, given `target_detail` of the same positions, the vocabulary ceiling and
    the agreement where the target is confident."""
    p = (
        [(runs >= i).float().mean().item() for i in range(1, steps + 1)]
        if len(runs)
        else [float("nan")] * steps
    )
    out: dict[str, Any] = {
        "positions": len(runs),
        "p_run_ge": [round(v, 4) for v in p],
        "tau": {k: round(1 + sum(p[:k]), 4) for k in range(1, steps + 1)},
    }
    if detail is not None:
        sure = detail["target_p"] >= CONFIDENT
        nan = float("nan")
        out["in_vocab"] = round(detail["in_vocab"].float().mean().item(), 4) if len(runs) else nan
        out["confident"] = round(sure.float().mean().item(), 4) if len(runs) else nan
        out["p_run_ge_1_confident"] = round((runs[sure] >= 1).float().mean().item(), 4) if sure.any() else nan
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from eval.prompts import BENCHMARKS, load_benchmark
    from maverick.target import TARGET_HELP, load_target, load_target_tokenizer
    from maverick.tokenizer import encode_chat

    ap = argparse.ArgumentParser(
        prog="python -m eval.acceptance",
        description="Teacher-forced greedy chain acceptance of EAGLE-3 drafts on a benchmark's first turns.",
    )
    ap.add_argument("--draft", action="append", required=True, help="draft directory (repeat to compare)")
    ap.add_argument("--bench", choices=BENCHMARKS, default="mtbench")
    ap.add_argument("--prompts", default=None, help="JSONL of prompts for --bench jsonl")
    ap.add_argument("--n", type=positive_int, default=80, help="number of prompts")
    ap.add_argument("--max-new-tokens", type=positive_int, default=128)
    ap.add_argument("--steps", type=positive_int, default=5, help="draft positions scored")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--target", "--gguf", dest="target", default=None, help=TARGET_HELP)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model, tok = load_target(args.target, dtype=dtype), load_target_tokenizer(args.target)
    drafts = {path: load_draft(path, dtype=dtype) for path in args.draft}  # every draft checked before work
    for path, draft in drafts.items():
        check_feature_layers(
            draft.config.feature_layers, model.config.num_hidden_layers, f"{path}/config.json"
        )
    bench = load_benchmark(args.bench, args.n, args.prompts)
    prompts = [
        encode_chat(
            tok,
            ([{"role": "system", "content": p["system"]}] if "system" in p else [])
            + [{"role": "user", "content": p["turns"][0]}],
        )
        for p in bench
    ]
    categories = [p.get("category", args.bench) for p in bench]
    t0 = time.perf_counter()
    answers = greedy_answers(model, prompts, args.max_new_tokens)
    result: dict[str, Any] = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "answer_tokens": sum(map(len, answers)),
        "answer_seconds": round(time.perf_counter() - t0, 1),
        "drafts": {},
    }
    print(f"{len(prompts)} {args.bench} prompts, {result['answer_tokens']} answer tokens ({args.dtype})")
    print(
        f"{'draft':48s} {'positions':>9s} | P(run >= i), i = 1..{args.steps} | tau(k): k = 1..{args.steps} | "
        f"in vocab | confident: share, P(run >= 1)"
    )
    fields: dict[tuple[int, ...], list[dict[str, Tensor]]] = {}  # the target's forwards, per feature layers
    probs: list[Tensor] = []  # target_probs per answer: the same whatever the draft
    for path in args.draft:
        draft = drafts[path]
        layers = tuple(draft.config.feature_layers)
        if layers not in fields:
            fields[layers] = [target_fields(model, p, a, layers) for p, a in zip(prompts, answers)]
        if not probs:
            probs = [
                target_probs(model, p, a, args.steps, f) for p, a, f in zip(prompts, answers, fields[layers])
            ]
        runs, details = [], []
        for p, a, f, tp in zip(prompts, answers, fields[layers], probs):
            runs.append(run_lengths(model, draft, p, a, args.steps, f))
            details.append(target_detail(draft, p, a, args.steps, f, tp))
        s = summarize(torch.cat(runs), args.steps, _cat(details))
        s["categories"] = {
            c: summarize(
                torch.cat([r for r, c2 in zip(runs, categories) if c2 == c]),
                args.steps,
                _cat([d for d, c2 in zip(details, categories) if c2 == c]),
            )
            for c in dict.fromkeys(categories)
        }
        result["drafts"][path] = s
        print(
            f"{path[-48:]:48s} {s['positions']:9d} | {' '.join(f'{v:.3f}' for v in s['p_run_ge'])} | "
            f"{' '.join(f'{v:.3f}' for v in s['tau'].values())} | {s['in_vocab']:8.3f} | "
            f"{s['confident']:.3f}, {s['p_run_ge_1_confident']:.3f}",
            flush=True,
        )
    if len(set(categories)) > 1:
        k = args.steps
        print(f"\nper category: P(run >= 1) / tau(k = {k}) / in vocab, one column per draft")
        for c in dict.fromkeys(categories):
            cells = [result["drafts"][path]["categories"][c] for path in args.draft]
            row = "  ".join(
                f"{s['p_run_ge'][0]:.3f} / {s['tau'][k]:.3f} / {s['in_vocab']:.3f}" for s in cells
            )
            print(f"{c:14s} {cells[0]['positions']:6d}  {row}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(tmp, args.out)
    return result


def _cat(details: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    return {k: torch.cat([d[k] for d in details]) for k in ("in_vocab", "target_p")}


if __name__ == "__main__":
    run_cli(main)
