"""train.fit refuses what would silently corrupt or lose a run: a shard whose bytes changed (sha256, on by
default), a manifest whose totals disagree with its shards, a non-finite step (stops before applying it,
keeps the last good checkpoint), an --out that holds an earlier run (unless --resume / --overwrite)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import tests.test_fit as tf
import train.samples as train_samples
from maverick.checkpoint import save_hf
from maverick.cli import UserError
from maverick.target import target_identity
from tests.test_fit import ROOT, draft_weights, records, run
from train.dump import DumpDataset, DumpError, DumpSettings, write_dumps
from train.fit import NonFiniteStep
from train.online import OnlineDataset


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes on a shared CPU: see tests/test_fit.py
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """test_fit's tiny target (an HF directory), 16 samples dumped from it, a 256-token draft vocab."""
    root = tmp_path_factory.mktemp("tiny")
    model, samples = tf.tiny_target(), tf.tiny_samples(16)
    save_hf(model, root / "target")
    d2t, t2d, _ = train_samples.draft_vocab_from(samples, 512, 256)
    data = {"source": "test", "split": "train", "num_samples": len(samples),
            "fingerprint": train_samples.samples_fingerprint(samples)}  # fmt: skip
    target = target_identity(root / "target") | {"dtype": "fp32"}
    settings = DumpSettings(target, tf.LAYERS, "bf16", 32, 8, data)
    write_dumps(model, samples, root / "dumps", settings, batch_tokens=1, vocab=(d2t, t2d), progress=False)
    return {"root": root, "model": model, "samples": samples, "vocab": (d2t, t2d)}


class NaNAfter:
    """The dumps, but every sample fetched from the `n`-th fetch on has NaN features (corrupt data that
    passed unverified)."""

    def __init__(self, data, n: int):
        self.data, self.n, self.fetches = data, n, 0
        self.lengths, self.feature_layers = data.lengths, data.feature_layers

    def __len__(self):
        return len(self.data)

    def fetch(self, indices):
        self.fetches += 1
        out = self.data.fetch(indices)
        if self.fetches >= self.n:
            out = [dict(s, features=torch.full_like(s["features"], float("nan"))) for s in out]
        return out


def test_non_finite_step_stops_and_keeps_the_last_good_checkpoint(tiny, tmp_path):
    data = NaNAfter(DumpDataset(tiny["root"] / "dumps"), n=4)  # steps 1-3 clean, step 4 NaN
    with pytest.raises(NonFiniteStep, match=r"step 4: .*not finite.*last good checkpoint is .*step-0000002"):
        run(tiny, tmp_path, data=data, steps=10, checkpoint_every=2)
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3]  # step 4 never logged
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-0000002"]
    assert not (tmp_path / "draft").exists()
    ck = draft_weights(tmp_path / "checkpoints" / "step-0000002")
    assert all(torch.isfinite(v.float()).all() for v in ck.values())


def test_out_holding_a_run_is_refused_unless_resume_or_overwrite(tiny, tmp_path):
    run(tiny, tmp_path, steps=2)
    before = (tmp_path / "train_log.jsonl").read_text()
    with pytest.raises(
        UserError, match=rf"--out {tmp_path} holds an earlier run \(train_log.jsonl, checkpoints, draft"
    ):
        run(tiny, tmp_path, steps=3)
    assert (tmp_path / "train_log.jsonl").read_text() == before  # nothing touched
    run(tiny, tmp_path, steps=3, overwrite=True)
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-0000003"]  # step-2 gone
    run(tiny, tmp_path, steps=3, resume="auto")  # a resume into its own directory is what --out is for


def _copy_dumps(tiny, tmp_path):
    import shutil

    d = tmp_path / "dumps"
    shutil.copytree(tiny["root"] / "dumps", d)
    return d


def test_dumps_are_verified_by_default_from_the_cli(tiny, tmp_path):
    d = _copy_dumps(tiny, tmp_path)
    shard = d / "shard-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-2048:] = bytes(2048)  # 2 KB overwritten, the size unchanged
    shard.write_bytes(bytes(raw))
    DumpDataset(d)  # the size and header still look right
    cmd = [sys.executable, "-m", "train.fit", "--dumps", str(d), "--out", str(tmp_path / "run"),
           "--target", str(tiny["root"] / "target"), "--steps", "1", "--tracker", "none", "--no-progress"]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    err = p.stderr.strip().splitlines()
    assert err[-1] == f"error: {shard}: sha256 differs from the manifest (corrupt shard)"
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "run" / "train_log.jsonl").exists()
    with pytest.raises(DumpError, match="sha256"):
        DumpDataset(d, verify=True)


