"""Regenerate the assistant turns of chat data with the target itself (as EAGLE-3 does).

A draft learns to predict the target; trained on text the target wrote (greedy here, the decoding the
benchmarks use), it sees the contexts it will meet when serving. The user turns come from the data
(ShareGPT by default); each assistant turn is replaced by the target's own answer to the conversation so
far, turn by turn, in batches (prompts of one batch may differ in length: see maverick/generate.py).

    python -m train.regenerate --out runs/regen/sharegpt.jsonl --max-samples 2000 --turns 2
    torchrun --nproc-per-node 8 -m train.regenerate --target DIR --out ...   # the target sharded

Output: JSONL of {"id", "messages"} (OpenAI form; `train.data.load_chats` reads it); an answer cut at
--max-new-tokens (no end-of-turn token) is marked `"cut": true` and ends its conversation. Resumable: the file
is appended batch by batch, a cut-off last line is dropped on restart, and ids already present are skipped.
An answer with no text (the target's first token was EOS) is not written: `load_chats` rejects an empty
turn. The conversation ends before that user turn, and `<out stem>.skipped.jsonl` records it
({"id", "turn", "reason"}; a rerun does not try it again); the summary counts them (`empty_answers`). A
conversation whose first prompt exceeds --max-prompt-tokens is recorded there too (`too_long`): a rerun
with a larger --max-prompt-tokens still skips it (delete its line to try it again).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from maverick.cli import (
    ArgumentParser,
    UserError,
    add_threads_option,
    device,
    nonnegative_int,
    output_file,
    positive_float,
    positive_int,
    run_cli,
)
from maverick.files import atomic_write
from maverick.generate import Decoder
from maverick.parallel import Shard, init_from_env, load_model, rank0_says
from maverick.target import TARGET_HELP, load_target_tokenizer
from maverick.tokenizer import encode_chat
from train.data import DEFAULT_HELDOUT_FRACTION, DEFAULT_SPLIT_SEED, is_heldout, load_chats, load_sharegpt


def skipped_path(out: Path) -> Path:
    """Where the empty answers and too long first prompts of `out` are recorded: chats.jsonl ->
    chats.skipped.jsonl."""
    return out.with_name(out.stem + ".skipped.jsonl")


def _read_done(path: Path, key: str = "messages") -> set[str]:
    """Ids already written; a partial last line (an interrupted write) is cut off, once every whole line has
    been read as a record: a JSON object with an 'id' and `key` ('messages' in --out, 'reason' in its
    skipped file). A file that is not ours is refused untouched (a chat file of other records, such as
    ShareGPT's {"id", "conversations"}, had this run's records appended to it)."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    keep = data[: data.rfind(b"\n") + 1]
    ids = set()
    for i, line in enumerate(keep.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or key not in rec:
                raise KeyError(key)
            ids.add(rec["id"])
        except (ValueError, KeyError, TypeError):  # the file is not ours: refuse it before changing a byte
            raise UserError(
                f"{path}: line {i} is not a record of train.regenerate (a JSON object with an 'id' and "
                f"'{key}'); give --out a new file, or one an earlier run wrote, to continue it"
            ) from None
    if len(keep) != len(data):
        atomic_write(path, keep)
    return ids


def user_turns(conv: dict, turns: int, max_user_chars: int) -> list[str]:
    users = [m["content"][:max_user_chars] for m in conv["messages"] if m["role"] == "user"]
    return users[:turns]


def regenerate(
    conversations: list[dict],
    out: Path,
    turns: int = 2,
    max_new_tokens: int = 384,
    max_prompt_tokens: int = 768,
    batch_size: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    target: str | None = None,
    max_user_chars: int = 2000,
    device: str = "cpu",
    max_seconds: float | None = None,
    shard: Shard | None = None,
    tokenizer: str | None = None,
) -> dict:
    """Answer the user turns of `conversations` with the target and append them to `out` (JSONL).
    target: a .gguf file or an HF directory (default SmolLM2-135M-Instruct); max_seconds: start no new batch
    after this long (the file stays whole; a rerun continues). shard: this rank of a tensor + expert
    parallel target (maverick/parallel.py, under torchrun): every rank decodes every batch (the gathered
    logits, so the same tokens), rank 0 writes, and rank 0's clock decides when to stop."""
    # before any model loads: a wrong --out stops here
    done = _read_done(out) | _read_done(skipped_path(out), "reason")
    model = load_model(shard, dtype, target, device=device)
    tok = load_target_tokenizer(tokenizer or target)
    eos = model.config.eos_ids
    writer = shard is None or shard.rank == 0
    if shard is not None:  # every rank has read what is done before rank 0 appends
        dist.barrier(group=shard.group)
    if writer:
        out.parent.mkdir(parents=True, exist_ok=True)
    todo = [c for c in conversations if c["id"] not in done and user_turns(c, turns, max_user_chars)]
    # sort by first-turn length within blocks of 8 batches, so a batch holds similar lengths (less padding
    # in the prefill) while the blocks keep the given order: a run stopped early answered every length
    block = 8 * batch_size
    todo = [
        c
        for i in range(0, len(todo), block)
        for c in sorted(todo[i : i + block], key=lambda c: len(user_turns(c, 1, max_user_chars)[0]))
    ]
    dec = Decoder(model, max_len=max_prompt_tokens + max_new_tokens + 8, batch_size=batch_size, exact=False)
    n_tokens, t0 = 0, time.perf_counter()
    bar = tqdm(total=len(todo), desc="regenerate", unit="conv", disable=not writer)
    n_done, skips, too_long = 0, 0, 0
    for i in range(0, len(todo), batch_size):
        if max_seconds is not None and i and rank0_says(time.perf_counter() - t0 >= max_seconds, shard):
            break
        batch = todo[i : i + batch_size]
        msgs = [[] for _ in batch]
        skipped = []  # {"id", "turn", "reason"} of the empty answers and the first prompts too long
        live = list(range(len(batch)))
        for turn in range(turns):
            live = [j for j in live if len(user_turns(batch[j], turns, max_user_chars)) > turn]
            prompts = []
            for j in live:
                msgs[j].append({"role": "user", "content": user_turns(batch[j], turns, max_user_chars)[turn]})
                prompts.append(encode_chat(tok, msgs[j]))
            keep = [k for k, p in enumerate(prompts) if len(p) <= max_prompt_tokens]
            for k, j in enumerate(live):
                if k not in keep:
                    msgs[j].pop()
                    if turn == 0:  # nothing to write: said in the skipped file, so a rerun does not try again
                        reason = (
                            f"prompt of {len(prompts[k])} tokens > --max-prompt-tokens {max_prompt_tokens}"
                        )
                        skipped.append({"id": batch[j]["id"], "turn": 1, "reason": reason})
                        too_long += 1
            live, prompts = [live[k] for k in keep], [prompts[k] for k in keep]
            if not live:
                break
            gen = dec.generate(prompts, max_new_tokens, stop_ids=eos, drop_finished=True)
            answered = []
            for j, ids in zip(live, gen.tokens):
                n_tokens += len(ids)
                text = tok.decode(ids, skip_special_tokens=True)
                if not text.strip():  # load_chats would reject the turn: end the conversation before it
                    msgs[j].pop()
                    skipped.append(
                        {"id": batch[j]["id"], "turn": turn + 1, "reason": f"empty answer ({ids[:4]})"}
                    )
                    continue
                msgs[j].append({"role": "assistant", "content": text})
                if ids[-1] not in eos:  # said, so that no later step takes it for a finished answer
                    msgs[j][-1]["cut"] = True
                answered.append(j)
            # a turn cut at max_new_tokens ends the conversation there
            ends = {j for j, ids in zip(live, gen.tokens) if ids and ids[-1] in eos}
            live = [j for j in answered if j in ends]
        if writer:
            with out.open("a") as f:
                for c, m in zip(batch, msgs):
                    if any(x["role"] == "assistant" for x in m):
                        f.write(json.dumps({"id": c["id"], "messages": m}) + "\n")
                f.flush()
                os.fsync(f.fileno())
        if skipped and writer:
            with skipped_path(out).open("a") as f:
                f.writelines(json.dumps(s) + "\n" for s in skipped)
        skips += len(skipped)
        n_done += len(batch)
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{n_tokens / (time.perf_counter() - t0):.0f}")
    bar.close()
    return {
        "conversations": n_done,
        "left": len(todo) - n_done,
        "new_tokens": n_tokens,
        "empty_answers": skips - too_long,
        "too_long": too_long,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv=None) -> None:
    ap = ArgumentParser(
        prog="python -m train.regenerate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", required=True, type=output_file)
    ap.add_argument("--data", default=None, help="JSON/JSONL chats (default: ShareGPT from its wheel)")
    ap.add_argument("--max-samples", type=positive_int, default=2000)
    ap.add_argument("--turns", type=positive_int, default=2)
    ap.add_argument("--max-new-tokens", type=positive_int, default=384)
    ap.add_argument("--max-prompt-tokens", type=positive_int, default=768)
    ap.add_argument("--batch-size", type=positive_int, default=32)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--target", "--gguf", dest="target", default=None,
                    help=TARGET_HELP + "; under torchrun each rank reads only its slices of an HF directory")  # fmt: skip
    ap.add_argument(
        "--tokenizer",
        default=None,
        help="GGUF file or HF directory with the tokenizer (default: the target's)",
    )
    ap.add_argument(
        "--seed", type=nonnegative_int, default=0, help="which conversations are taken (train split only)"
    )
    add_threads_option(ap)
    ap.add_argument("--max-seconds", type=positive_float, default=None,
                    help="start no new batch after this many seconds (a rerun continues)")  # fmt: skip
    ap.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the target runs (default: the GPU when there is one)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shard = init_from_env()  # torchrun: the target tensor + expert parallel over the ranks
    rank0 = shard is None or shard.rank == 0  # the rank that writes
    if args.data:
        convs = load_chats(args.data)
    else:
        convs, report = load_sharegpt()
        if rank0:
            print(report.summary())
    convs = [c for c in convs if not is_heldout(c["id"], DEFAULT_HELDOUT_FRACTION, DEFAULT_SPLIT_SEED)]
    g = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(convs), generator=g).tolist()
    convs = [convs[i] for i in order[: args.max_samples]]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    stats = regenerate(
        convs,
        args.out,
        args.turns,
        args.max_new_tokens,
        args.max_prompt_tokens,
        args.batch_size,
        dtype,
        args.target,
        device=args.device,
        max_seconds=args.max_seconds,
        shard=shard,
        tokenizer=args.tokenizer,
    )
    if rank0:
        print(json.dumps(stats | {"ranks": shard.world if shard else 1}))


if __name__ == "__main__":
    run_cli(main, resume="the same command continues, keeping the conversations written")
