"""Teacher-forced acceptance of EAGLE-3 drafts: what a chain would accept, from one target forward per
answer instead of a decoding run (seconds per draft instead of a benchmark's minutes).

The measures (P(run >= i), tau(k), the vocabulary ceiling, agreement where the target is confident) and
why they are exact for every greedy cycle start, and unbiased for sampled chains: train/acceptance.py.
This module is the command line.

    python -m eval.acceptance --draft eagle3/drafts/smollm2-135m-instruct --draft runs/draft-v6 --n 80
    python -m eval.acceptance --draft eagle3/drafts/smollm2-135m-instruct --temperature 1 --seed 0

At temperature > 0 (with --top-k / --top-p as decoding takes them) the target's answers are drawn with that
rule, and each position counts the probability that a sampled chain keeps its draft tokens there.
`--turns 2` scores MT-bench's second turns too, each asked after the target's own first answer (as text in
the chat, as eval.bench asks it), pooled with the first and shown per turn.

The target's answers do not depend on the drafts, and generating them is over half of a run (61 of 105 s
for MT-bench's 80 on 2 cores), so they are kept in `.cache/answers/`, keyed by everything they depend on
(the target file's path, size and mtime, dtype, --max-new-tokens, the prompt ids, the sampling rule and
seed, torch, the CPU, the thread count and ANSWERS_VERSION, the batched kernels' version); the next
comparison on the same prompts starts at the drafts.
`--fresh-answers` generates them again.

Under torchrun the target runs tensor + expert parallel (maverick/parallel.py; each rank reads its slices
of an HF directory), every rank runs every forward and scores every draft, and rank 0 prints and writes:

    torchrun --nproc-per-node 8 -m eval.acceptance --target DIR --draft DRAFT_A --draft DRAFT_B --n 80
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from eagle3.draft import DEFAULT_DRAFT, check_draft_fits, embeddings_note, load_draft
from eval.prompts import BENCHMARKS, answer_text, chat_ids, check_prompts_option, load_benchmark
from maverick.aot import cpu_name
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
from maverick.files import atomic_write, fingerprint
from maverick.parallel import init_from_env, load_model, rank0_prints, rank0_says
from maverick.sampling import SamplingParams, add_sampling_options
from maverick.target import (
    TARGET_HELP,
    default_target_path,
    load_target_tokenizer,
    target_identity,
)
from train.acceptance import (
    answers_of,
    next_token_probs,
    paired_difference,
    reach_of_runs,
    run_lengths,
    sampled_reach,
    summarize,
    target_detail,
    target_fields,
    target_probs,
)


def is_results(path: Path) -> bool:
    """Whether `path` holds this command's --out: a JSON object with "answer_tokens" and "drafts" (written
    since the first version)."""
    return is_json_with(path, ("answer_tokens", "drafts"))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = ArgumentParser(
        prog="python -m eval.acceptance",
        description="Teacher-forced chain acceptance of EAGLE-3 drafts on a benchmark's prompts (first turns, "
        "or --turns 2): greedy, or sampled with --temperature > 0 (the target's answers drawn with the same rule).",
    )
    ap.add_argument("--draft", action="append", default=None,
                    help="draft directory, or a training run's --out (repeat to compare; default: the shipped "
                    "draft, eagle3/drafts/smollm2-135m-instruct)")  # fmt: skip
    ap.add_argument("--bench", choices=BENCHMARKS, default="mtbench")
    ap.add_argument("--prompts", default=None, help="JSONL of prompts for --bench jsonl")
    ap.add_argument("--n", type=positive_int, default=80, help="number of prompts")
    ap.add_argument("--turns", type=positive_int, default=1,
                    help="turns scored per prompt, pooled (MT-bench has 2); each after the target's own earlier "
                    "answers, as eval.bench runs them")  # fmt: skip
    ap.add_argument("--max-new-tokens", type=positive_int, default=128)
    ap.add_argument("--steps", type=positive_int, default=5, help="draft positions scored")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--target", "--gguf", dest="target", default=None,
                    help=TARGET_HELP + "; under torchrun each rank reads only its slices of an HF directory")  # fmt: skip
    ap.add_argument("--tokenizer", default=None,
                    help="GGUF file or HF directory with the tokenizer (default: the target's own)")  # fmt: skip
    add_sampling_options(ap)
    add_threads_option(ap)
    ap.add_argument("--fresh-answers", action="store_true",
                    help="generate the target's answers again instead of reading them from .cache/answers")  # fmt: skip
    ap.add_argument("--out", type=output_file, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    args.draft = args.draft or [str(DEFAULT_DRAFT)]
    check_prompts_option(args.bench, args.prompts)
    if args.out is not None:  # an earlier run's results are replaced; a chat file or a user's notes are not
        refuse_foreign_output(args.out, is_results, "eval.acceptance's results")
    if args.max_new_tokens <= args.steps:
        raise UserError(
            f"--max-new-tokens {args.max_new_tokens} scores no position with --steps {args.steps}: an answer "
            f"of N tokens has N - {args.steps} positions; give more than {args.steps}"
        )
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    shard = init_from_env()  # torchrun: the target tensor + expert parallel over the ranks
    with rank0_prints(shard):  # rank 0 prints, shows progress and writes
        return _main(args, sampling, dtype, shard)


def _tail(path: str, width: int = 48) -> str:
    """A draft's path for the table: whole if it fits, else its end after an ellipsis."""
    return path if len(path) <= width else "…" + path[-(width - 1) :]


