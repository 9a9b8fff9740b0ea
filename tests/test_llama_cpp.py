"""llama.cpp as a bench row (eval/llama_cpp.py): refused with the install command when llama-cpp-python is
missing, and driven like our decoders (same prompt ids, greedy settings, stop tokens, token budget) when
it is there; the -compiled and llama.cpp rows are compared with the right reference."""

from __future__ import annotations

import sys
import types

import pytest

from eval import bench
from eval.llama_cpp import LlamaCpp, LlamaCppMissing
from eval.report import is_lossless_method, reference_method, variant
from maverick.cli import UserError, run_cli
from maverick.sampling import SamplingParams


def test_missing_binding_is_refused_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    with pytest.raises(LlamaCppMissing, match="pip install llama-cpp-python"):
        LlamaCpp("llama.cpp", "model.gguf", 256, [2])


def test_bench_exits_2_with_one_error_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(SystemExit) as e:
        run_cli(bench.main, ["--methods", "llama.cpp", "--n", "1", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("error: method llama.cpp needs llama-cpp-python")


class _FakeLlama:
    """Records how it is built and called; generates 7, 8, 9, ... forever."""

    made: list[dict] = []

    def __init__(self, **kw):
        self.kw = kw
        _FakeLlama.made.append(kw)

    def reset(self):  # the binding's: forget every evaluated token (n_tokens = 0)
        self.n_tokens = 0

    def generate(self, tokens, **kw):
        # the binding reuses the previous call's matching prefix unless n_tokens was reset to 0
        self.calls = getattr(self, "calls", []) + [(list(tokens), kw, getattr(self, "n_tokens", 0))]
        self.n_tokens = len(tokens)
        t = 7
        while True:
            yield t
            t += 1


def _fake_module(with_lookup: bool):
    mod = types.ModuleType("llama_cpp")
    mod.Llama = _FakeLlama
    spec = types.ModuleType("llama_cpp.llama_speculative")
    if with_lookup:
        spec.LlamaPromptLookupDecoding = lambda num_pred_tokens: ("lookup", num_pred_tokens)
    return mod, spec


def test_runs_greedy_on_our_prompt_ids_and_stops(monkeypatch):
    mod, spec = _fake_module(with_lookup=True)
    monkeypatch.setitem(sys.modules, "llama_cpp", mod)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", spec)
    r = LlamaCpp("llama.cpp-prompt-lookup", "m.gguf", 512, eos=[10], threads=2, lookup_tokens=6)
    assert _FakeLlama.made[-1]["draft_model"] == ("lookup", 6) and _FakeLlama.made[-1]["n_threads"] == 2
    new, st = r.run([1, 2, 3], 100, SamplingParams())
    assert new == [7, 8, 9, 10]  # up to and including the stop token
    ids, kw, cached = r.llm.calls[-1]
    assert ids == [1, 2, 3] and kw["temp"] == 0.0 and kw["top_k"] == 1 and kw["repeat_penalty"] == 1.0
    assert st["seconds"] >= st["ttft"] >= 0
    assert r.run([1], 2, SamplingParams())[0] == [7, 8]  # the token budget
    assert [c[2] for c in r.llm.calls] == [0, 0]  # every prompt processed whole: no reused prefix
    sampled = SamplingParams(0.7, top_k=20, top_p=1.0)
    r.run([1], 2, sampled)
    assert (r.llm.calls[-1][1]["temp"], r.llm.calls[-1][1]["top_k"]) == (0.7, 20)
    for ok in (SamplingParams(1.0, top_p=0.9), sampled):
        r.run([1], 2, ok)
    with pytest.raises(UserError, match="applies --top-p 0.9 before --temperature 0.7"):
        r.run([1], 2, SamplingParams(0.7, top_p=0.9))  # llama.cpp's chain: top-p, then the temperature
    plain = LlamaCpp("llama.cpp", "m.gguf", 512, eos=[10])
    assert "draft_model" not in _FakeLlama.made[-1] and plain.method == "llama.cpp"


def test_prompt_lookup_refused_where_the_binding_lacks_it(monkeypatch):
    mod, spec = _fake_module(with_lookup=False)
    monkeypatch.setitem(sys.modules, "llama_cpp", mod)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", spec)
    with pytest.raises(LlamaCppMissing, match="LlamaPromptLookupDecoding"):
        LlamaCpp("llama.cpp-prompt-lookup", "m.gguf", 512, eos=[2])


def test_compiled_and_llama_cpp_rows_get_their_references():
    methods = ["ours-plain", "ours-plain-compiled", "eagle3-tuned+lookup-compiled", "llama.cpp"]
    assert variant("eagle3-tuned+lookup-compiled") == "-compiled"
    assert reference_method("eagle3-tuned+lookup-compiled", methods, "ours-plain") == "ours-plain-compiled"
    assert is_lossless_method("eagle3-tuned+lookup-compiled", "ours-plain-compiled")
    assert not is_lossless_method("ours-plain-compiled", "ours-plain")  # other numerics: shown only
    assert not is_lossless_method("llama.cpp", "ours-plain")


def test_engine_preset_leaves_out_llama_cpp_rows_when_missing(monkeypatch, capsys):
    """--preset engine runs without the optional extra: the llama.cpp rows are dropped with a note, the
    rest kept; with the binding present, they stay."""
    methods = bench.PRESETS["engine"]["methods"].split(",")
    assert "llama.cpp" in methods and "ours-plain+q4-compiled" in methods
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    kept = bench.without_missing_llama_cpp(methods)
    assert kept == [m for m in methods if not m.startswith("llama.cpp")]
    assert "note: no llama.cpp rows" in capsys.readouterr().err
