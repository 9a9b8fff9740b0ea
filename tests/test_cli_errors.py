"""Bad inputs a new user meets, each stopped with one line that names the file, line, key or option
(maverick/cli.py), before any work where that is possible; and the decoders' out-of-range counts."""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.draft import load_draft
from eagle3.spec import SpecDecoder, TreeConfig
from maverick.cli import UserError, read_utf8, run_cli
from maverick.generate import Decoder, Generation
from tests.test_draft import make
from tests.test_spec import make_draft, make_target

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def target():
    return make_target()


def exit_status(main, argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        run_cli(main, argv)
    return e.value.code, capsys.readouterr().err


# ---- the mechanism ----


def test_run_cli_user_error_is_one_line_and_status_2(capsys, monkeypatch):
    monkeypatch.delenv("MAVERICK_DEBUG", raising=False)

    def main(argv):
        raise UserError(f"{argv[0]}: line 3: bad\n  (wrapped)")

    code, err = exit_status(main, ["f.jsonl"], capsys)
    assert code == 2 and err == "error: f.jsonl: line 3: bad (wrapped)\n"
    code, err = exit_status(lambda argv: open(argv[0]), ["/no/such/file"], capsys)
    assert code == 2 and err == "error: /no/such/file: No such file or directory\n"
    with pytest.raises(UserError):  # --debug: the traceback, and main never sees the flag
        run_cli(main, ["f.jsonl", "--debug"])
    monkeypatch.setenv("MAVERICK_DEBUG", "1")
    with pytest.raises(UserError):
        run_cli(main, ["f.jsonl"])
    monkeypatch.delenv("MAVERICK_DEBUG")

    def bug(argv):
        raise KeyError(100)

    with pytest.raises(KeyError):  # a bug keeps its traceback
        run_cli(bug, [])
    assert exit_status(lambda argv: 1, [], capsys)[0] == 1
    assert exit_status(lambda argv: {"summary": 1}, [], capsys)[0] == 0


def _main_calls(path: Path) -> list[str]:
    """The statements under `if __name__ == "__main__":` of a module, as source."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return [ast.unparse(s) for s in node.body]
    return []


def test_every_entry_point_runs_through_run_cli():
    mains = [
        p
        for d in ("maverick", "eagle3", "eval", "train")
        for p in sorted((ROOT / d).glob("*.py"))
        if _main_calls(p)
    ]
    assert (
        len(mains) >= 9
    )  # generate, bench, acceptance, compare_runs, bench_fp8_gemm, dump, fit, regenerate, datastore
    # the commands that continue where they stopped when run again: their Ctrl-C line says how
    resumable = {"train.dump", "train.fit", "train.regenerate", "train.stage"}
    for p in mains:
        calls = [c for c in _main_calls(p) if re.match(r"run_cli\(main(\)|, resume=)", c)]
        assert len(calls) == 1, f"{p.relative_to(ROOT)}: __main__ does not call run_cli(main)"
        module = f"{p.parent.name}.{p.stem}"
        assert ("resume=" in calls[0]) == (module in resumable), f"{module}: {calls[0]}"


# ---- out-of-range counts ----


@pytest.mark.parametrize(
    "module, argv, option",
    [
        ("maverick.generate", ["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
        ("maverick.generate", ["--prompt", "hi", "--max-new-tokens", "-3"], "--max-new-tokens"),
        ("eval.bench", ["--max-new-tokens", "0"], "--max-new-tokens"),
        ("eval.acceptance", ["--draft", "d", "--steps", "0"], "--steps"),
        ("train.regenerate", ["--out", "x.jsonl", "--max-new-tokens", "0"], "--max-new-tokens"),
    ],
)
def test_counts_below_one_are_refused_before_work(module, argv, option, capsys):
    import importlib

    code, err = exit_status(importlib.import_module(module).main, argv, capsys)
    assert code == 2 and f"argument {option}: must be >= 1, got" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--q4", "--compile"], "use --engine compiled with --q4"),
        (["--q4", "--engine", "compiled", "--dtype", "fp32"], "add --dtype bf16"),
    ],
)
def test_generate_q4_engine_combinations_refused_before_loading(argv, says, capsys):
    """--q4 runs on the compiled engine in bf16 only; the other combinations stop before any model loads."""
    from maverick import generate

    code, err = exit_status(generate.main, ["--prompt", "hi", *argv], capsys)
    assert code == 2 and says in err and "Traceback" not in err


def test_generate_takes_threads(monkeypatch, capsys):
    """--threads N sets torch's CPU threads before the model loads, as in every other command; N < 1 is the
    one-line argparse error. (maverick.generate had no --threads: an unknown option.)"""
    from maverick import generate, parallel

    class Loading(Exception):
        pass

    seen = []

    def load_model(*args, **kwargs):
        seen.append(torch.get_num_threads())
        raise Loading

    before = torch.get_num_threads()
    n = 2 if before == 1 else 1  # a count other than the current one, so that setting it shows
    monkeypatch.setattr(parallel, "load_model", load_model)
    try:
        with pytest.raises(Loading):
            generate.main(["--prompt", "hi", "--threads", str(n)])
    finally:
        torch.set_num_threads(before)
    assert seen == [n]
    code, err = exit_status(generate.main, ["--prompt", "hi", "--threads", "0"], capsys)
    assert code == 2 and err == (
        "error: argument --threads: must be >= 1, got 0 (python -m maverick.generate --help for usage)\n"
    )


def test_decoders_emit_nothing_for_zero_new_tokens_and_refuse_negative(target):
    prompt = [[5, 9, 2, 7, 11]]
    eos = target.config.eos_ids
    for dec in (
        Decoder(target, max_len=64),
        SpecDecoder(target, make_draft(target), max_len=128),
        SpecDecoder(target, make_draft(target), max_len=128, tree=TreeConfig(2, 2, 4)),
    ):
        g = dec.generate(prompt, 0, stop_ids=eos)
        assert isinstance(g, Generation) and g.tokens == [[]] and g.new_tokens == 0
        assert len(dec.generate(prompt, 1, stop_ids=()).tokens[0]) == 1  # the control: 1 means one
        with pytest.raises(ValueError, match="max_new_tokens must be >= 0, got -1"):
            dec.generate(prompt, -1)


def test_prompt_over_the_targets_context_is_refused(target):
    ctx = target.config.max_position_embeddings
    long = [[3] * (ctx + 10)]
    spec = SpecDecoder(target, make_draft(target), max_len=ctx + 200)
    for dec in (Decoder(target, max_len=ctx + 200), spec):
        with pytest.raises(UserError, match=rf"prompt is {ctx + 10} tokens; .*context of {ctx} tokens"):
            dec.generate(long, 4)


def test_generate_cli_prompt_over_the_context(capsys):
    from maverick import generate

    code, err = exit_status(generate.main, ["--prompt", "word " * 9000, "--max-new-tokens", "4"], capsys)
    assert code == 2
    assert err.startswith("error: --prompt is 9") and "past the target's context of 8192 tokens" in err


def test_aux_layer_past_the_target_is_refused_at_construction(target):
    draft = make_draft(target)
    draft.config.feature_layers = (1, 2, 100)
    L = target.config.num_hidden_layers
    with pytest.raises(
        UserError,
        match=rf"eagle_aux_hidden_state_layer_ids \[1, 2, 100\].*\[100\] outside the target's {L} layers",
    ):
        SpecDecoder(target, draft)
    from eagle3.draft import check_feature_layers

    check_feature_layers((0, 2, L), L)  # the state after the last layer (index L) is a feature too
    with pytest.raises(
        UserError, match=r"^--feature-layers \[2, 99\] name layer\(s\) \[99\] outside the target's 30"
    ):
        check_feature_layers((2, 99), 30, "--feature-layers")  # train.dump's option


# ---- eval.bench: prompts over --max-prompt-tokens ----


def test_bench_refuses_a_long_prompt_before_loading_models(tmp_path, capsys):
    from eval import bench

    f = tmp_path / "p.jsonl"
    f.write_text(
        json.dumps({"id": "short", "prompt": "Hi."})
        + "\n"
        + json.dumps({"id": "long", "prompt": "word " * 200})
        + "\n"
    )
    argv = ["--bench", "jsonl", "--prompts", str(f), "--methods", "ours-plain", "--max-prompt-tokens", "64",
            "--turns", "1", "--out", str(tmp_path / "r")]  # fmt: skip
    code, err = exit_status(bench.main, argv, capsys)
    assert (
        code == 2
        and err.startswith("error: --bench jsonl: prompt long turn 1 is 2")
        and "--long-prompts truncate" in err
    )
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("method", ["eagle3-k", "eagle3-fast", "eagle3-tuned+store", "ours-plain+q8"])
def test_bench_refuses_an_unknown_method_before_loading_models(method, tmp_path, capsys, monkeypatch):
    from eval import bench

    def no_load(*a, **kw):
        raise AssertionError("a model was loaded before the method names were checked")

    monkeypatch.setattr(bench, "load_target", no_load)
    monkeypatch.setattr(bench, "load_model", no_load)
    monkeypatch.setattr(bench, "load_target_tokenizer", no_load)
    argv = ["--methods", f"ours-plain,{method}", "--n", "1", "--out", str(tmp_path / "r")]
    code, err = exit_status(bench.main, argv, capsys)
    assert code == 2 and err.startswith("error: ") and ("unknown method" in err or "+lookup+store" in err)
    assert not (tmp_path / "r").exists()


def test_bench_truncation_is_explicit_and_counted():
    from types import SimpleNamespace

    from eval.bench import fit_prompt

    cut: list[str] = []
    args = SimpleNamespace(max_prompt_tokens=4, long_prompts="truncate")
    assert fit_prompt([1, 2, 3], args, "a", cut) == [1, 2, 3] and cut == []
    assert fit_prompt([1, 2, 3, 4, 5, 6], args, "b", cut) == [3, 4, 5, 6] and cut == ["b"]
    with pytest.raises(UserError, match="b: 6 tokens, over --max-prompt-tokens 4"):
        fit_prompt([1, 2, 3, 4, 5, 6], SimpleNamespace(max_prompt_tokens=4, long_prompts="error"), "b", [])


# ---- files that are not what they claim ----


def test_non_utf8_chat_and_prompt_files_name_the_file_and_line(tmp_path):
    from eval.prompts import load_jsonl_prompts
    from train.data import load_chats

    good = json.dumps(
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    )
    f = tmp_path / "chats.jsonl"
    f.write_bytes((good + "\n" + good + "\n").encode() + b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(UserError, match=rf"{f}: line 3, byte 16 of the line: not UTF-8 \(0xe9\)"):
        load_chats(f)
    with pytest.raises(UserError, match=rf"{f}: line 3, byte 16"):
        load_jsonl_prompts(f)
    f.write_bytes(f.read_bytes().replace(b"\xe9", "\u00e9".encode()))  # the control: the same text in UTF-8
    assert read_utf8(f).endswith('"caf\u00e9"}\n') and len(load_jsonl_prompts(f)) == 3


def test_truncated_draft_weights_name_the_path(tmp_path):
    _, path = make(tmp_path)
    w = path / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-1000])
    with pytest.raises(UserError, match=rf"{w}: not a readable safetensors file .*truncated or corrupt"):
        load_draft(path)


def test_invalid_draft_config_names_the_path_and_line(tmp_path):
    _, path = make(tmp_path)
    c = path / "config.json"
    c.write_text(c.read_text().replace('"num_hidden_layers": 1,', '"num_hidden_layers": 1'))
    with pytest.raises(UserError, match=rf"{c}: invalid JSON: Expecting ',' delimiter \(line \d+"):
        load_draft(path)
    c.write_text("[1, 2]")
    with pytest.raises(UserError, match=rf"{c}: expected a JSON object"):
        load_draft(path)


def test_two_draft_ids_on_one_target_token_are_refused(tmp_path):
    _, path = make(tmp_path)
    sd = load_file(str(path / "model.safetensors"))
    d2t = sd["d2t"].clone()
    ids = torch.arange(len(d2t)) + d2t
    d2t[6] = ids[5] - 6  # draft ids 5 and 6 both map to ids[5]; t2d's count still equals the draft vocab
    save_file(dict(sd, d2t=d2t), str(path / "model.safetensors"))
    with pytest.raises(
        UserError, match=rf"d2t maps draft ids \[5, 6\] to the same target token {int(ids[5])}"
    ):
        load_draft(path)


# ---- train.regenerate: answers that are empty ----


def test_regenerate_skips_and_records_empty_answers(target, tmp_path, monkeypatch):
    import train.regenerate as regen
    from maverick.tokenizer import load_tokenizer
    from train.data import load_chats

    tok = load_tokenizer()

    class EOSFirst(Decoder):
        """The target whose first token is EOS for the first conversation (others answer 'Hi.')."""

        def generate(self, prompts, max_new_tokens, sampling=None, stop_ids=(), *a, **kw):
            eos = stop_ids[0]
            first = [p for p in prompts if tok.decode(p).count("Say nothing")]
            rows = [[eos] if p in first else tok.encode("Hi.") + [eos] for p in prompts]
            return Generation(rows, [len(p) for p in prompts], 0.0, 0.0)

    monkeypatch.setattr(regen, "Decoder", EOSFirst)
    monkeypatch.setattr(regen, "load_model", lambda *a, **kw: target)  # the answers are scripted above
    convs = [{"id": f"c{i}", "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "x"},
                                         {"role": "user", "content": "And then?"}]}
             for i, q in enumerate(["Say nothing.", "Say hi."])]  # fmt: skip
    out = tmp_path / "chats.jsonl"
    stats = regen.regenerate(
        convs, out, turns=2, max_new_tokens=8, max_prompt_tokens=64, batch_size=2, dtype=torch.float32
    )
    assert stats["empty_answers"] == 1
    chats = load_chats(out)  # what is written loads: no empty turn
    assert [c["id"] for c in chats] == ["c1"] and [m["content"] for m in chats[0]["messages"]][1::2] == [
        "Hi.",
        "Hi.",
    ]
    skipped = [json.loads(x) for x in regen.skipped_path(out).read_text().splitlines()]
    assert (
        skipped == [{"id": "c0", "turn": 1, "reason": skipped[0]["reason"]}]
        and "empty answer" in skipped[0]["reason"]
    )
    assert (
        regen.regenerate(
            convs, out, turns=2, max_new_tokens=8, max_prompt_tokens=64, batch_size=2, dtype=torch.float32
        )["conversations"]
        == 0
    )


@pytest.mark.skipif(os.name != "posix", reason="paths")
def test_acceptance_and_bench_refuse_a_draft_of_another_target_before_answering(tmp_path, capsys):
    from eval import acceptance, bench

    _, tiny = make(tmp_path / "tiny")  # a tiny draft: not the SmolLM2 target's
    code, err = exit_status(acceptance.main, ["--draft", str(tiny), "--n", "1"], capsys)
    assert code == 2 and err == (
        f"error: {tiny}/config.json: vocab_size=512, but the target's vocabulary is 49152: a draft of another target\n"
    )
    argv = ["--draft", str(tiny), "--n", "1", "--methods", "eagle3-k3", "--out", str(tmp_path / "r")]
    code, err = exit_status(bench.main, argv, capsys)
    assert code == 2 and f"{tiny}/config.json: vocab_size=512" in err
    shipped = ROOT / "eagle3/drafts/smollm2-135m-instruct"
    path = tmp_path / "draft"  # the shipped draft with an aux layer past the target's 30
    path.mkdir()
    (path / "model.safetensors").symlink_to(shipped / "model.safetensors")
    c = json.loads((shipped / "config.json").read_text())
    c["eagle_aux_hidden_state_layer_ids"], c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = (
        [2, 15, 99],
        [1, 14, 98],
    )
    (path / "config.json").write_text(json.dumps(c))
    code, err = exit_status(acceptance.main, ["--draft", str(path), "--n", "1"], capsys)
    assert code == 2 and "[99] outside the target's 30 layers" in err and f"{path}/config.json" in err


# ---- every numeric option is checked by argparse ----

ENTRY_POINTS = [
    "maverick.generate", "maverick.parallel", "eval.acceptance", "eval.bench", "eval.bench_engine",
    "eval.bench_fp8_gemm", "eval.compare_runs", "eval.quality", "eagle3.generate", "train.datastore", "train.dump", "train.fit",
    "train.regenerate", "train.stage", "train.stage_data",
]  # fmt: skip


class _Parsed(Exception):
    pass


def entry_point_parser(module: str, monkeypatch):
    """The argparse parser that `module.main` builds, caught at its first parse (nothing runs)."""
    import argparse
    import importlib

    seen = []

    def catch(self, *a, **kw):
        seen.append(self)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", catch)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(_Parsed):
        importlib.import_module(module).main([])
    monkeypatch.undo()
    return seen[0]


def test_entry_points_are_the_modules_with_a_main():
    found = {
        f"{p.parent.name}.{p.stem}"
        for d in ("maverick", "eagle3", "eval", "train")
        for p in (ROOT / d).glob("*.py")
        if _main_calls(p) and p.stem != "cli"
    }
    assert found == set(ENTRY_POINTS)


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_a_command_line_mistake_is_one_line_naming_the_command(module, capsys):
    """An unknown option (or a missing required one, which argparse reports first) is one line on stderr,
    exit status 2, naming the command as typed; argparse alone printed its usage block (8-29 lines) first,
    under the script's file name for some commands. --help is still argparse's usage, under that name."""
    import importlib

    main = importlib.import_module(module).main
    code, err = exit_status(main, ["--no-such-option"], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert err.endswith(f" (python -m {module} --help for usage)\n"), err
    assert "usage:" not in err
    with pytest.raises(SystemExit) as e:
        run_cli(main, ["--help"])
    out, err = capsys.readouterr()
    assert e.value.code == 0 and err == "" and out.startswith(f"usage: python -m {module} ")
    assert "options:" in out and "--help" in out  # the whole help, as argparse writes it


@pytest.mark.parametrize(
    "module, argv, says",
    [
        ("maverick.generate", [], "the following arguments are required: --prompt"),
        ("eagle3.generate", ["--prompt", "hi", "--k", "0"], "argument --k: must be >= 1, got 0"),
        ("eagle3.generate", ["--prompt", "hi", "--k", "2", "--tree", "3,4,12"],
         "argument --tree: not allowed with argument --k"),
        ("train.fit", ["--out", "o"], "one of the arguments --dumps --online is required"),
        ("train.regenerate", ["--out", "x.jsonl", "--max-samples"], "argument --max-samples: expected one argument"),
        ("eval.bench", ["--n", "3", "extra"], "unrecognized arguments: extra"),
    ],
)  # fmt: skip
def test_argparse_errors_are_exactly_one_line(module, argv, says, capsys):
    import importlib

    code, err = exit_status(importlib.import_module(module).main, argv, capsys)
    assert code == 2 and err == f"error: {says} (python -m {module} --help for usage)\n"


def test_an_invalid_choice_is_one_line(capsys):
    from maverick import generate

    code, err = exit_status(generate.main, ["--prompt", "hi", "--engine", "fast"], capsys)
    choices = r"\(choose from '?eager'?, '?compiled'?\)"  # quoted or not by the Python version
    usage = r"\(python -m maverick\.generate --help for usage\)"
    assert code == 2 and re.fullmatch(
        rf"error: argument --engine: invalid choice: 'fast' {choices} {usage}\n", err
    )


@pytest.mark.parametrize(
    "command, prog",
    [
        (["-m", "eagle3.generate", "--prompt", "hi", "--k", "0"], "python -m eagle3.generate"),
        (["scripts/gpu_decode.py", "--n", "x"], "python scripts/gpu_decode.py"),
    ],
)
def test_a_command_line_mistake_is_one_line_in_a_real_process(command, prog):
    """The whole command as a user runs it: one line on stderr, nothing on stdout, exit status 2."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, *command], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: argument "), r.stderr
    assert r.stderr.endswith(f" ({prog} --help for usage)\n"), r.stderr


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_no_numeric_option_takes_any_number(module, monkeypatch):
    """Every int or float option has a checked type (maverick.cli), so an out-of-range value is one argparse
    error before any model loads, not a traceback from deep inside."""
    parser = entry_point_parser(module, monkeypatch)
    options = [a for a in parser._actions if a.option_strings]
    assert len(options) >= 3  # the control: the parser was caught whole
    bare = [a.option_strings[0] for a in options if a.type in (int, float)]
    assert not bare, f"{module}: options with an unchecked int/float type: {bare}"


