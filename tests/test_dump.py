"""Hidden-state dumps: exact round trip, resume after a crash, corrupt shards, online == dumps, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train.dump as dump
from maverick.config import get_config
from maverick.model import Llama4
from maverick.target import load_target
from train.dump import DumpDataset, DumpError, DumpSettings, plan_batches, run_target, write_dumps
from train.online import OnlineDataset
from train.samples import draft_vocab_from, samples_fingerprint

LAYERS = (1, 2, 3)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny shapes: one thread is fastest, and on shared busy cores a descheduled second thread stalls
    every op."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_target(seed: int = 0, **overrides) -> Llama4:
    torch.manual_seed(seed)
    model = Llama4(get_config("tiny-dense", **overrides))
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(seed))
    return model.eval()


def tiny_samples(n: int, seed: int = 0, vocab: int = 512) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        T = int(torch.randint(6, 30, (1,), generator=g))
        mask = torch.zeros(T, dtype=torch.uint8)
        mask[T // 3 :] = 1  # a "prompt" then an "answer"
        out.append(
            {"input_ids": torch.randint(0, vocab, (T,), generator=g, dtype=torch.int32), "loss_mask": mask}
        )
    return out


def settings(samples, shard_size=3, dtype="bf16") -> DumpSettings:
    data = {"source": "test", "split": "train", "num_samples": len(samples),
            "fingerprint": samples_fingerprint(samples)}  # fmt: skip
    return DumpSettings({"name": "tiny-dense seed 0"}, LAYERS, dtype, 32, shard_size, data)


def test_plan_batches_respects_budget_and_covers_all():
    lengths = [5, 30, 7, 30, 12, 1, 29]
    batches = plan_batches(lengths, batch_tokens=60)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert batches[0] == [1, 3]  # longest first: 2 x 30 fits, a third 30-padded row does not
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 60


def test_round_trip_exact(tmp_path):
    model, samples = tiny_target(), tiny_samples(7)
    # batch_tokens=1: every sample gets its own forward, so the expected fields are computed identically
    m = write_dumps(model, samples, tmp_path, settings(samples), batch_tokens=1, progress=False)
    assert m["complete"] and m["num_shards"] == 3 and [s["samples"] for s in m["shards"]] == [3, 3, 1]
    T = sum(len(s["input_ids"]) for s in samples)
    assert m["tokens"] == T and m["bytes_per_token"] == pytest.approx(m["bytes"] / T)
    ds = DumpDataset(tmp_path, verify=True)
    assert len(ds) == 7 and ds.lengths == [len(s["input_ids"]) for s in samples]
    for i, s in enumerate(samples):
        got = ds[i]
        want = run_target(model, [s], LAYERS)[0]
        assert set(got) == set(dump.FIELDS)
        for k in dump.FIELDS:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (i, k)
        assert torch.equal(got["input_ids"], s["input_ids"]) and torch.equal(got["loss_mask"], s["loss_mask"])
        assert (
            got["features"].shape == (len(s["input_ids"]), 3 * 64) and got["features"].dtype == torch.bfloat16
        )
        with torch.no_grad():  # the stored fields are the target's: features, final hidden, argmax
            out = model(s["input_ids"].long()[None], feature_layers=LAYERS, logits="all")
        assert torch.equal(got["features"], out.features[0].bfloat16())
        assert torch.equal(got["hidden"], out.hidden[0].bfloat16())
        assert torch.equal(got["target_argmax"].long(), out.logits[0].argmax(-1))
    assert ds[-1]["input_ids"].shape == samples[-1]["input_ids"].shape
    with pytest.raises(IndexError):
        ds[7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sharded_heads_pick_is_one_process_pick_at_near_ties(dtype):
    """target_argmax on a head split over ranks: each rank's best row and score, the best score over ranks
    (the lowest id on a tie). Every row of the head has a near twin in the other half; the ranks' pick must
    be one process's. (A GEMM's bits depend on the head's rows: fp32 heads scored by it picked otherwise.)"""
    g = torch.Generator().manual_seed(0)
    N, H, V = 4096, 64, 512
    hidden = torch.randn(N, H, generator=g).to(dtype)
    base = torch.randn(V // 2, H, generator=g)
    head = torch.cat([base, base + 1e-6 * torch.randn(V // 2, H, generator=g)]).to(dtype)
    one, _ = dump.full_vocab_best(hidden, head)
    halves = [dump.full_vocab_best(hidden, part) for part in head.split(V // 2)]
    scores = torch.stack([s.double() for _, s in halves])  # [ranks, N]
    ids = torch.stack([i + r * (V // 2) for r, (i, _) in enumerate(halves)])
    two = ids.gather(0, scores.argmax(0, keepdim=True))[0]
    assert torch.equal(two, one), int((two != one).sum())


def test_full_vocab_argmax_bf16_head_equals_fp32():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(300, 64, generator=g).bfloat16()
    head = (torch.randn(4000, 64, generator=g) * 0.3).bfloat16()
    want = (hidden.float() @ head.float().T).argmax(-1)
    assert torch.equal(dump.full_vocab_argmax(hidden, head), want)
    assert torch.equal(dump.full_vocab_argmax(hidden.float(), head.float()), want)
    assert not torch.equal((hidden @ head.T).argmax(-1), want)  # plain bf16 logits do get it wrong
    hidden[7] = torch.nan  # a broken row gets an id of the vocabulary (it got int64's max), the rest theirs
    ids = dump.full_vocab_argmax(hidden, head)
    assert 0 <= int(ids[7]) < 4000 and torch.equal(ids[:7], want[:7]) and torch.equal(ids[8:], want[8:])


def test_batched_forward_matches_single(tmp_path):
    """Right padding inside a batched forward does not change what is stored (beyond fp32 rounding)."""
    model, samples = tiny_target(), tiny_samples(5)
    batched = run_target(model.float(), samples, LAYERS, store_dtype=torch.float16)
    for s, b in zip(samples, batched):
        single = run_target(model, [s], LAYERS, store_dtype=torch.float16)[0]
        assert torch.equal(b["target_argmax"], single["target_argmax"])
        assert torch.allclose(b["features"].float(), single["features"].float(), atol=2e-3, rtol=1e-3)


def test_resume_skips_finished_shards_and_cleans_partial_files(tmp_path, monkeypatch):
    model, samples = tiny_target(), tiny_samples(8)
    st = settings(samples)
    calls = []
    real = dump.run_target

    def crashing(model, chunk, *a, **k):
        calls.append(len(chunk))
        if sum(calls) > 4:  # dies while computing the second shard
            raise KeyboardInterrupt
        return real(model, chunk, *a, **k)

    monkeypatch.setattr(dump, "run_target", crashing)
    with pytest.raises(KeyboardInterrupt):
        write_dumps(model, samples, tmp_path, st, batch_tokens=1, progress=False)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert not manifest["complete"] and [s["index"] for s in manifest["shards"]] == [0]
    (tmp_path / "shard-00001.safetensors.tmp-4242-0a1b2c3d").write_bytes(
        b"half a shard"
    )  # as if killed mid-write
    first = (tmp_path / "shard-00000.safetensors").stat()
    with pytest.raises(DumpError, match="incomplete"):
        DumpDataset(tmp_path)
    assert len(DumpDataset(tmp_path, allow_partial=True)) == 3

    calls.clear()
    monkeypatch.setattr(
        dump, "run_target", lambda m, chunk, *a, **k: calls.append(len(chunk)) or real(m, chunk, *a, **k)
    )
    m = write_dumps(model, samples, tmp_path, st, batch_tokens=1, progress=False)
    assert m["complete"] and sum(calls) == 5  # only the 3 + 2 samples of shards 1 and 2 were recomputed
    assert not list(tmp_path.glob("*.tmp*"))
    again = (tmp_path / "shard-00000.safetensors").stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)

    fresh = tmp_path / "fresh"
    monkeypatch.setattr(dump, "run_target", real)
    write_dumps(model, samples, fresh, st, batch_tokens=1, progress=False)
    a, b = DumpDataset(tmp_path), DumpDataset(fresh)
    for i in range(len(samples)):
        for k in dump.FIELDS:
            assert torch.equal(a[i][k], b[i][k])


def test_other_settings_are_refused(tmp_path):
    model, samples = tiny_target(), tiny_samples(4)
    write_dumps(model, samples, tmp_path, settings(samples), progress=False)
    partial = tmp_path / "shard-00009.safetensors.tmp-123-0a1b2c3d"  # another run's write in progress
    partial.write_bytes(b"x")
    with pytest.raises(DumpError, match="dtype"):
        write_dumps(model, samples, tmp_path, settings(samples, dtype="fp16"), progress=False)
    assert partial.exists()  # a refused run deletes nothing (it cleaned the folder before it checked)


def test_corrupt_shard_names_the_file(tmp_path):
    model, samples = tiny_target(), tiny_samples(6)
    write_dumps(model, samples, tmp_path, settings(samples), progress=False)
    shard = tmp_path / "shard-00001.safetensors"
    raw = shard.read_bytes()
    shard.write_bytes(raw[:-100])  # truncated
    with pytest.raises(DumpError, match="shard-00001.safetensors.*truncated"):
        DumpDataset(tmp_path)
    # the manifest updated to the truncated size: the safetensors header still gives it away
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["shards"][1]["bytes"] = len(raw) - 100
    manifest["bytes"] -= 100  # the totals too (else check_manifest_totals refuses it first)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DumpError, match="shard-00001.safetensors.*truncated or corrupt"):
        DumpDataset(tmp_path)
    # same size, flipped bytes in the data: only the checksum sees it
    shard.write_bytes(raw[:-10] + bytes(10))
    manifest["shards"][1]["bytes"] = len(raw)
    manifest["bytes"] += 100
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    DumpDataset(tmp_path)
    with pytest.raises(DumpError, match="shard-00001.safetensors: sha256"):
        DumpDataset(tmp_path, verify=True)
    shard.write_bytes(b"\x05")
    with pytest.raises(DumpError, match="shard-00001.safetensors"):
        DumpDataset(tmp_path)


def test_several_directories_read_as_one(tmp_path):
    model = tiny_target()
    a_samples, b_samples = tiny_samples(4, seed=1), tiny_samples(5, seed=2)
    va, vb = draft_vocab_from(a_samples, 512, 50)[:2], draft_vocab_from(b_samples, 512, 50)[:2]
    write_dumps(model, a_samples, tmp_path / "a", settings(a_samples), vocab=va, progress=False)
    write_dumps(model, b_samples, tmp_path / "b", settings(b_samples), vocab=vb, progress=False)
    a, b = DumpDataset(tmp_path / "a"), DumpDataset(tmp_path / "b")
    both = DumpDataset(f"{tmp_path / 'a'},{tmp_path / 'b'}")
    assert len(both) == 9 and both.lengths == a.lengths + b.lengths and both.tokens == a.tokens + b.tokens
    for i, (ds, j) in enumerate([(a, k) for k in range(4)] + [(b, k) for k in range(5)]):
        for k in dump.FIELDS:
            assert torch.equal(both[i][k], ds[j][k]), (i, k)
    assert not torch.equal(va[0], vb[0])
    for got, want in zip(both.vocab(), va):  # the first directory's vocabulary
        assert torch.equal(got, want)
    with pytest.raises(IndexError, match="9 samples"):
        both[9]

    other = settings(b_samples)
    other.target = {"name": "tiny-dense seed 0", "size": 123}
    write_dumps(model, b_samples, tmp_path / "c", other, progress=False)
    with pytest.raises(DumpError, match=r"c/manifest.json: target.size is 123 but None in .*a/manifest.json"):
        DumpDataset([tmp_path / "a", tmp_path / "c"])
    write_dumps(model, b_samples, tmp_path / "d", settings(b_samples, dtype="fp16"), progress=False)
    with pytest.raises(DumpError, match=r"d/manifest.json: dtype is 'fp16' but 'bf16'"):
        DumpDataset([tmp_path / "a", tmp_path / "d"])


def test_online_equals_dumps(tmp_path):
    model, samples = tiny_target(), tiny_samples(5)
    write_dumps(model, samples, tmp_path, settings(samples), batch_tokens=1, progress=False)
    ds = DumpDataset(tmp_path)
    online = OnlineDataset(model, samples, LAYERS, batch_tokens=1)
    assert online.lengths == ds.lengths and online.feature_layers == ds.feature_layers
    for got, i in zip(online.fetch([4, 0, 2]), [4, 0, 2]):
        for k in dump.FIELDS:
            assert torch.equal(got[k], ds[i][k]), (i, k)
    fp32 = OnlineDataset(
        model, samples, LAYERS, store_dtype=torch.float32
    )  # (its identity raised StopIteration)
    assert fp32.fetch([0])[0]["features"].dtype == torch.float32 and fp32.identity["dtype"] == "torch.float32"


def test_vocab_saved_and_validated(tmp_path):
    from eagle3.vocab import count_tokens, select_draft_vocab

    model, samples = tiny_target(), tiny_samples(6)
    d2t, t2d, coverage = draft_vocab_from(samples, 512, 100)
    want_d2t, want_t2d = select_draft_vocab(count_tokens(samples, 512), 100)
    assert torch.equal(d2t, want_d2t) and torch.equal(t2d, want_t2d) and 0 < coverage <= 1
    write_dumps(model, samples, tmp_path, settings(samples), vocab=(d2t, t2d), progress=False)
    got = DumpDataset(tmp_path).vocab()
    assert torch.equal(got[0], d2t) and torch.equal(got[1], t2d)
    dump.save_vocab(tmp_path, d2t + 1, t2d)  # off by one: caught on load
    with pytest.raises(DumpError, match="vocab.safetensors"):
        DumpDataset(tmp_path).vocab()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_dump_matches_cpu(tmp_path):
    model, samples = tiny_target(), tiny_samples(4)
    cpu = run_target(model, samples, LAYERS, store_dtype=torch.float16)
    gpu = run_target(tiny_target().cuda(), samples, LAYERS, store_dtype=torch.float16)
    for c, g in zip(cpu, gpu):
        assert g["features"].device.type == "cpu"  # stored fields always come back to the host
        assert torch.allclose(c["features"].float(), g["features"].float(), atol=2e-3, rtol=1e-3)
        assert (c["target_argmax"] == g["target_argmax"]).float().mean() > 0.95


def test_cli_help():
    r = subprocess.run(
        [sys.executable, "-m", "train.dump", "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and "--draft-vocab-size" in r.stdout and "--shard-size" in r.stdout


CHATS = [
    {"id": f"c{i}", "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
    for i, (q, a) in enumerate(
        [
            ("What is 2+2?", "2+2 is 4."),
            ("Name a colour.", "Blue is a colour."),
            ("Say hi.", "Hi there!"),
            ("Capital of France?", "Paris is the capital of France."),
            ("Count to 3.", "1, 2, 3."),
        ]  # fmt: skip
    )
]


def test_cli_end_to_end_on_chats(tmp_path):
    """python -m train.dump on a chat file with a tiny target saved as an HF directory without tokenizer
    files: refused by default (the tokenizer is the target's own), run with SmolLM2's via --tokenizer."""
    from maverick.checkpoint import save_hf
    from maverick.gguf_loader import default_gguf_path

    target = tmp_path / "target"
    save_hf(tiny_target(vocab_size=49152), target)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    out = tmp_path / "dumps"
    with pytest.raises(FileNotFoundError, match=r"target has no tokenizer files \(tokenizer.json"):
        dump.main(["--out", str(out), "--target", str(target), "--data", str(chats)])
    argv = ["--out", str(out), "--target", str(target), "--tokenizer", str(default_gguf_path()),
            "--target-dtype", "fp32", "--data", str(chats),
            "--heldout-fraction", "0.2", "--shard-size", "2", "--draft-vocab-size", "64",
            "--feature-layers", "1,2,3", "--cache-dir", str(tmp_path / "cache"), "--no-progress"]  # fmt: skip
    summary = dump.main(argv)  # (an empty held-out split cannot be reloaded by `datasets`: keep one there)
    assert summary["complete"] and summary["samples"] == 4 and summary["shards"] == 2
    assert summary["bytes_per_token"] == pytest.approx(2 * 4 * 64 + 4 + 1 + 4, abs=200)
    ds = DumpDataset(out)
    d2t, t2d = ds.vocab()
    assert d2t.numel() == 64 and t2d.numel() == 49152
    assert ds.manifest["target"]["path"] == str(target.resolve()) and ds.manifest["target"]["kind"] == "hf"
    assert ds[0]["loss_mask"].sum() > 0
    assert dump.main(argv)["dump_tokens_per_s"] == 0.0  # rerun: everything is already there


def test_out_holding_other_files_is_refused_untouched(tmp_path, capsys):
    """`train.dump --out eagle3/drafts` wrote manifest.json, a shard and vocab.safetensors beside the shipped
    draft. A directory that holds other files and no manifest is now refused, naming it, before the data is
    read; a new or empty directory, a dump's, or what a first run stopped before its manifest left go on."""
    from tests.test_cli_errors import exit_status

    drafts = tmp_path / "drafts"
    (drafts / "smollm2-135m-instruct").mkdir(parents=True)
    (drafts / "smollm2-135m-instruct" / "config.json").write_text("{}")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    argv = ["--out", str(drafts), "--data", str(chats), "--max-length", "64",
            "--heldout-fraction", "0.2", "--cache-dir", str(tmp_path / "cache"), "--no-progress"]  # fmt: skip
    code, err = exit_status(dump.main, argv, capsys)
    assert code == 2 and err == (
        f"error: {drafts}: holds smollm2-135m-instruct and no manifest.json, so it is not a dump directory; "
        "give --out a new or empty directory, or a dump's to resume it\n"
    )
    assert [p.name for p in drafts.iterdir()] == ["smollm2-135m-instruct"] and not (
        tmp_path / "cache"
    ).exists()
    (drafts / "manifest.json").write_text('{"format": "something else"}')  # another program's manifest
    with pytest.raises(DumpError, match="manifest.json: format 'something else'"):
        dump.check_out(drafts)
    # the controls: what a dump writes before its first manifest (a rerun finishes it), an empty directory
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "vocab.safetensors").write_bytes(b"x")
    (stopped / "shard-00000.safetensors.tmp-123-0123abcd").write_bytes(b"x")
    (stopped / "manifest.json.tmp-123-0123abcd").write_bytes(b"x")
    dump.check_out(stopped)
    dump.check_out(tmp_path / "cache")
    (tmp_path / "empty").mkdir()
    dump.check_out(tmp_path / "empty")


def test_real_target_smoke(tmp_path):
    """SmolLM2 from the GGUF wheel: 2 chats dumped, argmax equal to the model's own logits."""
    pytest.importorskip("gguf")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    out = tmp_path / "dumps"
    summary = dump.main(["--out", str(out), "--data", str(chats), "--heldout-fraction", "0.2", "--max-samples", "2", "--max-length", "64",
                         "--cache-dir", str(tmp_path / "cache"), "--no-progress"])  # fmt: skip
    ds = DumpDataset(out)
    assert summary["samples"] == 2 and ds.feature_layers == (2, 15, 27)
    s = ds[0]
    assert s["features"].shape == (len(s["input_ids"]), 3 * 576) and s["hidden"].shape[1] == 576
    model = load_target(Path(ds.manifest["target"]["path"]), torch.bfloat16)
    with torch.no_grad():
        logits = model(s["input_ids"].long()[None]).logits[0].float()
    assert (logits.argmax(-1) == s["target_argmax"].long()).float().mean() > 0.95


def test_an_empty_train_split_is_one_line(tmp_path):
    """--split heldout where every conversation is held out: the draft vocabulary (counted on the train split)
    stopped train.dump and train.fit --online with torch.cat's ValueError traceback; now a UserError naming the
    split, the data and the fraction. The control: the same data with more of it in training gives samples."""
    import argparse

    from maverick.cli import UserError
    from train.data import is_heldout
    from train.samples import chat_samples

    ids = [f"c{i}" for i in range(40)]
    held = next(i for i in ids if is_heldout(i, 0.99, 0))
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "\n".join(
            json.dumps(
                {
                    "id": i,
                    "messages": [
                        {"role": "user", "content": f"Question {i}?"},
                        {"role": "assistant", "content": f"Answer {i}."},
                    ],
                }
            )
            for i in [held] + [i for i in ids if i != held]
        )  # fmt: skip
    )
    args = argparse.Namespace(data=str(chats), split="heldout", max_samples=None, max_conversations=1,
                              max_length=64, heldout_fraction=0.99, split_seed=0, cache_dir=str(tmp_path / "c"))  # fmt: skip
    with pytest.raises(UserError, match=rf"^no samples in the train split of {chats} \(1 conversations, "
                       r"--heldout-fraction 0.99\), on which the draft vocabulary is counted"):  # fmt: skip
        chat_samples(args, None)
    args.max_conversations, args.heldout_fraction = 40, 0.5
    samples, train, data = chat_samples(args, None)
    assert len(samples) >= 1 and len(train) >= 1 and data["num_samples"] == len(samples)
