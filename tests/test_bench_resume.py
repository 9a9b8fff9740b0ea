"""`eval.bench` loses nothing: Ctrl-C reports the finished prompts, every finished prompt is in
<out>/records.jsonl, and `--resume` continues from the first unfinished one (nothing redone, the same
records an uninterrupted run gives), refusing other settings or prompts by name."""

from __future__ import annotations

import json

import pytest

from eval import bench
from tests.test_cli_errors import exit_status

TINY = ["--turns", "1", "--max-new-tokens", "4", "--methods", "ours-plain,eagle3-k3"]


def count_runs(monkeypatch, stop_at: int | None = None) -> dict:
    """Count Runner.run calls (warm-up included); raise KeyboardInterrupt at call `stop_at`."""
    calls = {"n": 0}
    run = bench.Runner.run

    def counted(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == stop_at:
            raise KeyboardInterrupt
        return run(self, *a, **kw)

    monkeypatch.setattr(bench.Runner, "run", counted)
    return calls


def outputs(out) -> dict:
    report = json.loads((out / "report.json").read_text())
    return {(r["method"], r["prompt_id"], r["turn"]): r["output_ids"] for r in report["records"]}


def test_ctrl_c_then_resume_runs_only_the_unfinished_prompts(tmp_path, monkeypatch, capsys):
    out = tmp_path / "r"
    argv = ["--n", "3", *TINY, "--out", str(out)]
    # warm-up (2 methods), prompts 1 and 2 (2 methods each), then Ctrl-C in the 3rd prompt's first method
    count_runs(monkeypatch, stop_at=2 + 2 * 2 + 1)
    assert bench.main(argv) == 130
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["interrupted_after_prompts"] == 2
    runs = sorted((r["method"], r["prompt_id"]) for r in report["records"])
    assert (
        len(runs) == 4
        and len({p for _, p in runs}) == 2
        and {m for m, _ in runs} == {"ours-plain", "eagle3-k3"}
    )
    err = capsys.readouterr().err
    assert "interrupted: the report keeps the 2 prompts every method finished" in err and "--resume" in err
    lines = (out / bench.PROGRESS_FILE).read_text().splitlines()
    assert len(lines) == 3 and "settings" in json.loads(lines[0])  # the header and the 2 finished prompts

    calls = count_runs(monkeypatch)
    assert bench.main([*argv, "--resume"]) == 0  # 0: every method's tokens equal ours-plain's
    assert calls["n"] == 2 + 2  # warm-up, then the 3rd prompt alone
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["resumed_prompts"] == 2 and "interrupted_after_prompts" not in report["config"]
    assert len(report["records"]) == 6 and len((out / bench.PROGRESS_FILE).read_text().splitlines()) == 4
    resumed = outputs(out)

    whole = tmp_path / "whole"  # the control: the same run uninterrupted gives the same tokens
    assert bench.main(["--n", "3", *TINY, "--out", str(whole)]) == 0
    assert outputs(whole) == resumed


def test_a_killed_run_resumes_past_its_cut_off_line_and_extends_with_a_larger_n(tmp_path, monkeypatch):
    out = tmp_path / "r"
    argv = [*TINY, "--max-prompt-tokens", "20", "--long-prompts", "truncate", "--out", str(out)]
    assert bench.main(["--n", "1", *argv]) == 0
    progress = out / bench.PROGRESS_FILE
    whole_lines = progress.read_bytes()
    with progress.open("ab") as f:  # a run killed while writing its 2nd prompt's line
        f.write(b'{"prompt_id":"82","prompt_sha":"ab')
    calls = count_runs(monkeypatch)
    assert bench.main(["--n", "2", *argv, "--resume"]) == 0
    assert calls["n"] == 2 + 2  # warm-up and the 2nd prompt; the 1st is not run again
    lines = progress.read_bytes()
    assert lines.startswith(whole_lines) and lines.count(b"\n") == 3 and lines.endswith(b"\n")
    assert sorted({p for _, p, _ in outputs(out)}) == ["81", "82"]
    config = json.loads((out / "report.json").read_text())["config"]
    assert config["n"] == 2 and config["truncated_turns"] == 2 * 2  # the resumed prompt's cut turns counted


def test_sampled_runs_resume_to_the_uninterrupted_samples(tmp_path, monkeypatch):
    sampled = [*TINY, "--temperature", "0.8", "--top-k", "20", "--dist-samples", "0", "--seed", "3"]
    assert bench.main(["--n", "2", *sampled, "--out", str(tmp_path / "whole")]) == 0
    assert bench.main(["--n", "1", *sampled, "--out", str(tmp_path / "r")]) == 0
    assert bench.main(["--n", "2", *sampled, "--out", str(tmp_path / "r"), "--resume"]) == 0
    whole, resumed = outputs(tmp_path / "whole"), outputs(tmp_path / "r")
    assert whole == resumed and len(whole) == 4
    assert whole[("ours-plain", "81", 0)] != whole[("ours-plain", "82", 0)]


def no_models(monkeypatch) -> None:
    """Every refusal after this comes before a model loads."""

    def refuse(*a, **kw):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(bench, "load_target", refuse)
    monkeypatch.setattr(bench, "load_model", refuse)
    monkeypatch.setattr(bench, "load_target_tokenizer", refuse)


def test_resume_refuses_other_settings_and_missing_progress(tmp_path, capsys, monkeypatch):
    out = tmp_path / "r"
    assert bench.main(["--n", "1", *TINY, "--out", str(out)]) == 0
    no_models(monkeypatch)
    argv = ["--n", "1", *TINY, "--out", str(out), "--resume"]
    argv[argv.index("4")] = "5"  # --max-new-tokens 5
    code, err = exit_status(bench.main, argv, capsys)
    assert code == 2 and "cannot resume with different settings (max_new_tokens: 4 then, 5 now)" in err
    (out / bench.PROGRESS_FILE).write_text('{"settings": {}}\nnot json\n')
    code, err = exit_status(bench.main, argv, capsys)
    assert (
        code == 2
        and f"{out / bench.PROGRESS_FILE}: line 2 is not a line of eval.bench's progress file" in err
    )

    new = tmp_path / "new"
    code, err = exit_status(bench.main, ["--n", "1", *TINY, "--out", str(new), "--resume"], capsys)
    assert code == 2 and f"--resume: {new / bench.PROGRESS_FILE} does not exist" in err
    code, err = exit_status(bench.main, ["--n", "1", *TINY, "--resume"], capsys)
    assert code == 2 and "--resume continues the run in --out: give its --out" in err
    code, err = exit_status(bench.main, ["--resume", "--overwrite", "--out", str(out)], capsys)
    assert code == 2 and "not allowed with argument" in err
    with pytest.raises(AssertionError, match="a model was loaded"):  # --overwrite deletes nothing before
        bench.main(["--n", "1", *TINY, "--out", str(out), "--overwrite"])  # its first prompt is done
    assert (out / "report.json").exists() and (out / bench.PROGRESS_FILE).read_text().startswith(
        '{"settings": {}}'
    )
    assert not new.exists()


def test_resume_refuses_prompts_that_are_not_this_runs(tmp_path, capsys):
    out = tmp_path / "r"
    assert bench.main(["--n", "2", *TINY, "--out", str(out)]) == 0
    code, err = exit_status(bench.main, ["--n", "1", *TINY, "--out", str(out), "--resume"], capsys)
    assert code == 2 and "prompt 82 was run but is not among this run's 1 prompts" in err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "Say yes."}\n')
    jsonl = ["--bench", "jsonl", "--prompts", str(prompts), "--n", "1", *TINY, "--out", str(tmp_path / "j")]
    assert bench.main(jsonl) == 0
    prompts.write_text('{"id": "a", "prompt": "Say no."}\n')
    code, err = exit_status(bench.main, [*jsonl, "--resume"], capsys)
    assert code == 2 and "prompt a has another text than when it was run" in err


