"""Every number of the evaluation report checked against hand-computed values for known runs."""

from __future__ import annotations

import io
import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from eval.report import (
    RED,
    RESET,
    MethodSummary,
    RunRecord,
    acceptance_rates,
    first_difference,
    load_report,
    print_table,
    summarise,
    table_rows,
    to_markdown,
    write_report,
)

P0_IDS = list(range(100))
P1_IDS = list(range(1000, 1050))


def plain(prompt_id: str, tokens: int, seconds: float, ids: list[int], **kw) -> RunRecord:
    return RunRecord("ours-plain", prompt_id, 0, tokens, seconds, ttft=0.5, output_ids=ids, **kw)


def single_prompt_records() -> list[RunRecord]:
    """The brief's example: plain 100 tokens in 10 s, HF 100 in 20 s, EAGLE accepted [3, 1, 0, 4] in 4 s."""
    return [
        plain("p0", 100, 10.0, P0_IDS, peak_memory_mb=1000.0, dtype="bf16"),
        RunRecord("hf-generate", "p0", 0, 100, 20.0, ttft=1.0, peak_memory_mb=1500.0, output_ids=P0_IDS),
        RunRecord(
            "eagle3-k4",
            "p0",
            0,
            100,
            4.0,
            ttft=0.25,
            cycles=4,
            accepted=[3, 1, 0, 4],
            draft_lengths=[4, 4, 4, 4],
            draft_seconds=1.0,
            verify_seconds=2.5,
            peak_memory_mb=1100.0,
            output_ids=P0_IDS,
            dtype="bf16",
        ),
    ]


def two_prompt_records() -> list[RunRecord]:
    """Two prompts, where the aggregate speedup and the mean of per-prompt speedups differ, a fixed-k
    method with one changed token and a tuned method whose k varies and whose output is truncated."""
    changed = P1_IDS.copy()
    changed[7] += 1
    return [
        plain("p0", 100, 10.0, P0_IDS, peak_memory_mb=1000.0),
        RunRecord("hf-generate", "p0", 0, 100, 20.0, ttft=1.0, output_ids=P0_IDS),
        RunRecord(
            "eagle3-k4",
            "p0",
            0,
            100,
            4.0,
            ttft=0.2,
            cycles=4,
            accepted=[3, 1, 0, 4],
            draft_lengths=[4, 4, 4, 4],
            draft_seconds=1.0,
            verify_seconds=2.0,
            peak_memory_mb=1100.0,
            output_ids=P0_IDS,
        ),
        RunRecord(
            "eagle3-tuned",
            "p0",
            0,
            100,
            5.0,
            ttft=0.3,
            cycles=4,
            accepted=[2, 1, 0, 3],
            draft_lengths=[2, 4, 3, 3],
            draft_seconds=0.5,
            verify_seconds=4.0,
            output_ids=P0_IDS[:60],
        ),
        plain("p1", 50, 10.0, P1_IDS, peak_memory_mb=1200.0),
        RunRecord("hf-generate", "p1", 0, 50, 20.0, ttft=1.0, output_ids=P1_IDS),
        RunRecord(
            "eagle3-k4",
            "p1",
            0,
            50,
            2.5,
            ttft=0.4,
            cycles=2,
            accepted=[4, 4],
            draft_lengths=[4, 4],
            draft_seconds=0.5,
            verify_seconds=1.5,
            peak_memory_mb=1300.0,
            output_ids=changed,
        ),
    ]


def by_method(summaries: list[MethodSummary]) -> dict[str, MethodSummary]:
    return {s.method: s for s in summaries}