def _main(args, sampling: SamplingParams, dtype: torch.dtype, shard) -> dict[str, Any]:
    rank0 = shard is None or shard.rank == 0
    progress = functools.partial(tqdm, unit="answer", file=sys.stderr, leave=False, disable=not rank0)
    model = load_model(shard, dtype, args.target)
    tok = load_target_tokenizer(args.tokenizer or args.target)
    # every draft is read and checked before any work
    drafts = {path: load_draft(path, dtype=dtype, device=str(model.device)) for path in args.draft}
    for draft in drafts.values():
        check_draft_fits(draft.config, model.config, draft.source)
        if note := embeddings_note(draft, model.model.embed_tokens):
            print(f"note: {note}", file=sys.stderr)
    bench = load_benchmark(args.bench, args.n, args.prompts)
    t0 = time.perf_counter()
    target = args.target or default_target_path()
    rule = "greedy" if sampling.greedy else f"sampled: {describe(sampling)}, seed {args.seed}"
    asked = answer_turns(model, tok, target, bench, args, sampling, rule, shard)
    prompts, answers, categories, turns = asked.prompts, asked.answers, asked.categories, asked.turns
    result: dict[str, Any] = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "answer_tokens": sum(map(len, answers)),
        "answer_seconds": round(time.perf_counter() - t0, 1),
        "answers_cached": turns[0]["answers_cached"],
        "turns": turns,
        "drafts": {},
    }
    print(
        f"{'draft':48s} {'positions':>9s} | P(run >= i), i = 1..{args.steps} | tau(k): k = 1..{args.steps} | "
        f"walked tau(k) | in vocab | confident: share, P(run >= 1)"
    )
    fields: dict[tuple[int, ...], list[dict[str, Tensor]]] = {}  # the target's forwards, per feature layers
    probs: list[Tensor] = []  # target_probs per answer: the same whatever the draft
    p_next: list[Tensor | None] = []  # sampled: next_token_probs per answer, the same whatever the draft
    reaches: dict[str, list[Tensor]] = {}
    for path in args.draft:
        draft = drafts[path]
        layers = tuple(draft.config.feature_layers)
        if layers not in fields:
            pairs = progress(list(zip(prompts, answers)), desc="target")
            fields[layers] = [target_fields(model, p, a, layers) for p, a in pairs]
        if not probs:
            p_next = [
                None if sampling.greedy else next_token_probs(model, p, a, f, sampling)
                for p, a, f in zip(prompts, answers, fields[layers])
            ]
            probs = [
                target_probs(model, p, a, args.steps, f, sampling, n)
                for p, a, f, n in zip(prompts, answers, fields[layers], p_next)
            ]
        reach, details = [], []
        scored = zip(prompts, answers, fields[layers], probs, p_next)
        for p, a, f, tp, n in progress(list(scored), desc="draft"):
            if sampling.greedy:
                reach.append(reach_of_runs(run_lengths(model, draft, p, a, args.steps, f), args.steps))
            else:
                reach.append(sampled_reach(model, draft, p, a, args.steps, sampling, f, n))
            details.append(target_detail(draft, p, a, args.steps, f, tp, sampled=not sampling.greedy))
        reaches[path] = reach

        s = _part(reach, details, [True] * len(reach), args.steps)
        s["categories"] = {
            c: _part(reach, details, [c2 == c for c2 in categories], args.steps)
            for c in dict.fromkeys(categories)
        }
        if len(turns) > 1:
            s["turns"] = {
                t["turn"]: _part(reach, details, [t2 == t["turn"] for t2 in asked.turn_of], args.steps)
                for t in turns
            }
        result["drafts"][path] = s
        print(
            f"{_tail(path):48s} {s['positions']:9d} | {' '.join(f'{v:.3f}' for v in s['p_run_ge'])} | "
            f"{' '.join(f'{v:.3f}' for v in s['tau'].values())} | "
            f"{' '.join(f'{v:.3f}' for v in s['tau_walked'].values())} | {s['in_vocab']:8.3f} | "
            f"{s['confident']:.3f}, {s['p_run_ge_1_confident']:.3f}",
            flush=True,
        )
    k = args.steps
    first = args.draft[0]
    for path in args.draft[1:]:
        d = paired_difference(reaches[first], reaches[path], asked.prompt_of, k)
        result["drafts"][path]["against_first"] = d
        print(
            f"{_tail(path)} less {_tail(first)}, paired over the same answers (95% bootstrap over the "
            f"{d['clusters']} prompts): tau({k}) {d['tau']:+.3f} [{d['tau_ci95'][0]:+.3f}, "
            f"{d['tau_ci95'][1]:+.3f}], walked {d['tau_walked']:+.3f} [{d['tau_walked_ci95'][0]:+.3f}, "
            f"{d['tau_walked_ci95'][1]:+.3f}]"
        )
    for title, key, names in (
        ("category", "categories", list(dict.fromkeys(categories)) if len(set(categories)) > 1 else []),
        ("turn", "turns", [t["turn"] for t in turns] if len(turns) > 1 else []),
    ):
        if not names:
            continue
        print(f"\nper {title}: P(run >= 1) / tau(k = {k}) / walked / in vocab, one column per draft")
        for c in names:
            cells = [result["drafts"][path][key][c] for path in args.draft]
            row = "  ".join(
                f"{s['p_run_ge'][0]:.3f} / {s['tau'][k]:.3f} / {s['tau_walked'][k]:.3f} / {s['in_vocab']:.3f}"
                for s in cells
            )
            print(f"{str(c):14s} {cells[0]['positions']:6d}  {row}")
    if args.out is not None and rank0:
        atomic_write(args.out, json.dumps(result, indent=1) + "\n")
    return result


