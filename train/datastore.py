"""Build a retrieval datastore (eagle3/datastore.py) from chat data: the assistant turns, as token ids.

    python -m train.datastore --data runs/regen/all-v2.jsonl,runs/regen/new-c.jsonl \\
        --out eagle3/drafts/smollm2-135m-instruct.datastore.safetensors

Each conversation is rendered with the target's chat template exactly as the target reads it
(train/data.py: render_chat) and each assistant span of its loss mask (the content and its closing
`<|im_end|>`) becomes one run of the store, so a proposal may end a turn the way the target does. Feed it
the target's OWN answers (`python -m train.regenerate`): the store drafts what the target would write.
Put it beside the draft directory (`<draft dir>.datastore.safetensors`, where eval.bench looks by default),
not inside it: vLLM loads every *.safetensors file in a draft directory.
Conversations in the held-out split of train/data.py are left out (the `sharegpt-heldout` benchmark
draws from it).
"""

from __future__ import annotations

import argparse
import logging
import time

from eagle3.datastore import MAX_SIZE, Datastore, is_datastore
from maverick.cli import (
    ArgumentParser,
    UserError,
    heldout_fraction,
    nonnegative_int,
    output_file,
    positive_int,
    positive_int_list,
    refuse_foreign_output,
    run_cli,
)
from train.data import DEFAULT_HELDOUT_FRACTION, DEFAULT_SPLIT_SEED, is_heldout, load_chats, render_chat

log = logging.getLogger(__name__)


def assistant_runs(tokenizer, conversations, max_length: int = 4096) -> list[list[int]]:
    """The token ids of every assistant span (loss mask 1) of the rendered conversations. A conversation
    that cannot be rendered with an exact mask is left out and logged (with the first one's id)."""
    runs, failed = [], []
    for conv in conversations:
        try:
            ids, mask = render_chat(tokenizer, conv["messages"], max_length)
        except ValueError as exc:
            failed.append((conv.get("id"), exc))
            continue
        run: list[int] = []
        for t, m in zip(ids, mask):
            if m:
                run.append(t)
            elif run:
                runs.append(run)
                run = []
        if run:
            runs.append(run)
    if failed:
        log.warning(
            "left out %d conversations that do not render exactly (first: %s: %s)", len(failed), *failed[0]
        )
    return runs


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(
        prog="python -m train.datastore",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", required=True, help="JSON/JSONL chat files, comma-separated")
    p.add_argument("--out", required=True, type=output_file, help="the .safetensors file to write")
    p.add_argument("--tokenizer", default=None, help="GGUF file with the tokenizer (default: SmolLM2's)")
    p.add_argument(
        "--sizes",
        type=positive_int_list,
        default="4,3",
        help=f"n-gram sizes matched, comma-separated (1..{MAX_SIZE})",
    )
    p.add_argument("--max-tokens", type=positive_int, default=10, help="the longest proposal")
    p.add_argument(
        "--max-candidates", type=positive_int, default=256, help="occurrences voted on per proposal"
    )
    p.add_argument(
        "--max-length", type=positive_int, default=4096, help="tokens per conversation (longer: cut)"
    )
    p.add_argument("--heldout-fraction", type=heldout_fraction, default=DEFAULT_HELDOUT_FRACTION)
    p.add_argument("--split-seed", type=nonnegative_int, default=DEFAULT_SPLIT_SEED)
    args = p.parse_args(argv)
    if max(args.sizes) > MAX_SIZE:
        raise UserError(f"--sizes {','.join(map(str, args.sizes))}: n-gram sizes go up to {MAX_SIZE}")
    refuse_foreign_output(args.out, is_datastore, "a datastore")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from maverick.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    tok = load_tokenizer(args.tokenizer)
    files = [f for f in args.data.split(",") if f]
    conversations, held = [], 0
    for f in files:
        for conv in load_chats(f):
            if is_heldout(str(conv["id"]), args.heldout_fraction, args.split_seed):
                held += 1
            else:
                conversations.append(conv)
    runs = assistant_runs(tok, conversations, args.max_length)
    store = Datastore(runs, sizes=args.sizes, max_tokens=args.max_tokens, max_candidates=args.max_candidates)
    store.save(args.out, meta={"data": files, "conversations": len(conversations), "heldout_left_out": held})
    log.info(
        "%s: %d conversations (%d held-out left out), %d runs, %d tokens, %.0f s",
        args.out, len(conversations), held, store.n_runs, store.n_tokens, time.perf_counter() - t0,
    )  # fmt: skip


if __name__ == "__main__":
    run_cli(main)
