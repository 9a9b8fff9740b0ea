"""Distribution check for sampling (temperature > 0): speculative sampling must emit tokens with the
target's own distribution. Greedy runs are checked token by token; sampled runs can only be checked in
distribution, and this does it on the first token a speculative cycle decides.

The first new token comes from the prefill (the same for every method); the second is the first one that
a drafting + verification cycle emits, so its marginal is where a wrong acceptance rule shows. Its exact
marginal is enumerated: p(t2) = sum over t1 of p(t1) p(t2 | prompt, t1), one batched target forward over
the first token's support S (the `max_support` most likely first tokens). The method is run `samples` times
on the prompt (one batch of identical rows; trees: one row at a time); the rows whose first token is in S
(N of them) are compared with the second token's distribution given that, p(t2 | t1 in S) = sum over t1 in
S of p(t1) p(t2 | t1) / p(S): the total-variation distance is measured on the `buckets - 1` most likely
tokens plus one bucket for all others (coarsening never increases the TV, so a distribution that passes
coarsened may still differ in its tail; a wrong acceptance rule moves the head).

Bound (delta = 1e-3): E[TV] <= 0.5 * sqrt(buckets / N) (Cauchy-Schwarz on multinomial deviations), plus
sqrt(ln(1/delta) / 2N) for the deviation of one run (McDiarmid). (The mass outside S was added to the bound
before: on SmolLM2 at temperature 1 it reached 0.25, a bound of 0.40 that accepting every draft token, TV
0.15, passed.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from maverick.generate import prefill
from maverick.model import Llama4
from maverick.sampling import SamplingParams, logits_to_probs


@dataclass
class DistCheck:
    method: str
    prompt_id: str
    samples: int
    buckets: int
    tv: float
    bound: float
    uncovered: float  # first-token probability mass outside the support (those rows are not compared)

    @property
    def passed(self) -> bool:
        return self.tv <= self.bound


@torch.no_grad()
def second_token_marginal(
    target: Llama4, prompt: Sequence[int], sampling: SamplingParams, max_support: int = 64
) -> tuple[torch.Tensor, float, torch.Tensor]:
    """(exact distribution of the 2nd new token [V] over the covered first tokens, uncovered mass, the
    covered first tokens)."""
    cache = target.new_cache(1, len(prompt) + 2)
    logits, _ = prefill(target, cache, [prompt])
    p1 = logits_to_probs(logits[0].float(), sampling)  # [V]
    support = p1.topk(min(max_support, int((p1 > 0).sum()))).indices
    covered = float(p1[support].sum())
    rows = [list(prompt) + [int(t)] for t in support]
    cache = target.new_cache(len(rows), len(prompt) + 2)
    logits2, _ = prefill(target, cache, rows)
    p2_given = logits_to_probs(logits2.float(), sampling)  # [S, V]
    return p1[support] @ p2_given, max(0.0, 1.0 - covered), support


def tv_bound(buckets: int, n: int, delta: float = 1e-3) -> float:
    return 0.5 * math.sqrt(buckets / n) + math.sqrt(math.log(1 / delta) / (2 * n))


def bucketed_tv(tokens: Sequence[int], exact: torch.Tensor, buckets: int) -> float:
    """TV between the empirical distribution of `tokens` and `exact` [V], on the buckets - 1 most likely
    tokens of `exact` plus one bucket for the rest."""
    top = exact.topk(buckets - 1).indices
    emp = torch.bincount(torch.tensor(list(tokens)), minlength=exact.numel()).float() / len(tokens)
    e_top, x_top = emp[top], exact[top].float()
    rest = (1 - e_top.sum()) - (exact.sum() - x_top.sum())
    return 0.5 * float((e_top - x_top).abs().sum() + rest.abs())


def check_method(
    method: str,
    prompt_id: str,
    generate: Callable[[list[list[int]], int], list[list[int]]],
    batch_ok: bool,
    target: Llama4,
    prompt: Sequence[int],
    sampling: SamplingParams,
    samples: int = 500,
    buckets: int = 10,
    max_support: int = 64,
) -> DistCheck:
    """`generate(prompts, max_new_tokens) -> token lists` runs the method (a batch of prompts when
    batch_ok, else one prompt per call) without stop tokens, so that every row has a second token."""
    if sampling.greedy:
        raise ValueError("the distribution check is for sampling (temperature > 0)")
    exact, uncovered, support = second_token_marginal(target, prompt, sampling, max_support)
    if batch_ok:
        outs = generate([list(prompt)] * samples, 2)
    else:
        outs = [generate([list(prompt)], 2)[0] for _ in range(samples)]
    if any(len(o) < 2 for o in outs):
        raise RuntimeError(f"{method}: a row ended before its second token (run it without stop tokens)")
    covered = set(support.tolist())
    second = [o[1] for o in outs if o[0] in covered]
    if not second:
        raise RuntimeError(f"{method}: no row's first token was among the {len(covered)} enumerated")
    tv = bucketed_tv(second, exact / exact.sum(), buckets)
    return DistCheck(method, prompt_id, len(second), buckets, tv, tv_bound(buckets, len(second)), uncovered)