def test_resume_refuses_a_draft_changed_in_place(tmp_path, capsys):
    """A draft retrained into the same directory (train.fit --resume into runs/draft) is another draft: one
    report must not mix records of both (before: resumed, exit 0)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from eagle3.draft import DEFAULT_DRAFT

    draft = tmp_path / "draft"
    draft.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(DEFAULT_DRAFT / f, draft / f)
    argv = ["--n", "1", *TINY, "--out", str(tmp_path / "r"), "--draft", str(draft)]
    assert bench.main(argv) == 0
    w = load_file(draft / "model.safetensors")
    save_file({k: v / 2 if v.is_floating_point() else v for k, v in w.items()}, draft / "model.safetensors")
    code, err = exit_status(bench.main, [*argv, "--resume", "--n", "2"], capsys)
    assert code == 2 and "cannot resume with different settings (weights:" in err


def test_greedy_runs_add_the_plain_decoding_each_method_is_checked_against(tmp_path, capsys):
    """--methods eagle3-k3 alone was compared with nothing (exit 0 whatever it emitted); a +q4 method with
    bf16 plain decoding, whose differences never count. The references are added, with a note."""
    assert bench.with_references(["eagle3-k3+q4", "hf-generate"], 0.0) == ["ours-plain+q4", "eagle3-k3+q4",
                                                                           "hf-generate"]  # fmt: skip
    assert bench.with_references(["ours-plain", "eagle3-k3-compiled"], 0.0)[0] == "ours-plain-compiled"
    assert bench.with_references(["eagle3-k3"], 0.7) == ["eagle3-k3"]  # sampled: the distribution check
    out = tmp_path / "r"
    assert bench.main(["--n", "1", "--turns", "1", "--max-new-tokens", "4", "--methods", "eagle3-k3",
                       "--out", str(out)]) == 0  # fmt: skip
    assert "added ours-plain: the plain decoding the methods are checked against" in capsys.readouterr().err
    s = {x["method"]: x for x in json.loads((out / "report.json").read_text())["summaries"]}
    assert set(s) == {"ours-plain", "eagle3-k3"} and (
        s["eagle3-k3"]["compared"],
        s["eagle3-k3"]["mismatches"],
    ) == (1, 0)


def test_bench_keeps_an_earlier_run_unless_told_to_overwrite(tmp_path, capsys):
    (tmp_path / "report.json").write_text("{}")
    argv = [
        "--n",
        "1",
        "--turns",
        "1",
        "--max-new-tokens",
        "2",
        "--methods",
        "ours-plain",
        "--out",
        str(tmp_path),
    ]
    code, err = exit_status(bench.main, argv, capsys)
    assert code == 2 and f"{tmp_path} holds an earlier run (report.json): --resume continues it" in err
    assert (tmp_path / "report.json").read_text() == "{}"
    assert bench.main([*argv, "--overwrite"]) == 0  # the control
    assert json.loads((tmp_path / "report.json").read_text())["config"]["n"] == 1
    code, err = exit_status(bench.main, argv, capsys)
    assert code == 2 and f"{tmp_path} holds an earlier run (records.jsonl, report.json)" in err
    (tmp_path / "notes").mkdir()  # a folder holding a report.md of the user's (no records, no report.json)
    (tmp_path / "notes" / "report.md").write_text("my notes")
    argv[-1] = str(tmp_path / "notes")
    code, err = exit_status(bench.main, argv, capsys)
    assert code == 2 and f"{tmp_path / 'notes'} holds report.md, which this run writes" in err
    assert (tmp_path / "notes" / "report.md").read_text() == "my notes"
