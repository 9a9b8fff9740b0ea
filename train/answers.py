"""Token-id conversations in resumable xz-compressed JSONL: what train/fastgen.py writes and train/stage.py reads.

A record is {"id", "prompts": [[int]], "answers": [[int]]}: prompts[k] are the ids that precede answer k
(the first the whole chat prompt of the first user turn, each later one the next user turn's segment of the
chat template, which starts right after the previous answer's end-of-turn token), answers[k] the target's
greedy answer, its stop token included. The sample a draft trains on is prompts[0] + answers[0] +
prompts[1] + answers[1] + ..., with the loss on the answers. A prompt record (the input of a regeneration)
has no "answers".

Why ids and not text: the target continues its own tokens turn after turn (a serving engine keeps its
cache, it does not re-tokenize its answer), and no tokenizer is needed where the ids are used (a GPU machine
without the GGUF tokenizer's dependencies).

Resumable: each `append` writes its records as one complete xz stream at the end of the file and fsyncs
it; an xz file may hold several streams one after another (`xz -dc` reads them all). A run killed mid-write
leaves at most a cut-off last stream, which `read_records` drops (and `repair` cuts off, through a temporary
file and a rename), so nothing complete is lost and a rerun redoes only what was not written. A power loss
can leave a write's blocks unwritten, read back as zero bytes at the file's end: they count as cut off too.
A damaged stream is an error naming its byte, never dropped: streams after it may be whole.
"""

from __future__ import annotations

import json
import lzma
import os
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from maverick.cli import UserError, jsonl_objects
from maverick.files import atomic_path, atomic_write

XZ_MAGIC = b"\xfd7zXZ\x00"


def _ends_with_footer(data: bytes) -> bool:
    """Whether `data` ends with a whole xz stream footer (CRC32, backward size, flags, "YZ"; its CRC right):
    the last stream is all there, so a decoder still waiting for bytes means a damaged stream, not a cut."""
    foot = data[-12:]
    return (
        len(foot) == 12
        and foot[10:] == b"YZ"
        and int.from_bytes(foot[:4], "little") == zlib.crc32(foot[4:10])
    )


def is_xz(path: str | os.PathLike) -> bool:
    """Whether the file starts as an xz stream does."""
    with open(path, "rb") as f:
        return f.read(len(XZ_MAGIC)) == XZ_MAGIC


def _looks_xz(data: bytes) -> bool:
    """Whether `data` starts as an xz stream does (or is the start of one: a write cut off early, or all
    zero bytes: a first write lost to a power loss)."""
    return bool(data) and (data[: len(XZ_MAGIC)] == XZ_MAGIC[: len(data)] or not data.strip(b"\0"))


def _streams(data: bytes, path: Path) -> tuple[list[bytes], int]:
    """(the decompressed complete streams, the byte length they span); a cut-off last stream is left out.

    Only running out of data ends the read quietly: that is all a write killed mid-append leaves. A stream
    the decoder rejects (a damaged byte, a failed check) is a UserError naming its byte, never a cut: with
    complete streams after it, dropping it would drop them too, and `repair` would cut them off the file.
    Zero bytes at the end are left out first: a power loss's unwritten blocks, after a whole stream or in
    place of a cut-off one (a stream never ends in a zero byte: its footer ends in "YZ")."""
    data = data.rstrip(b"\0")
    out, pos = [], 0
    while pos < len(data):
        dec = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
        try:
            text = dec.decompress(data[pos:])
        except lzma.LZMAError as exc:
            raise UserError(f"{path}: the xz stream at byte {pos} is damaged ({exc})") from None
        if not dec.eof:  # the data ends before the stream's footer: an interrupted write, if it is the last
            # NOTE a damaged size field also makes the decoder wait for more data (and read on into the next
            # streams): a cut-off write neither has a stream start after its own nor ends with a whole footer
            if data.find(XZ_MAGIC, pos + 1) != -1 or _ends_with_footer(data):
                whole = "it reads as cut off, but the data after it is whole"
                raise UserError(f"{path}: the xz stream at byte {pos} is damaged ({whole})")
            break
        out.append(text)
        pos = len(data) - len(dec.unused_data)
        while pos < len(data) and data[pos] == 0:  # xz stream padding
            pos += 1
    return out, pos


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of the complete streams of `path` ([] if it does not exist); plain JSONL files too.

    xz or plain is decided by the content, not the name (`write` writes xz whatever the name): a file named
    .xz that is not xz, a damaged stream, or a record that is not JSON is a UserError naming it. A plain
    file's last line without a newline is a record when it is whole JSON, else a cut-off write, dropped."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    if _looks_xz(data):
        texts, _ = _streams(data, path)
    elif data and path.name.endswith(".xz"):
        raise UserError(f"{path}: not an xz file (its name ends in .xz)")
    else:
        texts = [data if _whole_last_line(data) else data[: data.rfind(b"\n") + 1]]
    return _parse(texts, path)


def _whole_last_line(data: bytes) -> bool:
    """Whether the text after the last newline of a plain file is empty or a whole JSON value."""
    last = data[data.rfind(b"\n") + 1 :]
    if not last.strip():
        return True
    try:
        json.loads(last)
    except ValueError:  # JSONDecodeError, or a UnicodeDecodeError of a character cut in two
        return False
    return True


def repair(path: str | os.PathLike) -> tuple[list[dict[str, Any]], int]:
    """Cut a cut-off last stream off `path` (temporary file, rename); returns the records of its complete
    streams (what `read_records` gives, from the same decompression) and the bytes dropped. Anything else
    wrong with the file (not xz, a damaged stream) is a UserError and the file is left as it is."""
    path = Path(path)
    if not path.exists():
        return [], 0
    data = path.read_bytes()
    if data and not _looks_xz(data):  # `append` would add xz streams to it: a file of neither kind
        raise UserError(f"{path}: not an xz file (answers are appended to it as xz streams)")
    texts, end = _streams(data, path)
    if end < len(data):
        atomic_write(path, data[:end])
    return _parse(texts, path), len(data) - end


def _parse(texts: list[bytes], path: Path) -> list[dict[str, Any]]:
    try:
        text = b"".join(texts).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return [obj for _, obj in jsonl_objects(path, text)]


def append(path: str | os.PathLike, records: Iterable[Mapping[str, Any]], preset: int = 6) -> int:
    """Append `records` as one xz stream, flushed to disk; returns the bytes written (0 for no records)."""
    lines = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
    if not lines:
        return 0
    blob = lzma.compress(lines.encode(), format=lzma.FORMAT_XZ, preset=preset)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    return len(blob)


def write(path: str | os.PathLike, records: Iterable[Mapping[str, Any]], preset: int = 6) -> None:
    """Write a whole file (one stream) under a temporary name, then rename it into place."""
    with atomic_path(path) as tmp:
        if not append(tmp, records, preset):
            tmp.write_bytes(b"")


def sample(record: Mapping[str, Any]) -> dict[str, list[int]]:
    """The training sample of an answered record: {"input_ids", "loss_mask"} (1 on answer tokens)."""
    ids: list[int] = []
    mask: list[int] = []
    for p, a in zip(record["prompts"], record["answers"]):
        ids += p + a
        mask += [0] * len(p) + [1] * len(a)
    return {"input_ids": ids, "loss_mask": mask}
