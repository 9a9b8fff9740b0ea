"""Draft training: the loss pieces against train/ttt.py, learning on a tiny target, bit-identical resume,
2-process DDP (gloo) == 1 process, online == dumps, FP8, CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from eagle3.draft import DraftConfig, Eagle3Draft, load_draft, save_draft
from maverick.checkpoint import save_hf
from maverick.cli import UserError
from maverick.config import get_config
from maverick.model import Llama4
from maverick.target import target_identity
from train.dump import DumpDataset, DumpSettings, write_dumps
from train.fit import (
    FitConfig,
    TTTObjective,
    WarmupCosine,
    collate,
    epoch_batches,
    grow_vocab,
    soft_cross_entropy,
    step_counts,
    train,
    ttt_step_sums,
)
from train.online import OnlineDataset
from train.samples import draft_vocab_from, samples_fingerprint
from train.ttt import TTTBatch, target_draft_logits, ttt_loss

LAYERS = (1, 2, 3)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny shapes: one thread is fastest, and on shared busy cores a second OpenMP thread that gets
    descheduled stalls every op (measured: 40x slower steps)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_target() -> Llama4:
    model = Llama4(get_config("tiny-dense"))
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    with (
        torch.no_grad()
    ):  # a sharper head (tied embeddings) so the target's next-token distribution is peaked
        model.model.embed_tokens.weight.mul_(8)
    return model.eval()


def tiny_samples(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        T = int(torch.randint(8, 33, (1,), generator=g))
        mask = torch.zeros(T, dtype=torch.uint8)
        mask[T // 4 :] = 1
        out.append(
            {"input_ids": torch.randint(0, 512, (T,), generator=g, dtype=torch.int32), "loss_mask": mask}
        )
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny target saved as an HF directory, 16 samples dumped from it, a 256-token draft vocab."""
    root = tmp_path_factory.mktemp("tiny")
    model, samples = tiny_target(), tiny_samples(16)
    save_hf(model, root / "target")
    d2t, t2d, _ = draft_vocab_from(samples, 512, 256)
    data = {"source": "test", "split": "train", "num_samples": len(samples),
            "fingerprint": samples_fingerprint(samples)}  # fmt: skip
    target = target_identity(root / "target") | {"dtype": "fp32"}
    settings = DumpSettings(target, LAYERS, "bf16", 32, 8, data)
    write_dumps(model, samples, root / "dumps", settings, batch_tokens=1, vocab=(d2t, t2d), progress=False)
    return {"root": root, "model": model, "samples": samples, "vocab": (d2t, t2d)}


def run(tiny, out, data=None, callback=None, eval_data=None, **kw):
    m = tiny["model"]
    defaults = dict(steps=10, batch_size=4, lr=3e-3, warmup=2, bf16=False, tracker="none", progress=False)
    cfg = FitConfig(out=str(out), **(defaults | kw))
    data = data if data is not None else DumpDataset(tiny["root"] / "dumps")
    w = m.model.embed_tokens.weight.detach()
    return train(cfg, data, tiny["vocab"], w, w, m.config, eval_data=eval_data, step_callback=callback)


def records(out) -> list[dict]:
    return [json.loads(x) for x in (Path(out) / "train_log.jsonl").read_text().splitlines()]


def draft_weights(out) -> dict[str, torch.Tensor]:
    return load_file(str(Path(out) / "draft" / "model.safetensors"))


def make_batch(seed=0):
    target = get_config("tiny-dense")
    cfg = DraftConfig.for_target(target, draft_vocab_size=128, feature_layers=LAYERS)
    draft = Eagle3Draft(cfg)
    draft.init_weights(std=0.2, generator=torch.Generator().manual_seed(seed))
    d2t, t2d = draft_vocab_from(tiny_samples(8, seed), 512, 128)[:2]
    draft.set_vocab(d2t, t2d)
    g = torch.Generator().manual_seed(seed)
    B, T, H = 3, 14, 64
    samples = []
    for b in range(B):
        L = T - 3 * b  # right padding in the batch
        samples.append({
            "input_ids": torch.randint(0, 512, (L,), generator=g), "loss_mask": (torch.rand(L, generator=g) > 0.3).to(torch.uint8),
            "features": torch.randn(L, 3 * H, generator=g).bfloat16(), "hidden": torch.randn(L, H, generator=g).bfloat16(),
        })  # fmt: skip
    head = torch.randn(512, H, generator=g)
    for s in samples:
        s["target_argmax"] = (s["hidden"].float() @ head.T).argmax(-1).int()
    emb = torch.nn.Embedding(512, H)
    return draft, emb, samples, head