@pytest.mark.parametrize(
    "module, argv, says",
    [
        ("maverick.generate", ["--prompt", "hi", "--temperature", "-1"], "--temperature: must be a finite number in [0, inf), got -1"),
        ("maverick.generate", ["--prompt", "hi", "--temperature", "nan"], "--temperature: must be a finite number"),
        ("maverick.generate", ["--prompt", "hi", "--top-p", "2"], "--top-p: must be a finite number in (0, 1], got 2"),
        ("maverick.generate", ["--prompt", "hi", "--top-k", "-2"], "--top-k: must be >= 0, got -2"),
        ("eval.bench", ["--bench", "nosuch"], "--bench: invalid choice: 'nosuch'"),
        ("eval.bench", ["--n", "0"], "--n: must be >= 1, got 0"),
        ("eval.bench", ["--threads", "-1"], "--threads: must be >= 1, got -1"),
        ("eval.bench_engine", ["--rows", "2,x"], "--rows: 'x' is not an integer"),
        ("train.dump", ["--out", "d", "--feature-layers", "a,b"], "--feature-layers: 'a' is not an integer"),
        ("train.dump", ["--out", "d", "--heldout-fraction", "1"], "--heldout-fraction: must be a finite number in [0, 1), got 1"),
        ("train.regenerate", ["--out", "x", "--device", "foo"], "--device: 'foo' is not a torch device"),
        ("train.fit", ["--online", "--out", "f", "--lr", "-1"], "--lr: must be a finite number in (0, inf), got -1"),
        ("train.fit", ["--online", "--out", "f", "--min-lr-ratio", "2"], "--min-lr-ratio: must be a finite number in [0, 1], got 2"),
        ("train.stage", ["--minutes", "0", "--out", "o", "--data", "d"], "--minutes: must be a finite number in (0, inf), got 0"),
        ("train.datastore", ["--data", "d", "--out", "o", "--sizes", "0"], "--sizes: must be >= 1, got 0"),
        ("maverick.parallel", ["--world", "0"], "--world: must be >= 1, got 0"),
    ],
)  # fmt: skip
def test_out_of_range_values_are_refused_before_work(module, argv, says, capsys):
    import importlib

    code, err = exit_status(importlib.import_module(module).main, argv, capsys)
    assert code == 2 and says in err and "Traceback" not in err