ANSWERS_DIR = Path(__file__).resolve().parent.parent / ".cache" / "answers"
# 2: batched decoding's attention on a CPU computes in fp32 (maverick.decode_attention), not in SDPA's bf16
# 3: batches of like prompt lengths (train.acceptance.answers_of; the same tokens as 2 on an AMD EPYC) and
#    prefills of over 64 tokens with SDPA's is_causal (maverick.model; a few answers change in their bits)
ANSWERS_VERSION = 3


@dataclass
class Asked:
    """Every answer scored, all turns pooled: its prompt ids, the target's answer, the prompt's category, the
    turn (1-based) and the prompt's index; and per turn, its prompts, answer tokens and the kept answers'
    file, if read."""

    prompts: list[list[int]] = field(default_factory=list)
    answers: list[list[int]] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    turn_of: list[int] = field(default_factory=list)
    prompt_of: list[int] = field(default_factory=list)  # the benchmark prompt's index
    turns: list[dict[str, Any]] = field(default_factory=list)


def answer_turns(
    model, tok, target, bench: list[dict], args, sampling: SamplingParams, rule: str, shard=None
) -> Asked:
    """The target's answers to the first --turns turns of each benchmark prompt, each turn asked after the
    target's own earlier answers (their text in the chat, as eval.bench asks it); kept or read back per turn
    (`target_answers`)."""
    asked = Asked()
    texts: list[list[str]] = [[] for _ in bench]  # each prompt's answers so far, as its next turn holds them
    for turn in range(args.turns):
        idx = [i for i, p in enumerate(bench) if len(p["turns"]) > turn]
        if not idx:
            break
        ids = [chat_ids(tok, bench[i], turn, texts[i]) for i in idx]
        got, cache = target_answers(model, target, args.dtype, ids, args.max_new_tokens, args.fresh_answers,
                                    sampling, args.seed, shard)  # fmt: skip
        for i, a in zip(idx, got):
            texts[i].append(answer_text(tok, a, model.config.eos_ids))
        asked.prompts += ids
        asked.answers += got
        asked.categories += [bench[i].get("category", args.bench) for i in idx]
        asked.turn_of += [turn + 1] * len(idx)
        asked.prompt_of += idx
        asked.turns.append(
            {"turn": turn + 1, "prompts": len(idx), "answer_tokens": sum(map(len, got)),
             "answers_cached": str(cache) if cache else None}
        )  # fmt: skip
        where = f", read from {cache}" if cache else ""
        print(
            f"{len(idx)} {args.bench} prompts, turn {turn + 1}: {asked.turns[-1]['answer_tokens']} answer "
            f"tokens ({args.dtype}, {rule}{where})"
        )
    return asked


