"""The notebooks run top to bottom (small settings) and say what they should; their helpers are right.

Each notebook is executed with nbclient in a fresh python3 kernel (ipykernel of this environment) with
NB_SMALL=1, and writes its key numbers to $NB_RESULTS, which the tests read back and check: numbers
that must hold whatever the machine's speed (lossless outputs, tau bounds, exact parameter counts, the
chunk rule), not timings. The notebooks that decode with the shipped draft skip when there is none
(set MAVERICK_DRAFT to a draft directory to run them before it exists).

The helper tests at the top (eval/notebook_utils.py) need no kernel and run in a second.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import time
from pathlib import Path

import pytest
import torch

from eagle3.spec import SpecStats
from eval import notebook_utils as nbu
from maverick.config import get_config
from maverick.generate import Generation
from maverick.model import Llama4

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ["01_quickstart", "02_train_draft", "03_draft_length", "04_llama4_anatomy"]
NEEDS_DRAFT = {"01_quickstart", "03_draft_length"}
CELL_TIMEOUT = 600  # seconds per cell; a small notebook takes well under 2 minutes in all


# ------------------------------------------------------------------------------------------ helpers


class ByteTokenizer:
    """A stand-in tokenizer: token id = one UTF-8 byte, so characters split across tokens (as in a
    byte-level BPE) and a prefix can end inside a character."""

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode("utf-8", errors="replace")


def test_token_sources_prefill_cycles_and_cut_last_cycle():
    # prefill token 5; cycle 0 accepted 7, 8 and the target said 9; cycle 1 was cut by the budget
    sources = nbu.token_sources([5, 7, 8, 9, 10, 11], [[7, 8, 9], [10, 11, 12]])
    assert sources == [(-1, True), (0, False), (0, False), (0, True), (1, False), (1, False)]
    assert nbu.token_sources([], []) == []
    assert nbu.token_sources([4], []) == [(-1, True)]


def test_token_sources_refuses_cycles_of_another_run():
    with pytest.raises(ValueError, match="differ from the 4 output tokens at index 2"):
        nbu.token_sources([5, 7, 8, 9], [[7, 3, 9]])


def test_token_pieces_keep_split_characters_whole():
    text = "a\u00e9\u20acb<"  # 1 + 2 + 3 + 1 + 1 bytes
    ids = list(text.encode())
    pieces = nbu.token_pieces(ByteTokenizer(), ids)
    assert pieces == ["a", "", "\u00e9", "", "", "\u20ac", "b", "<"]
    assert "".join(pieces) == text


def test_highlight_html_marks_accepted_drafts_per_cycle():
    tok = ByteTokenizer()
    out = list(b"abcdefg")
    # prefill a | cycle 0: b, c accepted, d target | cycle 1: e target | cycle 2: f accepted, g target
    cycles = [list(b"bcd"), list(b"e"), list(b"fg")]
    page = nbu.highlight_html(tok, out, cycles)
    body = page.split('<div style="font-family')[1]
    coloured = re.findall(r'<span style="background:(#[0-9a-f]+)"[^>]*>([^<]*)</span>', body)
    assert coloured == [(nbu.CYCLE_COLOURS[0], "b"), (nbu.CYCLE_COLOURS[0], "c"), (nbu.CYCLE_COLOURS[0], "f")]
    plain = re.findall(r'<span title="token \d+: target[^"]*">([^<]*)</span>', body)
    assert plain == ["a", "d", "e", "g"]
    assert "7 tokens, 3 cycles" in page and "accepted (3)" in page
    # cycle 1 accepted nothing, cycle 2's drafts take the first colour again (2 % 2 == 0); escaping
    page = nbu.highlight_html(tok, list(b"x<y"), [list(b"<"), list(b"y")])
    assert html.escape("<") in page and "<y" not in page


def test_cycle_recorder_keeps_one_row():
    rec = nbu.CycleRecorder(row=1)
    rec([[1, 2], [3]])
    rec([[4], [5, 6]])
    assert rec.cycles == [[3], [5, 6]]
    rec.reset()
    assert rec.cycles == []


def test_write_results_env_atomic_and_strict(tmp_path, monkeypatch):
    monkeypatch.delenv("NB_RESULTS", raising=False)
    assert nbu.write_results({"a": 1}) is None
    path = tmp_path / "sub" / "r.json"
    monkeypatch.setenv("NB_RESULTS", str(path))
    nbu.write_results({"t": torch.tensor([1, 2]), "p": Path("/x"), "f": 0.5})
    assert json.loads(path.read_text()) == {"t": [1, 2], "p": "/x", "f": 0.5}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temporary file left
    with pytest.raises(ValueError):
        nbu.write_results({"x": math.nan})
    with pytest.raises(TypeError, match="object is not JSON serialisable"):
        nbu.write_results({"x": object()})


def test_environment_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("NB_SMALL", "1")
    assert nbu.small_mode()
    monkeypatch.setenv("NB_SMALL", "0")
    assert not nbu.small_mode()
    monkeypatch.setenv("NB_THREADS", "zero")
    with pytest.raises(ValueError, match="NB_THREADS"):
        nbu.set_threads_from_env()
    monkeypatch.setenv("MAVERICK_DRAFT", str(tmp_path / "nothing"))
    assert nbu.draft_path() == tmp_path / "nothing"
    with pytest.raises(FileNotFoundError, match="MAVERICK_DRAFT"):
        nbu.require_draft()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{}")
    assert nbu.require_draft(tmp_path / "d") == tmp_path / "d"
    monkeypatch.setenv("NB_WORKDIR", str(tmp_path / "w" / "x"))
    assert nbu.workdir() == tmp_path / "w" / "x" and (tmp_path / "w" / "x").is_dir()


def test_router_loads_count_every_token_and_remove_hooks(monkeypatch):
    from maverick.model import MoE

    cfg = get_config("tiny-moe")
    torch.manual_seed(0)
    model = Llama4(cfg)
    model.init_weights(std=0.1)
    tokens = torch.randint(0, cfg.vocab_size, (3, 20))
    # record every routing decision the forward itself makes (the hook routes the same input again)
    calls = []
    route = MoE.route
    monkeypatch.setattr(MoE, "route", lambda self, x: calls.append(route(self, x)) or calls[-1])
    loads = nbu.router_loads(model, tokens)
    assert sorted(loads) == cfg.moe_layers
    assert len(calls) == 2 * len(cfg.moe_layers)  # per MoE layer: the hook's, then the forward's
    for layer, (hook_call, forward_call) in zip(cfg.moe_layers, zip(calls[::2], calls[1::2])):
        assert torch.equal(hook_call[0], forward_call[0])
        assert torch.equal(loads[layer], torch.bincount(forward_call[0], minlength=cfg.num_local_experts))
        assert loads[layer].shape == (cfg.num_local_experts,) and int(loads[layer].sum()) == 60
    assert all(not layer.feed_forward._forward_pre_hooks for layer in model.model.layers)
    with pytest.raises(ValueError, match="no MoE layer"):
        nbu.router_loads(Llama4(get_config("tiny-dense")), tokens)


def test_run_record_and_pooled_tau():
    plain = Generation([[1, 2, 3]], [4], seconds=0.5, ttft=0.1)
    r = nbu.run_record("plain", 7, plain)
    assert (r.prompt_id, r.new_tokens, r.cycles, r.output_ids) == ("7", 3, 0, [1, 2, 3])
    assert nbu.tokens_per_s(plain) == 6.0
    assert nbu.run_record("plain", 7, plain, peak_mb=12.5).peak_memory_mb == 12.5  # measured after generating
    stats = SpecStats(cycles=2, accepted=[3, 0], accepted_rows=[[3], [0]], draft_lengths=[4, 4])
    stats.draft_seconds, stats.verify_seconds = 0.1, 0.2
    spec = Generation([[1, 2, 3, 4, 5, 6]], [4], seconds=0.4, ttft=0.1, stats={"spec": stats})
    r = nbu.run_record("k=4", "p", spec)
    assert (r.cycles, r.accepted, r.draft_lengths, r.verify_seconds) == (2, [3, 0], [4, 4], 0.2)
    assert nbu.pooled_tau([spec, spec]) == 2.5  # (4 + 1) / 2 per generation
    with pytest.raises(ValueError, match="one prompt, got 2 rows"):  # a batch's draft lengths are row 0's
        nbu.run_record(
            "k=4", "p", Generation([[1, 2], [3, 4]], [4, 4], seconds=0.4, ttft=0.1, stats={"spec": stats})
        )
    with pytest.raises(ValueError, match="no speculative cycle"):
        nbu.pooled_tau([Generation([[1]], [1], 1.0, 0.1, {"spec": SpecStats()})])


# ----------------------------------------------------------------------------------- the notebooks


@pytest.mark.parametrize("name", NAMES)
def test_notebook_committed_clean(name):
    """Outputs stripped, a parameters cell with SMALL, results written, no model code inside."""
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code), f"{name}: outputs not stripped"
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and 'SMALL = os.environ.get("NB_SMALL", "0") == "1"' in params[0].source
    assert code.index(params[0]) == 0, f"{name}: the parameters cell must be the first code cell"
    source = "\n".join(c.source for c in code)
    assert "nbu.write_results(results)" in source
    assert not re.search(r"^\s*class |nn\.Module|def forward", source, re.M), f"{name}: model code inside"


def _execute(name: str, tmp_path: Path, monkeypatch) -> dict:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    if name in NEEDS_DRAFT and not (nbu.draft_path() / "config.json").is_file():
        pytest.skip(
            f"{name} decodes with an EAGLE-3 draft and there is none at {nbu.draft_path()} "
            "(the shipped draft is missing and MAVERICK_DRAFT is not set to a draft directory)"
        )
    results = tmp_path / "results.json"
    monkeypatch.setenv("NB_SMALL", "1")
    monkeypatch.setenv("NB_RESULTS", str(results))
    monkeypatch.setenv("NB_WORKDIR", str(tmp_path / "work"))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    # One torch thread unless the caller says otherwise: the small runs are latency-bound (tiny matmuls),
    # and on a shared CPU more threads than free cores makes them several times slower, not faster.
    monkeypatch.setenv("NB_THREADS", os.environ.get("NB_THREADS") or "1")
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    # kernel "python3": jupyter_client runs it with this interpreter (sys.executable), so the kernel sees
    # this environment's packages whether or not the venv is on PATH
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    t0 = time.perf_counter()
    client.execute()
    print(f"{name}: executed in {time.perf_counter() - t0:.1f} s")
    assert results.is_file(), f"{name} ran but wrote no results to NB_RESULTS"
    return json.loads(results.read_text())


def test_01_quickstart(tmp_path, monkeypatch):
    r = _execute("01_quickstart", tmp_path, monkeypatch)
    assert r["small"] is True
    assert r["identical"] is True
    assert r["q4_identical"] is True
    assert r["plain_tokens_per_s"] > 0 and r["spec_tokens_per_s"] > 0
    assert r["speedup"] == pytest.approx(r["spec_tokens_per_s"] / r["plain_tokens_per_s"], rel=1e-12)
    assert 1.0 <= r["tau"] <= r["k"] + 1
    assert 1 <= r["new_tokens"] <= 32 and 1 <= r["cycles"] < r["new_tokens"]
    assert r["lookup_tokens_per_s"] > 0 and r["lookup_tau"] >= 1.0
    assert 0 <= r["lookup_cycles"] <= r["new_tokens"]


def test_02_train_draft(tmp_path, monkeypatch):
    r = _execute("02_train_draft", tmp_path, monkeypatch)
    assert (r["samples"], r["steps"]) == (16, 20)
    assert r["tokens"] > 16
    assert r["loss_last"] < r["loss_first"]
    assert r["acc0_last"] >= r["acc0_first"]
    assert 1.0 <= r["tau_before"] <= r["k"] + 1
    assert 1.0 <= r["tau_after"] <= r["k"] + 1
    assert (Path(r["draft"]) / "config.json").is_file()
    for key in ("tf_walked_tau_before", "tf_walked_tau_after"):  # teacher-forced, eval.acceptance
        assert 1.0 <= r[key] <= r["k"] + 1
    gain = r["tf_gain"]
    assert gain["k"] == r["k"] and gain["clusters"] == 2
    assert gain["tau_ci95"][0] <= gain["tau"] <= gain["tau_ci95"][1]
    assert gain["tau_walked"] == pytest.approx(r["tf_walked_tau_after"] - r["tf_walked_tau_before"], abs=2e-4)


def test_03_draft_length(tmp_path, monkeypatch):
    r = _execute("03_draft_length", tmp_path, monkeypatch)
    ks = r["ks"]
    assert ks == list(range(1, 9))
    assert sorted(r["tau_by_k"], key=int) == [str(k) for k in ks]
    for k in ks:
        assert 1.0 <= r["tau_by_k"][str(k)] <= k + 1
        assert r["tokens_per_s_by_k"][str(k)] > 0
    for t in r["trees"]:
        assert 1.0 <= t["tau"] <= t["depth"] + 1 and t["tokens_per_s"] > 0
    assert r["mismatches"] == 0
    assert r["tuner_best_k"] in r["tuner_choices"]
    assert sum(r["tuner_k_counts"].values()) >= 1
    assert all(0.0 < a < 1.0 for a in r["tuner_alphas"])
    # tuned trees: each tree drafted (tried first), plain decoding's tokens (asserted in the notebook)
    assert set(r["tree_tuner_cycles"]) == {
        f"tree {t['depth']}x{t['top_k']}/{t['total_tokens']}" for t in r["trees"]
    }
    assert all(n >= 1 for n in r["tree_tuner_cycles"].values()) and r["tree_tuner_tau"] >= 1.0


def test_04_llama4_anatomy(tmp_path, monkeypatch):
    r = _execute("04_llama4_anatomy", tmp_path, monkeypatch)
    assert r["param_counts"] == {
        "maverick-400b": [400_711_848_960, 17_184_691_200],
        "scout-109b": [107_769_861_120, 17_172_894_720],
    }
    C, T = r["chunk"], r["mask_len"]
    assert C == 16 and T == 48
    assert r["visible_chunked"] == [p % C + 1 for p in range(T)]  # resets at every chunk boundary
    assert r["visible_full"] == [p + 1 for p in range(T)]
    assert r["decode_visible"] == list(range(16, 21))  # position 20 sees its own chunk only
    assert sorted(r["router_loads"]) == ["1", "3"]
    for counts in r["router_loads"].values():
        assert len(counts) == 4 and sum(counts) == r["tokens_routed"]
    assert r["maverick_nope_layers"] == list(range(3, 48, 4))
    assert r["maverick_moe_layers"] == list(range(1, 48, 2))
    assert sum(r["maverick_breakdown"].values()) == 400_711_848_960
    assert r["moe_reference_max_diff"] < 1e-5