def test_manifest_totals_must_match_the_shard_list(tiny, tmp_path):
    d = _copy_dumps(tiny, tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    for key, value in (("tokens", m["tokens"] + 1), ("samples", m["samples"] - 8)):
        (d / "manifest.json").write_text(json.dumps(dict(m, **{key: value})))
        with pytest.raises(DumpError, match=rf"manifest.json: {key} is {value} but its shard list sums to"):
            DumpDataset(d)
    shards = [dict(e) for e in m["shards"]]
    shards[1]["first_sample"] = 0  # two shards claiming the same samples
    (d / "manifest.json").write_text(json.dumps(dict(m, shards=shards)))
    with pytest.raises(DumpError, match="starts at sample 0, expected 8"):
        DumpDataset(d)
    (d / "manifest.json").write_text(json.dumps(dict(m, shards=m["shards"][:1])))  # "complete", one shard
    with pytest.raises(DumpError, match="sums to"):
        DumpDataset(d)


def _dump(tiny, out, samples, dtype, layers=tf.LAYERS):
    """tiny's samples (or others of the same lengths) dumped with the target record's dtype `dtype`."""
    data = {"source": "test", "split": "train", "num_samples": len(samples),
            "fingerprint": train_samples.samples_fingerprint(samples)}  # fmt: skip
    target = target_identity(tiny["root"] / "target") | {"dtype": dtype}
    settings = DumpSettings(target, layers, "bf16", 32, 8, data)
    write_dumps(tiny["model"], samples, out, settings, batch_tokens=1, vocab=tiny["vocab"], progress=False)
    return DumpDataset(out)


def test_resume_refuses_other_data_of_the_same_lengths(tiny, tmp_path):
    """The checkpoint's data check was a hash of the sample lengths: a run started on one target dtype's dumps
    resumed on another's (or on other samples of the same lengths, or online on another target) without a
    word. The checkpoint now holds the data's identity (samples fingerprint, target, features) and names what
    differs; a checkpoint saved before it (no identity) resumes as before."""
    kw = dict(steps=4, checkpoint_every=2)
    run(tiny, tmp_path / "run", stop_after=2, **kw)  # tiny's dumps: target dtype fp32
    state = torch.load(tmp_path / "run/checkpoints/step-0000002/training_state.pt", weights_only=True)
    assert state["data"]["identity"]["target.dtype"] == "fp32"
    bf16 = _dump(tiny, tmp_path / "bf16", tiny["samples"], "bf16")
    with pytest.raises(UserError, match=r"trained on other data \(target.dtype 'fp32', 'bf16': saved, now\)"):
        run(tiny, tmp_path / "run", data=bf16, resume="auto", **kw)
    shifted = [dict(s, input_ids=(s["input_ids"] + 1) % 512) for s in tiny["samples"]]  # the same lengths
    other = _dump(tiny, tmp_path / "other", shifted, "fp32")
    fp = state["data"]["identity"]["samples"][0][:12]
    with pytest.raises(
        UserError, match=rf"other data \(samples \['{fp}'\], \['[0-9a-f]{{12}}'\]: saved, now\)"
    ):
        run(tiny, tmp_path / "run", data=other, resume="auto", **kw)
    target = {"size": 1, "dtype": "fp32"}  # online: the samples and the target it was loaded from
    online = OnlineDataset(tiny["model"], tiny["samples"], tf.LAYERS, batch_tokens=1, target=target)
    run(tiny, tmp_path / "online", data=online, stop_after=2, **kw)
    online = OnlineDataset(
        tiny["model"], tiny["samples"], tf.LAYERS, batch_tokens=1, target=target | {"dtype": "bf16"}
    )
    with pytest.raises(UserError, match=r"other data \(target.dtype 'fp32', 'bf16': saved, now\)"):
        run(tiny, tmp_path / "online", data=online, resume="auto", **kw)
    assert [r["step"] for r in records(tmp_path / "run")] == [1, 2]  # nothing trained
    # the control: a checkpoint saved before the identity was recorded resumes on the bf16 dumps
    del state["data"]["identity"]
    torch.save(state, tmp_path / "run/checkpoints/step-0000002/training_state.pt")
    run(tiny, tmp_path / "run", data=bf16, resume="auto", **kw)
    assert [r["step"] for r in records(tmp_path / "run")] == [1, 2, 3, 4]


def test_eval_dumps_must_be_the_training_dumps_kind(tiny, tmp_path):
    """--eval-dumps made with other feature layers (or another target dtype) than --dumps were scored every
    --eval-every steps, a held-out loss that means nothing; now refused before the run, naming the field."""
    layers = _dump(tiny, tmp_path / "layers", tiny["samples"][:8], "fp32", layers=(3, 2, 1))
    with pytest.raises(UserError, match=r"--eval-dumps .*/layers: not dumps of the training data's target and "
                       r"features \(feature_layers \[3, 2, 1\], \[1, 2, 3\]: held-out, training\)"):  # fmt: skip
        run(tiny, tmp_path / "a", steps=2, eval_every=2, eval_data=layers)
    bf16 = _dump(tiny, tmp_path / "bf16", tiny["samples"][:8], "bf16")
    with pytest.raises(UserError, match=r"\(target.dtype 'bf16', 'fp32': held-out, training\)"):
        run(tiny, tmp_path / "b", steps=2, eval_every=2, eval_data=bf16)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before the run
    same = _dump(tiny, tmp_path / "same", tiny["samples"][:8], "fp32")  # the control: the same kind is scored
    run(tiny, tmp_path / "c", steps=2, eval_every=2, eval_data=same)
    assert "eval_loss" in records(tmp_path / "c")[-1]