def test_checked_types_accept_their_range():
    """The control of the test above: values inside each range pass through unchanged."""
    import argparse

    from maverick import cli

    assert cli.positive_float("2e-4") == 2e-4 and cli.nonnegative_float("0") == 0.0
    assert cli.share("0") == 0.0 and cli.share("1") == 1.0 and cli.heldout_fraction("0.02") == 0.02
    assert cli.top_p("1") == 1.0 and cli.int_list("2, 15,27") == [2, 15, 27]
    assert cli.positive_int_list("4,3") == [4, 3] and cli.device("cpu") == "cpu"
    for fn, text in [(cli.positive_float, "0"), (cli.share, "1.5"), (cli.top_p, "0"), (cli.int_list, ","),
                     (cli.positive_float, "inf"), (cli.device, "cuda:99" if torch.cuda.is_available() else "cuda")]:  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError):
            fn(text)


# ---- files and options that only a loader or a command can check ----


@pytest.mark.parametrize("content", [b"not a gguf", b""])
def test_a_file_that_is_not_gguf_is_one_line(content, tmp_path, capsys):
    from maverick import generate

    f = tmp_path / "model.gguf"
    f.write_bytes(content)
    code, err = exit_status(generate.main, ["--prompt", "hi", "--target", str(f)], capsys)
    assert code == 2 and err.startswith(f"error: {f}: not a readable GGUF file ({len(content)} bytes")


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("architectures", 3, "architectures must be a list of names, got 3"),
        ("hidden_size", "576", "hidden_size must be a positive integer, got '576'"),
        ("draft_vocab_size", True, "draft_vocab_size must be a positive integer, got True"),
        ("num_key_value_heads", 0, "num_key_value_heads must be a positive integer, got 0"),
        ("rope_theta", -1, "rope_theta must be a positive number, got -1"),
        ("rope_scaling", "yes", "rope_scaling must be a JSON object or null"),
        ("eagle_config", [1], "eagle_config must be a JSON object, got [1]"),
    ],
)
def test_draft_config_fields_of_the_wrong_type_name_the_field(key, value, says, tmp_path):
    _, path = make(tmp_path)
    c = path / "config.json"
    d = json.loads(c.read_text())
    load_draft(path)  # the control: the file as written loads
    c.write_text(json.dumps(d | {key: value}))
    with pytest.raises(UserError, match=re.escape(f"{c}: {says}")):
        load_draft(path)