def test_grown_vocab_keeps_the_drafts_logits_and_starts_new_tokens_at_zero():
    """grow_vocab: every old token keeps its lm_head row (its logit on any state is the old draft's), the
    new ones are the most frequent others and score exactly 0, every other weight is the draft's."""
    src, *_ = make_batch()
    counts = torch.randint(0, 100, (512,), generator=torch.Generator().manual_seed(3))
    grown = grow_vocab(src, counts, 200)
    assert grown.config.draft_vocab_size == 200 and grown.d2t.numel() == 200
    old_ids, new_ids = src.draft_to_target_ids.tolist(), grown.draft_to_target_ids.tolist()
    added = sorted(set(new_ids) - set(old_ids))
    assert set(old_ids) <= set(new_ids) and len(added) == 72
    others = sorted(set(range(512)) - set(old_ids), key=lambda t: (-int(counts[t]), t))
    assert added == sorted(others[:72])
    h = torch.randn(4, 9, 64, generator=torch.Generator().manual_seed(4))
    before, after = src.logits(h), grown.logits(h)
    col = {t: i for i, t in enumerate(new_ids)}
    torch.testing.assert_close(after[..., [col[t] for t in old_ids]], before, rtol=0, atol=1e-6)
    assert bool((after[..., [col[t] for t in added]] == 0).all())
    a, b = src.state_dict(), grown.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if k not in ("d2t", "t2d", "lm_head.weight"))


def test_grown_vocab_matches_rows_by_target_id_when_the_map_is_unsorted():
    """A draft from elsewhere may list its tokens in any order (d2t need only be one-to-one): the grown
    draft gives each old target token the old draft's logit, whatever the order (it copied rows in draft-id
    order before, so each row landed under another token)."""
    src, *_ = make_batch()
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(5))
    ids = src.draft_to_target_ids[perm]
    assert not bool((ids[1:] > ids[:-1]).all())
    with torch.no_grad():
        src.lm_head.weight.copy_(src.lm_head.weight[perm])
    src.set_vocab(ids - torch.arange(128), src.t2d)
    grown = grow_vocab(src, torch.ones(512, dtype=torch.long), 200)
    h = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(6))
    before, after = src.logits(h), grown.logits(h)
    col = {t: i for i, t in enumerate(grown.draft_to_target_ids.tolist())}
    torch.testing.assert_close(after[..., [col[t] for t in ids.tolist()]], before, rtol=0, atol=1e-6)


def test_collate_equals_target_draft_logits():
    draft, _, samples, head = make_batch()
    b = collate(samples, head[draft.draft_to_target_ids], draft.t2d)
    for i, s in enumerate(samples):
        L = len(s["input_ids"])
        logits, in_vocab = target_draft_logits(s["hidden"].float(), head, draft)
        assert torch.allclose(b.target_logits[i, :L], logits, atol=1e-4)
        assert torch.equal(b.target_in_vocab[i, :L], in_vocab)
        assert (
            not b.target_in_vocab[i, L:].any()
            and not b.attention_valid[i, L:].any()
            and b.attention_valid[i, :L].all()
        )
        assert not b.loss_mask[i, L:].any()
    assert 0 < b.target_in_vocab.sum() < b.attention_valid.sum()  # some argmaxes fall outside the draft vocab


def test_step_sums_normalised_locally_equal_ttt_loss():
    draft, emb, samples, head = make_batch()
    b = collate(samples, head[draft.draft_to_target_ids], draft.t2d)
    loss, stats = ttt_loss(draft, emb, b, steps=5, decay=0.8)
    ce, correct = ttt_step_sums(draft, emb, b, steps=5)
    counts = step_counts(b, 5)
    assert counts.tolist() == [int(c) for c in stats["count"]]
    mine = sum(0.8**i * ce[i] / counts[i].clamp(min=1) for i in range(5))
    assert torch.allclose(mine, loss, rtol=1e-5)
    assert torch.allclose(correct / counts.clamp(min=1), torch.stack(stats["acc"]).float(), atol=1e-6)
    # gradients agree too
    params = (draft.fc.weight, draft.lm_head.weight)  # lm_head: only valid positions reach it now
    for g1, g2 in zip(
        torch.autograd.grad(loss, params, retain_graph=True), torch.autograd.grad(mine, params)
    ):
        assert torch.allclose(g1, g2, rtol=1e-4, atol=1e-5)  # |g| ~ 0.8, float reassociation ~ 5e-7
    # a batch shorter than the unroll: the missing steps count 0 and contribute 0
    short = TTTBatch(*(t[:, :4] if t.dim() == 2 else t[:, :4] for t in (b.input_ids, b.loss_mask, b.features,
                     b.target_logits, b.target_in_vocab, b.attention_valid)))  # fmt: skip
    ce, _ = TTTObjective(draft, emb.weight, 5)(*dataclasses.astuple(short))
    assert ce.shape == (5,) and (ce[3:] == 0).all() and step_counts(short, 5)[2:].sum() == 0


