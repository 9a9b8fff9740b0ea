"""Compare draft training runs side by side (e.g. bf16 vs FP8 on the same data, seed and batches):

    python -m eval.compare_runs runs/fp8-curve/bf16 runs/fp8-curve/fp8 --out results/fp8-curve.png

Prints the mean loss and step-0 top-1 agreement of each run over windows of --window optimizer steps,
with each run's loss relative to the first run's, and plots the curves (loss, step-0 agreement).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from maverick.cli import (
    ArgumentParser,
    UserError,
    jsonl_objects,
    output_file,
    positive_int,
    read_utf8,
    refuse_foreign_output,
    run_cli,
)
from maverick.files import atomic_path
from train.fit import LOG_FILE


def read_log(run: str | os.PathLike) -> list[dict]:
    """The records of a train.fit log, each checked for its step, loss and acc_i; a last line cut off
    mid-write (a run still training, or killed) is dropped with a word on stderr."""
    path = Path(run) if str(run).endswith(".jsonl") else Path(run) / LOG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no training log (train_log.jsonl of python -m train.fit)")
    lines = read_utf8(path).splitlines()
    filled = [n for n, line in enumerate(lines, start=1) if line.strip()]
    if len(filled) > 1 and not _is_json(lines[filled[-1] - 1]):
        print(f"{path}: line {filled[-1]}: cut off mid-write, left out", file=sys.stderr)
        lines = lines[: filled[-1] - 1]
    records = [_checked_record(f"{path}: line {n}", rec) for n, rec in jsonl_objects(path, "\n".join(lines))]
    if not records:
        raise UserError(f"{path}: no log records (the run has not logged a step yet)")
    return records


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _checked_record(where: str, rec: dict) -> dict:
    for key in ("step", "loss", "acc_i"):
        if key not in rec:
            raise UserError(f"{where}: no {key!r} (not a train.fit log record)")
    if not isinstance(rec["step"], int) or isinstance(rec["step"], bool):
        raise UserError(f"{where}: 'step' is {rec['step']!r}, not an integer")
    if not _is_number(rec["loss"]):
        raise UserError(f"{where}: 'loss' is {rec['loss']!r}, not a number")
    acc = rec["acc_i"]
    if not isinstance(acc, list) or not acc or not _is_number(acc[0]):
        raise UserError(f"{where}: 'acc_i' is {acc!r}, not a list of numbers")
    return rec


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def windows(logs: dict[str, list[dict]], window: int) -> list[dict]:
    """Per window of --window logged steps that every run has (runs logged at other intervals are compared
    at the steps they share): mean loss and step-0 agreement of each run, and each run's loss relative to
    the first run's (0.01 = 1% higher)."""
    by_step = {name: {r["step"]: r for r in recs} for name, recs in logs.items()}
    names = list(logs)
    steps = sorted(set.intersection(*(set(d) for d in by_step.values())))
    if not steps:
        spans = ", ".join(f"{n}: steps {recs[0]['step']}-{recs[-1]['step']}" for n, recs in logs.items())
        raise UserError(f"the runs share no logged step ({spans})")
    rows = []
    for lo in range(0, len(steps), window):
        chunk = steps[lo : lo + window]
        row = {"steps": (chunk[0], chunk[-1])}
        for name in names:
            recs = [by_step[name][s] for s in chunk]
            row[name] = {
                "loss": sum(r["loss"] for r in recs) / len(recs),
                "acc0": sum(r["acc_i"][0] for r in recs) / len(recs),
            }
        base = row[names[0]]["loss"]
        for name in names:
            row[name]["rel_loss"] = row[name]["loss"] / base - 1 if base else float("nan")
        rows.append(row)
    return rows


def is_plot(path: Path) -> bool:
    """Whether `path` is a plot as `plot` writes it: a PNG whose first chunks say Matplotlib made it (its
    "Software" text chunk, before the image data). A run's train_log.jsonl or a photo is not one."""
    with path.open("rb") as f:
        head = f.read(512)
    return head.startswith(b"\x89PNG\r\n\x1a\n") and b"tEXtSoftware\x00Matplotlib" in head


def plot(logs: dict[str, list[dict]], path: Path) -> None:
    """The curves on an Agg canvas of their own (not pyplot's: a notebook's backend stays as it was)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    ax_l, ax_a = fig.subplots(1, 2)
    for name, recs in logs.items():
        steps = [r["step"] for r in recs]
        ax_l.plot(steps, [r["loss"] for r in recs], lw=1, label=name)
        ax_a.plot(steps, [r["acc_i"][0] for r in recs], lw=1, label=name)
    ax_l.set(xlabel="optimizer step", ylabel="weighted TTT loss", title="loss")
    ax_a.set(xlabel="optimizer step", ylabel="top-1 agreement, unroll step 0", title="agreement")
    ax_l.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")


def main(argv: Sequence[str] | None = None) -> list[dict]:
    ap = ArgumentParser(
        prog="python -m eval.compare_runs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("runs", nargs="+", help="train.fit output directories (or their train_log.jsonl)")
    ap.add_argument("--window", type=positive_int, default=10)
    ap.add_argument("--out", type=output_file, default=None, help="PNG of the curves")
    args = ap.parse_args(argv)
    if args.out:  # an earlier plot is replaced; a run's log, a user's picture or notes are not
        refuse_foreign_output(args.out, is_plot, "a plot of eval.compare_runs (a Matplotlib PNG)")
    logs = {str(r): read_log(r) for r in args.runs}
    rows = windows(logs, args.window)
    names = list(logs)
    print("steps      " + "  ".join(f"{n[-24:]:>24} loss (rel) acc0" for n in names))
    for row in rows:
        cells = [f"{row[n]['loss']:8.3f} ({row[n]['rel_loss']:+.2%}) {row[n]['acc0']:.3f}" for n in names]
        print(f"{row['steps'][0]:>4}-{row['steps'][1]:<5} " + "  ".join(f"{c:>40}" for c in cells))
    if args.out:
        plot(logs, args.out)
        print(f"plot: {args.out}")
    return rows


if __name__ == "__main__":
    run_cli(main)