def first_turns(tok, bench: list[dict]) -> list[list[int]]:
    """Each benchmark prompt's first user turn (after its system prompt, if any) as chat-template ids."""
    return [chat_ids(tok, p, 0, []) for p in bench]


def target_answers(
    model,
    target: str | os.PathLike,
    dtype: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    fresh: bool,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    shard=None,
) -> tuple[list[list[int]], Path | None]:
    """`model`'s answers to `prompts` (the target file `target` in `dtype`; greedy, or drawn with `sampling`
    from `seed`), read from ANSWERS_DIR where an earlier run kept them (unless `fresh`), else generated and
    kept. Returns (answers, the file they were read from, or None where they were generated). A tensor
    parallel target (`shard`, rank r of w) keeps its own answers (its partial sums add in another order);
    every rank reads or generates as rank 0 does, and rank 0 writes."""
    ranks = shard.world if shard is not None else 1
    path = answers_path(target, dtype, max_new_tokens, prompts, sampling, seed, ranks)
    answers = None if fresh else read_answers(path, len(prompts))
    if rank0_says(answers is not None, shard):
        if answers is None:  # rank 0 read them, this rank could not: a file that changed between reads
            raise UserError(f"{path}: rank {shard.rank} could not read the answers rank 0 read; run again")
        return answers, path
    rank0 = shard is None or shard.rank == 0
    answers = answers_of(model, prompts, max_new_tokens, sampling=sampling, seed=seed, progress=rank0)
    if rank0:
        write_answers(path, answers)
    return answers, None


def answers_path(
    target: str | os.PathLike,
    dtype: str,
    max_new_tokens: int,
    prompts: list[list[int]],
    sampling: SamplingParams | None = None,
    seed: int = 0,
    ranks: int = 1,
) -> Path:
    """Where the target's answers to `prompts` are kept: named by a digest of all they depend on (the
    batched bf16 kernels' choices included: torch, the CPU, the thread count, ANSWERS_VERSION; for sampled
    answers the rule and the seed; the ranks of a tensor parallel target; an HF directory's weight and JSON
    files, each by size and mtime)."""
    ident = target_identity(target)
    if Path(target).expanduser().is_dir():
        ident["files"] = fingerprint(target)
    else:  # as before the folders' fingerprint: the answers kept for the GGUF stay valid
        ident["mtime_ns"] = fingerprint(target)[1]
    key = [
        ident, dtype, max_new_tokens, prompts, torch.__version__, cpu_name(), torch.get_num_threads(),
        ANSWERS_VERSION,
    ]  # fmt: skip
    if sampling is not None and not sampling.greedy:
        key.append([sampling.temperature, sampling.top_k, sampling.top_p, seed])
    if ranks > 1:
        key.append({"ranks": ranks})
    return ANSWERS_DIR / f"{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]}.json"


def describe(sampling: SamplingParams) -> str:
    """'temperature 1.0, top-k 20, top-p 0.9' (the filters that are on)."""
    parts = [f"temperature {sampling.temperature:g}"]
    parts += [f"top-k {sampling.top_k}"] if sampling.top_k else []
    parts += [f"top-p {sampling.top_p:g}"] if sampling.top_p < 1 else []
    return ", ".join(parts)


def read_answers(path: Path, n: int) -> list[list[int]] | None:
    """The kept answers (None if there are none, or the file is damaged: they are generated again)."""
    try:
        answers = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(answers, list) and len(answers) == n
    ok = ok and all(isinstance(a, list) and a and all(type(t) is int for t in a) for a in answers)
    return answers if ok else None


def write_answers(path: Path, answers: list[list[int]]) -> None:
    try:
        atomic_write(path, json.dumps(answers))
    except OSError:  # a read-only checkout: generated again next time
        pass


def _part(
    reach: list[Tensor], details: list[dict[str, Tensor]], keep: list[bool], steps: int
) -> dict[str, Any]:
    """`summarize` of the answers marked in `keep`."""
    return summarize(
        [r for r, k in zip(reach, keep) if k], steps, _cat([d for d, k in zip(details, keep) if k])
    )


def _cat(details: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    return {k: torch.cat([d[k] for d in details]) for k in ("in_vocab", "target_p")}


if __name__ == "__main__":
    run_cli(main)
