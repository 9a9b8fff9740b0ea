"""Teacher-forced acceptance of EAGLE-3 drafts: what a greedy chain would accept, from one target forward
per answer instead of a decoding run (the scoring behind `python -m eval.acceptance` and train.stage).

A chain cycle that starts after the committed token x_m drafts x_{m+1}, x_{m+2}, ... and keeps its tokens
while they equal the target's greedy ones. While they do, the draft's state at its step j is exactly the
training-time-test state at index m - 1, unroll step j (train/ttt.py: true features up to m - 1, then its
own outputs). So over the target's own greedy answer, run(t) = the number of leading unroll steps at
index t whose argmax is the target's, and a cycle starting there accepts min(run(t), k) tokens: exactly,
for every cycle start (tests/test_acceptance.py checks it against SpecDecoder cycle by cycle). Averaged
over all answer positions (a decoding run visits only the cycle starts):

    P(run >= i)   the share of positions whose first i draft tokens are right (i = 1..steps)
    tau(k)        = 1 + sum_{i <= k} P(run >= i), the chain acceptance length at draft length k

A decoding run does not start cycles at every position: each starts where the last one's tokens ended,
which is more often just after a miss, where the draft does worse than on average. So also:

    walked tau(k) the acceptance length of decoding at a fixed draft length k, walking each answer from its
                  first cycle start as decoding does (`walk`): for greedy chains the decoding run itself,
                  cycle for cycle (SmolLM2's answers to 20 MT-bench questions: 1.68 where tau(4) says
                  1.79, and decoding measured 1.66)

Where the acceptance comes from (same positions, the first draft token only):

    in vocab      the share of positions whose next target token is in the draft vocabulary: the ceiling
                  of P(run >= 1), since a draft never proposes a token outside it
    confident     the share of positions where the target gives its token probability >= 0.9, and
                  P(run >= 1) there: what the draft gets right where the target itself is sure

and every number per category of the benchmark (MT-bench has eight).

Sampled chains (temperature > 0, with top-k / top-p as decoding applies them to both sides): a draft token
y ~ q is kept with probability min(1, p(y)/q(y)), and the emitted token x is distributed as p whatever the
draft; so P(kept and x emitted) = min(p(x), q(x)), and given that the target emits x the token was kept
with probability min(p(x), q(x)) / p(x). Down a chain each step's draft conditions on the emitted tokens
before it (the kept ones, which the training-time-test state holds), so over an answer the target SAMPLED
with the same rule, the product of these ratios over the first i steps is the probability that a cycle
keeps its first i draft tokens given that the target emits this answer, and its mean over sampled answers
is P(run >= i) without bias (`sampled_reach`; tests/test_acceptance.py checks it against the first cycles
of SpecDecoder runs). At temperature 0 the ratios are 0 or 1 and this is the greedy count. Given the answer,
the cycles' draws are independent, so the walk is a Markov chain along it: `walk` sums the probability
that a cycle starts at each position.

Trees are not covered (a tree accepts what its top-k branches hold; use eval.bench).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from eagle3.draft import Eagle3Draft
from maverick.generate import Decoder
from maverick.model import Llama4
from maverick.parallel import all_gather_last
from maverick.sampling import SamplingParams, logits_to_probs
from train.dump import plan_batches, run_target
from train.ttt import ttt_unroll


def answers_of(
    model: Llama4,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    batch_size: int = 16,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    prefill_tokens: int = 8192,
    progress: bool = False,
) -> list[list[int]]:
    """The target's answers (up to and including a stop token), in the prompts' order: greedy, or drawn
    with `sampling` from one generator seeded with `seed`.

    A batch prefills every row padded to its longest prompt, so batches are made longest prompts first, of
    up to `batch_size` rows and `prefill_tokens` padded prompt tokens (train.dump.plan_batches): a long
    prompt goes with few others or alone. ShareGPT's held-out first turns run from 31 to 3,195 tokens: in
    batches of 16, the one holding the longest spent 153 s prefilling 16 rows padded to 3,195 tokens on 2
    cores; its 80 answers take 91 s now.
    progress: a progress bar on stderr, a batch at a time."""
    out: list[list[int]] = [[] for _ in prompts]
    g = None if sampling is None or sampling.greedy else torch.Generator(model.device).manual_seed(seed)
    bar = tqdm(
        total=len(prompts), desc="answers", unit="prompt", file=sys.stderr, disable=not progress, leave=False
    )
    for rows in plan_batches([len(p) for p in prompts], prefill_tokens, batch_size):
        chunk = [prompts[j] for j in rows]  # longest first
        dec = Decoder(model, max_len=len(chunk[0]) + max_new_tokens + 8, batch_size=len(chunk), exact=False)
        got = dec.generate(
            chunk, max_new_tokens, sampling=sampling, stop_ids=model.config.eos_ids, generator=g
        )
        for j, answer in zip(rows, got.tokens):
            out[j] = answer
        bar.update(len(rows))
    bar.close()
    return out


def target_fields(
    model: Llama4, prompt: Sequence[int], answer: Sequence[int], feature_layers: Sequence[int]
) -> dict[str, Tensor]:
    """The target's forward over prompt + answer: its features and greedy choices (train.dump.run_target)."""
    sample = {"input_ids": list(prompt) + list(answer), "loss_mask": [0] * len(prompt) + [1] * len(answer)}
    return run_target(model, [sample], feature_layers, model.dtype)[0]