def test_soft_cross_entropy_equals_log_softmax_form():
    """The fused soft CE (logsumexp - p.z, gradient softmax - p) against autograd through log_softmax, on
    fp32 and bf16 logits (bf16: computed in fp32 from the bf16 values, gradient returned in bf16)."""
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(6, 50, generator=g) * 3, -1)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        z = (torch.randn(6, 50, generator=g) * 4).to(dtype).requires_grad_()
        w = torch.rand(6, generator=g)
        ref = -(p * F.log_softmax(z.float(), -1)).sum(-1)
        mine = soft_cross_entropy(z, p)
        assert torch.allclose(mine, ref, rtol=1e-6, atol=1e-6)
        (gr,) = torch.autograd.grad((ref * w).sum(), z)
        (gm,) = torch.autograd.grad((mine * w).sum(), z)
        assert gm.dtype == dtype and torch.allclose(gm.float(), gr.float(), rtol=tol, atol=tol)


def test_epoch_batches_deterministic_and_grouped():
    lengths = [int(x) for x in torch.randint(5, 500, (203,), generator=torch.Generator().manual_seed(0))]
    a = epoch_batches(lengths, 8, seed=1, epoch=0)
    assert a == epoch_batches(lengths, 8, seed=1, epoch=0)
    assert a != epoch_batches(lengths, 8, seed=1, epoch=1) and a != epoch_batches(lengths, 8, seed=2, epoch=0)
    flat = [i for b in a for i in b]
    assert len(a) == 25 and all(len(b) == 8 for b in a) and len(set(flat)) == 200
    pad = lambda bs: sum(len(b) * max(lengths[i] for i in b) - sum(lengths[i] for i in b) for b in bs)  # noqa: E731
    assert pad(a) < 0.3 * pad(epoch_batches(lengths, 8, seed=1, epoch=0, group_by_length=False))


