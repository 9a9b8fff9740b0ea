"""train.stage end to end on a tiny random target: regenerate, train, score, write; a rerun resumes without
redoing or losing anything; a next stage continues from the previous one. train.stage_data's id segments
rebuild the rendered chat with the real tokenizer."""

import json
import lzma
import time

import pytest
import torch

from maverick.checkpoint import save_hf
from maverick.cli import run_cli
from maverick.config import get_config
from maverick.model import Llama4
from train import answers
from train.stage import ANSWERS, main


def make_data(root):
    model = Llama4(get_config("tiny-dense"))
    model.init_weights(std=0.15, generator=torch.Generator().manual_seed(0))
    save_hf(model.eval(), root / "target")
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(8, 512, (n,), generator=g).tolist()  # noqa: E731
    recs = []
    for i in range(12):
        recs.append(
            {
                "id": f"t{i}",
                "prompts": [ids(int(torch.randint(4, 20, (1,), generator=g))) for _ in range(1 + i % 3)],
            }
        )
    recs += [{"id": f"h{i}", "split": "heldout", "prompts": [ids(12)]} for i in range(3)]
    recs += [{"id": f"old{i}", "prompts": [ids(10)], "answers": [ids(9) + [2]]} for i in range(2)]
    recs[-1]["more"] = [ids(6)]  # a later user turn: the stage continues this chat after its answer
    answers.write(root / "data.jsonl.xz", recs)
    return root / "target", root / "data.jsonl.xz"


def run(target, data, out, *extra):
    common = ["--minutes", "5", "--target", str(target), "--data", str(data), "--out", str(out), "--device", "cpu",
              "--dtype", "fp32", "--batch-size", "4", "--max-len", "96", "--max-new-tokens", "8",
              "--token-budget", "128", "--bucket", "32", "--max-length", "96", "--max-steps", "6", "--log-every", "2",
              "--heldout", "3", "--score-new-tokens", "12", "--ttt-steps", "3", "--draft-vocab-size", "128"]  # fmt: skip
    return main(common + list(extra))


def check_scored_against_init(sc):
    """Both drafts scored, and the new one's tau(k) less the initial one's, inside its interval."""
    assert set(sc["drafts"]) == {"init", "new"} and sc["new_less_init"]["clusters"] == sc["heldout"]
    d = sc["new_less_init"]
    k = d["k"]  # the steps scored
    assert d["tau"] == pytest.approx(sc["drafts"]["new"]["tau"][k] - sc["drafts"]["init"]["tau"][k], abs=2e-4)
    assert d["tau_ci95"][0] <= d["tau"] <= d["tau_ci95"][1]


def test_stage_runs_resumes_and_chains(tmp_path, capsys):
    torch.set_num_threads(1)
    target, data = make_data(tmp_path)
    out = tmp_path / "s1"
    s = run(target, data, out, "--stop-after", "regen", "--max-conversations", "7")
    assert set(s["phases"]) == {"regen"} and s["phases"]["regen"]["conversations"] == 7
    first = answers.read_records(out / ANSWERS)
    assert len(first) == 7 and not {r["id"] for r in first} & {"old0", "h0", "h1", "h2"}
    # a write cut off half-way by a kill: dropped on the rerun, nothing complete lost
    blob = lzma.compress(b'{"id": "t99"}\n', format=lzma.FORMAT_XZ)
    (out / ANSWERS).write_bytes((out / ANSWERS).read_bytes() + blob[:20])

    s = run(target, data, out)
    assert s["phases"]["regen"]["conversations"] == 7  # not regenerated again
    assert answers.read_records(out / ANSWERS) == first
    tr = s["phases"]["train"]
    assert (
        tr["samples"] == len({r["id"] for r in first} | {"old0", "old1"})
        and tr["steps"] == 6
        and tr["tokens"] > 0
    )
    assert (out / "draft" / "model.safetensors").is_file() and (out / "curve.png").is_file()
    assert not (out / "train_state.pt").exists()
    log = (out / "train_log.jsonl").read_text()
    assert [json.loads(x)["step"] for x in log.splitlines()] == [2, 4, 6]
    sc = s["phases"]["score"]
    assert sc["heldout"] == 3 and set(sc["drafts"]) == {"new"} and len(sc["drafts"]["new"]["p_run_ge"]) == 3
    assert s["out_bytes"] < 64 * 2**20

    # rerun: nothing redone
    s3 = run(target, data, out)
    assert s3["phases"] == json.loads(json.dumps(s["phases"])) and s3["runs"] == 3
    assert (out / "train_log.jsonl").read_text() == log

    # the next stage: the previous draft and answers, new conversations only
    out2 = tmp_path / "s2"
    s = run(target, data, out2, "--init-draft", str(out), "--max-conversations", "3")
    new = answers.read_records(out2 / ANSWERS)
    assert len(new) == 3 and not {r["id"] for r in new} & {r["id"] for r in first}
    ids = {r["id"] for r in first + new} | {"old0", "old1"}
    assert s["phases"]["train"]["samples"] == len(ids) and s["phases"]["train"]["init_draft"] == str(
        out / "draft"
    )
    check_scored_against_init(s["phases"]["score"])
    capsys.readouterr()

    # a third stage from the second: the first's answers are neither in --data nor beside its init, and the
    # stage says so (it would answer those chats again)
    s = run(
        target,
        data,
        tmp_path / "s3",
        "--init-draft",
        str(out2),
        "--max-conversations",
        "2",
        "--stop-after",
        "regen",
    )
    assert "warning: the --init-draft trained on 7 more answered conversations" in capsys.readouterr().out
    # the first stage's answers given as data (train.stage_data --answers folds them into one file): no word,
    # and none of the first stage's chats answered again
    s = run(target, data, tmp_path / "s4", "--data", str(out / ANSWERS), "--init-draft", str(out2),
            "--max-conversations", "2", "--stop-after", "regen")  # fmt: skip
    assert "warning" not in capsys.readouterr().out
    again = answers.read_records(tmp_path / "s4" / ANSWERS)
    assert len(again) == 2 and not {r["id"] for r in again} & {r["id"] for r in first + new}


