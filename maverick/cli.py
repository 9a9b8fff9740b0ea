"""How every `python -m ...` entry point reports a user's mistake: one line on stderr, exit status 2.

A user who names a missing file, a corrupt checkpoint or an out-of-range option should read what is
wrong and where, not a Python traceback; a bug in our code should still show its traceback. The two are
told apart by type: code that checks what the user gave raises `UserError` (a `ValueError`, so library
callers and tests that expect `ValueError` keep working) with a message that names the file, line, key
or option; `run_cli` prints it as `error: <message>` and exits 2, like argparse does for a bad option.
Missing or unreadable files and an output path taken by a file (`FileNotFoundError`, `FileExistsError`,
`PermissionError`, `IsADirectoryError`, `NotADirectoryError`) count as the user's too: their message names
the path. Everything else is a bug and propagates with its traceback.

A mistake on the command line itself (an unknown option, a missing required one, a value argparse refuses) is
one line as well: every entry point's parser is this module's `ArgumentParser`, whose error is
`error: <message> (python -m <module> --help for usage)`, exit status 2 (plain argparse prints its whole
usage block first); `--help` is argparse's. Its `prog` is the command as typed (`python -m train.fit`).

Ctrl-C is one line too (exit status 130): `interrupted`, followed by how to continue for a command that can
(`run_cli(main, resume="...")`); text streamed to stdout without a final newline (`write_stdout`) is ended
first, so the message starts a line of its own. `--debug` (anywhere on the command line; it is removed
before `main` parses) or the environment variable MAVERICK_DEBUG=1 shows the traceback of a user error or
an interrupt as well.

A new CLI needs three lines:

    from maverick.cli import ArgumentParser, UserError, run_cli
    ...
        ap = ArgumentParser(prog="python -m package.module", description=__doc__)
    ...
    if __name__ == "__main__":
        run_cli(main)

where `main(argv)` parses `argv` (a list without the program name) and returns None, a result (exit
status 0) or an int exit status. Checks of what the user gave raise `UserError(...)`. The argparse types
below (`positive_int`, `nonnegative_int`, `positive_float`, `nonnegative_float`, `share`, `heldout_fraction`,
`top_p`, `int_list`, `positive_int_list`, `device`) reject an out-of-range value before any work starts: every
numeric option of an entry point takes one (tests/test_cli_errors.py checks); `add_threads_option` adds the
shared `--threads`.
`read_utf8(path)` reads a text file and names the file, line and column of a byte that is not UTF-8.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

USER_ERROR_STATUS = 2
INTERRUPTED_STATUS = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
DEBUG_FLAG = "--debug"
DEBUG_ENV = "MAVERICK_DEBUG"
# OS errors caused by a path the user gave; their message carries the path
_USER_OS_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


class UserError(ValueError):
    """A mistake in what the user gave (a file, an option, a config key); the message names it and says
    what is wrong. `run_cli` prints it without a traceback."""


def debug_enabled(argv: Sequence[str] = ()) -> bool:
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def run_cli(
    main: Callable[[list[str]], Any], argv: Sequence[str] | None = None, *, resume: str = ""
) -> NoReturn:
    """Run `main(argv)` as a command: exit with its int status (0 for anything else it returns); a
    UserError (or a missing / unreadable file) becomes `error: ...` on stderr and exit status 2; Ctrl-C
    becomes `interrupted` (`interrupted; <resume>` for a command that continues when run again), status 130."""
    global _stdout_line_open
    _stdout_line_open = False
    args = list(sys.argv[1:] if argv is None else argv)
    debug = debug_enabled(args)
    args = [a for a in args if a != DEBUG_FLAG]
    try:
        result = main(args)
    except (UserError, *_USER_OS_ERRORS) as exc:
        if debug:
            raise
        end_stdout_line()
        print(f"error: {user_message(exc)}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR_STATUS)
    except KeyboardInterrupt:
        # Ctrl-C: outputs are renamed in whole or appended record by record (a cut record is dropped when
        # the command runs again), so this is a clean stop
        if debug:
            raise
        end_stdout_line()
        print("interrupted" + (f"; {resume}" if resume else ""), file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED_STATUS)
    sys.exit(result if isinstance(result, int) and not isinstance(result, bool) else 0)


# whether the text written by `write_stdout` ends without a newline (an answer streamed token by token)
_stdout_line_open = False


def write_stdout(text: str) -> None:
    """Write streamed text to stdout now (flushed). If run_cli then stops on Ctrl-C or a user error while the
    text ends without a newline, it ends the line first: its message on stderr starts a line of its own on a
    terminal, and a redirected stdout still ends with a newline."""
    global _stdout_line_open
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()
        _stdout_line_open = not text.endswith("\n")


def end_stdout_line() -> None:
    """A newline on stdout if `write_stdout` left a line open."""
    global _stdout_line_open
    if _stdout_line_open:
        sys.stdout.write("\n")
        sys.stdout.flush()
        _stdout_line_open = False


class ArgumentParser(argparse.ArgumentParser):
    """An entry point's parser: a command-line mistake is one line, `error: <message> (<prog> --help for
    usage)` on stderr and exit status 2 (SystemExit(2), as argparse's), without argparse's usage block.
    `prog` is required and is the command as the user types it: "python -m train.fit"."""

    def __init__(self, *, prog: str, **kwargs: Any):
        super().__init__(prog=prog, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(
            f"error: {' '.join(message.split())} ({self.prog} --help for usage)", file=sys.stderr, flush=True
        )
        sys.exit(USER_ERROR_STATUS)


def user_message(exc: BaseException) -> str:
    """One line: an OSError as '<path>: <reason>' unless its message already names the path."""
    if isinstance(exc, FileExistsError) and exc.filename is not None and Path(exc.filename).is_file():
        return f"{exc.filename}: is a file; an output directory goes there (give another --out)"
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return " ".join(str(exc).split()) or type(exc).__name__


def read_json_object(path: str | os.PathLike, error: type[UserError] = UserError) -> dict[str, Any]:
    """The JSON object of a UTF-8 file; invalid JSON, another JSON value or bytes that are not UTF-8 are an
    `error` naming the file (and the line)."""
    try:
        d = json.loads(read_utf8(path))
    except json.JSONDecodeError as exc:
        raise error(f"{path}: invalid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(d, dict):
        raise error(f"{path}: expected a JSON object, got {type(d).__name__}")
    return d


def jsonl_objects(path: str | os.PathLike, text: str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-empty line of a JSONL text; errors name the file and line."""
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: line {n}: invalid JSON: {exc.msg} (column {exc.colno})") from exc
        if not isinstance(obj, dict):
            raise UserError(f"{path}: line {n}: expected a JSON object, got {type(obj).__name__}")
        out.append((n, obj))
    return out


def read_utf8(path: str | os.PathLike) -> str:
    """The text of a UTF-8 file; a byte that is not UTF-8 is a UserError naming the file, line and column."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        col = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise UserError(
            f"{path}: line {line}, byte {col} of the line: not UTF-8 (0x{data[exc.start]:02x}); "
            "save the file as UTF-8"
        ) from exc


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (counts such as --max-new-tokens, --steps)."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (a learning rate, a budget in minutes)."""
    return _float_in(text, 0.0, math.inf, low_open=True)


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (a temperature, a clipping norm where 0 is off)."""
    return _float_in(text, 0.0, math.inf)


def share(text: str) -> float:
    """argparse type: a number in [0, 1] (a share of a budget, a ratio)."""
    return _float_in(text, 0.0, 1.0)


def heldout_fraction(text: str) -> float:
    """argparse type: a number in [0, 1) (what is held out of a split: all of it would leave no training data)."""
    return _float_in(text, 0.0, 1.0, high_open=True)


def top_p(text: str) -> float:
    """argparse type: a nucleus mass in (0, 1] (1 = off)."""
    return _float_in(text, 0.0, 1.0, low_open=True)


def _float_in(text: str, low: float, high: float, low_open: bool = False, high_open: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    below = value <= low if low_open else value < low
    above = value >= high if high_open else value > high
    if not math.isfinite(value) or below or above:
        lo, hi = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
        upper = "inf" if high == math.inf else f"{high:g}"
        raise argparse.ArgumentTypeError(f"must be a finite number in {lo}{low:g}, {upper}{hi}, got {text}")
    return value


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 0 (layer ids), at least one."""
    return _ints_at_least(text, 0)


def positive_int_list(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1 (row counts, n-gram sizes), at least one."""
    return _ints_at_least(text, 1)


def _ints_at_least(text: str, low: int) -> list[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated integers, such as 2,15,27")
    return [_int_at_least(p, low) for p in parts]


def device(text: str) -> str:
    """argparse type: a torch device this machine has ('cpu', 'cuda', 'cuda:1')."""
    import torch

    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (cpu, cuda, cuda:1)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text}: no CUDA GPU here (torch.cuda.is_available() is False)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text}: this machine has {torch.cuda.device_count()} CUDA GPU(s)"
            )
    elif dev.type != "cpu":
        raise argparse.ArgumentTypeError(f"{text}: only cpu and cuda devices are supported")
    return text


def check_output_dir(path: str | os.PathLike) -> None:
    """An output directory may not exist yet, but no file may stand where it goes (UserError)."""
    if Path(path).exists() and not Path(path).is_dir():
        raise UserError(f"{path} is a file; an output directory goes there")


def output_dir(text: str) -> str:
    """argparse type: an output directory, checked by `check_output_dir` before any work."""
    try:
        check_output_dir(text)
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def output_file(text: str) -> Path:
    """argparse type: an output file (a directory there is refused before any work)."""
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give the file's name")
    return Path(text)


def refuse_foreign_output(path: Path, is_ours: Callable[[Path], bool], what: str) -> None:
    """A file already at --out is replaced only when it is `what` this command writes (a rerun); anything
    else there (a draft's weights, a user's notes) is a UserError naming it, before any work."""
    if path.is_file() and path.stat().st_size and not is_ours(path):
        raise UserError(f"{path}: already exists and is not {what}; delete it or give another --out")


def is_json_with(path: Path, keys: Sequence[str]) -> bool:
    """Whether `path` holds one JSON object with every one of `keys`: how a command that writes its results
    as JSON (eval.acceptance, eval.quality) tells its own earlier output, for `refuse_foreign_output`."""
    try:
        obj = json.loads(path.read_bytes())
    except (ValueError, OSError, RecursionError):  # not JSON, not UTF-8 (a ValueError too), nested too deep
        return False
    return isinstance(obj, dict) and all(k in obj for k in keys)


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    """`--threads N` (N >= 1): torch's CPU threads; the entry point calls `torch.set_num_threads` with it."""
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch CPU threads (default torch's); on a shared busy CPU 1 can be 2-3x faster (a descheduled "
        "second OpenMP thread stalls every op)",
    )