def test_bench_options_that_need_another_are_refused_before_loading(tmp_path, capsys):
    from eval import bench

    out = ["--out", str(tmp_path / "r")]
    code, err = exit_status(bench.main, ["--bench", "jsonl", *out], capsys)
    assert code == 2 and "--bench jsonl needs --prompts FILE" in err
    code, err = exit_status(
        bench.main, ["--datastore", str(tmp_path), "--methods", "eagle3-tuned+lookup", *out], capsys
    )
    assert code == 2 and "--datastore is read by methods named <method>+lookup+store only" in err
    none = tmp_path / "none.safetensors"
    code, err = exit_status(
        bench.main, ["--datastore", str(none), "--methods", "eagle3-tuned+lookup+store", *out], capsys
    )
    assert code == 2 and f"{none}: no datastore for eagle3-tuned+lookup+store" in err
    assert not (tmp_path / "r").exists()


def test_bench_engine_refuses_a_cache_shorter_than_a_prompt(capsys, tmp_path):
    from eval import bench_engine

    out = tmp_path / "r"
    code, err = exit_status(
        bench_engine.main, ["--n", "1", "--max-len", "30", "--max-new-tokens", "4", "--out", str(out)], capsys
    )
    assert code == 2 and "--max-len 30 holds no 53-token prompt" in err and "give --max-len 57 or more" in err
    assert not out.exists()  # refused before its result directory was made