def test_stage_errors_name_the_path(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        run_cli(
            main,
            [
                "--minutes",
                "1",
                "--out",
                str(tmp_path / "o"),
                "--data",
                str(tmp_path / "none.xz"),
                "--device",
                "cpu",
            ],
        )
    assert e.value.code == 2 and "none.xz" in capsys.readouterr().err


def test_stage_data_segments_rebuild_the_rendered_chat():
    from maverick.tokenizer import encode_chat, load_tokenizer
    from train.stage_data import conversation_record

    tok = load_tokenizer()
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7"}]  # fmt: skip
    rec = conversation_record(tok, {"id": "x", "messages": msgs}, with_answers=True)
    flat = answers.sample(rec)["input_ids"]
    whole = encode_chat(tok, msgs, add_generation_prompt=False)
    assert flat == whole[: len(flat)] and len(whole) - len(flat) <= 1  # the template's trailing newline
    assert rec["answers"][0][-1] == tok.eos_token_id
    prompts_only = conversation_record(tok, {"id": "x", "messages": msgs}, with_answers=False)
    assert prompts_only["prompts"] == rec["prompts"] and "answers" not in prompts_only


def test_stage_data_neither_closes_nor_continues_a_cut_answer():
    """An answer the target stopped at its token budget gets no end-of-turn token, and the chat's later turns
    are not continued after it: marked by train.regenerate, or (older files) within CUT_MARGIN of the budget
    given. Before, 3,607 stage-6 chats would have been continued after an answer cut mid-sentence."""
    from maverick.tokenizer import load_tokenizer
    from train.stage_data import CUT_MARGIN, conversation_record

    tok = load_tokenizer()
    eos = tok.eos_token_id
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I"},
            {"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7"},
            {"role": "user", "content": "Another?"}]  # fmt: skip
    whole = conversation_record(tok, {"id": "x", "messages": msgs}, with_answers=True)
    assert [a[-1] for a in whole["answers"]] == [eos, eos] and len(whole["more"]) == 1
    cut = [dict(m) for m in msgs]
    cut[1]["cut"] = True
    rec = conversation_record(tok, {"id": "x", "messages": cut}, with_answers=True)
    assert rec["answers"] == [whole["answers"][0][:-1]] and "more" not in rec
    assert rec["prompts"] == whole["prompts"][:1]
    n = len(whole["answers"][0]) - 1  # "Hello! How can I" in tokens
    by_length = conversation_record(
        tok, {"id": "x", "messages": msgs}, with_answers=True, cut_tokens=n + CUT_MARGIN
    )
    assert by_length == rec
    longer = conversation_record(
        tok, {"id": "x", "messages": msgs}, with_answers=True, cut_tokens=n + CUT_MARGIN + 1
    )
    assert longer == whole


