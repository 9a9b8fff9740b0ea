"""Choosing how much to speculate, from measurements taken on the running machine.

A longer draft buys more tokens per cycle only while the draft keeps being accepted, and every
draft token costs a draft forward and a wider verify pass. The best draft length therefore depends
on the draft's acceptance on THIS traffic and on the costs of THIS machine, and both drift (a code
prompt is easier than a chat one; batch size changes the verify cost). So the tuner measures both
and maximises expected goodput, not acceptance:

    E(k) = 1 + sum_{i=1..k} prod_{j<=i} alpha_j       expected tokens per cycle (bonus included)
    T(k) = draft_time(k) + verify_time(k + 1)         seconds per cycle
    choose argmax_k E(k) / T(k)

alpha_j is the conditional acceptance at draft position j (position j accepted given positions
< j were), tracked per position because EAGLE drafts get worse with depth. A cycle that accepted
n of k tokens is n successes at positions 1..n and, if n < k, one failure at position n + 1;
positions beyond the first rejection say nothing. Each alpha is (prior + hits) / (prior weight +
tries) over counts discounted by (1 - alpha_ema) per CYCLE, so a position rarely tried any more
(deep positions once k shrank) forgets old traffic as fast as position 1 does and drifts back to
its prior. The prior (worth two observations) of position 1 is optimistic (0.8); that of position
j > 1 is the estimate at position j - 1. A flat optimistic prior at every position makes a weak
draft look good at depth: with alpha = 0.33 / 0.25 at positions 1 / 2, position 3 is reached in ~8%
of cycles, too seldom for its evidence to outweigh 0.8 (simulated with the shipped draft's profile
and noisy costs: 0.977 of the best fixed k's goodput with the flat prior, 0.997 chained). Chained, a
position nobody reaches looks as good as the last one measured, and when acceptance rises at
position 1 the deeper ones follow, so longer drafts get tried again.

Costs are EMAs per size, reset to the median of the recent measurements after a burst of contention on
a shared CPU (see LinearCost). The first decisions sweep every k once, longest first (which also
measures the acceptance at every position): a line through two neighbouring noisy sizes
extrapolates to anything, and on MT-bench the tuner that trusted one stayed at k = 7-8 for ~600
cycles, leaving one step at a time through probes (21.3 tok/s against 22.3 for fixed k = 3).
`LinearCost` still predicts a size never measured by a least-squares line a + b * n through the
measured sizes (with one measured size: proportional for the draft, flat for the verify, which is
what the two look like on a GPU). The chosen k only measures its own neighbourhood, so every
``probe_every``-th decision deterministically tries a neighbour of the best k (alternately above
and below): that is how the tuner notices that a longer draft became worthwhile after the
acceptance rose.

Tree drafts have no per-position model that would survive dynamic trees, so tree configurations
(e.g. total-token budgets) are compared directly: EMA of tokens per cycle over EMA of seconds per
cycle, each configuration tried ``tree_min_trials`` times first, then probed round-robin. A
SpecDecoder given several trees asks ``choose_tree`` at each tree cycle and reports it with
``record_tree`` (eval.bench's eagle3-tree-tuned, eagle3.generate with ``--tree`` repeated).

``FixedK`` and ``HeuristicK`` (HF assisted generation: +2 after a fully accepted draft, -1
otherwise) share the interface so the decoding loop and benchmarks can swap policies.

The loop calls, per cycle: ``k = policy.choose_k()``, then ``record_draft(k, s)``,
``record_verify(k + 1, s)`` and ``record_acceptance(k, n_accepted)``. Every decision is appended to
``policy.log`` (a list of dicts); ``summary()`` returns the current estimates.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import torch

from maverick.parallel import rank0_value

__all__ = ["Acceptance", "DraftLengthTuner", "FixedK", "HeuristicK", "LinearCost"]


def _as_counts(n_accepted: int | Sequence[int] | torch.Tensor) -> list[int]:
    """n_accepted for one row (int) or a batch (sequence / 1-D tensor; a tensor is read once)."""
    if isinstance(n_accepted, torch.Tensor):
        return [int(x) for x in n_accepted.reshape(-1).tolist()]
    if isinstance(n_accepted, int):
        return [n_accepted]
    return [int(x) for x in n_accepted]


class LinearCost:
    """Measured seconds per size (EMA), with a least-squares line for sizes not measured yet.

    ``single`` says how one measured size extrapolates: "proportional" (t * n / n0: draft cost grows
    with the number of draft steps) or "flat" (t: a verify pass is memory-bound, nearly constant in
    the number of tokens for small n).

    A size's cost is the EMA of its measurements, reset to the median of its last ``window`` ones when
    that is below ``reset_ratio`` times the EMA (window 0: never). Another process on the same cores only
    ever adds time, in bursts; a size measured rarely (a probe every ``probe_every`` cycles) kept the EMA
    of a burst for dozens of probes, and the tuner then sat at k = 1 for ~400 cycles after one (MT-bench
    on a 2-core CPU). The reset forgets a burst once most of the recent measurements are clean; in quiet
    times it never fires (noise of +-15% stays far from a factor 0.75), so the estimate is the plain EMA.
    (Taking the smaller of the EMA and the median instead made the rarely measured sizes look cheaper than
    they are, the minimum of two noisy estimates, and the tuner drafted too long.) Simulated
    (tests/test_tuner.py): 0.991 of the best fixed k's goodput after bursts where the EMA alone gets
    0.919 (0.69 at worst); 0.992 for both without bursts.
    """

    def __init__(
        self, ema: float = 0.1, single: str = "proportional", window: int = 7, reset_ratio: float = 0.75
    ):
        if not 0.0 < ema <= 1.0:
            raise ValueError(f"LinearCost.ema must be in (0, 1], got {ema}")
        if single not in ("proportional", "flat"):
            raise ValueError(f"LinearCost.single must be 'proportional' or 'flat', got {single!r}")
        if window < 0:
            raise ValueError(f"LinearCost.window must be >= 0, got {window}")
        if not 0.0 < reset_ratio <= 1.0:
            raise ValueError(f"LinearCost.reset_ratio must be in (0, 1], got {reset_ratio}")
        self.ema, self.single, self.window, self.reset_ratio = ema, single, window, reset_ratio
        self.seconds: dict[int, float] = {}  # the cost (EMA) of each measured size
        self.recent: dict[int, list[float]] = {}  # its last `window` measurements
        self.counts: dict[int, int] = {}

    def record(self, n: int, seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"measured seconds for size {n} must be finite and >= 0, got {seconds}")
        c = self.counts.get(n, 0) + 1
        w = max(self.ema, 1.0 / c)  # plain mean for the first 1/ema measurements, then EMA
        self.seconds[n] = seconds if c == 1 else (1 - w) * self.seconds[n] + w * seconds
        self.counts[n] = c
        if self.window:
            recent = self.recent.setdefault(n, [])
            recent.append(seconds)
            del recent[: -self.window]
            median = statistics.median(recent)
            if len(recent) == self.window and median < self.reset_ratio * self.seconds[n]:
                self.seconds[n] = median  # the average still holds a burst that the recent times do not

    @property
    def measured(self) -> bool:
        return bool(self.seconds)

    def line(self) -> tuple[float, float]:
        """(a, b) of the fit a + b * n through the measured sizes."""
        if not self.seconds:
            raise ValueError("LinearCost.line: no size has been measured yet")
        xs = list(self.seconds)
        ys = [self.seconds[x] for x in xs]
        if len(xs) == 1:
            x, y = xs[0], ys[0]
            return (0.0, y / x) if self.single == "proportional" and x > 0 else (y, 0.0)
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        return my - b * mx, b

    def predict(self, n: int) -> float:
        if n in self.seconds:
            return self.seconds[n]
        a, b = self.line()
        return max(0.0, a + b * n)


def _neighbour(values: list[int], x: int, up: bool) -> int:
    """The value next to x in the sorted `values` (2+ of them): above it if `up` (or x is the first), else
    below it (or above, if x is the last)."""
    i = values.index(x)
    return values[i + 1] if i + 1 < len(values) and (up or i == 0) else values[i - 1]


class Acceptance:
    """The conditional acceptance alphas[j - 1] at draft position j, from counts discounted by (1 - ema) per
    cycle, each position's prior (worth `weight` observations) the estimate one position up, position 1's
    `prior` (see the module docstring). A cycle that accepted n of k tokens is n successes at positions
    1..n and, if n < k, one failure at position n + 1."""

    def __init__(self, positions: int, prior: float, weight: float, ema: float):
        self.prior, self.weight, self.ema = prior, weight, ema
        self.alphas = [prior] * positions
        self.hits = [0.0] * positions
        self.tries = [0.0] * positions

    def grow(self, positions: int) -> None:
        """Room for drafts of up to `positions` tokens (a new position starts at the last one's estimate)."""
        while len(self.alphas) < positions:
            self.alphas.append(self.alphas[-1] if self.alphas else self.prior)
            self.hits.append(0.0)
            self.tries.append(0.0)

    def expected_tokens(self, k: int) -> float:
        """E(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j."""
        total, run = 1.0, 1.0
        for j in range(k):
            run *= self.alphas[j]
            total += run
        return total

    def observe(self, k: int, counts: list[int]) -> None:
        # Discount every position's evidence by the age of the cycle, not by the number of its own
        # observations: deep positions are observed rarely once k shrank, and a per-observation EMA
        # would keep their stale values for thousands of cycles after the traffic changed.
        keep = 1.0 - self.ema
        for j in range(len(self.alphas)):
            self.hits[j] *= keep
            self.tries[j] *= keep
        # position j (1-based) was tried by rows with n >= j - 1 and accepted by rows with n >= j
        for j in range(1, min(k, len(self.alphas)) + 1):
            self.tries[j - 1] += sum(n >= j - 1 for n in counts)
            self.hits[j - 1] += sum(n >= j for n in counts)
        w, prior, alphas = self.weight, self.prior, []
        for h, t in zip(self.hits, self.tries):
            prior = (w * prior + h) / (w + t)  # position j's estimate is position j + 1's prior
            alphas.append(prior)
        self.alphas = alphas


class _Policy:
    """Shared bookkeeping: realised tokens and seconds, the decision log."""

    def __init__(self) -> None:
        self.log: list[dict[str, Any]] = []
        self.decisions = 0
        self.tokens = 0
        self.seconds = 0.0

    def record_draft(self, k: int, seconds: float) -> None:
        self.seconds += seconds

    def record_verify(self, n_tokens: int, seconds: float) -> None:
        self.seconds += seconds

    def record_cycle(self, n_tokens: int, seconds: float) -> None:
        """Tokens and seconds the policy's models do not learn from but its realised rate counts: rows of
        copied drafts (prompt lookup, datastore; their time outside the verify when no row drafted), and
        the cycles of a fixed tree."""
        self.tokens += n_tokens
        self.seconds += seconds

    def record_acceptance(self, k: int, n_accepted: int | Sequence[int] | torch.Tensor) -> None:
        counts = _as_counts(n_accepted)
        bad = [n for n in counts if not 0 <= n <= k]
        if bad:
            raise ValueError(f"record_acceptance: n_accepted must be in 0..k={k}, got {bad[:4]}")
        self.tokens += sum(n + 1 for n in counts)
        self._observe(k, counts)

    def _observe(self, k: int, counts: list[int]) -> None:
        pass

    @property
    def realised_tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    def summary(self) -> dict[str, Any]:
        return {
            "policy": type(self).__name__,
            "decisions": self.decisions,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "realised_tokens_per_s": self.realised_tokens_per_s,
        }


class FixedK(_Policy):
    """Always the same draft length (the baseline every tuner must beat)."""

    def __init__(self, k: int):
        super().__init__()
        if k < 0:
            raise ValueError(f"FixedK.k must be >= 0, got {k}")
        self.k = k

    def choose_k(self) -> int:
        self.decisions += 1
        self.log.append({"cycle": self.decisions, "kind": "chain", "k": self.k, "reason": "fixed"})
        return self.k

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "k": self.k}


