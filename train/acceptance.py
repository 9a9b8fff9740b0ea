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

Where the acceptance comes from (same positions, the first draft token only):

    in vocab      the share of positions whose next target token is in the draft vocabulary: the ceiling
                  of P(run >= 1), since a draft never proposes a token outside it
    confident     the share of positions where the target gives its token probability >= 0.9, and
                  P(run >= 1) there: what the draft gets right where the target itself is sure

and every number per category of the benchmark (MT-bench has eight).

Trees and sampling are not covered (a tree accepts what its top-k branches hold; use eval.bench).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from eagle3.draft import Eagle3Draft
from maverick.generate import Decoder
from maverick.model import Llama4
from train.dump import run_target
from train.ttt import ttt_unroll


def greedy_answers(
    model: Llama4, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int = 16
) -> list[list[int]]:
    """The target's greedy answers (up to and including a stop token), in batches."""
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        dec = Decoder(
            model, max_len=max(map(len, chunk)) + max_new_tokens + 8, batch_size=len(chunk), exact=False
        )
        out += dec.generate(chunk, max_new_tokens, stop_ids=model.config.eos_ids).tokens
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
    ok = torch.zeros(steps, T, dtype=torch.bool, device=model.device)
    for i, logits in ttt_unroll(
        draft, model.model.embed_tokens, x, f["features"][None].to(model.device), steps
    ):
        pred = draft.draft_to_target_ids[logits[0].argmax(-1)]  # index t, step i predicts x_{t+2+i}
        ok[i, : T - 1 - i] = pred[: T - 1 - i] == target[1 + i :]
    # leading correct steps: cumprod along the steps
    run = ok.long().cumprod(0).sum(0)
    first = len(prompt) - 1
    last = T - 1 - steps  # index t scores steps 0..steps-1 only if t + steps <= T - 1
    return run[first:last].cpu()


CONFIDENT = 0.9  # the target's probability of its own token from which a position counts as confident


def _first_draft_targets(prompt: Sequence[int], answer: Sequence[int], steps: int) -> slice:
    """The indices t + 1 of the target's choices for x_{t+2}, the first draft token of a cycle starting at
    index t, for the positions of `run_lengths`."""
    first, last = len(prompt) - 1, len(prompt) + len(answer) - 1 - steps
    return slice(first + 1, last + 1)


@torch.no_grad()
def target_probs(
    model: Llama4, prompt: Sequence[int], answer: Sequence[int], steps: int, fields: dict[str, Tensor]
) -> Tensor:
    """For the positions of `run_lengths`: the target's probability of its greedy choice for the cycle's
    first draft token x_{t+2} (fp32 softmax over the full vocabulary from the stored final hidden state).
    The same for every draft, so computed once per answer."""
    at = _first_draft_targets(prompt, answer, steps)
    target = fields["target_argmax"].long()[at]
    hidden = fields["hidden"][at].to(model.device).float()
    head = model.lm_head.weight.float()
    p = torch.zeros(len(target))
    for i in range(0, len(target), 512):  # [512, V] fp32 probabilities at a time
        probs = (hidden[i : i + 512] @ head.T).softmax(-1)
        p[i : i + 512] = probs.gather(1, target[i : i + 512, None].to(probs.device))[:, 0].cpu()
    return p


def target_detail(
    draft: Eagle3Draft,
    prompt: Sequence[int],
    answer: Sequence[int],
    steps: int,
    fields: dict[str, Tensor],
    target_p: Tensor,
) -> dict[str, Tensor]:
    """For the positions of `run_lengths`: whether the target's greedy choice for x_{t+2} is in the draft
    vocabulary, and its probability (`target_probs`)."""
    target = fields["target_argmax"].long()[_first_draft_targets(prompt, answer, steps)]
    return {"in_vocab": draft.t2d[target.to(draft.t2d.device)].cpu(), "target_p": target_p}


def summarize(runs: Tensor, steps: int, detail: dict[str, Tensor] | None = None) -> dict[str, Any]:
    """P(run >= i), tau(k) and, given `target_detail` of the same positions, the vocabulary ceiling and
    the agreement where the target is confident."""
    p = (
        [(runs >= i).float().mean().item() for i in range(1, steps + 1)]
        if len(runs)
        else [float("nan")] * steps
    )
    out: dict[str, Any] = {
        "positions": len(runs),
        "p_run_ge": [round(v, 4) for v in p],
        "tau": {k: round(1 + sum(p[:k]), 4) for k in range(1, steps + 1)},
    }
    if detail is not None:
        sure = detail["target_p"] >= CONFIDENT
        nan = float("nan")
        out["in_vocab"] = round(detail["in_vocab"].float().mean().item(), 4) if len(runs) else nan
        out["confident"] = round(sure.float().mean().item(), 4) if len(runs) else nan
        out["p_run_ge_1_confident"] = round((runs[sure] >= 1).float().mean().item(), 4) if sure.any() else nan
    return out