def test_too_few_samples_for_one_batch_say_which_options():
    from train.fit import epoch_batches

    assert len(epoch_batches([5] * 8, 4, 0, 0)) == 2  # the control
    with pytest.raises(
        UserError, match=r"3 samples cannot fill one global batch of 4 \(--batch-size x --grad-accum"
    ):
        epoch_batches([5] * 3, 4, 0, 0)


# ---- outputs: a path that is not ours is refused, untouched ----


def test_regenerate_refuses_an_out_file_it_did_not_write_and_leaves_it_untouched(tmp_path, capsys):
    from train import regenerate

    f = tmp_path / "notes.md"
    f.write_bytes(b"# my notes\nno newline at the end")  # the last line looks like a cut-off write
    code, err = exit_status(regenerate.main, ["--out", str(f), "--max-samples", "1"], capsys)
    assert code == 2 and f"{f}: line 1 is not a record of train.regenerate" in err
    assert f.read_bytes() == b"# my notes\nno newline at the end"
    sharegpt = tmp_path / "sharegpt.jsonl"  # a chat file of other records: answers were appended to it
    sharegpt.write_text('{"id": "a", "conversations": [{"from": "human", "value": "hi"}]}\n')
    new = tmp_path / "new.jsonl"
    new.write_text('{"id": "b", "messages": [{"role": "user", "content": "hi"}]}\n')
    argv = ["--out", str(sharegpt), "--data", str(new), "--turns", "1", "--max-new-tokens", "4"]
    code, err = exit_status(regenerate.main, argv, capsys)
    assert code == 2 and f"{sharegpt}: line 1 is not a record of train.regenerate" in err
    assert sharegpt.read_text() == '{"id": "a", "conversations": [{"from": "human", "value": "hi"}]}\n'
    ours = tmp_path / "chats.jsonl"  # the control: an interrupted file of ours loses its partial line only
    ours.write_text('{"id": "a", "messages": []}\n{"id": "b", "mess')
    assert regenerate._read_done(ours) == {"a"} and ours.read_text() == '{"id": "a", "messages": []}\n'


