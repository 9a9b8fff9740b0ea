"""Sampling rules: how logits become the next token, for plain and speculative decoding alike.

One ``SamplingParams`` is applied to the target's logits and, in speculative decoding, to the draft's
too (eagle3/sampling.py verifies a draft against the target with them): the same temperature / top-k /
top-p processing on both sides is what keeps speculative sampling lossless. These rules live in the model
package so that plain decoding (maverick/generate.py) needs nothing from the draft package above it.

Shape legend: V vocabulary; ``...`` any leading batch dimensions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["SamplingParams", "logits_to_probs", "sample"]


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution; one instance is applied to BOTH draft and target.

    temperature == 0 means greedy (a one-hot of the argmax); top_k == 0 and top_p == 1.0 switch the
    respective filter off.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"SamplingParams.temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] (1 = off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., V] -> float32 probabilities [..., V]: temperature, then top-k, then top-p.

    Top-k keeps every token whose logit ties the k-th largest (as HF does), so it may keep more than
    k. Top-p keeps the smallest prefix of the sorted distribution whose mass reaches top_p: a token
    is kept iff the mass strictly before it is < top_p, so the most likely token always survives.
    The result is renormalised after each filter.
    """
    x = logits.float()  # [..., V]
    V = x.shape[-1]
    if params.greedy:
        return F.one_hot(x.argmax(-1), V).to(torch.float32)
    # the largest logit to 0 first: a tiny temperature then sends the rest to -inf, not every logit to inf
    # (a temperature below ~1e-38 made NaN probabilities); one below float32's smallest normal (which would
    # round to 0 in the division: 0 / 0) divides as that number, already the argmax's limit
    x = (x - x.amax(-1, keepdim=True)) / max(params.temperature, torch.finfo(torch.float32).tiny)
    if 0 < params.top_k < V:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)  # [..., V]
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)  # [..., V]
        mass_before = sorted_p.cumsum(-1) - sorted_p
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per distribution: probs [..., V] (need not be normalised) -> long [...]. A generator on
    another device than probs (a CPU one for a CUDA model) draws on its own device: the same stream."""
    flat = probs.reshape(-1, probs.shape[-1])  # [R, V]
    if generator is not None and generator.device != flat.device:
        drawn = torch.multinomial(flat.to(generator.device), 1, generator=generator).to(flat.device)
        return drawn.view(probs.shape[:-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def uniform(*shape: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """fp32 uniforms in [0, 1) on `device`, drawn on the generator's own device (as `sample`)."""
    where = generator.device if generator is not None else device
    return torch.rand(*shape, generator=generator, device=where, dtype=torch.float32).to(device)


def add_sampling_options(parser) -> None:
    """`--temperature`, `--top-k`, `--top-p` and `--seed` of a command, checked as SamplingParams checks them."""
    from maverick.cli import nonnegative_float, nonnegative_int, top_p

    parser.add_argument("--temperature", type=nonnegative_float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=nonnegative_int, default=0, help="0: off")
    parser.add_argument("--top-p", type=top_p, default=1.0, help="1: off")
    parser.add_argument("--seed", type=nonnegative_int, default=0)
