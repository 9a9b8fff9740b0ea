"""Tests for eagle3.tuner on a synthetic speculative process with known optimum.

The process: every draft token is accepted i.i.d. with probability a (the cycle stops at the first
rejection), a draft of k tokens costs k * c seconds and a verify pass 1 second. Expected tokens per
cycle are (1 - a^(k+1)) / (1 - a), so the goodput of k is f(k) = (1 - a^(k+1)) / ((1 - a)(k c + 1))
and the best k is its argmax over the choices 1..8.
"""

import collections
import random

import pytest
import torch

from eagle3.tuner import DraftLengthTuner, FixedK, HeuristicK, LinearCost

CHOICES = range(1, 9)


def _goodput(a: float, c: float, k: int) -> float:
    return (1 - a ** (k + 1)) / ((1 - a) * (k * c + 1))


def _best(a: float, c: float) -> int:
    return max(CHOICES, key=lambda k: _goodput(a, c, k))


def _simulate(policy, accept_at, c: float, cycles: int, seed: int = 0) -> list[tuple[int, int]]:
    """Runs `cycles` cycles; accept_at(t) is the acceptance at cycle t. Returns (k, n) per cycle."""
    rng = random.Random(seed)
    out = []
    for t in range(cycles):
        a = accept_at(t)
        k = policy.choose_k()
        n = 0
        while n < k and rng.random() < a:
            n += 1
        policy.record_draft(k, k * c)
        policy.record_verify(k + 1, 1.0)
        policy.record_acceptance(k, n)
        out.append((k, n))
    return out


def _exploit_choices(tuner: DraftLengthTuner, start: int, stop: int | None = None) -> list[int]:
    return [e["k"] for e in tuner.log[start:stop] if e["reason"] == "best"]


# ----------------------------------------------------------------------------------------------
# convergence on the synthetic process


@pytest.mark.parametrize(("a", "c"), [(0.6, 0.1), (0.8, 0.05), (0.9, 0.02), (0.5, 0.3)])
def test_tuner_converges_to_the_analytic_optimum(a, c):
    tuner = DraftLengthTuner(CHOICES)
    _simulate(tuner, lambda t: a, c, cycles=2000)
    best = _best(a, c)
    chosen = collections.Counter(_exploit_choices(tuner, -500)).most_common(1)[0][0]
    # For (0.8, 0.05), k = 7 and k = 8 differ by 0.3% in goodput: no finite run can tell them apart
    # reliably, so the criterion is "the argmax, or within 1% of it"; for the other three pairs
    # the runner-up is >= 1.6% worse, so this demands the exact argmax.
    runner_up = sorted((_goodput(a, c, k) for k in CHOICES), reverse=True)[1]
    if runner_up < 0.99 * _goodput(a, c, best):
        assert chosen == best
    else:
        assert _goodput(a, c, chosen) >= 0.99 * _goodput(a, c, best)
    # realised goodput over the whole run (warm-up at k = 8 and probes included) vs the best fixed k
    assert tuner.realised_tokens_per_s >= 0.95 * _goodput(a, c, best)


def test_tuner_matches_the_best_fixed_k_on_the_same_traffic():
    a, c = 0.6, 0.1
    best = _best(a, c)
    tuner, fixed = DraftLengthTuner(CHOICES), FixedK(best)
    _simulate(tuner, lambda t: a, c, cycles=3000, seed=7)
    _simulate(fixed, lambda t: a, c, cycles=3000, seed=7)
    assert fixed.realised_tokens_per_s == pytest.approx(_goodput(a, c, best), rel=0.03)
    assert tuner.realised_tokens_per_s >= 0.97 * fixed.realised_tokens_per_s