def test_stage_data_folds_in_a_stages_answers(tmp_path):
    """--answers: a stage's id records join the data (replacing the chat's unanswered record), so a later
    stage trains on them and does not answer them again; a held-out chat's answers are refused."""
    from maverick.cli import UserError
    from train.data import DEFAULT_HELDOUT_FRACTION, DEFAULT_SPLIT_SEED, is_heldout
    from train.stage_data import main as stage_data

    ids = [f"c{i}" for i in range(40)]
    train = [c for c in ids if not is_heldout(c, DEFAULT_HELDOUT_FRACTION, DEFAULT_SPLIT_SEED)][:3]
    held = next(c for c in ids if is_heldout(c, DEFAULT_HELDOUT_FRACTION, DEFAULT_SPLIT_SEED))
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": c, "messages": [{"role": "user", "content": f"Say {c}."}]}) + "\n"
                             for c in train + [held]))  # fmt: skip
    stage_answers = tmp_path / "answers.jsonl.xz"
    answers.write(stage_answers, [{"id": train[0], "prompts": [[1, 2, 3]], "answers": [[4, 5, 2]]}])
    out = tmp_path / "data.jsonl.xz"
    summary = stage_data(["--out", str(out), "--chats", str(chats), "--answers", str(stage_answers)])
    recs = {r["id"]: r for r in answers.read_records(out)}
    assert sorted(recs) == sorted(train + [held]) and summary["answered"] == 1 and summary["heldout"] == 1
    assert recs[held]["split"] == "heldout"
    assert recs[train[0]] == {"id": train[0], "prompts": [[1, 2, 3]], "answers": [[4, 5, 2]]}
    assert "answers" not in recs[train[1]]
    answers.write(stage_answers, [{"id": held, "prompts": [[1]], "answers": [[2]]}])
    with pytest.raises(UserError, match=f"{held}: an answered conversation of the held-out split"):
        stage_data(["--out", str(out), "--chats", str(chats), "--answers", str(stage_answers)])
    notes = tmp_path / "notes.jsonl.xz"  # not this command's: kept, and named
    notes.write_text("my notes\n")
    chat_xz = tmp_path / "regen.jsonl.xz"  # an xz chat file (--chats, --answered) given as --out by mistake
    answers.write(chat_xz, [{"id": "a", "messages": [{"role": "user", "content": "Hi."}]}])
    # a stage's answers (runs/stageN/out/answers.jsonl.xz: id records too, no held-out ones) were replaced
    stage_answers.write_bytes(b"")
    answers.append(
        stage_answers, [{"id": f"s{i}", "prompts": [[1, 2]], "answers": [[4, 2]]} for i in range(9)]
    )
    for kept in (notes, chat_xz, stage_answers):
        before = kept.read_bytes()
        with pytest.raises(UserError, match=f"{kept}: already exists and is not id records"):
            stage_data(["--out", str(kept), "--chats", str(chats)])
        assert kept.read_bytes() == before
    stage_data(["--out", str(out), "--chats", str(chats)])  # its own output: replaced (a rerun)
    no_held = tmp_path / "no_held.jsonl.xz"  # one with no held-out record (its unanswered ones tell it) too
    stage_data(["--out", str(no_held), "--chats", str(chats), "--heldout", "0"])
    stage_data(["--out", str(no_held), "--chats", str(chats), "--heldout", "0"])
    # --out names the xz file it writes: a .jsonl name (train.stage read it as plain JSONL) is refused
    with pytest.raises(UserError, match=f"{tmp_path / 'data.jsonl'}: --out must end in .xz"):
        stage_data(["--out", str(tmp_path / "data.jsonl"), "--chats", str(chats)])
    assert not (tmp_path / "data.jsonl").exists()


def test_stage_continues_answered_chats_after_their_answers(tmp_path):
    torch.set_num_threads(1)
    target, data = make_data(tmp_path)
    s = run(target, data, tmp_path / "o", "--stop-after", "regen")
    got = {r["id"]: r for r in answers.read_records(tmp_path / "o" / ANSWERS)}
    assert s["phases"]["regen"]["conversations"] == 13 and "old0" not in got  # 12 new + old1 continued
    old1 = next(r for r in answers.read_records(data) if r["id"] == "old1")
    assert got["old1"]["prompts"] == old1["prompts"] + old1["more"]
    assert got["old1"]["answers"][0] == old1["answers"][0] and len(got["old1"]["answers"]) == 2


