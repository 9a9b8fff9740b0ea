"""The READMEs' commands work as written: every `python -m ...` parses and every `make X` target exists.

A command is taken from the README's code blocks and inline code: the module after `python -m` (or
`accelerate launch ... -m`) and its arguments. For this project's modules the command runs in-process up
to its argument parsing, with `ArgumentParser.parse_args` patched to stop right after parsing: unknown
flags, missing required arguments and bad values fail as they would for a user, and nothing else runs.
`--help` goes the same way and must exit 0. Other packages' modules (ipykernel) are checked with
`--help` in a subprocess. `make X` must be a target: `make -n X` (prints, runs nothing) exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
READMES = [ROOT / "README.md", ROOT / "eagle3" / "drafts" / "smollm2-135m-instruct" / "README.md"]
OUR_PACKAGES = ("maverick", "eagle3", "train", "eval")


class Parsed(Exception):
    """Raised by the patched `parse_args` once the command's arguments parsed."""

    def __init__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace):
        super().__init__(parser.prog)
        self.parser, self.namespace = parser, namespace


def code_spans(text: str) -> list[str]:
    """Code of a markdown text: lines of indented or fenced blocks (continuations joined) and the inline
    spans of each prose paragraph (which may wrap across lines)."""
    spans, fenced, paragraph = [], False, []
    lines = text.splitlines()

    def flush():
        spans.extend(" ".join(m.split()) for m in re.findall(r"`([^`]+)`", "\n".join(paragraph)))
        paragraph.clear()

    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            flush()
            fenced = not fenced
        elif fenced or line.startswith("    ") and not paragraph:
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            spans.append(line.split(" # ")[0].strip())
        elif line.strip():
            paragraph.append(line)
        else:
            flush()
        i += 1
    flush()
    return spans


def module_commands(text: str) -> list[tuple[str, list[str]]]:
    """(module, args) of every `python -m` / `accelerate launch -m` command in a markdown text."""
    commands = []
    for span in code_spans(text):
        try:
            words = shlex.split(span)
        except ValueError:
            continue
        for j, w in enumerate(words[:-2]):
            launcher = w.endswith("python") or w == "accelerate" and words[j + 1] == "launch"
            if not launcher:
                continue
            rest = words[j + 1 :]
            if w == "accelerate":
                rest = accelerate_script_args(rest[1:])
            elif rest[0] != "-m":
                continue
            else:
                rest = rest[1:]
            commands.append((rest[0], rest[1:]))
            break
    return commands


def accelerate_script_args(args: list[str]) -> list[str]:
    """`accelerate launch`'s own flags must parse too; returns ["-m", module, args...] -> [module, args...]."""
    from accelerate.commands.launch import launch_command_parser

    ns = launch_command_parser().parse_args(args)
    assert ns.module, f"accelerate launch {' '.join(args)}: the README's launches run a module (-m)"
    return [ns.training_script, *ns.training_script_args]


def make_targets(text: str) -> list[str]:
    return sorted({t for span in code_spans(text) for t in re.findall(r"(?:^|&&\s*)make\s+([\w-]+)", span)})


def parse_in_process(module: str, args: list[str]) -> argparse.Namespace | int:
    """Run `python -m module args` up to its argument parsing: the parsed namespace, or the exit code
    argparse gave (0 for --help, 2 for a bad command line)."""
    import runpy

    original = argparse.ArgumentParser.parse_args

    def parse_args(self, argv=None, namespace=None):
        raise Parsed(self, original(self, argv, namespace))

    argv, sys.argv = sys.argv, [module, *args]
    argparse.ArgumentParser.parse_args = parse_args
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                runpy.run_module(module, run_name="__main__", alter_sys=False)
            except Parsed as p:
                return p.namespace
            except SystemExit as e:
                if e.code:
                    print(err.getvalue(), file=sys.__stderr__)
                return e.code or 0
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv = argv
    raise AssertionError(f"python -m {module} finished without parsing its arguments")


def commands() -> list[tuple[str, str, list[str]]]:
    out = []
    for readme in READMES:
        out += [(readme.relative_to(ROOT).as_posix(), m, a) for m, a in module_commands(readme.read_text())]
    return out


COMMANDS = commands()