def test_tuner_follows_a_drop_in_acceptance():
    a_before, a_after, c, switch = 0.9, 0.4, 0.1, 1000
    assert (_best(a_before, c), _best(a_after, c)) == (8, 2)
    tuner = DraftLengthTuner(CHOICES)
    cycles = _simulate(tuner, lambda t: a_before if t < switch else a_after, c, cycles=2000, seed=0)
    before = collections.Counter(_exploit_choices(tuner, switch - 200, switch))
    assert before.most_common(1)[0][0] == 8
    # within 300..400 cycles after the drop the tuner mostly picks the new optimum
    settled = collections.Counter(_exploit_choices(tuner, switch + 300, switch + 400))
    assert settled.most_common(1)[0][0] == 2
    # After that the choice still wanders between 1, 2 and 3: at a = 0.4 their goodputs are within
    # 4% of each other (1.273, 1.300, 1.249) and alpha is estimated from ~100 recent cycles (noise
    # ~0.05), so only clearly worse lengths are excluded ...
    after = _exploit_choices(tuner, switch + 300)
    assert max(after) <= 4 and collections.Counter(after).most_common(1)[0][0] == 2
    assert tuner.alphas[0] == pytest.approx(a_after, abs=0.1)
    # ... and the goodput realised after the switch is within a few percent of the best fixed k
    tail = cycles[switch + 300 :]
    realised = sum(n + 1 for _, n in tail) / sum(k * c + 1 for k, _ in tail)
    assert realised >= 0.95 * _goodput(a_after, c, 2)


def test_tuner_discovers_that_longer_drafts_became_worthwhile():
    # a = 0.2: k = 1 is best by 5.6%; a = 0.9: k = 8 is best, k = 7 1.6% behind. Nothing but the
    # probes and the optimistic prior ever tries k > 1 before the switch.
    c, switch = 0.1, 600
    tuner = DraftLengthTuner(CHOICES)
    _simulate(tuner, lambda t: 0.2 if t < switch else 0.9, c, cycles=1500, seed=3)
    assert collections.Counter(_exploit_choices(tuner, switch - 100, switch)).most_common(1)[0][0] == 1
    late = collections.Counter(_exploit_choices(tuner, -300)).most_common(1)[0][0]
    assert late >= 7 and _goodput(0.9, c, late) >= 0.98 * _goodput(0.9, c, _best(0.9, c))


# ----------------------------------------------------------------------------------------------
# estimates, probes and the log


def test_alpha_bookkeeping_single_row_and_batch():
    tuner = DraftLengthTuner(range(1, 5), alpha_init=0.8, prior_weight=2.0, alpha_ema=0.1)
    tuner.record_acceptance(4, 2)  # positions 1, 2 accepted, 3 rejected, 4 never tried
    # each position's prior (weight 2) is the estimate one position up; position 1's is 0.8
    a1 = (1.6 + 1) / 3
    a2 = (2 * a1 + 1) / 3
    a3 = (2 * a2 + 0) / 3
    assert tuner.alphas == pytest.approx([a1, a2, a3, a3])  # position 4, never tried: its prior

    tuner.record_acceptance(3, torch.tensor([0, 3, 1]))
    # evidence decays by 0.9 per cycle; position 1: tried by 3 rows, accepted by 2; position 2:
    # tried by the rows with n >= 1 (2), accepted by 1; position 3: tried 1, accepted 1
    hits = [0.9 + 2, 0.9 + 1, 0 + 1, 0]
    tries = [0.9 + 3, 0.9 + 2, 0.9 + 1, 0]
    want, prior = [], 0.8
    for h, t in zip(hits, tries):
        prior = (2 * prior + h) / (2 + t)
        want.append(prior)
    assert tuner.alphas == pytest.approx(want)
    assert tuner.tokens == 3 + (1 + 4 + 2)
    e3 = (
        1
        + tuner.alphas[0]
        + tuner.alphas[0] * tuner.alphas[1]
        + tuner.alphas[0] * tuner.alphas[1] * tuner.alphas[2]
    )
    assert tuner.expected_tokens(3) == pytest.approx(e3)
    assert tuner.expected_tokens(0) == 1.0
    with pytest.raises(ValueError, match="0..k=3"):
        tuner.record_acceptance(3, [4])


