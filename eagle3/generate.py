"""Speculative decoding of one prompt from the command line: the target with an EAGLE-3 draft.

    python -m eagle3.generate --prompt "Why is the sky blue?" --chat
    python -m eagle3.generate --prompt "Why is the sky blue?" --chat --lookup --q4 --engine compiled --check

By default the SmolLM2 target and the shipped draft, the draft length tuned to the acceptance it sees
(eagle3/tuner.py); `--k N` fixes it, `--tree D,K,T` drafts trees (depth, children per node, nodes verified;
given several times, the tuner picks one each cycle by its measured tokens per second);
`--lookup` copies drafts from earlier text where the sequence repeats itself (eagle3/lookup.py). The answer
streams cycle by cycle; a JSON line follows: tokens/s, tau (tokens per cycle, the bonus token included), the
draft's share of the time and the draft lengths chosen. `--check` (greedy) decodes the prompt plainly as
well, on the same weights and engine, and says whether the tokens are identical and how much faster the
speculative decoding was. Plain decoding alone: `python -m maverick.generate`; many prompts and methods side
by side: `python -m eval.bench`.

Under torchrun the target runs tensor + expert parallel (maverick/parallel.py; each rank reads its slices
of an HF directory), the draft on every rank; the tuner's choices are rank 0's (eagle3.tuner.RankAgreed,
which SpecDecoder puts around a tuner on a sharded target):

    torchrun --nproc-per-node 8 -m eagle3.generate --target DIR --draft DRAFT --prompt "Hi" --chat --check
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

import torch

from eagle3.draft import DEFAULT_DRAFT, check_draft_fits, load_draft
from eagle3.lookup import LookupConfig
from eagle3.spec import SpecDecoder, TreeConfig, spare_slots
from eagle3.tuner import DraftLengthTuner, FixedK
from maverick.cli import (
    ArgumentParser,
    UserError,
    add_threads_option,
    positive_int,
    positive_int_list,
    run_cli,
    write_stdout,
)
from maverick.compiled import for_engine
from maverick.generate import Decoder, Generation, TextStream, check_lengths
from maverick.parallel import init_from_env, load_model
from maverick.sampling import SamplingParams, add_sampling_options
from maverick.target import TARGET_HELP, load_target_tokenizer
from maverick.tokenizer import encode_chat

# prompt lookup's copy lengths: eval.bench's eagle3-tuned+lookup (the tuner's default lengths are its too)
LOOKUP = LookupConfig(max_tokens=10, streak_tokens=20)


def tree_spec(text: str) -> TreeConfig:
    """argparse type: DEPTH,TOP_K,TOKENS."""
    parts = positive_int_list(text)
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"{text!r}: give DEPTH,TOP_K,TOKENS, such as 3,4,12")
    try:
        return TreeConfig(*parts)
    except ValueError as exc:  # argparse would say only "invalid tree_spec value"
        raise argparse.ArgumentTypeError(str(exc)) from None


def tree_specs(text: str) -> list[TreeConfig]:
    """argparse type: trees D,K,T separated by ';', such as 2,2,3;3,4,12 (each once)."""
    trees = [tree_spec(part) for part in text.split(";") if part.strip()]
    if not trees:
        raise argparse.ArgumentTypeError(f"{text!r}: give trees as D,K,T;D,K,T, such as 2,2,3;3,4,12")
    return list(dict.fromkeys(trees))


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="python -m eagle3.generate", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    ap.add_argument("--target", "--gguf", dest="target", default=None,
                    help=TARGET_HELP + "; under torchrun each rank reads only its slices of an HF directory")  # fmt: skip
    ap.add_argument("--tokenizer", default=None,
                    help="GGUF file or HF directory with the tokenizer (default: the target's own)")  # fmt: skip
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT),
                    help="EAGLE-3 draft directory, or a training run's --out (default: the shipped draft)")  # fmt: skip
    ap.add_argument("--max-new-tokens", type=positive_int, default=256)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    add_sampling_options(ap)
    shape = ap.add_mutually_exclusive_group()
    shape.add_argument("--k", type=positive_int, default=None,
                       help="a fixed draft length (default: tuned from measured times, so the draws of a sampled "
                       "run, and its text, differ from run to run whatever --seed; a fixed --k repeats them)")  # fmt: skip
    shape.add_argument("--tree", type=tree_spec, action="append", default=None, metavar="D,K,T",
                       help="draft trees: depth, children per node, draft nodes verified per cycle (3,4,12); "
                       "repeat it to tune the tree, cycle by cycle")  # fmt: skip
    ap.add_argument("--lookup", action="store_true", help="copy drafts from earlier text where it repeats")
    ap.add_argument("--engine", choices=["eager", "compiled"], default="eager",
                    help="compiled: the target's steps as compiled graphs (maverick/compiled.py)")  # fmt: skip
    ap.add_argument(
        "--q4", action="store_true", help="keep the GGUF's 4-bit linears packed (faster decoding)"
    )
    ap.add_argument("--check", action="store_true",
                    help="greedy only: decode plainly too and compare the tokens (and the speed)")  # fmt: skip
    add_threads_option(ap)
    return ap


def shape_name(trees: list[TreeConfig], k: int | None) -> str:
    if trees:
        shapes = " | ".join(map(str, trees))
        return f"tree {shapes}" if len(trees) == 1 else f"tuned tree of {shapes}"
    return f"k={k}" if k else "tuned"


def stats_of(gen: Generation) -> dict[str, Any]:
    """What a researcher reads off one speculative generation: speed, tau, the draft's share, draft lengths."""
    s = gen.stats["spec"]
    n = gen.new_tokens
    return {
        "new_tokens": n,
        "seconds": round(gen.seconds, 3),
        "tokens_per_s": round(n / gen.seconds, 2) if gen.seconds > 0 else None,
        "ttft_s": round(gen.ttft, 3),
        "cycles": s.cycles,
        "tau": round(s.tau, 3),
        "draft_share": round(s.draft_seconds / gen.seconds, 3) if gen.seconds > 0 else None,
        "lookup_cycles": s.lookup_cycles,
        "draft_lengths": dict(sorted(Counter(s.draft_lengths).items())),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    if args.check and not sampling.greedy:
        raise UserError(
            "--check compares greedy tokens: drop --temperature (sampled outputs differ by design)"
        )
    if args.q4 and args.engine == "compiled" and args.dtype != "bf16":
        raise UserError("--q4 --engine compiled runs the int4 kernel on bf16: add --dtype bf16 or drop --q4")
    if args.tree is not None and args.engine == "compiled" and torch.cuda.is_available():
        raise UserError("--tree on --engine compiled is checked on CPU engines only: verify chains on a GPU")
    if args.threads:
        torch.set_num_threads(args.threads)
    shard = init_from_env()  # torchrun: the target tensor + expert parallel over the ranks
    if shard is not None and (args.q4 or args.engine == "compiled"):
        raise UserError("--q4 and --engine compiled run in one process only: drop them under torchrun")
    rank0 = shard is None or shard.rank == 0  # the rank that writes
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    tok = load_target_tokenizer(args.tokenizer or args.target)
    ids = (
        encode_chat(tok, [{"role": "user", "content": args.prompt}]) if args.chat else tok.encode(args.prompt)
    )
    target = load_model(shard, dtype, args.target, q4=args.q4)
    check_lengths([ids], args.max_new_tokens, target.config.max_position_embeddings, "--prompt")
    draft = load_draft(args.draft, dtype=dtype, device=str(target.device))
    check_draft_fits(draft.config, target.config, draft.source)

    trees = list(dict.fromkeys(t.for_sampling(sampling) for t in args.tree or ()))
    max_len = len(ids) + args.max_new_tokens + spare_slots(trees)
    # the engine the speculative decoder and --check's plain decoder share
    model = for_engine(target, args.engine, max_len, draft.config.feature_layers)
    if args.engine == "compiled":
        secs = model.compile()
        print(json.dumps({"compile_s": round(sum(secs.values()), 1), "buckets": list(secs)}), flush=True)
    policy = None if trees else FixedK(args.k) if args.k else DraftLengthTuner()  # several trees: made there
    spec = SpecDecoder(
        model,
        draft,
        max_len=max_len,
        policy=policy,
        tree=trees or None,
        compile_draft=args.engine == "compiled",
        lookup=LOOKUP if args.lookup else None,
        engine=args.engine,
    )
    eos = target.config.eos_ids
    stream = TextStream(tok, show=rank0)

    plain = Decoder(model, max_len=max_len) if args.check else None
    if plain is not None:  # both warmed up alike, so that the speeds compare
        plain.generate([ids], 8, stop_ids=())
        spec.generate([ids], 8, stop_ids=())
    rng = torch.Generator().manual_seed(args.seed)
    gen = spec.generate(
        [ids], args.max_new_tokens, sampling, eos, rng, on_output=lambda rows: stream.add(rows[0])
    )
    stream.finish()
    result = {"draft": str(args.draft), "shape": shape_name(trees, args.k), "lookup": args.lookup}
    result |= {"engine": args.engine, "q4": args.q4, "dtype": args.dtype} | stats_of(gen)
    if len(trees) > 1:  # the cycles each tree got (the warm-up's included)
        counts = spec.policy.tree_counts
        result["tree_cycles"] = {str(t): counts[t] for t in trees}
    if plain is not None:
        base = plain.generate([ids], args.max_new_tokens, stop_ids=eos)
        a, b = base.tokens[0], gen.tokens[0]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        plain_tok_s = base.new_tokens / base.seconds
        result |= {
            "identical_to_plain": a == b,
            "first_difference": None if a == b else first,
            "plain_tokens_per_s": round(plain_tok_s, 2),
            "speedup": round(gen.new_tokens / gen.seconds / plain_tok_s, 2),
        }
    if shard is not None:
        result["ranks"] = shard.world
    if rank0:
        write_stdout("\n" + json.dumps(result) + "\n")
    if args.check and not result["identical_to_plain"]:
        return 1
    return result


if __name__ == "__main__":
    run_cli(main)