@pytest.mark.parametrize(
    "module, argv, what",
    [
        (
            "eval.acceptance",
            ["--n", "1", "--max-new-tokens", "8", "--steps", "2"],
            "eval.acceptance's results",
        ),
        (
            "eval.quality",
            ["--n", "1", "--max-new-tokens", "4", "--variants", "codes"],
            "eval.quality's results",
        ),
        ("eval.bench_fp8_gemm", ["--tokens", "1"], "eval.bench_fp8_gemm's results"),
        ("eval.compare_runs", ["{run}"], "a plot of eval.compare_runs"),
    ],
)
def test_a_results_out_file_replaces_only_its_own_results(module, argv, what, tmp_path, capsys):
    """`python -m eval.acceptance --out runs/regen/chats.jsonl` replaced the user's regenerated chats with
    its JSON (exit 0). A file at --out that is not the command's own output is now refused, untouched,
    before any work (the test files' controls rerun each over its own output). Small runs: before, each
    ran to the end and wrote over the chats."""
    import importlib

    main = importlib.import_module(module).main
    (tmp_path / "run").mkdir()  # a training log for eval.compare_runs to plot
    (tmp_path / "run" / "train_log.jsonl").write_text('{"step": 1, "loss": 2.0, "acc_i": [0.5]}\n')
    argv = [a.replace("{run}", str(tmp_path / "run")) for a in argv]
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n')
    code, err = exit_status(main, [*argv, "--out", str(chats)], capsys)
    assert (
        code == 2
        and err.startswith(f"error: {chats}: already exists and is not {what}")
        and err.count("\n") == 1
    )
    assert chats.read_text() == '{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n'


def test_bench_fp8_gemm_replaces_its_own_results(tmp_path):
    """The control of the above for eval.bench_fp8_gemm (its default --out is a path in the repository, so a
    rerun must go on over an earlier run's JSON: the CPU correctness pass here, the timings on CUDA)."""
    from eval import bench_fp8_gemm

    out = tmp_path / "gemm.json"
    out.write_text(json.dumps({"config": {}, "mode": "timing", "rows": []}))
    assert bench_fp8_gemm.main(["--tokens", "1", "--out", str(out)])["out"] == str(out)
    assert bench_fp8_gemm.is_results(out) and json.loads(out.read_text())["rows"]


DIR_OUTS = ["train.dump", "train.fit", "train.stage", "eval.bench", "eval.bench_engine"]
FILE_OUTS = ["train.regenerate", "train.datastore", "train.stage_data", "eval.acceptance", "eval.bench_fp8_gemm",
             "eval.compare_runs", "eval.quality"]  # fmt: skip


@pytest.mark.parametrize("module", DIR_OUTS + FILE_OUTS)
def test_an_output_path_of_the_wrong_kind_is_refused_while_parsing(module, tmp_path, capsys, monkeypatch):
    """A file where an output directory goes, or a directory where an output file goes: refused by the
    parser, before any data or model is read (train.fit read all of ShareGPT first, eval.bench_engine ran
    its whole benchmark before failing to write it)."""
    import importlib

    main = importlib.import_module(module).main
    f = tmp_path / "taken"
    f.write_text("x")
    taken, says = (f, "is a file; an output directory goes there") if module in DIR_OUTS else (
        tmp_path, "is a directory; give the file's name")  # fmt: skip
    code, err = exit_status(main, ["--out", str(taken)], capsys)
    assert code == 2 and f"argument --out: {taken} {says}" in err
    assert f.read_text() == "x"


def test_every_output_option_checks_its_kind(monkeypatch):
    """Each entry point's --out takes maverick.cli's output_dir or output_file type (the list above is all
    of them)."""
    from maverick.cli import output_dir, output_file

    found = {}
    for module in ENTRY_POINTS:
        for action in entry_point_parser(module, monkeypatch)._actions:
            if "--out" in action.option_strings:
                found[module] = action.type
    assert {m for m, t in found.items() if t is output_dir} == set(DIR_OUTS)
    assert {m for m, t in found.items() if t is output_file} == set(FILE_OUTS)
    assert set(found) - set(DIR_OUTS) - set(FILE_OUTS) == set()