def test_linear_cost_fit_and_single_point_extrapolation():
    draft = LinearCost(ema=0.5, single="proportional")
    draft.record(4, 0.2)
    assert draft.predict(8) == pytest.approx(0.4)  # one point: proportional
    verify = LinearCost(single="flat")
    verify.record(5, 1.0)
    assert verify.predict(9) == pytest.approx(1.0)  # one point: flat
    draft.record(2, 0.15)
    assert draft.line() == pytest.approx((0.1, 0.025))
    assert draft.predict(6) == pytest.approx(0.25)
    # first measurements are averaged, later ones EMA-weighted (ema 0.5 -> weight max(0.5, 1/count))
    draft.record(2, 0.25)
    assert draft.seconds[2] == pytest.approx(0.2)
    draft.record(2, 0.4)
    assert draft.seconds[2] == pytest.approx(0.3)
    # a burst: the EMA is reset to the median of the last `window` times once that falls below 0.75x it
    burst, plain = LinearCost(ema=0.1, window=7), LinearCost(ema=0.1, window=0)
    for t in [1.0] * 20 + [5.0] * 20 + [1.0, 1.1, 0.9]:
        burst.record(3, t)
        plain.record(3, t)
    assert burst.seconds[3] > 2.5  # 4 of the last 7 are burst times: median 5
    burst.record(3, 1.0)
    assert burst.seconds[3] == pytest.approx(1.1)  # now 4 of 7 are clean: the median, 1.1
    assert plain.seconds[3] > 2.5
    quiet, ema_only = LinearCost(ema=0.1, window=7), LinearCost(ema=0.1, window=0)
    for t in [1.0, 1.2, 0.8, 1.1, 0.9, 1.2, 0.8, 1.0, 1.15]:  # +-20% noise never resets: the plain EMA
        quiet.record(3, t)
        ema_only.record(3, t)
    assert quiet.seconds[3] == ema_only.seconds[3]
    with pytest.raises(ValueError, match="size 3"):
        draft.record(3, float("nan"))


def test_cycle_time_uses_draft_plus_verify_of_k_plus_one():
    tuner = DraftLengthTuner(range(0, 5))
    assert tuner.tokens_per_s() is None
    assert tuner.choose_k() == 4  # before any cost: the largest choice, to measure every position
    tuner.record_draft(4, 0.4)
    tuner.record_verify(5, 1.0)
    tuner.record_verify(2, 0.7)  # verify line: 0.5 + 0.1 n
    assert tuner.cycle_time(4) == pytest.approx(0.4 + 1.0)
    assert tuner.cycle_time(2) == pytest.approx(0.2 + 0.8)
    assert tuner.cycle_time(0) == pytest.approx(0.6)  # k = 0: no draft at all
    rates = tuner.tokens_per_s()
    assert rates[2] == pytest.approx(tuner.expected_tokens(2) / 1.0)


def test_probes_follow_a_deterministic_schedule_and_everything_is_logged():
    tuner = DraftLengthTuner(CHOICES, probe_every=4)
    _simulate(tuner, lambda t: 0.6, 0.1, cycles=64)
    assert len(tuner.log) == 64 == tuner.decisions
    assert tuner.log[0]["reason"] == "init" and tuner.log[0]["k"] == 8
    # then every other length once, longest first, before any choice relies on extrapolated costs
    assert [(e["reason"], e["k"]) for e in tuner.log[1:8]] == [("sweep", k) for k in range(7, 0, -1)]
    assert all(e["reason"] in ("best", "probe") for e in tuner.log[8:])
    probes = [e for e in tuner.log if e["reason"] == "probe"]
    assert [e["cycle"] for e in probes] == list(range(12, 65, 4))
    # a probe is a neighbour of the k the tuner would otherwise choose, alternately above and below
    for e in probes[2:]:
        best = max(e["tokens_per_s"], key=e["tokens_per_s"].get)
        assert abs(e["k"] - best) == 1
    assert len({e["k"] - max(e["tokens_per_s"], key=e["tokens_per_s"].get) for e in probes[2:]}) == 2
    entry = tuner.log[-1]
    assert set(entry) >= {"cycle", "k", "reason", "expected_tokens", "cycle_time", "tokens_per_s"}
    assert set(entry["tokens_per_s"]) == set(CHOICES)
    summary = tuner.summary()
    assert summary["decisions"] == 64 and len(summary["alphas"]) == 8
    assert summary["best_k"] == max(summary["tokens_per_s"], key=summary["tokens_per_s"].get)


def test_tuner_rejects_bad_settings():
    with pytest.raises(ValueError, match="k_init"):
        DraftLengthTuner(range(1, 4), k_init=7)
    with pytest.raises(ValueError, match="k_init=0 never measures"):  # it chose k = 0 ("init") forever
        DraftLengthTuner(range(0, 4), k_init=0)
    assert DraftLengthTuner([0], k_init=0).choose_k() == 0
    with pytest.raises(ValueError, match="alpha_init"):
        DraftLengthTuner(alpha_init=1.0)
    with pytest.raises(ValueError, match="choices"):
        DraftLengthTuner([])
    with pytest.raises(ValueError, match="no tree_configs"):
        DraftLengthTuner().choose_tree()
    with pytest.raises(ValueError, match="tree_min_trials must be >= 1"):  # it picked among unmeasured trees
        DraftLengthTuner(tree_configs=["a", "b"], tree_min_trials=0)