class HeuristicK(_Policy):
    """HF assisted generation's schedule: k += 2 after a fully accepted draft, else k -= 1.

    Bounded to [k_min, k_max]. For a batch, the draft counts as fully accepted only if every row
    accepted all k tokens (the batch shares one k).
    """

    def __init__(self, k_init: int = 5, k_min: int = 1, k_max: int = 8):
        super().__init__()
        if not 0 <= k_min <= k_init <= k_max:
            raise ValueError(
                f"HeuristicK needs 0 <= k_min <= k_init <= k_max, got {k_min}, {k_init}, {k_max}"
            )
        self.k, self.k_min, self.k_max = k_init, k_min, k_max

    def choose_k(self) -> int:
        self.decisions += 1
        self.log.append({"cycle": self.decisions, "kind": "chain", "k": self.k, "reason": "heuristic"})
        return self.k

    def _observe(self, k: int, counts: list[int]) -> None:
        full = all(n == k for n in counts)
        self.k = min(self.k_max, k + 2) if full else max(self.k_min, k - 1)

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "k": self.k}


class DraftLengthTuner(_Policy):
    """Goodput-maximising choice of the chain draft length k (and of a tree configuration).

    choices: candidate k values (>= 0; 0 = no speculation). alpha_init / prior_weight: the
    optimistic prior of the acceptance at position 1 (deeper positions: the estimate one position
    up) and how many observations a prior is worth.
    alpha_ema: per-cycle discount of the acceptance evidence (0.01 ~ the last hundred cycles at
    batch 1: noise ~0.05 on an alpha, yet follows a shift in traffic within a few hundred cycles).
    cost_ema, cost_window: the measured times' EMA weight and median window (LinearCost).
    probe_every: every n-th decision tries a neighbour of the best k. k_init: the first choice,
    before any cost is known (default: the largest, which measures the acceptance at every position
    at once). tree_configs: hashable tree configurations for ``choose_tree``; tree_min_trials: tries
    of each before exploiting.
    """

    def __init__(
        self,
        choices: Iterable[int] = range(1, 9),
        *,
        alpha_init: float = 0.8,
        prior_weight: float = 2.0,
        alpha_ema: float = 0.01,
        cost_ema: float = 0.1,
        cost_window: int = 7,
        probe_every: int = 16,
        k_init: int | None = None,
        tree_configs: Iterable[Hashable] = (),
        tree_min_trials: int = 3,
        tree_ema: float = 0.05,
    ):
        super().__init__()
        self.choices = sorted(set(int(k) for k in choices))
        if not self.choices or self.choices[0] < 0:
            raise ValueError(f"DraftLengthTuner.choices must be non-empty and >= 0, got {self.choices}")
        if not 0.0 < alpha_init < 1.0:
            raise ValueError(f"DraftLengthTuner.alpha_init must be in (0, 1), got {alpha_init}")
        if prior_weight <= 0 or not 0.0 < alpha_ema <= 1.0 or not 0.0 < tree_ema <= 1.0:
            raise ValueError("DraftLengthTuner: prior_weight must be > 0 and alpha_ema, tree_ema in (0, 1]")
        if probe_every < 2:
            raise ValueError(f"DraftLengthTuner.probe_every must be >= 2, got {probe_every}")
        if tree_min_trials < 1:  # the best tree is picked among measured ones: each must be tried
            raise ValueError(f"DraftLengthTuner.tree_min_trials must be >= 1, got {tree_min_trials}")
        self.k_init = self.choices[-1] if k_init is None else k_init
        if self.k_init not in self.choices:
            raise ValueError(f"DraftLengthTuner.k_init={self.k_init} is not one of choices {self.choices}")
        # k = 0 measures no draft cost: beside positive choices, every later choice stayed k = 0 ("init")
        if self.k_init == 0 and self.choices != [0]:
            raise ValueError("DraftLengthTuner.k_init=0 never measures the draft's cost: give a k_init >= 1")
        self.alpha_ema, self.prior_weight, self.probe_every = alpha_ema, prior_weight, probe_every
        k_max = self.choices[-1]
        self.alpha_init = alpha_init
        self.accept = Acceptance(k_max, alpha_init, prior_weight, alpha_ema)  # the EAGLE-3 draft's
        # prompt-lookup copies' (choose_copy), apart after a copy accepted in full (a streak) and not
        self.copy_accept = {s: Acceptance(0, alpha_init, prior_weight, alpha_ema) for s in (False, True)}
        self.copy_decisions = 0
        self._copy_probe_up = True
        self.draft_cost = LinearCost(cost_ema, single="proportional", window=cost_window)
        self.verify_cost = LinearCost(cost_ema, single="flat", window=cost_window)
        # a cycle without draft forwards (k = 0, or every row copied) still has the draft catch up on its
        # accepted tokens: that time, by verify size (record_catch_up; k = 0: size 1)
        self.catch_up_cost = LinearCost(cost_ema, single="flat", window=cost_window)
        self._probe_up = True

        self.tree_configs = list(tree_configs)
        if len(set(self.tree_configs)) != len(self.tree_configs):
            raise ValueError(f"DraftLengthTuner.tree_configs must be distinct, got {self.tree_configs}")
        self.tree_min_trials, self.tree_ema = tree_min_trials, tree_ema
        self.tree_tokens: dict[Hashable, float] = {}
        self.tree_seconds: dict[Hashable, float] = {}
        self.tree_counts: dict[Hashable, int] = {c: 0 for c in self.tree_configs}
        self.tree_decisions = 0
        self._tree_probe = 0

    # -- estimates --------------------------------------------------------------------------

    @property
    def alphas(self) -> list[float]:
        """alphas[j - 1]: the EAGLE-3 draft's conditional acceptance at position j."""
        return self.accept.alphas

    @property
    def alpha_tries(self) -> list[float]:
        return self.accept.tries

    def expected_tokens(self, k: int) -> float:
        """E(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j."""
        return self.accept.expected_tokens(k)

    def cycle_time(self, k: int) -> float:
        """T(k) = draft_time(k) + verify_time(k + 1) from the measured costs (needs both measured); k = 0's
        draft time is its catch-up, once measured."""
        draft = self._catch_up(1) if k == 0 else self.draft_cost.predict(k)
        return max(draft + self.verify_cost.predict(k + 1), 1e-12)

    def tokens_per_s(self) -> dict[int, float] | None:
        """Estimated goodput per candidate k, or None while a cost has never been measured."""
        if not (self.verify_cost.measured and (self.draft_cost.measured or self.choices == [0])):
            return None
        return {k: self.expected_tokens(k) / self.cycle_time(k) for k in self.choices}

    def best_k(self) -> int | None:
        rates = self.tokens_per_s()
        return None if rates is None else max(rates, key=rates.__getitem__)

    # -- chain ------------------------------------------------------------------------------

    def choose_k(self) -> int:
        self.decisions += 1
        rates = self.tokens_per_s()
        unmeasured = [k for k in self.choices if not self._measured(k)]
        if rates is None:
            k, reason = self.k_init, "init"
        elif unmeasured:  # measure every length once, longest first, before trusting any extrapolation
            k, reason = unmeasured[-1], "sweep"
        else:
            k, reason = max(rates, key=rates.__getitem__), "best"
            if self.decisions % self.probe_every == 0 and len(self.choices) > 1:
                k, reason = self._neighbour(k), "probe"
        self.log.append(
            {
                "cycle": self.decisions,
                "kind": "chain",
                "k": k,
                "reason": reason,
                "expected_tokens": self.expected_tokens(k),
                "cycle_time": None if rates is None else self.cycle_time(k),
                "tokens_per_s": rates,
            }
        )
        return k

    def _measured(self, k: int) -> bool:
        return k + 1 in self.verify_cost.seconds and (k == 0 or k in self.draft_cost.seconds)

    def _neighbour(self, k: int) -> int:
        self._probe_up = not self._probe_up
        return _neighbour(self.choices, k, up=not self._probe_up)

    def _catch_up(self, n_tokens: int) -> float:
        return self.catch_up_cost.predict(n_tokens) if self.catch_up_cost.measured else 0.0

    def record_draft(self, k: int, seconds: float) -> None:
        super().record_draft(k, seconds)
        if k > 0:
            self.draft_cost.record(k, seconds)
        else:  # no draft forward: the catch-up on the one accepted token
            self.catch_up_cost.record(1, seconds)

    def record_catch_up(self, n_tokens: int, seconds: float) -> None:
        """The time outside the verify of a cycle whose rows all copied their drafts (a verify of n_tokens):
        the draft catching up on what was accepted. Only the copy length's choice uses it; the realised
        rate gets it through record_cycle."""
        self.catch_up_cost.record(n_tokens, seconds)

    def record_verify(self, n_tokens: int, seconds: float) -> None:
        super().record_verify(n_tokens, seconds)
        self.verify_cost.record(n_tokens, seconds)

    def _observe(self, k: int, counts: list[int]) -> None:
        self.accept.observe(k, counts)

    # -- prompt-lookup copies ---------------------------------------------------------------

    def choose_copy(self, lengths: Sequence[int], streak: bool = False) -> int:
        """How many tokens a prompt-lookup copy drafts, of `lengths`: the most expected tokens per second,
        E(L) / (verify_time(L + 1) + catch_up(L + 1)) (a copy costs no draft forward, but the draft catches
        up on what was accepted: a fixed cost per cycle that favours longer copies). Copies are all or nothing (most
        are either rejected at the first token or accepted whole) and a copy after one accepted in full
        (`streak`) is accepted far more often, so each kind has its own acceptance per position. A verify
        cost that grows with its rows (the compiled 4-bit engine: 6.9 ms for 2 rows, 17.5 for 12) makes
        short copies pay where long ones are mostly rejected; a flat one (eager) keeps them long. As for k:
        every length's verify is measured once first, longest first, and every `probe_every`-th decision
        tries a neighbour of the best."""
        lengths = sorted(set(lengths))
        acc = self.copy_accept[streak]
        acc.grow(lengths[-1])
        self.copy_decisions += 1
        unmeasured = [n for n in lengths if n + 1 not in self.verify_cost.seconds]
        if unmeasured:
            return unmeasured[-1]
        best = max(
            lengths,
            key=lambda n: (
                acc.expected_tokens(n) / max(self.verify_cost.predict(n + 1) + self._catch_up(n + 1), 1e-12)
            ),
        )
        if self.copy_decisions % self.probe_every == 0 and len(lengths) > 1:
            self._copy_probe_up = not self._copy_probe_up
            return _neighbour(lengths, best, up=not self._copy_probe_up)
        return best

    def record_copy(self, n_copied: int, n_accepted: int, streak: bool = False) -> None:
        """A copy of n_copied tokens (chosen by `choose_copy` with this `streak`) had n_accepted accepted."""
        if not 0 <= n_accepted <= n_copied:
            raise ValueError(f"record_copy: n_accepted must be in 0..{n_copied}, got {n_accepted}")
        acc = self.copy_accept[streak]
        acc.grow(n_copied)
        acc.observe(n_copied, [n_accepted])

    # -- trees ------------------------------------------------------------------------------

    def choose_tree(self) -> Hashable:
        """The tree configuration to use this cycle (explore each, then best goodput + probes)."""
        if not self.tree_configs:
            raise ValueError("DraftLengthTuner.choose_tree: no tree_configs were given")
        self.tree_decisions += 1
        rates = {c: self.tree_tokens[c] / max(self.tree_seconds[c], 1e-12) for c in self.tree_tokens}
        fewest = min(self.tree_configs, key=self.tree_counts.__getitem__)
        if self.tree_counts[fewest] < self.tree_min_trials:
            config, reason = fewest, "explore"
        else:
            config, reason = max(self.tree_configs, key=rates.__getitem__), "best"
            others = [c for c in self.tree_configs if c != config]
            if others and self.tree_decisions % self.probe_every == 0:
                config, reason = others[self._tree_probe % len(others)], "probe"
                self._tree_probe += 1
        self.log.append(
            {
                "cycle": self.tree_decisions,
                "kind": "tree",
                "config": config,
                "reason": reason,
                "expected_tokens": self.tree_tokens.get(config),
                "cycle_time": self.tree_seconds.get(config),
                "tokens_per_s": rates,
            }
        )
        return config

    def record_tree(self, config: Hashable, n_tokens: int, seconds: float) -> None:
        """One tree cycle: tokens emitted (accepted + bonus, summed over rows) and its seconds."""
        if config not in self.tree_counts:
            raise ValueError(f"record_tree: unknown tree config {config!r}; known {self.tree_configs}")
        if n_tokens < 1 or not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"record_tree: need n_tokens >= 1 and seconds > 0, got {n_tokens}, {seconds}")
        self.tokens += n_tokens
        self.seconds += seconds
        c = self.tree_counts[config] + 1
        w = max(self.tree_ema, 1.0 / c)
        self.tree_tokens[config] = (1 - w) * self.tree_tokens.get(config, 0.0) + w * n_tokens
        self.tree_seconds[config] = (1 - w) * self.tree_seconds.get(config, 0.0) + w * seconds
        self.tree_counts[config] = c

    # -- report -----------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        rates = self.tokens_per_s()
        out = {
            **super().summary(),
            "best_k": self.best_k(),
            "alphas": list(self.alphas),
            "alpha_tries": list(self.alpha_tries),
            "copy_alphas": {str(k): list(a.alphas) for k, a in self.copy_accept.items()},
            "expected_tokens": {k: self.expected_tokens(k) for k in self.choices},
            "cycle_time": None if rates is None else {k: self.cycle_time(k) for k in self.choices},
            "tokens_per_s": rates,
            "draft_seconds": dict(self.draft_cost.seconds),
            "verify_seconds": dict(self.verify_cost.seconds),
            "catch_up_seconds": dict(self.catch_up_cost.seconds),
        }
        if self.tree_configs:
            out["tree"] = {
                c: {
                    "count": self.tree_counts[c],
                    "tokens": self.tree_tokens.get(c),
                    "seconds": self.tree_seconds.get(c),
                }
                for c in self.tree_configs
            }
        return out


class RankAgreed:
    """A DraftLengthTuner whose every choice (draft length, copy length, tree) is rank 0's on every rank of a
    tensor parallel target (maverick/parallel.py, under torchrun). The tuner decides from measured times,
    which differ between ranks, and ranks that draft different lengths call different collectives and wait
    for each other forever. Each rank records its own times; rank 0's choice is broadcast, one small
    broadcast per decision. Everything else is the wrapped tuner's."""

    def __init__(self, policy: DraftLengthTuner, shard) -> None:
        self.policy, self.shard = policy, shard

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)

    def choose_k(self) -> int:
        return rank0_value(self.policy.choose_k(), self.shard)

    def choose_copy(self, lengths: Sequence[int], streak: bool = False) -> int:
        return rank0_value(self.policy.choose_copy(lengths, streak), self.shard)

    def choose_tree(self) -> Hashable:
        configs = list(self.policy.tree_configs)
        return configs[rank0_value(configs.index(self.policy.choose_tree()), self.shard)]