@torch.no_grad()
def run_lengths(
    model: Llama4,
    draft: Eagle3Draft,
    prompt: Sequence[int],
    answer: Sequence[int],
    steps: int,
    fields: dict[str, Tensor] | None = None,
) -> Tensor:
    """run[t] (capped at `steps`) for every index t at which a decoding cycle can start: t >= P - 1 for a
    prompt of P tokens (the first answer token comes from the prefill, so the first cycle starts at
    x_P, index P - 1), up to the last index that can score all `steps` steps. Element j is index P - 1 + j.
    fields: `target_fields` of this prompt and answer for the draft's feature layers, if already computed."""
    ids = list(prompt) + list(answer)
    T = len(ids)
    f = fields if fields is not None else target_fields(model, prompt, answer, draft.config.feature_layers)
    target = f["target_argmax"].long().to(model.device)  # target[t]: its greedy choice for x_{t+1}
    x = torch.as_tensor(ids, device=model.device)[None]
    first = len(prompt) - 1
    last = T - 1 - steps  # index t scores steps 0..steps-1 only if t + steps <= T - 1
    if last <= first:
        return torch.zeros(0, dtype=torch.long)
    n = last - first
    ok = torch.zeros(steps, n, dtype=torch.bool, device=model.device)
    unroll = ttt_unroll(
        draft, model.model.embed_tokens, x, f["features"][None].to(model.device), steps, start=first
    )
    for i, logits in unroll:  # row j: index first + j; step i predicts x_{first+j+2+i}
        pred = draft.draft_to_target_ids[logits[0, :n].argmax(-1)]
        ok[i] = pred == target[first + 1 + i : last + 1 + i]
    # leading correct steps: cumprod along the steps
    return ok.long().cumprod(0).sum(0).cpu()


CONFIDENT = 0.9  # the target's probability of its own token from which a position counts as confident


def _first_draft_targets(prompt: Sequence[int], answer: Sequence[int], steps: int) -> slice:
    """The indices t + 1 of the target's choices for x_{t+2}, the first draft token of a cycle starting at
    index t, for the positions of `run_lengths`."""
    first, last = len(prompt) - 1, len(prompt) + len(answer) - 1 - steps
    return slice(first + 1, last + 1)


@torch.no_grad()
def token_probs(
    model: Llama4, hidden: Tensor, tokens: Tensor, sampling: SamplingParams | None = None
) -> Tensor:
    """The target's probability of tokens[j] after the final hidden state hidden[j] ([N, H]): fp32 logits,
    through `sampling`'s rule where given (else the plain softmax), over the full vocabulary."""
    hidden, tokens = hidden.to(model.device).float(), tokens.long().to(model.device)
    head = model.lm_head.weight.float()
    shard = getattr(model, "shard", None)  # a tensor parallel target holds vocabulary rows of the head
    p = torch.zeros(len(tokens))
    for i in range(0, len(tokens), 512):  # [512, V] fp32 probabilities at a time
        logits = hidden[i : i + 512] @ head.T
        logits = logits if shard is None else all_gather_last(logits, shard)
        probs = logits.softmax(-1) if sampling is None else logits_to_probs(logits, sampling)
        p[i : i + 512] = probs.gather(1, tokens[i : i + 512, None])[:, 0].cpu()
    return p