# ----------------------------------------------------------------------------------------------
# tree configurations


def test_tree_budget_choice_converges_and_keeps_probing():
    # budget -> (mean tokens per cycle, seconds per cycle): goodput 2.6, 3.0, 2.4 -> 32 is best
    configs = {16: (2.6, 1.0), 32: (3.3, 1.1), 64: (3.6, 1.5)}
    tuner = DraftLengthTuner(tree_configs=list(configs), tree_min_trials=3, probe_every=16)
    rng = random.Random(0)
    chosen = []
    for _ in range(600):
        budget = tuner.choose_tree()
        mean, secs = configs[budget]
        tokens = 1 + sum(rng.random() < (mean - 1) / 6 for _ in range(6))  # binomial, mean `mean`
        tuner.record_tree(budget, tokens, secs * (1 + 0.05 * rng.gauss(0, 1)))
        chosen.append(budget)
    assert chosen[:9] == [16, 32, 64] * 3  # each explored tree_min_trials times first
    assert collections.Counter(chosen[-300:]).most_common(1)[0][0] == 32
    tree_log = [e for e in tuner.log if e["kind"] == "tree"]
    assert len(tree_log) == 600 and sum(e["reason"] == "probe" for e in tree_log) == 600 // 16
    assert tuner.realised_tokens_per_s >= 0.9 * 3.0
    assert tuner.summary()["tree"][32]["count"] > 300
    with pytest.raises(ValueError, match="unknown tree config 8"):
        tuner.record_tree(8, 3, 1.0)


# ----------------------------------------------------------------------------------------------
# baselines


def test_fixed_k_always_returns_k():
    fixed = FixedK(3)
    _simulate(fixed, lambda t: 0.7, 0.1, cycles=50)
    assert [e["k"] for e in fixed.log] == [3] * 50
    assert fixed.summary()["k"] == 3 and fixed.tokens >= 50


def test_heuristic_k_follows_plus_two_minus_one():
    h = HeuristicK(k_init=5, k_min=1, k_max=8)
    ks = []
    for n_of_k in [lambda k: k, lambda k: k, lambda k: 0, lambda k: k - 1, lambda k: 0] + [lambda k: 0] * 8:
        k = h.choose_k()
        ks.append(k)
        h.record_acceptance(k, n_of_k(k))
    # 5 -full-> 7 -full-> 8 (capped at k_max) -> 7 -> 6 -> 5 ... -> 1 (k_min)
    assert ks == [5, 7, 8, 7, 6, 5, 4, 3, 2, 1, 1, 1, 1]
    # a batch counts as fully accepted only if every row accepted everything
    h = HeuristicK(k_init=4)
    h.record_acceptance(4, [4, 4, 3])
    assert h.choose_k() == 3
    h.record_acceptance(3, [3, 3])
    assert h.choose_k() == 5


def test_weak_draft_with_the_shipped_drafts_acceptance_profile():
    """Conditional acceptance 0.33 / 0.25 / 0.4 / 0.25 at positions 1-4 (the shipped SmolLM2 draft on
    MT-bench), costs measured with +-25% noise. Position 3 is reached in ~8% of cycles, too seldom for its
    evidence to outweigh a flat optimistic prior; with each position's prior chained to the estimate one
    position up the tuner realises 0.997 of the best fixed k on average over these seeds (a flat 0.8 prior
    at every position: 0.977)."""
    profile, c, v = [0.33, 0.25, 0.4, 0.25], 0.07, 0.02

    def goodput(k):
        e, run = 1.0, 1.0
        for j in range(k):
            run *= profile[min(j, 3)]
            e += run
        return e / (k * c + 1 + v * k)

    best = max(goodput(k) for k in CHOICES)
    ratios = []
    for seed in range(6):
        rng = random.Random(seed)
        tuner = DraftLengthTuner(CHOICES)
        tokens = cost = 0.0
        for _ in range(1500):
            k = tuner.choose_k()
            n = 0
            while n < k and rng.random() < profile[min(n, 3)]:
                n += 1
            tuner.record_draft(k, k * c * rng.uniform(0.75, 1.25))
            tuner.record_verify(k + 1, (1 + v * k) * rng.uniform(0.75, 1.25))
            tuner.record_acceptance(k, n)
            tokens += n + 1
            cost += k * c + 1 + v * k
        ratios.append(tokens / cost / best)
    assert sum(ratios) / len(ratios) >= 0.985 and min(ratios) >= 0.97, ratios


