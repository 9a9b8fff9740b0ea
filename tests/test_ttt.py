"""The training-time test must compute exactly what the draft computes when decoding."""

from __future__ import annotations

import torch

from eagle3.draft import DraftConfig, Eagle3Draft
from maverick.config import get_config
from train.ttt import TTTBatch, ttt_loss, ttt_mask, ttt_unroll


def brute_force_mask(T: int, step: int) -> torch.Tensor:
    """Key (j, s) is seen from (step, t) iff it is in the draft's cache when decoding: the true prefix
    (step 0, s <= t) and the chain of its own earlier steps from index t (1 <= j <= step, s == t)."""
    m = torch.zeros(T, (step + 1) * T, dtype=torch.bool)
    for t in range(T):
        for j in range(step + 1):
            for s in range(T):
                m[t, j * T + s] = (j == 0 and s <= t) or (1 <= j <= step and s == t)
    return m


def test_mask_matches_brute_force():
    for T in (1, 5, 9):
        for step in range(4):
            assert torch.equal(ttt_mask(T, step), brute_force_mask(T, step))


def make_draft(seed=0):
    target = get_config("tiny-dense")
    cfg = DraftConfig.for_target(target, draft_vocab_size=target.vocab_size, feature_layers=(1, 2, 3))
    torch.manual_seed(seed)
    d = Eagle3Draft(cfg)
    d.init_weights(std=0.2)
    d.d2t.zero_()
    d.t2d.fill_(True)
    emb = torch.nn.Embedding(target.vocab_size, target.hidden_size)
    return d, emb


@torch.no_grad()
def test_unroll_equals_decoding_with_cache():
    """Step i at index t == catch up on true pairs up to t with the cache, then i draft steps on own outputs."""
    d, emb = make_draft()
    B, T, H = 1, 12, d.config.hidden_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, d.config.vocab_size, (B, T), generator=g)
    feats = torch.randn(B, T, 3 * H, generator=g)
    unrolled = dict(ttt_unroll(d, emb, ids, feats, steps=4))
    for t in (0, 3, 7):
        cache = d.new_cache(B, 32)
        pos = torch.arange(t + 1)[None]
        h = d(emb(ids[:, 1 : t + 2]), d.project(feats[:, : t + 1]), pos, cache=cache)[:, -1:]
        assert torch.allclose(d.logits(h)[0, 0], unrolled[0][0, t], atol=1e-5)
        for i in range(1, 4):
            if t + 1 + i >= T:
                break
            h = d(emb(ids[:, t + 1 + i : t + 2 + i]), h, torch.tensor([[t + i]]), cache=cache)
            assert torch.allclose(d.logits(h)[0, 0], unrolled[i][0, t], atol=1e-5), (t, i)


@torch.no_grad()
def test_unroll_from_a_start_index_gives_those_rows_of_the_whole_unroll():
    """start = s computes indices s.. only (a prompt's answer positions): each step's rows are rows s.. of the
    whole unroll, with right padding too, and the states (hidden=True) as well."""
    d, emb = make_draft(seed=3)
    B, T, H = 2, 14, d.config.hidden_size
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, d.config.vocab_size, (B, T), generator=g)
    feats = torch.randn(B, T, 3 * H, generator=g)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, 11:] = False
    for hidden in (False, True):
        whole = dict(ttt_unroll(d, emb, ids, feats, 5, valid, hidden=hidden))
        for start in (1, 6, 12):
            part = dict(ttt_unroll(d, emb, ids, feats, 5, valid, hidden=hidden, start=start))
            assert part.keys() == whole.keys()
            for i, x in part.items():
                assert x.shape[1] == T - start
                ref = whole[i][:, start:]  # fp32; few-row matmuls may sum in another order
                torch.testing.assert_close(x, ref, rtol=0, atol=1e-5 * float(ref.abs().max()))
    assert not torch.allclose(whole[1][:, 6:], whole[0][:, 6:])  # the steps differ: the check has teeth


def test_loss_masks_and_decreases():
    d, emb = make_draft()
    B, T, H, V = 2, 16, d.config.hidden_size, d.config.vocab_size
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (B, T), generator=g)
    batch = TTTBatch(
        input_ids=ids,
        loss_mask=torch.ones(B, T, dtype=torch.long),
        features=torch.randn(B, T, 3 * H, generator=g),
        target_logits=torch.randn(B, T, V, generator=g) * 3,
        target_in_vocab=torch.ones(B, T, dtype=torch.bool),
    )
    _, stats = ttt_loss(d, emb, batch, steps=3)
    assert [int(c) for c in stats["count"]] == [B * (T - 2), B * (T - 3), B * (T - 4)]
    batch.loss_mask[:, :8] = 0
    _, stats = ttt_loss(d, emb, batch, steps=3)
    assert [int(c) for c in stats["count"]] == [B * 8, B * 8, B * 8]
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        loss, _ = ttt_loss(d, emb, batch, steps=3)
        first = first if first is not None else float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.7 * first