def test_fit_refuses_a_file_as_out_before_reading_data(tmp_path):
    from train.fit import FitConfig, check_out

    f = tmp_path / "taken"
    f.write_text("x")
    with pytest.raises(UserError, match="is a file; an output directory goes there"):
        check_out(FitConfig(out=str(f), online=True))
    assert check_out(FitConfig(out=str(tmp_path / "new"), online=True)) == []  # the control


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--new-vocab"], "error: --new-vocab replaces an --init-draft's vocabulary (a fresh draft has the data's)"),
        (["--eval-every", "2"], "error: --eval-every scores --eval-dumps: give them, or drop --eval-every"),
        (["--eval-dumps", "e"], "error: --eval-dumps are scored every --eval-every N steps: give it"),
        (["--draft-vocab-size", "17", "--target-dtype", "bf16", "--max-samples", "3"],
         "error: --draft-vocab-size, --target-dtype, --max-samples: --online options, not read with --dumps"),
        (["--split", "train"], "error: --split: --online options, not read with --dumps"),
    ],
)  # fmt: skip
def test_fit_refuses_options_it_would_ignore(argv, says, tmp_path, capsys):
    """Each of these ran to the end (exit 0) without the option: --new-vocab with no --init-draft, --eval-every
    with no --eval-dumps (and --eval-dumps never scored without it), the online data options with --dumps.
    Now refused before any data is read (--dumps names no directory here)."""
    from train import fit

    base = ["--dumps", str(tmp_path / "none"), "--out", str(tmp_path / "out"), "--tracker", "none"]
    code, err = exit_status(fit.main, base + argv, capsys)
    assert code == 2 and err.strip().startswith(says) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_fit_online_options_keep_their_defaults():
    """The control: with --online the data options (parsed as None to see them given) get their defaults."""
    from train import fit

    cfg = fit.config_from_args(fit.build_parser().parse_args(["--online", "--out", "o"]))
    assert (cfg.draft_vocab_size, cfg.target_dtype) == (8192, "bf16")
    assert cfg.online_args == {"data": "sharegpt", "split": "train", "max_samples": None, "max_conversations": None,
                               "heldout_fraction": 0.02, "split_seed": 0, "cache_dir": ".cache/chat_data",
                               "tokenizer": None, "max_length": 1024}  # fmt: skip
    cfg = fit.config_from_args(fit.build_parser().parse_args(["--online", "--out", "o", "--split", "heldout",
                                                              "--draft-vocab-size", "64"]))  # fmt: skip
    assert (cfg.draft_vocab_size, cfg.online_args["split"]) == (64, "heldout")


def test_answers_too_short_to_score_are_refused(capsys):
    from eval import acceptance

    draft = str(ROOT / "eagle3/drafts/smollm2-135m-instruct")
    code, err = exit_status(acceptance.main, ["--draft", draft, "--max-new-tokens", "5"], capsys)
    assert code == 2 and "--max-new-tokens 5 scores no position with --steps 5" in err


def test_ctrl_c_is_one_line_and_status_130(capsys, monkeypatch):
    monkeypatch.delenv("MAVERICK_DEBUG", raising=False)

    def main(argv):
        raise KeyboardInterrupt

    code, err = exit_status(main, [], capsys)
    assert code == 130 and err == "interrupted\n"  # no claim that this command continues when run again
    with pytest.raises(SystemExit) as e:
        run_cli(main, [], resume="the same command continues")  # a command that does says how
    assert e.value.code == 130 and capsys.readouterr().err == "interrupted; the same command continues\n"
    with pytest.raises(KeyboardInterrupt):  # --debug: the traceback
        run_cli(main, ["--debug"])


@pytest.mark.parametrize("text", ["The countless", "A line.\n"])
def test_ctrl_c_while_an_answer_streams_starts_its_own_line(text, capsys, monkeypatch):
    """maverick.generate streams the answer with no newline until it ends; a Ctrl-C mid-answer ends that line on
    stdout first, so that 'interrupted' is a line of its own on a terminal (it was glued on: '...countlessinterrupted
    (the resumable ...'), and a redirected stdout ends with a newline. A line already ended gets no blank one."""
    from maverick import generate
    from maverick.target import load_target_tokenizer

    ids = load_target_tokenizer(None).encode(text)

    def interrupted(self, prompts, max_new_tokens, *args, on_tokens=None, **kwargs):
        for t in ids:
            on_tokens(torch.tensor([t]))
        raise KeyboardInterrupt

    monkeypatch.delenv("MAVERICK_DEBUG", raising=False)
    monkeypatch.setattr(generate.Decoder, "generate", interrupted)
    with pytest.raises(SystemExit) as e:
        run_cli(generate.main, ["--prompt", "hi", "--max-new-tokens", "8"])
    out, err = capsys.readouterr()
    assert out == text.removesuffix("\n") + "\n"
    assert e.value.code == 130 and err == "interrupted\n"


# ---- a target's config.json with a field of the wrong type ----


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("num_attention_heads", "nine", "num_attention_heads must be a positive integer, got 'nine'"),
        ("hidden_size", 0, "hidden_size must be a positive integer, got 0"),
        ("vocab_size", 1.5, "vocab_size must be a positive integer, got 1.5"),
        ("rms_norm_eps", "1e-5", "rms_norm_eps must be a positive number, got '1e-5'"),
        ("rope_theta", -1, "rope_theta must be a positive number, got -1"),
    ],
)
@pytest.mark.parametrize("layout", ["llama", "llama4"])
def test_target_config_fields_of_the_wrong_type_name_the_file_and_field(layout, key, value, says, tmp_path):
    from maverick.checkpoint import hf_model_config
    from maverick.config import get_config

    if layout == "llama":
        d = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "rope_theta": 10000.0}  # fmt: skip
    else:
        d = get_config("tiny-moe").to_hf_dict()
        d.pop("rope_parameters")
        d["rope_theta"] = 10000.0
    f = tmp_path / "config.json"
    f.write_text(json.dumps(d))
    cfg, _ = hf_model_config(tmp_path)  # the control: the file as written reads
    assert cfg.hidden_size == d["hidden_size"]
    f.write_text(json.dumps(d | {key: value}))
    with pytest.raises(UserError, match=re.escape(f"{f}: ") + ".*" + re.escape(says)):
        hf_model_config(tmp_path)