def test_noisy_costs_weak_draft():
    """Costs measured with +-25% noise (a shared CPU) and a weak draft: the tuner must not stay at the long
    draft it starts with. It did, when sizes never measured were extrapolated by a line through the two
    it had measured (k = 8 and 7: the slope is noise), and left one step per probe; now it measures every
    k once first."""
    a, c = 0.3, 0.07
    rng = random.Random(5)
    tuner = DraftLengthTuner(CHOICES)
    out = []
    for _ in range(1500):
        k = tuner.choose_k()
        n = 0
        while n < k and rng.random() < a:
            n += 1
        tuner.record_draft(k, k * c * rng.uniform(0.75, 1.25))
        tuner.record_verify(k + 1, rng.uniform(0.75, 1.25))
        tuner.record_acceptance(k, n)
        out.append((k, n))
    first = [k for k, _ in out[:100]]
    assert sum(k >= 6 for k in first) <= 10  # the long start is left within the first cycles
    realised = sum(n + 1 for _, n in out) / sum(k * c + 1 for k, _ in out)
    assert realised >= 0.96 * _goodput(a, c, _best(a, c))


def _goodput_after_bursts(policy, seed: int, p_spike: float, cycles: int = 2000, burst=(600, 900)) -> float:
    """A weak draft (the shipped one's profile), verify costs measured on the CPU (2 tokens dearer than 3),
    +-15% noise, and between cycles 600 and 900 another process that makes a cycle 5x slower with
    probability p_spike. Returns tokens per true second after the burst."""
    profile, verify = [0.40, 0.35, 0.31, 0.5], {2: 36, 3: 33, 4: 33.5, 5: 35, 6: 37, 7: 39, 8: 41, 9: 43}
    rng = random.Random(seed)
    tokens = cost = 0.0
    for t in range(cycles):
        k = policy.choose_k()
        n = 0
        while n < k and rng.random() < profile[min(n, 3)]:
            n += 1
        s = 5.0 if burst[0] <= t < burst[1] and rng.random() < p_spike else 1.0
        d, v = (0.8 + 2.2 * k) * s, verify[k + 1] * s
        policy.record_draft(k, d * rng.uniform(0.85, 1.15))
        policy.record_verify(k + 1, v * rng.uniform(0.85, 1.15))
        policy.record_acceptance(k, n)
        if t >= burst[1]:
            tokens, cost = tokens + n + 1, cost + d + v
    return tokens / cost


def test_tuner_recovers_from_a_burst_of_contention():
    """Cost EMAs alone kept the burst's times for the lengths measured only by probes and sat at the wrong
    k for hundreds of cycles (seen on the 2-core CPU: 0.71x the best fixed k); the median window
    forgets the burst. Measured over these 12 seeds: EMA alone 0.919 on average (0.69 at worst), with the
    reset 0.991 (0.978); no burst: 0.992 for both."""
    ratios = {0: [], 7: []}
    quiet = []
    for seed in range(12):
        best = max(_goodput_after_bursts(FixedK(k), seed, 0.3) for k in (1, 2, 3))
        for window in ratios:
            tuner = DraftLengthTuner(CHOICES, cost_window=window)
            ratios[window].append(_goodput_after_bursts(tuner, seed, 0.3) / best)
        best_quiet = max(_goodput_after_bursts(FixedK(k), seed, 0.0) for k in (1, 2, 3))
        quiet.append(_goodput_after_bursts(DraftLengthTuner(CHOICES), seed, 0.0) / best_quiet)
    mean = {w: sum(r) / len(r) for w, r in ratios.items()}
    assert mean[7] >= 0.98 and min(ratios[7]) >= 0.96, ratios[7]
    assert mean[0] < 0.95  # the scenario does catch the EMA-only estimate
    assert sum(quiet) / len(quiet) >= 0.985, quiet