def test_a_failed_regeneration_keeps_every_finished_conversation(tmp_path, monkeypatch):
    """Regeneration that fails (or is stopped by Ctrl-C) after 3 conversations, before its first flush: the
    3 are written, and the stage trains on them."""
    import train.stage as stage

    torch.set_num_threads(1)
    target, data = make_data(tmp_path)
    real = stage.FastGenerator.run

    minutes_then = []

    def failing(self, convs, on_done, **kw):
        n = []

        def done(ans):
            on_done(ans)
            n.append(1)
            if len(n) == 2:  # flushed once (--flush-every 2): a SIGKILL here would count the run's minutes
                minutes_then.append(json.loads((tmp_path / "o" / "stage.json").read_text())["minutes"])
            if len(n) == 3:
                raise RuntimeError("CUDA out of memory")

        return real(self, convs, done, **kw)

    monkeypatch.setattr(stage.FastGenerator, "run", failing)
    s = run(target, data, tmp_path / "o", "--stop-after", "train", "--flush-every", "2")
    assert minutes_then[0] > 0
    assert "out of memory" in s["phases"]["regen"]["error"]
    kept = answers.read_records(tmp_path / "o" / ANSWERS)
    assert len(kept) == 3 and s["phases"]["train"]["samples"] == len(
        {r["id"] for r in kept} | {"old0", "old1"}
    )


def test_a_rerun_answers_the_conversations_an_uninterrupted_run_would(tmp_path):
    """Regeneration stopped after some conversations (here: --max-conversations 2), then rerun: the rerun goes
    on down the same shuffled order (it shuffled what was left, and answered other conversations)."""
    torch.set_num_threads(1)
    target, data = make_data(tmp_path)
    once, twice = tmp_path / "once", tmp_path / "twice"
    run(target, data, once, "--max-conversations", "6", "--stop-after", "regen")
    run(target, data, twice, "--max-conversations", "2", "--stop-after", "regen")
    assert len(answers.read_records(twice / ANSWERS)) == 2
    (twice / "stage.json").unlink()  # (so that the rerun regenerates again, as after an interruption)
    run(target, data, twice, "--max-conversations", "6", "--stop-after", "regen")
    ids = [{r["id"] for r in answers.read_records(p / ANSWERS)} for p in (once, twice)]
    assert len(ids[0]) == 6 and ids[0] == ids[1]


def kill_training_at(n: int, monkeypatch):
    """The stage's n-th training step raises ("killed"); returns a function that undoes it."""
    import train.stage as stage

    real, calls = stage.dense_step_sums, []

    def killed_at_n(*a, **kw):
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError("killed")
        return real(*a, **kw)

    monkeypatch.setattr(stage, "dense_step_sums", killed_at_n)
    return lambda: monkeypatch.setattr(stage, "dense_step_sums", real)


def test_interrupted_training_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    import train.stage as stage

    target, data = make_data(tmp_path)
    out = tmp_path / "o"
    revive = kill_training_at(5, monkeypatch)
    seen, killing = [], stage.dense_step_sums

    def watched(*a, **kw):  # stage.json's minutes at each step: saved with each checkpoint (a SIGKILL's run)
        seen.append(json.loads((out / "stage.json").read_text())["minutes"])
        return killing(*a, **kw)

    monkeypatch.setattr(stage, "dense_step_sums", watched)
    with pytest.raises(RuntimeError, match="killed"):
        run(target, data, out, "--checkpoint-seconds", "0", "--max-conversations", "5")
    assert len(seen) == 5 and seen[4] > seen[1] > seen[0]
    killed = json.loads((out / "stage.json").read_text())
    assert (out / "train_state.pt").is_file() and set(killed["phases"]) == {"regen"}
    assert killed["minutes"] > 0  # the killed run's minutes count (they were added at a run's end only)
    revive()
    (out / "train_state.pt.tmp-1-0000abcd").write_bytes(
        b"half"
    )  # a save a SIGKILL cut short: never read, removed
    s = run(target, data, out, "--checkpoint-seconds", "0")
    tr = s["phases"]["train"]
    assert (tr["steps"], tr["steps_this_run"]) == (6, 2) and s["phases"]["regen"]["conversations"] == 5
    assert s["runs"] == 2 and s["minutes"] > killed["minutes"]
    assert [json.loads(x)["step"] for x in (out / "train_log.jsonl").read_text().splitlines()] == [2, 4, 6]
    assert not (out / "train_state.pt").exists() and not list(out.glob("*.tmp-*"))