def test_the_readmes_have_commands():
    # the README's own commands, so that a change in the extraction cannot silently skip them all
    modules = {m for where, m, _ in COMMANDS if where == "README.md"}
    assert {"train.regenerate", "train.dump", "train.fit", "eval.acceptance", "eval.bench"} <= modules
    assert make_targets((ROOT / "README.md").read_text()) == ["bench", "bench-full", "test", "test-all"]


@pytest.mark.parametrize(
    "where,module,args", COMMANDS, ids=[f"{w}:{m} {' '.join(a)}"[:90] for w, m, a in COMMANDS]
)
def test_module_command_parses(where, module, args):
    if module.split(".")[0] not in OUR_PACKAGES:
        words = [a for a in args if not a.startswith("-")][:1]  # a subcommand, as in `ipykernel install`
        r = subprocess.run([sys.executable, "-m", module, *words, "--help"], capture_output=True, cwd=ROOT)
        assert r.returncode == 0, f"{where}: python -m {module} {' '.join(words)} --help: {r.stderr.decode()}"
        return
    assert parse_in_process(module, ["--help"]) == 0, f"{where}: python -m {module} --help"
    parsed = parse_in_process(module, args)
    assert isinstance(parsed, argparse.Namespace), f"{where}: python -m {module} {shlex.join(args)}"


@pytest.mark.parametrize("target", sorted({t for r in READMES for t in make_targets(r.read_text())}))
def test_make_target_exists(target):
    r = subprocess.run(["make", "-n", target], capture_output=True, cwd=ROOT, text=True)
    assert r.returncode == 0, f"make {target}: {r.stderr}"


def test_an_unknown_flag_or_target_fails():
    # the negative controls: the same checks reject a flag the parser lacks and a missing make target
    assert parse_in_process("eval.bench", ["--preset", "quick", "--no-such-flag"]) == 2
    assert parse_in_process("train.fit", ["--dumps", "runs/dumps"]) == 2  # --out is required
    text = "    python -m eval.acceptance --draft a --drafts b\n"
    [(module, args)] = module_commands(text)
    assert parse_in_process(module, args) == 2
    assert subprocess.run(["make", "-n", "no-such-target"], capture_output=True, cwd=ROOT).returncode != 0


def test_make_bench_runs_the_quick_preset():
    """`make bench` is the ~5-minute job: its preset picks 3 questions and 7 methods; explicit flags win."""
    make = subprocess.run(["make", "-n", "bench"], capture_output=True, cwd=ROOT, text=True).stdout
    line = next(x for x in make.splitlines() if "-m eval.bench" in x)
    args = shlex.split(line.split("-m eval.bench", 1)[1])
    quick = parse_in_process("eval.bench", args)
    assert (quick.preset, quick.n, quick.max_new_tokens, quick.turns) == ("quick", 3, 128, 2)
    methods = quick.methods.split(",")
    assert methods == [
        "hf-generate", "ours-plain", "eagle3-tuned", "eagle3-tuned+lookup", "eagle3-tree+lookup",
        "ours-plain+q4", "eagle3-tuned+lookup+q4",
    ]  # fmt: skip
    assert parse_in_process("eval.bench", [*args, "--n", "5"]).n == 5
    full = parse_in_process("eval.bench", [])
    assert full.preset == "full" and full.n == 10 and set(methods) < set(full.methods.split(","))


# every command that takes a target, with its other required arguments
TARGET_COMMANDS = [("train.dump", ["--out", "d"]), ("train.fit", ["--out", "o", "--online"]),
                   ("train.stage", ["--out", "o", "--minutes", "1", "--data", "d.jsonl.xz"]), ("train.regenerate", ["--out", "o.jsonl"]),
                   ("eval.bench", []), ("eval.acceptance", []), ("eval.quality", []), ("eval.bench_engine", []),
                   ("eagle3.generate", ["--prompt", "hi"]), ("maverick.generate", ["--prompt", "hi"])]  # fmt: skip


@pytest.mark.parametrize("module,required", TARGET_COMMANDS, ids=[m for m, _ in TARGET_COMMANDS])
def test_every_target_option_takes_the_gguf_alias(module, required):
    """The README: "Every `--target` (alias `--gguf`)"; train.dump, train.fit and train.stage had no alias."""
    parsed = parse_in_process(module, [*required, "--gguf", "x.gguf"])
    assert isinstance(parsed, argparse.Namespace) and "x.gguf" in vars(parsed).values()