def next_token_probs(
    model: Llama4,
    prompt: Sequence[int],
    answer: Sequence[int],
    fields: dict[str, Tensor],
    sampling: SamplingParams,
) -> Tensor:
    """p_next[u - P]: the target's probability, under `sampling`'s rule, of the answer's token x_{u+1} at
    index u, for u = P .. T - 2 (a prompt of P tokens, T in all): what a sampled chain's draft tokens are
    checked against. The same for every draft, so computed once per answer."""
    P, T = len(prompt), len(prompt) + len(answer)
    ids = torch.as_tensor(list(prompt) + list(answer))
    return token_probs(model, fields["hidden"][P : T - 1], ids[P + 1 :], sampling)


def target_probs(
    model: Llama4,
    prompt: Sequence[int],
    answer: Sequence[int],
    steps: int,
    fields: dict[str, Tensor],
    sampling: SamplingParams | None = None,
    p_next: Tensor | None = None,
) -> Tensor:
    """For the positions of `run_lengths`: the target's probability of the cycle's first draft token
    x_{t+2}. Greedy (`sampling` None or at temperature 0): of its greedy choice, under the plain fp32
    softmax; sampled: of the answer's own token, under the sampling rule (`next_token_probs`, read from
    `p_next` where given). The same for every draft, so computed once per answer."""
    at = _first_draft_targets(prompt, answer, steps)
    if sampling is None or sampling.greedy:
        return token_probs(model, fields["hidden"][at], fields["target_argmax"][at])
    if p_next is None:
        p_next = next_token_probs(model, prompt, answer, fields, sampling)
    return p_next[: max(0, at.stop - at.start)]  # position j: index P + j


def kept(q: Tensor, p: Tensor) -> Tensor:
    """The probability that a draft token drawn from q was kept, given that the target emitted it (q, p:
    the draft's and the target's probabilities of the emitted token): min(p, q) / p."""
    return torch.where(q >= p, torch.ones_like(p), q / p)


@torch.no_grad()
def sampled_reach(
    model: Llama4,
    draft: Eagle3Draft,
    prompt: Sequence[int],
    answer: Sequence[int],
    steps: int,
    sampling: SamplingParams,
    fields: dict[str, Tensor] | None = None,
    p_next: Tensor | None = None,
) -> Tensor:
    """Sampled chains: [positions, steps] for the positions of `run_lengths` (row j: the cycle starting at
    index P - 1 + j); element (j, i): the probability that the cycle keeps its first i + 1 draft tokens,
    given that the target emits `answer` (drawn with `sampling`): the product of `kept` over steps 0..i.
    Step i's draft token is x_{t+2+i}, checked against the target's distribution at index t + 1 + i.
    p_next: `next_token_probs` of this answer, if already computed."""
    f = fields if fields is not None else target_fields(model, prompt, answer, draft.config.feature_layers)
    if p_next is None:
        p_next = next_token_probs(model, prompt, answer, f, sampling)
    x = torch.as_tensor(list(prompt) + list(answer))[None]
    return _reach_rows(model, draft, x, len(prompt), f["features"][None], p_next[None], steps, sampling)[0]