def test_single_prompt_numbers():
    s = by_method(summarise(single_prompt_records()))
    assert list(s) == ["ours-plain", "hf-generate", "eagle3-k4"]

    p, hf, e = s["ours-plain"], s["hf-generate"], s["eagle3-k4"]
    assert (p.tokens_per_s, hf.tokens_per_s, e.tokens_per_s) == (10.0, 5.0, 25.0)
    assert (p.speedup, p.speedup_hf) == (1.0, 2.0)
    assert (hf.speedup, hf.speedup_hf) == (0.5, 1.0)
    assert (e.speedup, e.speedup_hf) == (2.5, 5.0)
    assert (e.speedup_mean, e.speedup_hf_mean) == (2.5, 5.0)

    assert e.tau == 3.0  # mean of (3 + 1, 1 + 1, 0 + 1, 4 + 1)
    assert e.accept_rates == [0.75, 0.5, 0.5, 0.25]
    assert e.draft_share == 0.25 and e.verify_share == 0.625
    assert e.draft_length_counts == [0, 0, 0, 0, 4] and e.mean_draft_length == 4.0
    assert (e.cycles, e.prompts, e.generations, e.new_tokens, e.seconds) == (4, 1, 1, 100, 4.0)
    assert (e.mean_ttft, e.peak_memory_mb, e.dtype) == (0.25, 1100.0, "bf16")

    # Non-speculative methods have no tau, no acceptance, no draft share.
    for m in (p, hf):
        assert (m.tau, m.accept_rates, m.draft_share, m.mean_draft_length, m.cycles) == (
            None,
            [],
            None,
            None,
            0,
        )
    assert all((m.compared, m.mismatches, m.first_mismatch_index) == (1, 0, None) for m in s.values())


def test_two_prompts_aggregate_vs_per_prompt_speedup():
    s = by_method(summarise(two_prompt_records()))
    p, e = s["ours-plain"], s["eagle3-k4"]
    assert p.tokens_per_s == 150 / 20
    assert s["hf-generate"].tokens_per_s == 150 / 40
    assert e.tokens_per_s == 150 / 6.5
    # Aggregate: (150 / 6.5) / 7.5; per prompt: p0 25 / 10 = 2.5, p1 20 / 5 = 4.0, mean 3.25.
    assert e.speedup == pytest.approx(20 / 6.5, rel=1e-15)
    assert e.speedup_mean == 3.25
    # Against HF: p0 25 / 5 = 5, p1 20 / 2.5 = 8, mean 6.5.
    assert e.speedup_hf == pytest.approx(40 / 6.5, rel=1e-15)
    assert e.speedup_hf_mean == 6.5

    # accepted over both prompts: [3, 1, 0, 4, 4, 4] -> tau = (16 + 6) / 6.
    assert e.tau == 22 / 6
    assert e.accept_rates == [5 / 6, 4 / 6, 4 / 6, 3 / 6]
    assert e.draft_share == 1.5 / 6.5
    assert e.mean_ttft == pytest.approx(0.3, rel=1e-15) and e.peak_memory_mb == 1300.0
    assert (e.prompts, e.generations, e.cycles) == (2, 2, 6)
    assert p.peak_memory_mb == 1200.0 and p.mean_ttft == 0.5


def test_tuned_draft_lengths_condition_acceptance_on_reaching_the_position():
    t = by_method(summarise(two_prompt_records()))["eagle3-tuned"]
    # accepted [2, 1, 0, 3] with k [2, 4, 3, 3]: position 3 is reached by 3 cycles, position 4 by one.
    assert t.accept_rates == [3 / 4, 2 / 4, 1 / 3, 0.0]
    assert t.tau == 10 / 4
    assert t.draft_length_counts == [0, 0, 1, 2, 1] and t.mean_draft_length == 3.0
    assert t.tokens_per_s == 20.0 and t.speedup == 2.0 and t.speedup_hf == 4.0
    assert t.draft_share == 0.1 and t.verify_share == 0.8
    assert acceptance_rates([], []) == []


def test_a_cut_last_cycle_counts_in_tau_as_emitted_and_in_the_rates_as_accepted():
    """The budget kept 2 of the last cycle's 4 accepted tokens (+ bonus) from the output: tau counts the
    tokens the cycles emitted, the rate at each position what the target's verify accepted."""
    base = single_prompt_records()[2]  # accepted [3, 1, 0, 4], k 4
    cut = replace(base, method="eagle3-tuned", accepted=[3, 1, 0, 1], cut=[0, 0, 0, 3])
    s = by_method(summarise([*single_prompt_records()[:2], cut]))["eagle3-tuned"]
    assert s.tau == (3 + 1 + 0 + 1 + 4) / 4  # emitted per cycle
    assert s.accept_rates == [0.75, 0.5, 0.5, 0.25]  # as uncut: base's rates
    assert acceptance_rates([3, 1, 0, 1], [4] * 4) == [0.75, 0.25, 0.25, 0.0]  # read without the cut: too low
    # as SpecStats now writes it: the 2 kept tokens are draft tokens, the cycle's target token was cut too
    kept = replace(cut, accepted=[3, 1, 0, 2], cut=[0, 0, 0, 2], target_cut=1)
    k = by_method(summarise([*single_prompt_records()[:2], kept]))["eagle3-tuned"]
    assert (k.tau, k.accept_rates) == (s.tau, s.accept_rates)


