"""Writing files so that nothing is lost: a reader sees the old file or the new one, never half of one.

The files the project keeps (configs, manifests, logs, answers, dump shards, training states, reports, plots)
are written under a temporary name beside their place, flushed to disk, then renamed over it in one step; whole
directories (checkpoints, drafts) go through `atomic_dir`. A run killed mid-write leaves a
`<name>.tmp-*` file or folder, which no reader takes for the real one (their globs end in the real suffix) and
`remove_leftovers` deletes when a job starts again in that directory.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

LEFTOVER = re.compile(r"\.tmp-\d+-[0-9a-f]{8}")  # atomic_path's and atomic_dir's temporary names
_UMASK = os.umask(0o022)  # read once, at import (os.umask sets it too: put back at once)
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK  # what open() gives a new file: some writers (safetensors 0.8) make theirs 0600


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write (with any writer: safetensors, torch.save, a plot);
    on success it is synced and renamed over `path`, on error removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # not mkstemp: its file is private (0600) and the rename would keep that
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    _named_by(path, tmp.touch)  # a folder we may not write in fails here, named by the file asked for
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
        _fsync_dir(path.parent)  # the rename itself
    finally:
        tmp.unlink(missing_ok=True)


def _named_by(path: Path, make) -> None:
    """Create a temporary file or folder; an OSError names `path`, not the temporary name the user never gave."""
    try:
        make()
    except OSError as exc:
        raise type(exc)(exc.errno, exc.strerror, str(path)) from None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, tmp_prefix: str | None = None) -> Iterator[Path]:
    """Yield a temporary directory beside `path` (named `tmp_prefix` + a unique tail, by default
    `<name>.tmp-`) to fill; on success it replaces `path` in one rename, on error it is removed, so a reader
    never sees a half-written checkpoint."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # not mkdtemp: its folder is private (0700), and a draft or checkpoint is for others to read too
    tmp = path.with_name(f"{tmp_prefix or path.name + '.tmp-'}{os.getpid()}-{secrets.token_hex(4)}")
    _named_by(path, tmp.mkdir)
    old = tmp.with_name(tmp.name + "-old")
    try:
        yield tmp
        for d, _, files in os.walk(tmp):  # every file, then every folder, on disk before the rename
            for name in files:
                with open(Path(d) / name, "rb+") as f:
                    os.fsync(f.fileno())
                os.chmod(Path(d) / name, FILE_MODE)
            _fsync_dir(Path(d))
        if path.exists():  # moved aside, not deleted first: a crash in between leaves the old one whole
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        for p in (tmp, old):
            if p.exists():
                shutil.rmtree(p)


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write `data` (str as UTF-8) to `path` through a temporary file and a rename; returns the path."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    return Path(path)


def remove_leftovers(directory: str | os.PathLike) -> list[Path]:
    """Delete the `<name>.tmp-<pid>-<8 hex digits>` files and folders a killed write left in `directory` (not
    below it): they are never whole. A user's own `notes.tmp-2024.txt` is not one; a folder `atomic_dir` had
    moved aside whose new one never took its place is put back. Returns what was deleted."""
    gone = sorted(p for p in Path(directory).glob("*.tmp-*") if LEFTOVER.search(p.name))
    for p in list(gone):
        real = p.with_name(p.name[: p.name.index(".tmp-")])
        if (
            p.name.endswith("-old") and p.is_dir() and not real.exists()
        ):  # killed between atomic_dir's renames
            os.replace(p, real)
            gone.remove(p)
    for p in gone:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
    return gone


def fingerprint(
    path: str | os.PathLike, suffixes: tuple[str, ...] = (".safetensors", ".json", ".gguf")
) -> list:
    """What tells whether a checkpoint changed, cheaply: a file's size and mtime, or a folder's files of
    these suffixes each by name, size and mtime (a file rewritten in place changes its own mtime, not its
    folder's)."""
    p = Path(path).expanduser().resolve()
    if p.is_dir():
        return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(p.iterdir())
                if f.is_file() and f.suffix in suffixes]  # fmt: skip
    st = p.stat()
    return [st.st_size, st.st_mtime_ns]