@torch.no_grad()
def sampled_reach_rows(
    model: Llama4,
    draft: Eagle3Draft,
    prompt: Sequence[int],
    answers: Sequence[Sequence[int]],
    steps: int,
    sampling: SamplingParams,
) -> Tensor:
    """`sampled_reach` of many answers of one length to one prompt, in one batch: [answers, positions,
    steps]."""
    if len({len(a) for a in answers}) != 1:
        raise ValueError("sampled_reach_rows: the answers must have one length")
    samples = [
        {"input_ids": list(prompt) + list(a), "loss_mask": [0] * len(prompt) + [1] * len(a)} for a in answers
    ]
    f = run_target(model, samples, draft.config.feature_layers, model.dtype)
    x = torch.tensor([s["input_ids"] for s in samples])
    p_next = torch.stack([next_token_probs(model, prompt, a, r, sampling) for a, r in zip(answers, f)])
    features = torch.stack([r["features"] for r in f])
    return _reach_rows(model, draft, x, len(prompt), features, p_next, steps, sampling)


def _reach_rows(
    model: Llama4,
    draft: Eagle3Draft,
    x: Tensor,
    P: int,
    features: Tensor,
    p_next: Tensor,
    steps: int,
    sampling: SamplingParams,
) -> Tensor:
    """`sampled_reach` of B rows of one length: x [B, T] token ids (a prompt of P tokens, then the answer),
    the target's features [B, T, F] and `next_token_probs` [B, T - 1 - P] -> [B, positions, steps]."""
    B, T = x.shape
    dev = model.device
    x = x.to(dev)
    to_draft = torch.full((len(draft.t2d),), -1, dtype=torch.long, device=dev)
    to_draft[draft.draft_to_target_ids.to(dev)] = torch.arange(draft.config.draft_vocab_size, device=dev)
    first, last = P - 1, T - 1 - steps
    if last <= first:  # an answer of `steps` tokens or fewer scores no position
        return torch.zeros(B, 0, steps)
    n = last - first
    keep = torch.ones(steps, B, n)
    for i, logits in ttt_unroll(draft, model.model.embed_tokens, x, features.to(dev), steps, start=first):
        q_d = logits_to_probs(logits[:, :n], sampling)  # [B, n, V'] the draft's rule, as decoding's
        d = to_draft[x[:, first + 2 + i : last + 2 + i]]  # the emitted tokens the draft tokens are checked by
        q = torch.where(d >= 0, q_d.gather(2, d.clamp(min=0)[..., None])[..., 0], torch.zeros((), device=dev))
        keep[i] = kept(q.cpu(), p_next[:, first + 1 + i - P : last + 1 + i - P])
    return keep.cumprod(0).permute(1, 2, 0)


def target_detail(
    draft: Eagle3Draft,
    prompt: Sequence[int],
    answer: Sequence[int],
    steps: int,
    fields: dict[str, Tensor],
    target_p: Tensor,
    sampled: bool = False,
) -> dict[str, Tensor]:
    """For the positions of `run_lengths`: whether the cycle's first draft token x_{t+2} (the target's
    greedy choice, or for a `sampled` answer its own token) is in the draft vocabulary, and its probability
    (`target_probs`)."""
    at = _first_draft_targets(prompt, answer, steps)
    if sampled:
        target = torch.as_tensor(list(prompt) + list(answer))[at.start + 1 : at.stop + 1]
    else:
        target = fields["target_argmax"].long()[at]
    return {"in_vocab": draft.t2d[target.to(draft.t2d.device)].cpu(), "target_p": target_p}


def reach_of_runs(runs: Tensor, steps: int) -> Tensor:
    """Greedy run lengths [N] -> [N, steps]: element (j, i) is 1 where run j reached i + 1 draft tokens."""
    return (runs[:, None] > torch.arange(steps)).float()


def walk(reach: Tensor, k: int) -> tuple[float, float]:
    """A decoding run at a fixed draft length k over one answer, from its first cycle start (position 0)
    through the positions `reach` [positions, >= k] scores: (expected cycles started there, expected tokens
    they emit). A cycle at t keeps a >= i tokens with probability reach[t, i - 1] and the next one starts
    at t + a + 1; o[t], the probability that a cycle starts at t, carries forward. Greedy reach (0 or 1)
    walks the decoding run itself."""
    n = len(reach)
    r = reach[:, :k].tolist()
    o = [1.0] + [0.0] * (n + k)
    cycles = tokens = 0.0
    for t in range(n):
        if o[t] == 0.0:
            continue
        ge = [1.0, *r[t], 0.0]  # P(a >= j), j = 0..k+1
        for a in range(k + 1):
            o[t + a + 1] += o[t] * (ge[a] - ge[a + 1])
        cycles += o[t]
        tokens += o[t] * sum(ge)  # 1 + E[a]
    return cycles, tokens