def _copy_rate(L: int, first: float, then: float, cost) -> float:
    """Expected tokens per second of a copy of L tokens: the first accepted with probability `first`, each
    next one (given the one before) with `then`; the verify of L + 1 rows costs cost(L + 1)."""
    return (1 + first * (1 - then**L) / (1 - then)) / cost(L + 1)


def _bucketed(n: int) -> float:
    """A compiled 4-bit engine's verify cost shape: the rows of the bucket n pads to, ~0.9 s a row."""
    bucket = next(b for b in (2, 4, 8, 12, 24) if b >= n)
    return 6.0 + 0.9 * (bucket - 1)


def _copy_choices(tuner, lengths, first, then, verify, cycles, catch_up=None) -> list[int]:
    """The copy lengths the tuner chooses over `cycles` simulated copies (the first token accepted with
    probability `first`, each next one with `then`), each verify costing verify(L + 1), each catch-up
    `catch_up` seconds (None: not reported)."""
    rng = random.Random(0)
    chosen = []
    for _ in range(cycles):
        L = tuner.choose_copy(lengths)
        n = 0
        while n < L and rng.random() < (first if n == 0 else then):
            n += 1
        tuner.record_verify(L + 1, verify(L + 1))
        if catch_up is not None:
            tuner.record_catch_up(L + 1, catch_up)
        tuner.record_copy(L, n)
        chosen.append(L)
    return chosen


@pytest.mark.parametrize("cost", [_bucketed, lambda n: 1.0], ids=["bucketed", "flat"])
def test_copy_length_converges_to_the_analytic_optimum(cost):
    """Copies that are mostly all or nothing (first token accepted 45% of the time, each next one 80%):
    with a verify cost that grows with its rows a short copy pays, with a flat one the longest."""
    lengths, first, then = [1, 3, 7, 10], 0.45, 0.8
    want = max(lengths, key=lambda L: _copy_rate(L, first, then, cost))
    chosen = _copy_choices(DraftLengthTuner(choices=range(1, 5)), lengths, first, then, cost, 600)
    assert want == (3 if cost is _bucketed else 10)
    top = collections.Counter(chosen[300:]).most_common(1)[0]
    assert top[0] == want and top[1] >= 0.7 * 300, collections.Counter(chosen[300:])


def test_copies_after_a_full_accept_are_learnt_apart():
    """A streak copy (after one accepted in full) has its own acceptance: here always accepted, while other
    copies never are; the streak keeps the longest length, the others fall to the shortest."""
    tuner = DraftLengthTuner()
    lengths = [1, 3, 7, 11]
    for _ in range(200):
        for streak in (False, True):
            L = tuner.choose_copy(lengths, streak)
            tuner.record_verify(L + 1, _bucketed(L + 1))
            tuner.record_copy(L, L if streak else 0, streak)
    assert tuner.copy_accept[True].alphas[0] > 0.95 and tuner.copy_accept[False].alphas[0] < 0.05
    assert tuner.choose_copy(lengths, True) == 11
    assert tuner.choose_copy(lengths, False) == 1
    with pytest.raises(ValueError, match="record_copy"):
        tuner.record_copy(3, 4)


def test_a_copys_catch_up_is_weighed_with_its_verify():
    """A copy's cycle also has the draft catch up on what was accepted: a fixed 30 s here beside a verify
    of 1 s a row. Weighed by its verify alone the shortest copy pays (E(L) / (L + 1) falls with L); with the
    catch-up the longest does, and the tuner finds it. k = 0's cycle time counts its catch-up too."""
    lengths, first, then = [1, 3, 7, 10], 0.45, 0.8
    verify, catch_up = (lambda n: 1.0 * n), 30.0
    alone = max(lengths, key=lambda L: _copy_rate(L, first, then, verify))
    want = max(lengths, key=lambda L: _copy_rate(L, first, then, lambda n: verify(n) + catch_up))
    assert (alone, want) == (1, 10)
    tuner = DraftLengthTuner(choices=range(0, 5))
    chosen = _copy_choices(tuner, lengths, first, then, verify, 400, catch_up)
    top = collections.Counter(chosen[200:]).most_common(1)[0]
    assert top[0] == want and top[1] >= 0.7 * 200, collections.Counter(chosen[200:])
    tuner.record_draft(0, 5.0)
    assert tuner.cycle_time(0) == pytest.approx(5.0 + tuner.verify_cost.predict(1))
