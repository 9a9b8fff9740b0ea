"""python -m eagle3.generate: speculative decoding of one prompt on the SmolLM2 target with the shipped draft;
what it streams is what it returns, and --check finds plain decoding's tokens (greedy)."""

from __future__ import annotations

import json

import pytest

from eagle3 import generate
from maverick.cli import run_cli
from maverick.target import load_target_tokenizer

PROMPT = ["--prompt", "List three primary colors.", "--chat", "--max-new-tokens", "24"]


def run(argv, capsys) -> tuple[dict, str]:
    result = generate.main(argv)
    out = capsys.readouterr().out
    text, _, line = out.rstrip("\n").rpartition("\n")
    assert json.loads(line) == json.loads(json.dumps(result))  # the JSON line is the returned result
    return result, text


@pytest.mark.parametrize(
    "extra, shape",
    [
        ([], "tuned"),
        (["--k", "3", "--lookup"], "k=3"),
        (["--tree", "3,4,12"], "tree 3,4,12"),
        (["--tree", "2,2,3", "--tree", "3,4,12", "--lookup"], "tuned tree of 2,2,3 | 3,4,12"),
    ],
)
def test_speculative_generation_equals_plain_and_streams_its_tokens(extra, shape, capsys, monkeypatch):
    gens = []
    spec_generate = generate.SpecDecoder.generate
    monkeypatch.setattr(
        generate.SpecDecoder, "generate", lambda *a, **kw: gens.append(spec_generate(*a, **kw)) or gens[-1]
    )
    result, text = run([*PROMPT, "--check", *extra], capsys)
    assert result["identical_to_plain"] is True and result["first_difference"] is None
    assert result["shape"] == shape and 1 <= result["new_tokens"] <= 24 and result["tau"] >= 1.0
    assert result["cycles"] >= 1 and 0 < result["draft_share"] < 1 and result["speedup"] > 0
    tokens = gens[-1].tokens[0]  # the timed run (after --check's warm-up)
    assert len(tokens) == result["new_tokens"] and len(text) > 20
    assert text == load_target_tokenizer().decode(tokens, skip_special_tokens=True)  # streamed whole
    if "tuned tree" in shape:  # each tree tried (3 times, warm-up included) before the tuner settles
        assert set(result["tree_cycles"]) == {"2,2,3", "3,4,12"} and min(result["tree_cycles"].values()) >= 1


def test_sampling_runs_a_cut_tree_and_the_seed_repeats_it(capsys):
    argv = [*PROMPT, "--temperature", "0.8", "--top-p", "0.9", "--tree", "3,4,12", "--seed", "3"]
    a, text_a = run(argv, capsys)
    b, text_b = run(argv, capsys)
    assert a["shape"] == "tree 2,2,6" and text_a == text_b  # TreeConfig.for_sampling; the same draws


@pytest.mark.parametrize(
    "argv, says",
    [
        ([*PROMPT, "--check", "--temperature", "0.5"], "--check compares greedy tokens"),
        ([*PROMPT, "--tree", "3,4"], "--tree: '3,4': give DEPTH,TOP_K,TOKENS"),
        ([*PROMPT, "--k", "3", "--tree", "3,4,12"], "not allowed with argument"),
        ([*PROMPT, "--k", "0"], "--k: must be >= 1, got 0"),
        ([*PROMPT, "--q4", "--engine", "compiled", "--dtype", "fp32"], "add --dtype bf16"),
    ],
)
def test_bad_options_are_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        run_cli(generate.main, argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and "Traceback" not in err