def paired_difference(
    a: Sequence[Tensor],
    b: Sequence[Tensor],
    clusters: Sequence[int],
    k: int,
    rounds: int = 2000,
    seed: int = 0,
) -> dict[str, Any]:
    """Draft b's tau(k) and walked tau(k) less draft a's, scored on the same answers (`reach` per answer,
    `summarize`'s), with 95% intervals from a paired bootstrap: `rounds` times, the clusters (an answer's
    prompt: the turns of one chat move together) drawn with replacement, both drafts on the same draw."""
    ids = {c: j for j, c in enumerate(dict.fromkeys(clusters))}
    col = torch.tensor([ids[c] for c in clusters])
    C = len(ids)

    def per_cluster(values: list[float]) -> Tensor:
        return torch.zeros(C, dtype=torch.float64).index_add_(
            0, col, torch.tensor(values, dtype=torch.float64)
        )

    n = per_cluster([len(r) for r in a])
    sums = [per_cluster([float(r[:, :k].sum()) for r in x]) for x in (a, b)]
    walked = [[walk(r, k) for r in x] for x in (a, b)]
    cycles = [per_cluster([c for c, _ in w]) for w in walked]
    tokens = [per_cluster([t for _, t in w]) for w in walked]
    g = torch.Generator().manual_seed(seed)
    draws = torch.randint(C, (rounds, C), generator=g)
    W = torch.zeros(rounds, C, dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(rounds, C, dtype=torch.float64)
    )
    W = torch.cat([torch.ones(1, C, dtype=torch.float64), W])  # row 0: the sample itself

    def tau(x: int) -> Tensor:
        return 1 + (W @ sums[x]) / (W @ n).clamp(min=1)

    def tau_walked(x: int) -> Tensor:
        return (W @ tokens[x]) / (W @ cycles[x]).clamp(min=1e-9)

    out: dict[str, Any] = {"k": k, "clusters": C, "rounds": rounds}
    for name, fn in (("tau", tau), ("tau_walked", tau_walked)):
        d = fn(1) - fn(0)
        lo, hi = torch.quantile(d[1:], torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
        out[name] = round(float(d[0]), 4)
        out[name + "_ci95"] = [round(lo, 4), round(hi, 4)]
    return out


def summarize(
    reaches: Sequence[Tensor], steps: int, detail: dict[str, Tensor] | None = None
) -> dict[str, Any]:
    """P(run >= i), tau(k), walked tau(k) and, given `target_detail` of the same positions, the vocabulary
    ceiling and the agreement where the target is confident. reaches: one [positions, steps] per answer,
    `sampled_reach` or `reach_of_runs` of greedy run lengths."""
    reach = torch.cat(list(reaches)) if reaches else torch.zeros(0, steps)
    first = reach[:, 0]  # P(run >= 1) per position
    p = reach.mean(0).tolist() if len(reach) else [float("nan")] * steps
    walked = {k: [walk(r, k) for r in reaches] for k in range(1, steps + 1)}
    out: dict[str, Any] = {
        "positions": len(reach),
        "p_run_ge": [round(v, 4) for v in p],
        "tau": {k: round(1 + sum(p[:k]), 4) for k in range(1, steps + 1)},
        "tau_walked": {
            k: round(sum(t for _, t in w) / sum(c for c, _ in w), 4) if len(reach) else float("nan")
            for k, w in walked.items()
        },
    }
    if detail is not None:
        sure = detail["target_p"] >= CONFIDENT
        nan = float("nan")
        out["in_vocab"] = round(detail["in_vocab"].float().mean().item(), 4) if len(reach) else nan
        out["confident"] = round(sure.float().mean().item(), 4) if len(reach) else nan
        out["p_run_ge_1_confident"] = round(first[sure].mean().item(), 4) if sure.any() else nan
    return out