def test_mismatch_count_and_first_differing_token():
    s = by_method(summarise(two_prompt_records()))
    e, t = s["eagle3-k4"], s["eagle3-tuned"]
    assert (e.compared, e.mismatches, e.first_mismatch_index) == (2, 1, 7)
    assert e.mismatch_details == [{"prompt_id": "p1", "turn": 0, "index": 7}]
    # A truncated output differs at the first missing token.
    assert (t.compared, t.mismatches, t.first_mismatch_index) == (1, 1, 60)
    assert (s["hf-generate"].mismatches, s["ours-plain"].mismatches) == (0, 0)
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_sampled_runs_are_not_compared_token_by_token():
    s = by_method(summarise(two_prompt_records(), compare_outputs=False))
    assert all(x.mismatches is None and x.compared is None for x in s.values())
    assert print_table(list(s.values()), file=io.StringIO()) is True


def test_missing_baselines_give_none():
    records = [r for r in two_prompt_records() if r.method not in ("ours-plain", "hf-generate")]
    for m in summarise(records):
        assert (m.speedup, m.speedup_mean, m.speedup_hf, m.speedup_hf_mean) == (None,) * 4
        assert (m.compared, m.mismatches, m.first_mismatch_index, m.mismatch_details) == (
            None,
            None,
            None,
            [],
        )
    # Another baseline name is honoured.
    e = by_method(summarise(records, baseline="eagle3-tuned"))["eagle3-k4"]
    # Speedups use only the pairs both ran: p0, 25 tok/s over 20 tok/s.
    assert e.speedup == 1.25 and e.speedup_mean == 1.25 and e.compared == 1 and e.mismatches == 1


def test_record_validation_names_the_field():
    with pytest.raises(ValueError, match="'accepted' \\(3\\).*cycles=4"):
        RunRecord("m", "p", 0, 10, 1.0, 0.1, cycles=4, accepted=[1, 1, 1], draft_lengths=[2] * 4)
    with pytest.raises(ValueError, match="cycle 1 has accepted=3, cut=0, draft_length=2"):
        RunRecord("m", "p", 0, 10, 1.0, 0.1, cycles=2, accepted=[1, 3], draft_lengths=[2, 2])
    with pytest.raises(ValueError, match="cycle 0 has accepted=1, cut=2, draft_length=2"):
        RunRecord("m", "p", 0, 10, 1.0, 0.1, cycles=1, accepted=[1], cut=[2], draft_lengths=[2])
    with pytest.raises(ValueError, match="'cut' \\(1\\) must be empty or have one entry per cycle"):
        RunRecord("m", "p", 0, 10, 1.0, 0.1, cycles=2, accepted=[1, 1], cut=[0], draft_lengths=[2, 2])
    with pytest.raises(ValueError, match="'seconds' must be > 0"):
        RunRecord("m", "p", 0, 10, 0.0, 0.0)
    with pytest.raises(ValueError, match="'ttft' must be a finite number"):
        RunRecord("m", "p", 0, 10, 1.0, float("nan"))
    with pytest.raises(ValueError, match="'turn' must be an int"):
        RunRecord("m", "p", -1, 10, 1.0, 0.1)
    with pytest.raises(ValueError, match="duplicate record for method='ours-plain' prompt_id='p0' turn=0"):
        summarise(single_prompt_records() + single_prompt_records()[:1])
    with pytest.raises(ValueError, match="unknown field\\(s\\) \\['tokens'\\]"):
        RunRecord.from_dict({**asdict(single_prompt_records()[0]), "tokens": 3})