def test_warmup_cosine():
    f = WarmupCosine(warmup=4, total=24, min_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert (
        f(14) == pytest.approx(0.1 + 0.9 * 0.5)
        and f(24) == pytest.approx(0.1)
        and f(100) == pytest.approx(0.1)
    )


def test_loss_decreases_on_tiny_target(tiny, tmp_path):
    summary = run(tiny, tmp_path, steps=60, warmup=5, lr=3e-3)
    recs = records(tmp_path)
    assert [r["step"] for r in recs] == list(range(1, 61)) and summary["step"] == 60
    first, last = recs[0], recs[-1]
    assert first["loss"] == pytest.approx(sum(0.8**i * math.log(256) for i in range(7)), rel=0.05)  # ~uniform
    assert sum(r["loss"] for r in recs[-5:]) / 5 < 0.7 * first["loss"]
    assert last["acc_i"][0] > first["acc_i"][0] + 0.3
    assert (tmp_path / "curve.png").stat().st_size > 10_000
    draft = load_draft(tmp_path / "draft")  # the EAGLE-3 format, loadable as released drafts are
    assert torch.equal(draft.d2t, tiny["vocab"][0]) and draft.config.feature_layers == LAYERS


def test_heldout_evaluation(tiny, tmp_path):
    heldout = DumpDataset(tiny["root"] / "dumps")
    run(tiny, tmp_path, steps=4, eval_every=2, eval_data=heldout)
    recs = records(tmp_path)
    assert ["eval_loss" in r for r in recs] == [False, True, False, True]
    # the last evaluation scored the final draft on all 16 samples: recompute it in one padded batch
    draft = load_draft(tmp_path / "draft")
    w = tiny["model"].model.embed_tokens.weight.detach()
    b = collate(heldout.fetch(range(16)), w[draft.draft_to_target_ids], draft.t2d)
    with torch.no_grad():
        ce, correct = ttt_step_sums(draft, lambda ids: torch.nn.functional.embedding(ids, w), b, 7)
    counts = step_counts(b, 7).clamp(min=1)
    assert recs[-1]["eval_loss_i"] == pytest.approx((ce / counts).tolist(), rel=1e-4, abs=1e-5)
    assert recs[-1]["eval_acc_i"] == pytest.approx((correct / counts).tolist(), abs=1e-5)


class Crash(Exception):
    pass


def test_resume_is_bit_identical(tiny, tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    run(tiny, full, steps=10, checkpoint_every=5)

    def crash_at_7(step, record):
        if step == 7:
            raise Crash

    with pytest.raises(Crash):
        run(tiny, cut, steps=10, checkpoint_every=5, callback=crash_at_7)
    assert [p.name for p in (cut / "checkpoints").iterdir()] == ["step-0000005"] and not (
        cut / "draft"
    ).exists()
    run(tiny, cut, steps=10, checkpoint_every=5, resume="auto")
    a, b = draft_weights(full), draft_weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = records(full), records(cut)
    assert [r["step"] for r in rb] == list(range(1, 11))  # steps 6-7 of the crashed run were dropped, redone
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]
    state = torch.load(cut / "checkpoints" / "step-0000010" / "training_state.pt", weights_only=True)
    assert state["step"] == 10 and state["data"]["epoch"] == 2 and state["data"]["position"] == 2
    with pytest.raises(ValueError, match="different settings"):
        run(tiny, cut, steps=10, lr=1e-3, resume="auto")


def test_stopped_and_resumed_log_equals_the_uninterrupted_one(tiny, tmp_path):
    """--stop-after 3 logs step 3 (where it stopped, off the every-2 grid); resumed, the log is the
    uninterrupted run's [2, 4, 6] (before: [2, 3, 4, 6]), and a last line cut off mid-write is dropped, not
    a JSONDecodeError that stops --resume."""
    kw = dict(steps=6, log_every=2, checkpoint_every=2)
    run(tiny, tmp_path / "full", **kw)
    cut = tmp_path / "cut"
    run(tiny, cut, stop_after=3, **kw)
    assert [r["step"] for r in records(cut)] == [2, 3]
    with open(cut / "train_log.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 1.2')  # a kill mid-append
    run(tiny, cut, resume="auto", **kw)
    assert [r["step"] for r in records(cut)] == [2, 4, 6]
    assert [r["loss"] for r in records(cut)] == [r["loss"] for r in records(tmp_path / "full")]


def test_a_truncated_checkpoint_on_resume_is_one_line(tiny, tmp_path):
    """A training state or checkpoint draft cut short (a full disk, a copy) stopped --resume with a zip or
    safetensors traceback; now a UserError naming the file and saying what to delete."""
    from maverick.cli import UserError

    run(tiny, tmp_path, steps=2, checkpoint_every=2)
    ck = tmp_path / "checkpoints" / "step-0000002"
    state = ck / "training_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(UserError, match=f"{state}: a truncated or corrupt checkpoint .*delete {ck}"):
        run(tiny, tmp_path, steps=4, checkpoint_every=2, resume="auto")


def test_grad_accumulation_equals_one_big_batch(tiny, tmp_path):
    run(tiny, tmp_path / "a", steps=3, batch_size=4)
    run(tiny, tmp_path / "b", steps=3, batch_size=2, grad_accum=2)
    a, b = draft_weights(tmp_path / "a"), draft_weights(tmp_path / "b")
    # float reassociation through Adam: seen up to 1.1e-6; a wrong normalisation moves weights by ~lr (3e-3)
    assert all(torch.allclose(a[k].float(), b[k].float(), atol=5e-6, rtol=0) for k in a)


def test_init_draft_keeps_its_positions_and_norms(tiny, tmp_path):
    """--init-draft rebuilt the draft's config from the target's: an outside draft's rope_theta, rope_scaling
    and rms_norm_eps (SpecForge's Llama-3 configs leave rope_theta out: 10000 against the target's 500000)
    were replaced without a word, so training went on from another function (logits 0.1 apart, argmax 0.865
    in the review's example). train.stage kept them already."""
    run(tiny, tmp_path / "a", steps=2)
    cfg_file = tmp_path / "a" / "draft" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    mine = {"rope_theta": 1234.0, "rms_norm_eps": 1e-3, "max_position_embeddings": 777}
    assert all(cfg[k] != v for k, v in mine.items())
    cfg_file.write_text(json.dumps(cfg | mine))
    run(tiny, tmp_path / "b", steps=2, lr=0.0, init_draft=str(tmp_path / "a" / "draft"))
    got = json.loads((tmp_path / "b" / "draft" / "config.json").read_text())
    assert {k: got[k] for k in mine} == mine
    a, b = draft_weights(tmp_path / "a"), draft_weights(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_init_draft_continues_from_saved_weights(tiny, tmp_path):
    """--init-draft: a run that starts from a saved draft with lr 0 ends with exactly its weights; with a
    learning rate its first loss is that draft's loss on the first batch (below a random draft's). A draft
    with another vocabulary keeps it; with --new-vocab the run takes the data's vocabulary and gets the
    draft's lm_head rows of the shared tokens and every other weight. A checkpoint resumes only under the
    vocabulary it was trained with."""
    run(tiny, tmp_path / "a", steps=30, warmup=2)
    run(tiny, tmp_path / "b", steps=2, lr=0.0, init_draft=str(tmp_path / "a" / "draft"))
    a, b = draft_weights(tmp_path / "a"), draft_weights(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    run(tiny, tmp_path / "c", steps=1, init_draft=str(tmp_path / "a" / "draft"))
    first_c, first_b, random_start = (records(tmp_path / x)[0]["loss"] for x in "cba")
    assert first_c == first_b and first_c < random_start - 2.0

    other = load_draft(tmp_path / "a" / "draft")  # same weights, another vocabulary
    d2t, t2d = draft_vocab_from(tiny_samples(16, seed=5), 512, 256)[:2]
    assert not torch.equal(d2t, tiny["vocab"][0])
    other.set_vocab(d2t, t2d)
    save_draft(other, tmp_path / "other")
    run(tiny, tmp_path / "kept", steps=2, lr=0.0, init_draft=str(tmp_path / "other"))
    kept = draft_weights(tmp_path / "kept")
    assert torch.equal(kept["d2t"], d2t) and all(
        torch.equal(a[k], kept[k]) for k in a if k not in ("d2t", "t2d")
    )

    run(tiny, tmp_path / "d", steps=2, lr=0.0, init_draft=str(tmp_path / "other"), new_vocab=True)
    d = draft_weights(tmp_path / "d")
    assert torch.equal(d["d2t"], tiny["vocab"][0])
    assert all(torch.equal(a[k], d[k]) for k in a if k != "lm_head.weight")
    ours = (torch.arange(256) + tiny["vocab"][0]).tolist()  # target id of each of the run's draft ids
    theirs = {t: i for i, t in enumerate((torch.arange(256) + d2t).tolist())}
    shared = [(i, theirs[t]) for i, t in enumerate(ours) if t in theirs]
    assert 0 < len(shared) < 256
    for i, j in shared:
        assert torch.equal(d["lm_head.weight"][i], a["lm_head.weight"][j])
    assert not torch.equal(d["lm_head.weight"], a["lm_head.weight"])

    # a draft of a larger vocabulary (320) continued under the data's (256): its shared rows carried (the
    # size was refused, "draft_vocab_size=320, this run needs 256", though --new-vocab takes any vocabulary)
    counts = torch.bincount(
        torch.cat([s["input_ids"] for s in tiny_samples(16, seed=6)]).long(), minlength=512
    )
    big = grow_vocab(load_draft(tmp_path / "a" / "draft"), counts, 320)
    save_draft(big, tmp_path / "big")
    run(tiny, tmp_path / "g", steps=2, lr=0.0, init_draft=str(tmp_path / "big"), new_vocab=True)
    g = draft_weights(tmp_path / "g")
    assert torch.equal(g["d2t"], tiny["vocab"][0]) and all(
        torch.equal(a[k], g[k]) for k in a if k != "lm_head.weight"
    )
    theirs = {t: i for i, t in enumerate(big.draft_to_target_ids.tolist())}
    assert all(
        torch.equal(g["lm_head.weight"][i], big.lm_head.weight[theirs[t]])
        for i, t in enumerate(ours)
        if t in theirs
    )

    run(tiny, tmp_path / "e", steps=4, checkpoint_every=2, init_draft=str(tmp_path / "other"), new_vocab=True)
    with pytest.raises(UserError, match="draft vocabulary is not this run's.*--new-vocab"):
        run(
            tiny,
            tmp_path / "e",
            steps=4,
            checkpoint_every=2,
            init_draft=str(tmp_path / "other"),
            resume="auto",
        )


def test_eagle31_carries_an_eagle3_draft_and_keeps_its_norms(tiny, tmp_path):
    """--eagle-3.1 from an EAGLE-3 draft: with lr 0 the run ends with that draft's weights plus the two new
    norms (fc_norm on each aux feature, at the scale of its features: `scale_fc_norms`; norm_output: no
    tensor of its own), and it learns from there.
    A run continued from the EAGLE-3.1 draft without the flag stays EAGLE-3.1; a checkpoint does not resume
    with the flag changed."""
    run(tiny, tmp_path / "a", steps=10)
    run(tiny, tmp_path / "b", steps=2, lr=0.0, eagle31=True, init_draft=str(tmp_path / "a" / "draft"))
    a, b = draft_weights(tmp_path / "a"), draft_weights(tmp_path / "b")
    assert set(b) - set(a) == {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}
    assert all(torch.equal(a[k], b[k]) for k in a)
    # fc_norm starts at the median RMS of each aux layer's features (of the first 16 samples)
    feats = torch.cat([f["features"].float() for f in DumpDataset(tiny["root"] / "dumps").fetch(range(16))])
    for i, part in enumerate(feats.chunk(3, -1)):
        want = part.pow(2).mean(-1).sqrt().median()
        assert torch.allclose(b[f"fc_norm.{i}.weight"].float(), want.expand(64), rtol=1e-6), i
    cfg = load_draft(tmp_path / "b" / "draft").config
    assert cfg.fc_norm and cfg.norm_output and not cfg.norm_before_fc

    run(
        tiny,
        tmp_path / "c",
        steps=8,
        eagle31=True,
        init_draft=str(tmp_path / "a" / "draft"),
        checkpoint_every=4,
    )
    losses = [r["loss"] for r in records(tmp_path / "c")]
    assert losses[-1] < losses[0]
    run(tiny, tmp_path / "d", steps=1, lr=0.0, init_draft=str(tmp_path / "c" / "draft"))
    assert load_draft(tmp_path / "d" / "draft").config.fc_norm
    with pytest.raises(ValueError, match=r"different settings.*'eagle31': \(True, False\)"):
        run(
            tiny,
            tmp_path / "c",
            steps=10,
            checkpoint_every=4,
            init_draft=str(tmp_path / "a" / "draft"),
            resume="auto",
        )


def test_resume_builds_the_checkpoints_draft_or_refuses(tiny, tmp_path):
    """A run from an --init-draft takes that draft's norm variants; resumed without --init-draft it built a
    plain draft: norm_before_residual (no tensor) was dropped silently and training went on (exit 0), an
    EAGLE-3.1 init draft's fc_norm tensors stopped it with a load_state_dict traceback. Both are now one
    UserError naming the field; resumed with the same --init-draft, the run ends as the uninterrupted one."""
    run(tiny, tmp_path / "a", steps=2)
    src = load_draft(tmp_path / "a" / "draft")
    for variant in ("norm_before_residual", "fc_norm"):
        d = Eagle3Draft(dataclasses.replace(src.config, **{variant: True}))
        d.load_state_dict(src.state_dict(), strict=False)  # fc_norm's weights stay at 1
        save_draft(d, tmp_path / variant)
        kw = dict(steps=4, checkpoint_every=2, init_draft=str(tmp_path / variant))
        run(tiny, tmp_path / f"full-{variant}", **kw)
        cut = tmp_path / f"cut-{variant}"
        run(tiny, cut, stop_after=2, **kw)
        with pytest.raises(
            UserError, match=rf"draft/config.json: the checkpoint's draft is not the one this run builds "
            rf"\({variant}=True there, False now\); resume with the --init-draft"
        ):  # fmt: skip
            run(tiny, cut, steps=4, checkpoint_every=2, resume="auto")
        assert [r["step"] for r in records(cut)] == [1, 2]  # nothing trained
        run(tiny, cut, resume="auto", **kw)  # the control: with its --init-draft it resumes
        assert getattr(load_draft(cut / "draft").config, variant)
        assert [r["loss"] for r in records(cut)] == [r["loss"] for r in records(tmp_path / f"full-{variant}")]


def test_online_equals_dumps(tiny, tmp_path):
    online = OnlineDataset(tiny["model"], tiny["samples"], LAYERS, batch_tokens=1)
    run(tiny, tmp_path / "dumps", steps=3)
    run(tiny, tmp_path / "online", data=online, steps=3)
    a, b = draft_weights(tmp_path / "dumps"), draft_weights(tmp_path / "online")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bf16_autocast_trains(tiny, tmp_path):
    run(tiny, tmp_path, steps=20, bf16=True, warmup=2)
    recs = records(tmp_path)
    assert all(math.isfinite(r["loss"]) for r in recs) and recs[-1]["loss"] < 0.9 * recs[0]["loss"]
    assert draft_weights(tmp_path)["fc.weight"].dtype == torch.float32  # fp32 master weights


def test_fp8_flag(tiny, tmp_path):
    fp8 = pytest.importorskip("maverick.fp8")
    run(tiny, tmp_path, steps=4, fp8=True, checkpoint_every=2)
    recs = records(tmp_path)
    assert all(math.isfinite(r["loss"]) for r in recs)
    draft = load_draft(tmp_path / "draft")  # saved without FP8 scaling buffers
    assert not any(isinstance(m, fp8.Float8Linear) for m in draft.modules())
    run(
        tiny,
        tmp_path,
        steps=4,
        fp8=True,
        checkpoint_every=2,
        resume=str(tmp_path / "checkpoints" / "step-0000002"),
    )


def test_fp8_heldout_scoring_leaves_the_training_alone(tiny, tmp_path):
    """The held-out forward ran through the FP8 layers: its amaxes joined the delayed-scaling histories and
    the next scales, so scoring changed the trained weights (1e-3 after 4 steps). It is scored in high
    precision now (the draft that is saved and served), and the weights equal a run without scoring."""
    heldout = DumpDataset(tiny["root"] / "dumps")
    run(tiny, tmp_path / "plain", steps=4, fp8=True, lr=1e-3)
    run(tiny, tmp_path / "scored", steps=4, fp8=True, lr=1e-3, eval_every=1, eval_data=heldout)
    a, b = draft_weights(tmp_path / "plain"), draft_weights(tmp_path / "scored")
    assert all(torch.equal(a[k], b[k]) for k in a), max((a[k] - b[k]).abs().max().item() for k in a)
    assert [r["loss"] for r in records(tmp_path / "plain")] == [
        r["loss"] for r in records(tmp_path / "scored")
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_two_processes_equal_one(tiny, tmp_path):
    """torchrun, 2 processes on gloo x 2 samples == 1 process x 4 samples (same global batch)."""
    common = ["--dumps", str(tiny["root"] / "dumps"), "--steps", "3", "--precision", "fp32", "--lr", "1e-3",
              "--warmup", "1", "--tracker", "none", "--no-progress", "--threads", "1"]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    one = subprocess.run([sys.executable, "-m", "train.fit", "--out", str(tmp_path / "one"), "--batch-size", "4", *common,
                          "--tracker", "tensorboard"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(_free_port()), "-m", "train.fit", "--out", str(tmp_path / "two"), "--batch-size", "2", *common],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    summary = json.loads(two.stdout.strip().splitlines()[-1])
    assert summary["processes"] == 2 and summary["step"] == 3
    a, b = draft_weights(tmp_path / "one"), draft_weights(tmp_path / "two")
    # float reassociation through Adam: seen up to 1.1e-6; a wrong normalisation moves weights by ~lr (3e-3)
    assert all(torch.allclose(a[k].float(), b[k].float(), atol=5e-6, rtol=0) for k in a)
    ra, rb = records(tmp_path / "one"), records(tmp_path / "two")
    assert [r["count_i"] for r in ra] == [r["count_i"] for r in rb]
    assert [r["loss"] for r in ra] == pytest.approx([r["loss"] for r in rb], rel=1e-6)
    assert list((tmp_path / "one" / "eagle3-draft").glob("events.out.tfevents.*"))  # the tensorboard tracker


def test_fsdp2_two_processes_equal_one(tiny, tmp_path):
    """accelerate's FSDP2 on 2 gloo processes (tests/fsdp_cpu.py turns it on for CPU processes): every
    parameter sharded, 2 micro-batches of 1 sample per process, stopped at step 2 and resumed (the optimizer
    state gathered into the checkpoint and cut into shards again), held-out scoring over 5 batches of 1 (one
    process scores 3, the other 2 and runs a forward it does not count) == 1 process x 4 samples."""
    held_out = tiny_samples(5, seed=1)
    data = {"source": "test", "split": "eval", "num_samples": 5, "fingerprint": samples_fingerprint(held_out)}
    settings = DumpSettings(target_identity(tiny["root"] / "target") | {"dtype": "fp32"}, LAYERS, "bf16", 32, 8, data)  # fmt: skip
    write_dumps(tiny["model"], held_out, tmp_path / "eval", settings, batch_tokens=1, vocab=tiny["vocab"], progress=False)  # fmt: skip
    summary = run(tiny, tmp_path / "one", steps=4, lr=1e-3, warmup=1, eval_every=2, eval_data=DumpDataset(tmp_path / "eval"))  # fmt: skip
    assert summary["step"] == 4
    common = ["--dumps", str(tiny["root"] / "dumps"), "--steps", "4", "--precision", "fp32", "--lr", "1e-3", "--warmup", "1",
              "--eval-dumps", str(tmp_path / "eval"), "--eval-every", "2", "--batch-size", "1", "--grad-accum", "2",
              "--tracker", "none", "--no-progress", "--threads", "1", "--out", str(tmp_path / "two")]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for extra in (["--stop-after", "2"], ["--resume"]):
        two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                              str(_free_port()), str(ROOT / "tests" / "fsdp_cpu.py"), *common, *extra],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert two.returncode == 0, two.stderr[-3000:]
        n = len(draft_weights(tmp_path / "one"))  # the draft's tensors: its parameters + d2t, t2d
        assert f"sharded parameters: {n - 2} of {n - 2}" in two.stdout
    assert "resumed from" in two.stdout and json.loads(two.stdout.strip().splitlines()[-1])["processes"] == 2
    a, b = draft_weights(tmp_path / "one"), draft_weights(tmp_path / "two")
    # seen: 4.1e-7; resumed without the optimizer's state (Adam restarting) the weights move by 2e-3
    assert all(torch.allclose(a[k].float(), b[k].float(), atol=5e-6, rtol=0) for k in a)
    ra, rb = records(tmp_path / "one"), records(tmp_path / "two")
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in ra] == pytest.approx([r[key] for r in rb], rel=1e-5), key
    ea, eb = [r for r in ra if "eval_loss" in r], [r for r in rb if "eval_loss" in r]
    assert [r["step"] for r in ea] == [r["step"] for r in eb] == [2, 4]
    assert [r["eval_loss"] for r in ea] == pytest.approx([r["eval_loss"] for r in eb], rel=1e-5)
    assert [r["eval_acc_i"] for r in ea] == [r["eval_acc_i"] for r in eb]
    # bf16 as on GPUs: FSDP2 computes with bf16 copies of the parameters (accelerate's policy)
    common[common.index("fp32")] = "bf16"
    three = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                            str(_free_port()), str(ROOT / "tests" / "fsdp_cpu.py"), *common[:-1], str(tmp_path / "three"),
                            "--stop-after", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert three.returncode == 0, three.stderr[-3000:]
    bf16 = records(tmp_path / "three")[0]
    assert bf16["loss"] != ra[0]["loss"] and bf16["loss"] == pytest.approx(ra[0]["loss"], rel=1e-3)
    # FSDP1 (flat parameters) is refused in one line before anything runs
    v1 = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
                         str(_free_port()), str(ROOT / "tests" / "fsdp_cpu.py"), *common[:-1], str(tmp_path / "four")],
                        cwd=ROOT, env=env | {"FSDP_VERSION": "1"}, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert v1.returncode != 0 and "error: train.fit shards the draft with FSDP2 only" in v1.stderr


def test_cli_help():
    r = subprocess.run(
        [sys.executable, "-m", "train.fit", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert (
        r.returncode == 0 and "--resume" in r.stdout and "--ttt-steps" in r.stdout and "--online" in r.stdout
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_run_matches_cpu(tiny, tmp_path):
    """The same 3 fp32 steps on the GPU (the default when one is present) and on the CPU."""
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu_summary = run(tiny, tmp_path / "gpu", steps=3)
    run(tiny, tmp_path / "cpu", steps=3, cpu=True)
    assert gpu_summary["step"] == 3
    a, b = draft_weights(tmp_path / "gpu"), draft_weights(tmp_path / "cpu")
    assert all(torch.allclose(a[k].float(), b[k].float(), atol=1e-4, rtol=0) for k in a)
    assert records(tmp_path / "gpu")[0]["loss"] == pytest.approx(
        records(tmp_path / "cpu")[0]["loss"], rel=1e-4
    )


def test_a_warmup_past_the_steps_is_said(tiny, tmp_path, caplog):
    """The README's 20-step try ran inside the default 50-step warmup (the learning rate at 4e-5 of 1e-4:
    accuracy 0 every step) without a word."""
    import logging

    with caplog.at_level(logging.WARNING, logger="train.fit"):
        run(tiny, tmp_path / "a", steps=2, warmup=5)
    assert (
        "--warmup 5 >= --steps 2: the learning rate never leaves its warmup (it reaches 0.0012 of --lr 0.003)"
        in caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="train.fit"):
        run(tiny, tmp_path / "b", steps=3, warmup=2)
    assert "warmup" not in caplog.text


def test_plot_curves_leaves_matplotlibs_backend_as_it_was(tmp_path):
    """plot_curves ran matplotlib.use("Agg"): in a notebook (the inline backend) a later plt.show()
    showed nothing. It now draws on a canvas of its own, as eval/plots.py does; so does eval.compare_runs."""
    import matplotlib

    from eval.compare_runs import is_plot, plot
    from train.fit import plot_curves

    recs = [
        {"step": s, "loss_i": [1.0 / s, 2.0 / s], "acc_i": [0.1 * s, 0.05 * s], "loss": 1.0 / s}
        for s in (1, 2)
    ]
    before = matplotlib.get_backend()
    matplotlib.use("svg")  # a backend other than Agg, as a notebook's inline one is
    try:
        plot_curves(recs, tmp_path / "curve.png")
        plot({"a": recs}, tmp_path / "c.png")
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before)
    assert is_plot(tmp_path / "curve.png") and is_plot(tmp_path / "c.png")
