"""The benchmark's distribution check at temperature > 0 (eval/distcheck.py): its exact marginal equals a
full enumeration, correct speculative sampling passes, an acceptance rule that accepts every draft token
fails."""

from __future__ import annotations

import math

import pytest
import torch
from test_spec import accept_all, exact_marginals, make_draft, make_target

import eagle3.spec as spec_mod
from eagle3.spec import SpecDecoder, TreeConfig
from eagle3.tuner import FixedK
from eval.distcheck import bucketed_tv, check_method, second_token_marginal, tv_bound
from maverick.generate import Decoder
from maverick.sampling import SamplingParams

V = 16
PROMPT = [3, 7, 1, 9, 4]
SAMPLING = SamplingParams(0.9, top_k=8)


@pytest.fixture(scope="module")
def models():
    t = make_target(std=0.6, seed=5, vocab_size=V)
    return t, make_draft(t, std=0.6, seed=6)


def test_exact_marginal_equals_enumeration(models):
    t, _ = models
    p2, _ = exact_marginals(t, PROMPT, SAMPLING, V)
    mine, uncovered, _ = second_token_marginal(t, PROMPT, SAMPLING, max_support=64)
    assert uncovered == pytest.approx(0.0, abs=1e-6) and torch.allclose(mine, p2, atol=1e-6)
    # a support cut to the 2 likeliest first tokens: the left-out mass is reported
    part, uncovered, support = second_token_marginal(t, PROMPT, SAMPLING, max_support=2)
    assert uncovered > 0.001 and float(part.sum()) == pytest.approx(1 - uncovered, abs=1e-5)
    assert len(support) == 2


def test_bucketed_tv_and_bound():
    exact = torch.tensor([0.5, 0.3, 0.2, 0.0])
    assert bucketed_tv([0] * 5 + [1] * 3 + [2] * 2, exact, 3) == pytest.approx(0.0, abs=1e-7)
    assert bucketed_tv([0] * 10, exact, 3) == pytest.approx(0.5)  # buckets {0}, {1}, rest
    assert tv_bound(10, 1000) == pytest.approx(0.5 * math.sqrt(0.01) + math.sqrt(math.log(1000) / 2000))


def _spec_generate(t, d, **kw):
    def generate(rows, n):
        dec = SpecDecoder(t, d, max_len=32, **kw)
        return dec.generate(rows, n, SAMPLING, (), generate.g).tokens

    generate.g = torch.Generator().manual_seed(0)
    return generate


def test_correct_sampling_passes_and_accept_all_fails(models, monkeypatch):
    t, d = models
    plain = Decoder(t, max_len=32)
    g = torch.Generator().manual_seed(1)
    checks = [
        check_method(
            "plain",
            "p",
            lambda rows, n: plain.generate(rows, n, SAMPLING, (), g).tokens,
            True,
            t,
            PROMPT,
            SAMPLING,
            samples=2000,
        ),  # fmt: skip
        check_method(
            "k3", "p", _spec_generate(t, d, policy=FixedK(3)), True, t, PROMPT, SAMPLING, samples=2000
        ),
        check_method(
            "tree",
            "p",
            _spec_generate(t, d, tree=TreeConfig(2, 2, 6)),
            False,
            t,
            PROMPT,
            SAMPLING,
            samples=400,
        ),  # fmt: skip
    ]
    assert all(c.passed for c in checks), checks

    monkeypatch.setattr(spec_mod, "verify_chain_sampling", accept_all)
    bad = check_method("k3-accept-all", "p", _spec_generate(t, d, policy=FixedK(3)), True, t, PROMPT, SAMPLING,
                       samples=2000)  # fmt: skip
    assert not bad.passed and bad.tv > 2 * bad.bound


def test_a_cut_support_compares_the_rows_it_covers(models, monkeypatch):
    """With the first token's support cut to its likeliest token, the rows outside it are left out and
    the rest compared with the second token's distribution given the first in the support: correct sampling
    passes and accepting every draft token fails, with no uncovered mass in the bound (before: added to it,
    which on SmolLM2 at temperature 1 let accept-all pass)."""
    t, d = models
    good = check_method("k3", "p", _spec_generate(t, d, policy=FixedK(3)), True, t, PROMPT, SAMPLING,
                        samples=2000, max_support=1)  # fmt: skip
    assert good.uncovered > 0.02 and good.samples < 2000 and good.passed, good
    assert good.bound == pytest.approx(tv_bound(good.buckets, good.samples))
    monkeypatch.setattr(spec_mod, "verify_chain_sampling", accept_all)
    bad = check_method("k3-accept-all", "p", _spec_generate(t, d, policy=FixedK(3)), True, t, PROMPT, SAMPLING,
                       samples=2000, max_support=1)  # fmt: skip
    assert not bad.passed
