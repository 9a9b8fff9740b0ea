"""train.fastfit: bucketed fixed-shape batches (with filler rows) give the loss and gradients of the same
samples right-padded into one batch (train.fit's reference path), in fp32; so does the compiled step."""

import pytest
import torch

import train.dump as dump
from eagle3.draft import DraftConfig, Eagle3Draft
from maverick.config import get_config
from maverick.model import Llama4
from train.fastfit import Buckets, bucket_batches, dense_step_sums, target_batch, weighted_loss
from train.fit import collate, ttt_step_sums

LAYERS = (1, 2, 3)
STEPS = 4


def setup():
    torch.manual_seed(0)
    model = Llama4(get_config("tiny-dense"))
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8)  # a peaked next-token distribution
    model.eval()
    g = torch.Generator().manual_seed(1)
    samples = []
    for _ in range(11):
        T = int(torch.randint(5, 70, (1,), generator=g))
        mask = (torch.rand(T, generator=g) > 0.3).to(torch.uint8)
        samples.append({"input_ids": torch.randint(0, 512, (T,), generator=g), "loss_mask": mask})
    d2t, t2d, _ = dump.draft_vocab_from(samples, 512, 128)
    cfg = DraftConfig.for_target(model.config, draft_vocab_size=128, feature_layers=LAYERS)
    draft = Eagle3Draft(cfg)
    draft.init_weights(std=0.2, generator=torch.Generator().manual_seed(2))
    draft.set_vocab(d2t, t2d)
    return model, samples, draft


def test_bucketed_batches_give_the_loss_and_gradients_of_one_padded_batch():
    model, samples, draft = setup()
    w = model.model.embed_tokens.weight.detach()
    embed = lambda ids: torch.nn.functional.embedding(ids, w)  # noqa: E731
    lm_rows = w[draft.draft_to_target_ids].float()

    # reference: all samples right-padded into one batch, train.fit's sparse per-step sums
    fields = dump.run_target(model, samples, LAYERS, torch.float32)
    ref_batch = collate(fields, lm_rows, draft.t2d)
    ce, _ = ttt_step_sums(draft, embed, ref_batch, STEPS)
    from train.fit import step_counts

    ref_loss = weighted_loss(ce, step_counts(ref_batch, STEPS).float(), 0.8)
    ref_loss.backward()
    ref_grads = {k: p.grad.clone() for k, p in draft.named_parameters()}
    draft.zero_grad()

    # bucketed: buckets of 32 tokens, 3 rows per 96-token budget, fillers in short batches
    buckets = Buckets(token_budget=96, bucket=32, max_length=96)
    batches = bucket_batches([len(s["input_ids"]) for s in samples], buckets, seed=0, epoch=0)
    assert sorted(i for _, ix in batches for i in ix) == list(range(len(samples)))
    assert {T for T, _ in batches} == {32, 64, 96} and any(len(ix) < buckets.rows(T) for T, ix in batches)
    sums = []
    for T, ix in batches:
        b = target_batch(model, [samples[i] for i in ix], T, buckets.rows(T), LAYERS, lm_rows, draft.t2d)
        assert b.input_ids.shape == (buckets.rows(T), T)
        sums.append(dense_step_sums(draft, embed, b, STEPS))
    ce = torch.stack([s[0] for s in sums]).sum(0)
    counts = torch.stack([s[2] for s in sums]).sum(0)
    assert counts.tolist() == step_counts(ref_batch, STEPS).float().tolist()
    loss = weighted_loss(ce, counts, 0.8)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    loss.backward()
    for k, p in draft.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("T", [STEPS, STEPS + 1, STEPS + 2])
def test_a_bucket_no_longer_than_the_unroll_scores_its_steps(T):
    """A bucket of T <= steps + 1 tokens leaves the last steps nothing to predict (train.stage --bucket 8 at
    the default 7 steps): those steps count 0, as train.fit's sparse sums say, instead of a reshape error."""
    model, samples, draft = setup()
    w = model.model.embed_tokens.weight.detach()
    embed = lambda ids: torch.nn.functional.embedding(ids, w)  # noqa: E731
    lm_rows = w[draft.draft_to_target_ids].float()
    short = [{k: v[:T] for k, v in s.items()} for s in samples if len(s["input_ids"]) >= T][:2]
    b = target_batch(model, short, T, 2, LAYERS, lm_rows, draft.t2d)
    ce, correct, counts = dense_step_sums(draft, embed, b, STEPS)
    ref = collate(dump.run_target(model, short, LAYERS, torch.float32), lm_rows, draft.t2d)
    from train.fit import step_counts

    assert counts.tolist() == step_counts(ref, STEPS).float().tolist() and counts[T - 2 :].sum() == 0


def test_bucket_lengths_and_rows():
    b = Buckets(token_budget=4096, bucket=256, max_length=1000)
    assert [b.length(n) for n in (1, 256, 257, 999, 5000)] == [256, 256, 512, 1024, 1024]
    assert b.rows(1024) == 4 and b.rows(256) == 16
    lengths = [10, 300, 700, 20, 900, 260]
    assert bucket_batches(lengths, b, 1, 0) == bucket_batches(lengths, b, 1, 0)
    assert bucket_batches(lengths, b, 1, 0) != bucket_batches(lengths, b, 1, 1)


def assert_compiled_step_matches_eager(draft, embed, batch, steps: int = 2) -> None:
    """The compiled TTT step (train.stage --compile: one graph per bucket shape) gives the eager step's sums
    and gradients (fp32). Two unroll steps (the second reads the first's output) compile in half the time
    of four."""
    eager = dense_step_sums(draft, embed, batch, steps)
    weighted_loss(eager[0], eager[2], 0.8).backward()
    want = {k: p.grad.clone() for k, p in draft.named_parameters()}
    draft.zero_grad()
    step = torch.compile(lambda b: dense_step_sums(draft, embed, b, steps), dynamic=False)
    got = step(batch)
    weighted_loss(got[0], got[2], 0.8).backward()
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for k, p in draft.named_parameters():
        assert (want[k] != 0).any(), k
        torch.testing.assert_close(p.grad, want[k], rtol=1e-3, atol=1e-5, msg=k)


def test_compiled_step_matches_eager():
    model, samples, draft = setup()
    w = model.model.embed_tokens.weight.detach()
    batch = target_batch(model, samples[:4], 96, 4, LAYERS, w[draft.draft_to_target_ids].float(), draft.t2d)
    assert_compiled_step_matches_eager(draft, lambda ids: torch.nn.functional.embedding(ids, w), batch)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_fields_and_compiled_step_match():
    """On the GPU: the target's fields (fused causal attention for long batches) match the CPU's, and the
    compiled TTT step gives the eager step's sums and gradients (fp32)."""
    model, samples, draft = setup()
    w = model.model.embed_tokens.weight.detach()
    lm_rows = w[draft.draft_to_target_ids].float()
    cpu = target_batch(model, samples[:4], 96, 4, LAYERS, lm_rows, draft.t2d)
    model, draft = model.cuda(), draft.cuda()
    wc = w.cuda()
    gpu = target_batch(model, samples[:4], 96, 4, LAYERS, lm_rows.cuda(), draft.t2d.cuda())
    torch.testing.assert_close(gpu.features.cpu(), cpu.features, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gpu.target_logits.cpu(), cpu.target_logits, rtol=1e-4, atol=1e-3)
    assert_compiled_step_matches_eager(draft, lambda ids: torch.nn.functional.embedding(ids, wc), gpu)