def test_eagle31_stage_carries_an_eagle3_draft(tmp_path):
    """--eagle-3.1 with an EAGLE-3 --init-draft: the stage's draft has that draft's weights (no steps) plus
    fc_norm at its features' scale and norm_output, stage.json names the variants, and both drafts are scored."""
    from safetensors.torch import load_file

    from eagle3.draft import load_draft

    torch.set_num_threads(1)
    target, data = make_data(tmp_path)
    s1, s2 = tmp_path / "s1", tmp_path / "s2"
    run(target, data, s1, "--max-conversations", "3", "--max-steps", "2")
    s = run(
        target,
        data,
        s2,
        "--init-draft",
        str(s1),
        "--eagle-3.1",
        "--max-conversations",
        "1",
        "--max-steps",
        "0",
    )
    a, b = (load_file(str(p / "draft" / "model.safetensors")) for p in (s1, s2))
    assert set(b) - set(a) == {f"fc_norm.{i}.weight" for i in range(3)}
    assert all(torch.equal(a[k], b[k]) for k in a)
    scales = [b[f"fc_norm.{i}.weight"] for i in range(3)]  # each aux layer's feature scale (scale_fc_norms)
    assert all(bool((w == w[0]).all()) and float(w[0]) > 0 and float(w[0]) != 1.0 for w in scales)
    cfg = load_draft(s2 / "draft").config
    assert cfg.fc_norm and cfg.norm_output
    assert s["phases"]["train"]["norm_variants"] == ["fc_norm", "norm_output"]
    check_scored_against_init(s["phases"]["score"])


def test_training_does_not_resume_with_the_variant_changed(tmp_path, monkeypatch):
    import train.stage as stage

    torch.set_num_threads(1)
    target, data = make_data(tmp_path)
    out = tmp_path / "o"
    revive = kill_training_at(3, monkeypatch)
    with pytest.raises(RuntimeError, match="killed"):
        run(target, data, out, "--checkpoint-seconds", "0", "--max-conversations", "3", "--eagle-3.1")
    revive()
    with pytest.raises(
        stage.StageError, match=r"train_state.pt: its draft has the tensors \['fc_norm.0.weight'"
    ):
        run(target, data, out, "--checkpoint-seconds", "0")
    s = run(target, data, out, "--checkpoint-seconds", "0", "--eagle-3.1")
    assert s["phases"]["train"]["steps"] == 6 and s["phases"]["train"]["norm_variants"] == [
        "fc_norm",
        "norm_output",
    ]


def test_grow_vocab_stage_carries_the_draft_and_resumes_only_grown(tmp_path, monkeypatch):
    """--grow-vocab N from an --init-draft: the stage's draft has N tokens, the init draft's among them with
    their lm_head rows (no steps: unchanged), the new ones' rows at zero; stage.json says N. A training
    checkpoint resumes only with the same --grow-vocab; without --init-draft, or below its size, it is an
    error."""
    from safetensors.torch import load_file

    from eagle3.draft import load_draft
    from train.stage import StageError

    torch.set_num_threads(1)
    target, data = make_data(tmp_path)
    s1, s2, s3 = tmp_path / "s1", tmp_path / "s2", tmp_path / "s3"
    run(target, data, s1, "--max-conversations", "3", "--max-steps", "2")
    s = run(target, data, s2, "--init-draft", str(s1), "--grow-vocab", "160", "--max-conversations", "1",
            "--max-steps", "0")  # fmt: skip
    assert s["phases"]["train"]["draft_vocab_size"] == 160
    a, b = load_draft(s1 / "draft"), load_draft(s2 / "draft")
    old, new = a.draft_to_target_ids.tolist(), b.draft_to_target_ids.tolist()
    assert set(old) < set(new) and len(new) == 160
    wa, wb = (load_file(str(p / "draft" / "model.safetensors")) for p in (s1, s2))
    rows = {t: i for i, t in enumerate(new)}
    assert torch.equal(wb["lm_head.weight"][[rows[t] for t in old]], wa["lm_head.weight"])
    assert not wb["lm_head.weight"][[rows[t] for t in set(new) - set(old)]].any()
    assert all(torch.equal(wa[k], wb[k]) for k in wa if k not in ("d2t", "t2d", "lm_head.weight"))
    check_scored_against_init(s["phases"]["score"])

    revive = kill_training_at(3, monkeypatch)
    grow = ["--init-draft", str(s1), "--checkpoint-seconds", "0", "--max-conversations", "1"]
    with pytest.raises(RuntimeError, match="killed"):
        run(target, data, s3, *grow, "--grow-vocab", "160")
    revive()
    with pytest.raises(StageError, match=r"train_state.pt: its draft has 160 tokens, this run's 128"):
        run(target, data, s3, *grow)
    assert run(target, data, s3, *grow, "--grow-vocab", "160")["phases"]["train"]["steps"] == 6
    with pytest.raises(StageError, match="grows an --init-draft's vocabulary"):
        run(target, data, tmp_path / "s4", "--grow-vocab", "160")
    with pytest.raises(StageError, match="--grow-vocab 100: the init draft has 128 tokens"):
        run(target, data, tmp_path / "s5", "--init-draft", str(s1), "--grow-vocab", "100")
    assert not (tmp_path / "s5" / ANSWERS).exists()  # refused before any regeneration