def test_markdown_contains_the_numbers():
    md = to_markdown(summarise(two_prompt_records()))
    lines = md.splitlines()
    assert lines[0] == (
        "| method | tok/s | x plain | x HF | tau | accept@1 | accept@2 | accept@3 | accept@4 "
        "| draft share | TTFT (s) | peak MB | mismatches |"
    )
    assert lines[2] == "| ours-plain | 7.50 | 1.00x | 2.00x | - | - | - | - | - | - | 0.500 | 1200.0 | 0/2 |"
    assert lines[3] == "| hf-generate | 3.75 | 0.50x | 1.00x | - | - | - | - | - | - | 1.000 | 0.0 | 0/2 |"
    assert lines[4] == (
        "| eagle3-k4 | 23.08 | 3.08x | 6.15x | 3.67 | 0.83 | 0.67 | 0.67 | 0.50 | 23.1% | 0.300 | 1300.0 | 1/2 |"
    )
    assert lines[5] == (
        "| eagle3-tuned | 20.00 | 2.00x | 4.00x | 2.50 | 0.75 | 0.50 | 0.33 | 0.00 | 10.0% | 0.300 | 0.0 | 1/1 |"
    )
    assert len(lines) == 6


def test_compact_table_keeps_ten_columns_and_the_first_three_positions():
    summaries = summarise(two_prompt_records())
    header, rows = table_rows(summaries, compact=True)
    assert header == [
        "method", "tok/s", "x plain", "x HF", "tau", "accept@1", "accept@2", "accept@3", "draft share", "mismatches"
    ]  # fmt: skip
    # the same cells as the wide table, minus accept@4, TTFT and peak MB
    assert rows[2] == ["eagle3-k4", "23.08", "3.08x", "6.15x", "3.67", "0.83", "0.67", "0.67", "23.1%", "1/2"]
    assert rows[0] == ["ours-plain", "7.50", "1.00x", "2.00x", "-", "-", "-", "-", "-", "0/2"]
    out = io.StringIO()
    assert print_table(summaries, file=out, compact=True) is False
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["method", "tok/s", "x", "plain", "x", "HF", "tau"] + header[5:8] + [
        "draft", "share", "mismatches"
    ]  # fmt: skip
    assert "TTFT" not in out.getvalue() and "FAIL: eagle3-k4" in out.getvalue()


def test_print_table_marks_mismatches_red_and_fails():
    out = io.StringIO()
    assert print_table(summarise(two_prompt_records()), file=out) is False
    text = out.getvalue()
    assert f" {RED}1/2{RESET}\n" in text and f" {RED}1/1{RESET}\n" in text
    assert (
        "FAIL: eagle3-k4: 1 of 2 outputs differ from ours-plain (first: prompt 'p1' turn 0 at token 7)"
        in text
    )
    assert (
        "FAIL: eagle3-tuned: 1 of 1 outputs differ from ours-plain (first: prompt 'p0' turn 0 at token 60)"
        in text
    )

    out = io.StringIO()
    assert print_table(summarise(single_prompt_records()), file=out) is True
    assert "\033[" not in out.getvalue() and "FAIL" not in out.getvalue()
    header, *rows = out.getvalue().splitlines()
    assert header.split()[:3] == ["method", "tok/s", "x"] and len(rows) == 3
    assert rows[2].split()[:5] == ["eagle3-k4", "25.00", "2.50x", "5.00x", "3.00"]


def test_write_report_round_trip_and_plots(tmp_path):
    records = two_prompt_records()
    summaries = summarise(records)
    config = {"model": "tiny", "temperature": 0.0, "methods": ["ours-plain", "eagle3-k4"], "out": tmp_path}
    paths = write_report(records, summaries, config, tmp_path / "run")

    assert set(paths) == {"json", "markdown", "speedup", "acceptance", "draft_length"}
    loaded_config, loaded_records, loaded_summaries = load_report(paths["json"])
    assert loaded_config == {**config, "out": str(tmp_path)}
    assert loaded_records == records
    assert loaded_summaries == summaries
    assert json.loads(paths["json"].read_text())["summaries"][2]["tau"] == 22 / 6
    assert paths["markdown"].read_text() == to_markdown(summaries)
    for name in ("speedup", "acceptance", "draft_length"):
        data = paths[name].read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000, name
    # Atomic writes leave no temporary files behind.
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "acceptance.png",
        "draft_length.png",
        "report.json",
        "report.md",
        "speedup.png",
    ]


