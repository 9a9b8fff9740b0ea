"""scripts/gpu_decode.py's logic on the CPU (its methods run on a lent GPU): the eager methods decode the
payload's prompts losslessly, and --profile brings back where each method's step goes; eval.bench_engine's
--profile gives the same summary for the compiled engine's steps."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from maverick.config import get_config
from maverick.model import Llama4
from maverick.tokenizer import default_gguf_path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_decode.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_decode", SCRIPT)
    gd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gd)
    return gd


def test_gpu_decode_runs_the_eager_methods_and_profiles_them(tmp_path):
    gd = load_script()
    prompts = tmp_path / "prompts.json"
    assert gd.main(["--prepare", "--n", "1", "--prompts", str(prompts)]) == 0
    argv = ["--device", "cpu", "--gguf", str(default_gguf_path()), "--prompts", str(prompts), "--n", "1",
            "--max-new-tokens", "8", "--methods", "eager-plain,eager-eagle3,eager-eagle3-trees", "--profile", "2",
            "--out", str(tmp_path)]  # fmt: skip
    assert gd.main(argv) == 0
    r = json.loads((tmp_path / "gpu_decode.json").read_text())
    assert r["errors"] == {} and r["summary"]["eager-eagle3"]["mismatches_vs_eager-plain"] == 0
    assert r["summary"]["eager-eagle3-trees"]["mismatches_vs_eager-plain"] == 0
    assert (
        set(r["tree_cycles"]) == {"3,4,12", "4,6,24", "5,8,40", "6,10,60"}
        and sum(r["tree_cycles"].values()) > 0
    )
    for m in ("eager-plain", "eager-eagle3", "eager-eagle3-trees"):
        prof = r["profile"][m]
        assert prof["steps"] == 2 and prof["wall_ms"] > 0 and len(prof["ops"]) == 15
        assert "device_ms" not in prof  # a CPU run: the ops' CPU time only


def test_a_decode_call_cut_short_brings_back_what_it_measured(tmp_path, monkeypatch):
    """The device's timeout (SIGINT) during the third measured prompt: gpu_decode.json holds the two measured
    before it (it was written once, at the end: a call cut short brought back nothing)."""
    gd = load_script()
    prompts = tmp_path / "prompts.json"
    assert gd.main(["--prepare", "--n", "2", "--prompts", str(prompts)]) == 0
    real, calls = gd.measure, []

    def cut(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(gd, "measure", cut)
    argv = ["--device", "cpu", "--gguf", str(default_gguf_path()), "--prompts", str(prompts), "--n", "2",
            "--max-new-tokens", "4", "--methods", "eager-plain,eager-eagle3", "--profile", "0", "--out", str(tmp_path)]  # fmt: skip
    assert gd.main(argv) == 1
    r = json.loads((tmp_path / "gpu_decode.json").read_text())
    assert r["errors"] == {"interrupted": "KeyboardInterrupt"}
    assert sorted(r["summary"]) == ["eager-eagle3", "eager-plain"] and all(
        v["tokens"] > 0 for v in r["summary"].values()
    )


def test_bench_engine_profiles_its_decode_steps(capsys):
    from eval.bench_engine import profile_steps

    model = Llama4(get_config("tiny-dense")).eval()
    calls = []

    class Engine:  # CompiledTarget's two calls, on the eager model
        def new_cache(self, batch_size):
            return model.new_cache(batch_size, 64)

        def __call__(self, tokens, cache):
            calls.append(tokens.shape[1])
            with torch.no_grad():
                return model(tokens, cache=cache)

    prof = profile_steps(Engine(), [1, 2, 3], steps=3)
    assert calls == [3] + [1] * 5  # the prefill, 2 unrecorded steps, 3 recorded ones
    assert prof["steps"] == 3 and prof["wall_ms"] > 0 and prof["ops"] and "device_ms" not in prof
    assert "compiled decode profile" in capsys.readouterr().err


def test_bench_engine_lengths_fit_the_largest_bucket_and_keep_the_streak():
    """Drafts up to 8, copies 10 and streaks as asked, within the largest bucket's verify: the streak was cut
    to the draft's 8 (so --lookup-streak-tokens did nothing, copies 8 not 10); one row buckets are refused."""
    from eval.bench_engine import spec_lengths
    from maverick.cli import UserError

    assert spec_lengths((1, 2, 4, 8, 12, 24), 20) == (8, 10, 20)
    assert spec_lengths((1, 2, 4, 8, 12, 24), 10) == (8, 10, 10)
    assert spec_lengths((1, 2, 4, 8), 20) == (7, 7, 7)
    with pytest.raises(UserError, match="--rows 1: "):
        spec_lengths((1,), 20)


def test_a_speculative_profile_gets_its_cycles_however_many_tokens_each_emits():
    """An oracle draft emits 5 tokens a cycle: the budget of 5 + steps + 8 tokens ended the generation after
    ~5 cycles, short of the 5 + 10 the profile needs (trees on a GPU: no profile came back). The generation
    now lasts for the cycles and ends once they are recorded."""
    from eagle3.spec import SpecDecoder
    from eagle3.tuner import FixedK
    from maverick.generate import Decoder
    from tests.test_spec import OracleDraft, make_draft, make_target, prompts

    gd = load_script()
    target = make_target()
    p = prompts(1)[0]
    ref = Decoder(target, max_len=256).generate([p], 120).tokens[0]
    dec = SpecDecoder(target, make_draft(target, cls=OracleDraft, seq=p + ref), max_len=256, policy=FixedK(4))
    prof = gd.profile_method(dec, p, 10, "cpu")
    assert prof is not None and prof["steps"] == 10
    assert dec.tcache.lengths[0] < len(p) + 5 * 17  # it ended once recorded, not at the budget


def test_a_tree_check_without_its_engine_is_named_in_the_errors(tmp_path, monkeypatch):
    """--tree-check checks the compiled engine: when it cannot be built (or no compiled method was asked
    for), the JSON says the check did not run; it was left out without a word."""
    gd = load_script()
    prompts = tmp_path / "prompts.json"
    assert gd.main(["--prepare", "--n", "1", "--prompts", str(prompts)]) == 0

    def fails(*a, **kw):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr("maverick.compiled.CompiledTarget", fails)
    argv = ["--device", "cpu", "--gguf", str(default_gguf_path()), "--prompts", str(prompts), "--n", "1",
            "--max-new-tokens", "2", "--methods", "eager-plain", "--tree-check", "--out", str(tmp_path)]  # fmt: skip
    assert gd.main(argv) == 1
    r = json.loads((tmp_path / "gpu_decode.json").read_text())
    assert "no compiler here" in r["errors"]["compile"] and "not run" in r["errors"]["tree-check"]
    assert "tree_check" not in r and r["summary"]["eager-plain"]["tokens"] == 2  # the methods still ran
