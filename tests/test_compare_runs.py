"""eval.compare_runs: windowed means and relative loss of training logs, the plot, a missing log named."""

from __future__ import annotations

import json

import pytest

from eval.compare_runs import is_plot, main, read_log, windows
from maverick.cli import run_cli


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
    assert out.stat().st_size > 10_000 and is_plot(out)
    out.write_bytes(out.read_bytes()[:1000])  # a rerun replaces its own plot (another file is refused:
    main([str(tmp_path / "a"), "--out", str(out)])  # tests/test_cli_errors.py)
    assert out.stat().st_size > 10_000
    assert not is_plot(tmp_path / "a" / "train_log.jsonl")


def test_missing_log_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope/train_log.jsonl"):
        read_log(tmp_path / "nope")


def test_runs_logged_at_other_intervals_are_compared_at_shared_steps(tmp_path):
    write_log(tmp_path / "a", [10, 8, 6, 4, 2, 1], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6])  # steps 1..6
    (tmp_path / "b").mkdir()  # logged every 2 steps: 2, 4, 6
    recs = [{"step": s, "loss": lo, "acc_i": [0.5]} for s, lo in ((2, 16.0), (4, 8.0), (6, 2.0))]
    (tmp_path / "b" / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    rows = windows({"a": read_log(tmp_path / "a"), "b": read_log(tmp_path / "b")}, 2)
    assert [r["steps"] for r in rows] == [(2, 4), (6, 6)]
    assert rows[0]["a"]["loss"] == 6 and rows[0]["b"]["loss"] == 12 and rows[0]["b"]["rel_loss"] == 1
    assert rows[1]["b"]["rel_loss"] == 1


def test_a_cut_last_line_is_left_out_and_bad_records_are_named(tmp_path, capsys):
    write_log(tmp_path / "a", [10, 8, 6], [0.1, 0.2, 0.3])
    log = tmp_path / "a" / "train_log.jsonl"
    log.write_text(log.read_text() + '{"step": 4, "lo')  # a run still writing
    assert [r["step"] for r in read_log(tmp_path / "a")] == [1, 2, 3]
    assert "line 4: cut off mid-write" in capsys.readouterr().err
    cases = {
        '{"step": 1, "loss": 2.0}\n': "line 1: no 'acc_i'",
        '{"step": "1", "loss": 2.0, "acc_i": [0.5]}\n': "'step' is '1', not an integer",
        '{"step": 1, "loss": null, "acc_i": [0.5]}\n': "'loss' is None, not a number",
        '{"step": 1, "loss": 1.0, "acc_i": []}\n': "'acc_i' is [], not a list",
        '[1, 2]\n{"step": 1, "loss": 1.0, "acc_i": [0.5]}\n': "line 1: expected a JSON object",
        'x\n{"step": 1, "loss": 1.0, "acc_i": [0.5]}\n': "line 1: invalid JSON",
        "\n": "no log records",
    }
    for text, message in cases.items():
        log.write_text(text)
        with pytest.raises(SystemExit) as exc:
            run_cli(main, [str(tmp_path / "a"), str(tmp_path / "a")])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and str(log) in err, (text, err)


def test_runs_without_a_shared_step_are_refused(tmp_path, capsys):
    write_log(tmp_path / "a", [10, 8], [0.1, 0.2])
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "train_log.jsonl").write_text(
        json.dumps({"step": 10, "loss": 1.0, "acc_i": [0.5]}) + "\n"
    )
    with pytest.raises(SystemExit) as exc:
        run_cli(main, [str(tmp_path / "a"), str(tmp_path / "b")])
    assert exc.value.code == 2 and "share no logged step" in capsys.readouterr().err
