"""eval.compare_runs: windowed means and relative loss of training logs, the plot, a missing log named."""

from __future__ import annotations

import json

import pytest

from eval.compare_runs import main, read_log, windows


def write_log(path, losses, accs):
    path.mkdir()
    lines = [
        json.dumps({"step": i + 1, "loss": lo, "acc_i": [a, a / 2]})
        for i, (lo, a) in enumerate(zip(losses, accs))
    ]
    (path / "train_log.jsonl").write_text("\n".join(lines) + "\n")


def test_windows_and_plot(tmp_path):
    write_log(tmp_path / "a", [10, 8, 6, 4, 2], [0.1, 0.2, 0.3, 0.4, 0.5])
    write_log(tmp_path / "b", [11, 9, 6.6, 4.4, 2.2, 1.0], [0.1, 0.1, 0.3, 0.3, 0.5, 0.6])  # one step longer
    rows = windows({"a": read_log(tmp_path / "a"), "b": read_log(tmp_path / "b")}, 2)
    assert [r["steps"] for r in rows] == [(1, 2), (3, 4), (5, 5)]  # only the steps both runs have
    assert rows[0]["a"]["loss"] == 9 and rows[0]["b"]["loss"] == 10
    assert rows[0]["b"]["rel_loss"] == pytest.approx(1 / 9) and rows[1]["b"]["rel_loss"] == pytest.approx(0.1)
    assert rows[0]["b"]["acc0"] == pytest.approx(0.1) and rows[2]["a"]["acc0"] == pytest.approx(0.5)
    out = tmp_path / "plots" / "c.png"
    main([str(tmp_path / "a"), str(tmp_path / "b"), "--window", "2", "--out", str(out)])
    assert out.stat().st_size > 10_000


def test_missing_log_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope/train_log.jsonl"):
        read_log(tmp_path / "nope")