def test_write_report_without_speculative_or_baseline_methods(tmp_path):
    only_hf = [r for r in single_prompt_records() if r.method == "hf-generate"]
    paths = write_report(only_hf, summarise(only_hf), {}, tmp_path)
    assert all(p.stat().st_size > 0 for p in paths.values())


def test_unserialisable_config_is_named(tmp_path):
    records = single_prompt_records()
    with pytest.raises(TypeError, match="config value of type object"):
        write_report(records, summarise(records), {"bad": object()}, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_summary_from_dict_rejects_missing_fields():
    d = asdict(summarise(single_prompt_records())[0])
    del d["tau"]
    with pytest.raises(ValueError, match="missing field\\(s\\) \\['tau'\\]"):
        MethodSummary.from_dict(d)
    d["tau"] = 1.0
    assert MethodSummary.from_dict(d).tau == 1.0


def spec_record(method: str, ids: list[int], k: int) -> RunRecord:
    """4 tokens in 0.5 s from two cycles of k drafted tokens (2 accepted, then 0)."""
    return RunRecord(method, "p0", 0, 4, 0.5, ttft=0.5, output_ids=ids, cycles=2, accepted=[2, 0],
                     draft_lengths=[k, k])  # fmt: skip


@pytest.mark.parametrize("v", ["+fp8", "+q4"])
def test_variant_methods_are_checked_against_their_own_plain_decoding(v):
    """ "+fp8" / "+q4" methods: lossless against ours-plain+fp8 / +q4 (a difference fails); that plain
    decoding against the bf16 one is the numerics' effect on the output, shown but not a failure."""
    recs = [
        plain("p0", 4, 1.0, [1, 2, 3, 4]),
        RunRecord("ours-plain" + v, "p0", 0, 4, 1.0, ttft=0.5, output_ids=[1, 2, 9, 9]),
        spec_record("eagle3-k3" + v, [1, 2, 9, 9], k=3),
        spec_record("eagle3-k5" + v, [1, 2, 3, 4], k=5),
    ]
    s = by_method(summarise(recs))
    assert s["ours-plain" + v].reference == "ours-plain" and s["ours-plain" + v].first_mismatch_index == 2
    assert (s["eagle3-k3" + v].reference, s["eagle3-k3" + v].mismatches) == ("ours-plain" + v, 0)
    assert (s["eagle3-k5" + v].mismatches, s["eagle3-k5" + v].first_mismatch_index) == (1, 2)
    assert s["eagle3-k3" + v].speedup == pytest.approx(2.0)  # speed still against bf16 plain decoding
    out = io.StringIO()
    assert print_table(list(s.values()), file=out) is False
    fails = [line for line in out.getvalue().splitlines() if "FAIL" in line]
    assert len(fails) == 1 and f"eagle3-k5{v}: 1 of 1 outputs differ from ours-plain{v}" in fails[0]
    assert "1/1 vs ours-plain" in out.getvalue()
    d = asdict(s["eagle3-k3" + v])
    del d["reference"]  # reports written before the field existed still load
    assert MethodSummary.from_dict(d).reference == ""


def test_cycles_that_drafted_nothing_make_a_record_and_a_report(tmp_path):
    """Draft length 0 is no speculation (FixedK(0), a tuner with 0 among its choices): such generations
    decode plain decoding's tokens, and their records were refused ("need 1 <= k"), eval.bench's
    eagle3-k0 with a traceback. Each such cycle emits the target's token alone (tau 1) and reaches no
    draft position (no acceptance rate); the draft-length plot puts it at k = 0."""
    from eval.plots import plot_draft_length

    def spec(method, accepted, ks):
        return RunRecord(method, "p0", 0, 100, 5.0, ttft=0.25, cycles=len(ks), accepted=accepted,
                         draft_lengths=ks, output_ids=P0_IDS)  # fmt: skip

    records = [plain("p0", 100, 10.0, P0_IDS), spec("eagle3-k0", [0, 0, 0], [0, 0, 0]),
               spec("eagle3-tuned", [0, 2, 1, 0], [0, 2, 3, 0])]  # fmt: skip
    s = by_method(summarise(records))
    k0, tuned = s["eagle3-k0"], s["eagle3-tuned"]
    assert (k0.tau, k0.accept_rates, k0.draft_length_counts, k0.mean_draft_length) == (1.0, [], [3], 0.0)
    assert tuned.tau == 7 / 4 and tuned.accept_rates == [1.0, 0.5, 0.0]
    assert tuned.draft_length_counts == [2, 0, 1, 1]
    lines = {
        ln.get_label(): list(ln.get_xdata()) for ln in plot_draft_length(list(s.values())).axes[0].get_lines()
    }
    assert lines["fixed k"] == [0]
    paths = write_report(records, list(s.values()), {}, tmp_path)
    assert load_report(paths["json"])[1] == records
    with pytest.raises(ValueError, match="cycle 0 has accepted=1, cut=0, draft_length=0"):
        spec("eagle3-k0", [1], [0])


def test_bench_runs_eagle3_k0(tmp_path):
    """`eval.bench --methods ours-plain,eagle3-k0` ended in a traceback (the record of draft length 0 refused);
    now it reports plain decoding's tokens at tau 1."""
    from eval import bench

    out = tmp_path / "r"
    argv = "--n 1 --turns 1 --max-new-tokens 4 --methods ours-plain,eagle3-k0".split() + ["--out", str(out)]
    assert bench.main(argv) == 0  # 0: the tokens equal ours-plain's
    k0 = next(s for s in load_report(out / "report.json")[2] if s.method == "eagle3-k0")
    assert k0.tau == 1.0 and k0.mismatches == 0 and k0.draft_length_counts == [k0.cycles] and k0.cycles > 0


def test_draft_length_plot_joins_fixed_k_chains_of_like_numerics_only():
    """One fixed-k line per numerics (bf16 k=3,4; +q4 k=3), trees a point at their depth on no line."""
    from eval.plots import plot_draft_length

    def spec(method, k, seconds):
        return RunRecord(method, "p0", 0, 100, seconds, ttft=0.25, cycles=2, accepted=[1, 1],
                         draft_lengths=[k, k], draft_seconds=0.1, verify_seconds=0.2, output_ids=P0_IDS)  # fmt: skip

    records = [plain("p0", 100, 10.0, P0_IDS), RunRecord("ours-plain+q4", "p0", 0, 100, 8.0, ttft=0.5, output_ids=P0_IDS),
               spec("eagle3-k3", 3, 5.0), spec("eagle3-k4", 4, 6.0), spec("eagle3-k3+q4", 3, 4.0),
               spec("eagle3-tree", 3, 2.0)]  # fmt: skip
    ax = plot_draft_length(summarise(records)).axes[0]
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()}
    assert lines["fixed k"] == ([3, 4], [20.0, 100 / 6])
    assert lines["fixed k (+q4)"] == ([3], [25.0])
    assert not any(50.0 in y for label, (_, y) in lines.items() if label.startswith("fixed k"))  # the tree's


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux only")
def test_peak_memory_is_each_generations_own():
    """eval.bench resets the peak before each generation: a 400 MB buffer freed before the next one's
    reset is not in the next one's peak (the column read the process's resident memory after every method)."""
    import mmap

    from eval.bench import peak_memory_mb, reset_peak_memory

    reset_peak_memory()
    base = peak_memory_mb()
    buf = mmap.mmap(-1, 400 * 2**20)  # new pages (a freed tensor's may still be resident): 400 MB, touched
    for i in range(0, len(buf), mmap.PAGESIZE):
        buf[i] = 1
    buf.close()
    first = peak_memory_mb()
    reset_peak_memory()
    second = peak_memory_mb()
    assert first - base > 350 and second - base < 50, (base, first, second)


def test_peak_memory_follows_the_models_device_not_cudas_presence(monkeypatch):
    """A CPU run on a machine with a GPU read the idle CUDA allocator: every row's peak MB was ~0."""
    from eval import bench

    def idle_allocator(*a, **kw):
        raise AssertionError("the CUDA allocator read for a CPU run")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", idle_allocator)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", idle_allocator)
    bench.reset_peak_memory("cpu")
    assert bench.peak_memory_mb("cpu") > 10  # this process's resident peak (the models aside: Python, torch)
