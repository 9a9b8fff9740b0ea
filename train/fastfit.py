"""Online draft training at GPU speed: fixed-shape length buckets, the target's fields computed on the device,
large batches, bf16, an optionally compiled TTT step, a time budget.

`train.fit --online` runs the target per micro-batch of 32 samples, moves its features to the host and
back (`train.online.OnlineDataset` returns CPU tensors for `collate`), scores only the valid positions
through `nonzero` (a shape that changes every step), and so trained at 25-28k tokens/s on an H200. Here:

- buckets: a sample of n tokens (cut at `max_length`) goes to the smallest bucket T = bucket * k >= n, and
  each batch holds `token_budget // T` rows of T tokens, the last batch of a bucket filled with filler rows
  (token 0, no loss) so that every batch of a bucket has one shape: a compiled step compiles once per
  bucket, and the allocator reuses the same blocks;
- the target's forward, its logits over the draft vocabulary (final hidden state @ the lm_head rows of the
  draft vocabulary, fp32) and whether its full-vocabulary argmax lies inside the draft vocabulary are
  computed on the device for the whole batch (`target_batch`), never leaving it;
- the loss (`dense_step_sums`) scores every position of every unroll step densely and masks, so its shapes
  are fixed; the soft cross-entropy is `train.fit.soft_cross_entropy` (logsumexp form, no log-softmax over
  [N, V'] kept for the backward). Nothing over the target's full vocabulary is kept: its argmax is taken
  `HEAD_ROWS` positions at a time (`train.dump.full_vocab_argmax`).

The per-step sums are normalised by the whole batch's counts as in `train.fit` (its module NOTE), so a
bucketed batch gives the loss of the same samples right-padded into one batch (tests/test_fastfit.py).

Shape legend: B rows, T bucket length, H hidden, V' draft vocabulary, S unroll steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3.draft import Eagle3Draft
from maverick.model import Llama4
from train.dump import full_vocab_argmax
from train.fit import soft_cross_entropy
from train.ttt import TTTBatch, ttt_unroll

HEAD_ROWS = 8192  # positions per full-vocabulary argmax: [8192, V] in the target's dtype at a time


@dataclass
class Buckets:
    token_budget: int = 16384  # tokens per batch (rows x T)
    bucket: int = 256  # bucket lengths are multiples of this
    max_length: int = 1024  # samples are cut to the bucket length that holds this many tokens

    def length(self, n: int) -> int:
        return -(-min(n, self.max_length) // self.bucket) * self.bucket

    def rows(self, T: int) -> int:
        return max(1, self.token_budget // T)


def bucket_batches(
    lengths: Sequence[int], buckets: Buckets, seed: int, epoch: int
) -> list[tuple[int, list[int]]]:
    """One epoch's batches as (bucket length T, sample indices), a pure function of (lengths, seed, epoch):
    samples shuffled, grouped by bucket in that order, `buckets.rows(T)` per batch (a bucket's last batch may
    be short: `target_batch` fills it), the batches shuffled."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    groups: dict[int, list[int]] = {}
    for i in torch.randperm(len(lengths), generator=g).tolist():
        groups.setdefault(buckets.length(lengths[i]), []).append(i)
    batches = [
        (T, idx[j : j + buckets.rows(T)])
        for T, idx in sorted(groups.items())
        for j in range(0, len(idx), buckets.rows(T))
    ]
    return [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]