def test_profile_steps_write_what_bounds_each_phase(tmp_path, monkeypatch):
    """--profile-steps N: N decode steps and N training steps (after the first PROFILE_SKIP) profiled, their
    per-step wall time and top ops in stage.json; ops that run every step are among them."""
    import train.stage

    torch.set_num_threads(1)
    monkeypatch.setattr(train.stage, "PROFILE_SKIP", 2)
    target, data = make_data(tmp_path)
    s = run(target, data, tmp_path / "p", "--profile-steps", "3", "--max-conversations", "6")
    for phase in ("regen", "train"):
        prof = s["phases"][phase]["profile"]
        assert prof["steps"] == 3 and prof["wall_ms"] > 0 and prof["cpu_ms"] > 0, (phase, prof)
        names = [o["name"] for o in prof["ops"]]
        assert len(names) == 15 and all(o["self_cpu_ms"] >= 0 for o in prof["ops"])
        assert any(n.startswith(("aten::mm", "aten::addmm", "aten::bmm", "aten::linear")) for n in names), (
            names
        )
    assert "profile" not in run(target, data, tmp_path / "q", "--max-conversations", "2")["phases"]["regen"]


def test_a_failing_profiler_reports_and_never_stops_the_loop(monkeypatch):
    """No CUPTI on a lent machine must not cost its minutes: the profiler turns itself off and says why."""
    import train.profiling as tp

    class Broken:
        def __init__(self, *a, **kw):
            pass

        def start(self):
            pass

        def step(self):
            raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

        def stop(self):
            raise AssertionError("not reached: the profiler is off after its error")

    monkeypatch.setattr(tp, "profile", Broken)
    prof = tp.StepProfiler(2, 3, torch.device("cpu"))
    for _ in range(10):
        prof.step()
    assert prof.summary() == {"error": "RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"}
    assert "failed" in tp.describe("decode", prof.summary())
    assert tp.StepProfiler(2, 0, torch.device("cpu")).summary() is None  # off


def test_a_ctrl_c_or_a_failure_while_loading_counts_the_run_and_its_minutes(tmp_path, monkeypatch):
    """The budget's clock runs from the command's start: a Ctrl-C while the target loads (the device script's
    limit), or a failed load, counted neither the run nor its time."""
    import train.stage as stage_mod

    target, data = make_data(tmp_path)
    out = tmp_path / "o"
    out.mkdir()
    (out / "stage.json").write_text(json.dumps({"phases": {}, "runs": 1, "minutes": 2.5}))

    for runs, stop in enumerate((KeyboardInterrupt, RuntimeError("CUDA out of memory")), start=2):

        def interrupted(*a, stop=stop, **kw):
            time.sleep(0.1)  # a load under way
            raise stop

        monkeypatch.setattr(stage_mod, "load_target", interrupted)
        with pytest.raises(BaseException) as e:
            run(target, data, out)
        assert isinstance(e.value, KeyboardInterrupt | RuntimeError)
        s = json.loads((out / "stage.json").read_text())
        assert s["runs"] == runs and s["minutes"] > 2.5 + 0.0015 * (runs - 2)