def test_prompts_that_are_empty_or_hold_ids_past_the_vocabulary_are_refused(target):
    V = target.config.vocab_size
    for dec in (Decoder(target, max_len=64), SpecDecoder(target, make_draft(target), max_len=128)):
        with pytest.raises(UserError, match="prompt 1 is empty: a prompt needs at least one token"):
            dec.generate([[5, 9], []], 2)
        with pytest.raises(
            UserError, match=rf"prompt holds token id {V}, outside the target's vocabulary of {V} "
        ):
            dec.generate([[5, V, 2]], 2)
        with pytest.raises(UserError, match="prompt holds token id -1, outside"):
            dec.generate([[-1, 5]], 2)
        assert (
            len(dec.generate([[5, V - 1]], 2, stop_ids=()).tokens[0]) == 2
        )  # the control: the last id is in


def test_a_training_runs_out_directory_names_its_draft(tmp_path):
    """--draft / load_draft take a draft directory or a train.fit / train.stage --out holding one in draft/."""
    _, path = make(tmp_path / "run")
    assert path == tmp_path / "run" / "draft"
    a, b = load_draft(path), load_draft(tmp_path / "run")
    assert b.source == str(path / "config.json") and torch.equal(a.fc.weight, b.fc.weight)
    with pytest.raises(
        FileNotFoundError, match=rf"{tmp_path}: no draft \(config.json\) there or in {tmp_path}/draft"
    ):
        load_draft(tmp_path)


# ---- files of the wrong shape or kind (a sweep of bad inputs, 2026-12-07) ----


def test_answer_files_that_are_not_what_they_say_name_the_file(tmp_path):
    """A `.xz` that is not xz read as no records (train.stage then recorded an empty regeneration as done);
    a record that is not JSON raised a bare JSONDecodeError."""
    from train import answers

    fake = tmp_path / "a.jsonl.xz"
    fake.write_text("hello")
    with pytest.raises(UserError, match=f"{fake}: not an xz file"):
        answers.read_records(fake)
    with pytest.raises(UserError, match=f"{fake}: not an xz file"):
        answers.repair(fake)
    plain = tmp_path / "a.jsonl"
    plain.write_text('{"id": "x"}\n{"id": \n[1]\n')
    with pytest.raises(UserError, match=f"{plain}: line 2: invalid JSON"):
        answers.read_records(plain)
    plain.write_text('{"id": "x"}\n[1]\n')
    with pytest.raises(UserError, match=f"{plain}: line 2: expected a JSON object, got list"):
        answers.read_records(plain)


def test_stage_data_names_the_users_xz_file(tmp_path):
    from train.stage_data import read_chats

    bad = tmp_path / "chats.jsonl.xz"
    bad.write_bytes(b"\xfd7zXZ\x00cut")
    with pytest.raises(UserError, match=f"{bad}: not a whole xz file"):
        read_chats(str(bad))


@pytest.mark.parametrize(
    "file, content, says",
    [
        ("config.json", "[1, 2]", "config.json: expected a JSON object, got list"),
        ("config.json", b'{"a": "\xff"}', "config.json: line 1"),
    ],
)
def test_target_json_of_the_wrong_shape_is_one_line(file, content, says, tmp_path, capsys):
    from maverick import generate

    d = tmp_path / "target"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (d / file).write_bytes(content if isinstance(content, bytes) else content.encode())
    code, err = exit_status(generate.main, ["--target", str(d), "--prompt", "hi"], capsys)
    assert code == 2 and says in err and "Traceback" not in err


def test_a_dump_manifest_that_is_not_an_object_names_it(tmp_path):
    from train.dump import DumpError, read_manifest

    (tmp_path / "manifest.json").write_text("[1]")
    with pytest.raises(DumpError, match="manifest.json: expected a JSON object, got list"):
        read_manifest(tmp_path)


def test_a_file_that_is_no_datastore_is_one_line(tmp_path):
    from eagle3.datastore import Datastore

    bad = tmp_path / "x.safetensors"
    save_file({"w": torch.zeros(2)}, bad)
    with pytest.raises(UserError, match="not a datastore"):
        Datastore.load(bad)
    bad.write_bytes(b"not safetensors at all")
    with pytest.raises(UserError, match="cannot read the datastore"):
        Datastore.load(bad)


def test_no_methods_and_trees_deeper_than_their_nodes_are_one_line(capsys, tmp_path):
    from eagle3 import generate as spec_generate
    from eval import bench

    code, err = exit_status(
        bench.main, ["--n", "1", "--methods", " , ", "--out", str(tmp_path / "b")], capsys
    )
    assert code == 2 and "--methods: no method given" in err  # it was a ZeroDivisionError
    with pytest.raises(UserError, match="depth <= total_tokens"):
        TreeConfig(100, 4, 12)  # a KV cache overflow mid-run before
    with pytest.raises(SystemExit):
        spec_generate.build_parser().parse_args(["--prompt", "hi", "--tree", "100,4,12"])
    assert "tree 100,4,12: needs 1 <= depth <= total_tokens" in capsys.readouterr().err


def test_a_safetensors_index_of_the_wrong_shape_names_it(tmp_path):
    from maverick.checkpoint import CheckpointError, _safetensors_files

    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": [1]}')
    with pytest.raises(CheckpointError, match="index.json: weight_map must be an object"):
        _safetensors_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(CheckpointError, match="index.json: expected a JSON object, got list"):
        _safetensors_files(tmp_path)