@torch.no_grad()
def target_batch(
    model: Llama4,
    samples: Sequence[dict],
    T: int,
    rows: int,
    feature_layers: Sequence[int],
    lm_rows: Tensor,
    t2d: Tensor,
) -> TTTBatch:
    """The TTTBatch of `samples` (each {"input_ids", "loss_mask"}, lists or tensors), cut to T tokens,
    right-padded to [rows, T]; rows past the samples are fillers (token 0, every key valid so no softmax
    row is empty, no loss). lm_rows [V', H]: the target's head rows of the draft vocabulary (fp32)."""
    dev = model.device
    ids = torch.zeros(rows, T, dtype=torch.long)
    mask = torch.zeros(rows, T, dtype=torch.bool)
    valid = torch.ones(rows, T, dtype=torch.bool)
    for b, s in enumerate(samples):
        n = min(T, len(s["input_ids"]))
        ids[b, :n] = torch.as_tensor(s["input_ids"][:n], dtype=torch.long)
        mask[b, :n] = torch.as_tensor(s["loss_mask"][:n]).bool()
        valid[b, n:] = False
    ids, mask, valid = ids.to(dev, non_blocking=True), mask.to(dev), valid.to(dev)
    out = model(ids, feature_layers=tuple(feature_layers), logits=None)
    hidden = out.hidden  # [rows, T, H], after the final norm
    logits = hidden.float() @ lm_rows.T  # [rows, T, V'] fp32
    flat = hidden.reshape(-1, hidden.shape[-1])
    head = model.lm_head.weight
    argmax = torch.cat([full_vocab_argmax(h, head) for h in flat.split(HEAD_ROWS)]).view(rows, T)
    in_vocab = t2d[argmax] & valid
    return TTTBatch(ids, mask.long(), out.features, logits, in_vocab, valid)


def dense_step_sums(
    draft: Eagle3Draft, embed: Callable[[Tensor], Tensor], batch: TTTBatch, steps: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Per unroll step: (sum of soft cross-entropies over valid positions [S], top-1 agreements [S], valid
    positions [S]); the positions and targets of `train.fit.ttt_step_sums`, scored densely (fixed shapes)."""
    target_p = F.softmax(batch.target_logits.float(), dim=-1)  # [B, T, V']
    target_top = batch.target_logits.argmax(-1)  # [B, T]
    B, T = target_top.shape
    ce_sums, correct, counts = [], [], []
    unroll = ttt_unroll(
        draft, embed, batch.input_ids, batch.features, steps, batch.attention_valid, hidden=True
    )
    for i, h in unroll:
        n = T - 2 - i  # index t < n has a token x_{t+2+i} to predict
        if n <= 0:  # a bucket no longer than the unroll: the later steps have nothing to predict
            break
        valid = batch.loss_mask[:, 2 + i :].bool() & batch.target_in_vocab[:, 1 + i : T - 1]  # [B, n]
        lg = draft.logits(h[:, :n])  # [B, n, V']
        ce = soft_cross_entropy(lg.reshape(B * n, -1), target_p[:, 1 + i : 1 + i + n].reshape(B * n, -1))
        ce_sums.append(torch.where(valid.reshape(-1), ce, 0.0).sum())
        with torch.no_grad():
            hit = (lg.argmax(-1) == target_top[:, 1 + i : 1 + i + n]) & valid
            correct.append(hit.sum().float())
            counts.append(valid.sum().float())
    zero = batch.target_logits.new_zeros(())
    while len(ce_sums) < steps:  # buckets shorter than the unroll
        ce_sums.append(zero)
        correct.append(zero)
        counts.append(zero)
    return torch.stack(ce_sums), torch.stack(correct), torch.stack(counts)


def weighted_loss(ce: Tensor, counts: Tensor, decay: float) -> Tensor:
    """sum_i decay^i * ce_i / count_i (the count of the whole batch; empty steps count 0)."""
    w = decay ** torch.arange(len(ce), device=ce.device, dtype=torch.float32)
    return (w * ce.float() / counts.clamp(min=1)).sum()


class TimeSchedule:
    """lr multiplier from the share of the run done: linear warmup over the first `warmup` steps, then cosine
    from 1 to `min_ratio` as the share goes from 0 to 1: of the time budget (a time-boxed run does not know its
    step count in advance), or of the steps where a run is given their number (train.stage --max-steps)."""

    def __init__(self, warmup: int, min_ratio: float = 0.1):
        self.warmup, self.min_ratio = warmup, min_ratio

    def __call__(self, step: int, elapsed_share: float) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        p = min(1.0, max(0.0, elapsed_share))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * p))