def test_a_ctrl_c_in_training_saves_the_state_and_the_draft(tmp_path, monkeypatch):
    """A Ctrl-C (the device script's hang guard) during training ends that step, saves the training state
    and the draft, then stops: nothing was saved before the next --checkpoint-seconds (60 s by default), so
    a rerun started training over and a machine gone cold returned no draft."""
    import os
    import signal

    import train.stage as stage

    torch.set_num_threads(1)
    target, data = make_data(tmp_path)
    out = tmp_path / "o"
    real, calls = stage.dense_step_sums, []

    def ctrl_c_at_3(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **kw)

    monkeypatch.setattr(stage, "dense_step_sums", ctrl_c_at_3)
    with pytest.raises(KeyboardInterrupt):
        run(target, data, out, "--max-conversations", "3")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back
    assert torch.load(out / "train_state.pt", weights_only=True)["step"] == 3
    assert json.loads((out / "draft" / "training.json").read_text())["interrupted"] is True
    steps = lambda: [json.loads(x)["step"] for x in (out / "train_log.jsonl").read_text().splitlines()]  # noqa: E731
    assert steps() == [2, 3]  # the step after the last record is logged too (a 9-step run had no log)
    monkeypatch.setattr(stage, "dense_step_sums", real)
    s = run(target, data, out)
    assert (s["phases"]["train"]["steps"], s["phases"]["train"]["steps_this_run"]) == (6, 3)
    assert steps() == [2, 3, 4, 6] and (out / "curve.png").is_file()
    assert "interrupted" not in json.loads((out / "draft" / "training.json").read_text())


def test_training_resumes_only_on_its_vocabulary_and_samples(tmp_path, monkeypatch):
    """A checkpoint of a draft of another vocabulary of the same size (another --init-draft) trained against
    the first run's target rows without a word; one of other samples (another --data) resumed at a position
    of another batch list."""
    from eagle3.draft import load_draft, save_draft
    from train.samples import draft_vocab_from
    from train.stage import StageError

    torch.set_num_threads(1)
    target, data = make_data(tmp_path)
    run(target, data, tmp_path / "a", "--max-conversations", "3", "--max-steps", "2")
    other = load_draft(tmp_path / "a" / "draft")
    g = torch.Generator().manual_seed(5)
    samples = [
        {"input_ids": torch.randint(8, 512, (40,), generator=g), "loss_mask": torch.ones(40)}
        for _ in range(8)
    ]
    other.set_vocab(*draft_vocab_from(samples, 512, 128)[:2])
    assert not torch.equal(other.d2t, load_draft(tmp_path / "a" / "draft").d2t)
    save_draft(other, tmp_path / "b")
    out = tmp_path / "o"
    revive = kill_training_at(3, monkeypatch)
    first = ["--checkpoint-seconds", "0", "--max-conversations", "3"]
    with pytest.raises(RuntimeError, match="killed"):
        run(target, data, out, *first, "--init-draft", str(tmp_path / "a"))
    revive()
    with pytest.raises(StageError, match=r"train_state.pt: its draft vocabulary is not this run's"):
        run(target, data, out, *first, "--init-draft", str(tmp_path / "b"))
    more = tmp_path / "more.jsonl.xz"
    answers.write(more, [{"id": "x0", "prompts": [[9, 10, 11]], "answers": [[12, 13, 2]]}])
    with pytest.raises(StageError, match=r"train_state.pt: trained on other samples than this run's"):
        run(target, data, out, *first, "--init-draft", str(tmp_path / "a"), "--data", str(more))
    assert (
        run(target, data, out, *first, "--init-draft", str(tmp_path / "a"))["phases"]["train"]["steps"] == 6
    )


def test_with_max_steps_the_lr_follows_the_steps(tmp_path):
    """The LR's cosine ran over the share of the time budget spent, even with --max-steps: two runs of the
    same steps had other learning rates (2.4e-4 apart in an A/B pair). With --max-steps it follows the steps."""
    from train.fastfit import TimeSchedule

    torch.set_num_threads(1)
    target, data = make_data(tmp_path)
    out = tmp_path / "s"
    run(target, data, out, "--max-conversations", "2", "--warmup", "2", "--log-every", "1", "--lr", "1e-3")
    lrs = [json.loads(x)["lr"] for x in (out / "train_log.jsonl").read_text().splitlines()]
    sched = TimeSchedule(2)
    assert lrs == [pytest.approx(1e-3 * sched(s, s / 6), rel=1e-12) for s in range(6)]
    assert lrs[-1] < 0.3e-3  # the cosine ran down within the 6 steps, not over the 5 minutes
