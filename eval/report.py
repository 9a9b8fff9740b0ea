"""Benchmark records and everything computed from them: summaries, tables, the written report.

The benchmark runner runs several decoding methods on the same prompts, alternating prompt by
prompt so that drift in machine load hits every method alike, and emits one `RunRecord` per
(method, prompt, turn). This module never times anything itself: it only aggregates.

Definitions, chosen to match how the EAGLE papers and production engines report numbers:
- tokens/s is total new tokens over total wall seconds (prefill included), so a method cannot look
  fast by skipping slow prompts; the mean of per-prompt ratios is kept beside it in report.json
  (`speedup_mean`, `speedup_hf_mean`) because a few long prompts dominate the aggregate.
- tau (acceptance length) counts the bonus token: mean over cycles of (accepted + 1), the tokens a cycle
  emits (a last cycle cut by a stop token or the budget counts what it kept, its target token too only if
  kept: RunRecord.target_cut, eagle3.spec.SpecStats). Plain decoding has no cycles and gets None, not 1.0,
  so the table cannot mix the two up.
- The acceptance rate at draft position i is conditional on reaching it: among cycles that drafted
  at least i tokens, the fraction whose first i draft tokens were all accepted (chain drafting
  accepts a prefix, so "position i accepted" means accepted >= i), by the target's verify: tokens a stop
  token or the budget cut from the output count as accepted here (RunRecord.cut).
- Greedy speculative decoding must be lossless, so every method's output_ids are compared with the
  baseline's for the same (prompt, turn); any difference is a bug and is printed as a FAIL.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TextIO

from eval.summary import MethodSummary, variant
from maverick.files import atomic_write

RED = "\033[31m"
BOLD_RED = "\033[1;31m"
RESET = "\033[0m"


@dataclass
class RunRecord:
    """One generation: a method answering one turn of one prompt.

    `accepted[c]` is the number of draft tokens accepted in speculative cycle c, excluding the bonus
    token the target always contributes; `draft_lengths[c]` is the k drafted in that cycle (fixed
    for fixed-k methods, varying for tuned ones; 0: no speculation, the target's token alone, as FixedK(0)
    and a tuner with 0 among its choices decode). Plain decoding has cycles == 0 and both lists empty.
    """

    method: str
    prompt_id: str
    turn: int
    new_tokens: int
    seconds: float  # wall time of the whole generation, prefill included
    ttft: float  # seconds to the first new token
    cycles: int = 0
    accepted: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    # per cycle (or empty: none), accepted draft tokens the stop token or the budget cut from the output:
    # tau counts `accepted` (what reached the output), the acceptance rates accepted + cut (what was accepted)
    cut: list[int] = field(default_factory=list)
    # cycles (0 or 1: the last) whose target token, after the accepted draft tokens, the stop token or the
    # budget cut: every other cycle emitted accepted + 1 tokens
    target_cut: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    lookup_cycles: int = 0  # cycles whose draft was copied (eagle3/lookup.py, eagle3/datastore.py)
    store_cycles: int = 0  # of those, cycles whose draft came from the datastore (eagle3/datastore.py)
    peak_memory_mb: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    dtype: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Checked here, at creation, so that a bad record fails inside the runner that made it
        # rather than as a NaN or a wrong tau at the end of a long benchmark.
        where = f"RunRecord(method={self.method!r}, prompt_id={self.prompt_id!r}, turn={self.turn})"
        if not isinstance(self.method, str) or not self.method:
            raise ValueError(f"{where}: field 'method' must be a non-empty string")
        for name in ("turn", "new_tokens", "cycles", "target_cut", "lookup_cycles", "store_cycles"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}: field {name!r} must be an int >= 0, got {value!r}")
        for name in ("seconds", "ttft", "draft_seconds", "verify_seconds", "peak_memory_mb"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{where}: field {name!r} must be a finite number >= 0, got {value!r}")
        if self.seconds <= 0:
            raise ValueError(f"{where}: field 'seconds' must be > 0 (tokens/s divides by it)")
        if self.target_cut > self.cycles:
            raise ValueError(f"{where}: target_cut ({self.target_cut}) > cycles ({self.cycles})")
        if self.lookup_cycles > self.cycles:
            raise ValueError(f"{where}: lookup_cycles ({self.lookup_cycles}) > cycles ({self.cycles})")
        if self.store_cycles > self.lookup_cycles:
            raise ValueError(
                f"{where}: store_cycles ({self.store_cycles}) > lookup_cycles ({self.lookup_cycles})"
            )
        if len(self.accepted) != self.cycles or len(self.draft_lengths) != self.cycles:
            raise ValueError(
                f"{where}: 'accepted' ({len(self.accepted)}) and 'draft_lengths' "
                f"({len(self.draft_lengths)}) must both have one entry per cycle (cycles={self.cycles})"
            )
        if self.cut and len(self.cut) != self.cycles:
            raise ValueError(f"{where}: 'cut' ({len(self.cut)}) must be empty or have one entry per cycle")
        for c, (a, k, v) in enumerate(zip(self.accepted, self.draft_lengths, self.verified)):
            if not 0 <= a <= v <= k:
                raise ValueError(
                    f"{where}: cycle {c} has accepted={a}, cut={v - a}, draft_length={k}; need "
                    "0 <= accepted <= accepted + cut <= k"
                )

    @property
    def verified(self) -> list[int]:
        """Per cycle, the draft tokens the target's verify accepted: accepted + cut."""
        return [a + x for a, x in zip(self.accepted, self.cut)] if self.cut else self.accepted

    @classmethod
    def from_dict(cls, data: dict) -> RunRecord:
        """Inverse of `asdict`; unknown keys are rejected by name, fields with defaults may be absent."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"RunRecord: unknown field(s) {unknown}")
        return cls(**data)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first token where a and b differ; the shorter length if one is a prefix of the
    other; None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _per_prompt_tps(records: Iterable[RunRecord]) -> dict[str, float]:
    tokens: dict[str, int] = {}
    seconds: dict[str, float] = {}
    for r in records:
        tokens[r.prompt_id] = tokens.get(r.prompt_id, 0) + r.new_tokens
        seconds[r.prompt_id] = seconds.get(r.prompt_id, 0.0) + r.seconds
    return {p: tokens[p] / seconds[p] for p in tokens}


def _tps(records: Sequence[RunRecord]) -> float:
    return sum(r.new_tokens for r in records) / sum(r.seconds for r in records)


def _speedups(mine: list[RunRecord], other: list[RunRecord] | None) -> tuple[float | None, float | None]:
    """(ratio of tokens/s, mean of per-prompt ratios) against another method.

    Both are taken over the (prompt, turn) pairs the two methods share, so a method that ran fewer
    prompts (or a baseline that crashed on one) is not credited with a different workload. When every
    pair is shared the first is simply the ratio of the two methods' overall tokens/s.
    """
    if not other:
        return None, None
    shared = {(r.prompt_id, r.turn) for r in mine} & {(r.prompt_id, r.turn) for r in other}
    mine = [r for r in mine if (r.prompt_id, r.turn) in shared]
    other = [r for r in other if (r.prompt_id, r.turn) in shared]
    if not shared:
        return None, None
    mine_p, other_p = _per_prompt_tps(mine), _per_prompt_tps(other)
    ratios = [mine_p[p] / other_p[p] for p in mine_p if other_p[p] > 0]
    return _ratio(_tps(mine), _tps(other)), (sum(ratios) / len(ratios) if ratios else None)


def acceptance_rates(accepted: Sequence[int], draft_lengths: Sequence[int]) -> list[float]:
    """Per draft position i = 1..max k: accepted cycles among those that drafted at least i (`accepted`: what
    the verify accepted, RunRecord.verified)."""
    rates = []
    for i in range(1, max(draft_lengths, default=0) + 1):
        reached = [a for a, k in zip(accepted, draft_lengths) if k >= i]
        rates.append(sum(a >= i for a in reached) / len(reached))
    return rates


def _summarise_method(
    method: str,
    mine: list[RunRecord],
    by_method: dict[str, list[RunRecord]],
    baseline: str,
    hf_baseline: str,
    compare_outputs: bool = True,
) -> MethodSummary:
    new_tokens = sum(r.new_tokens for r in mine)
    seconds = sum(r.seconds for r in mine)
    speedup, speedup_mean = _speedups(mine, by_method.get(baseline))
    speedup_hf, speedup_hf_mean = _speedups(mine, by_method.get(hf_baseline))

    accepted = [a for r in mine for a in r.accepted]
    draft_lengths = [k for r in mine for k in r.draft_lengths]
    cycles = len(accepted)
    counts = [0] * (max(draft_lengths, default=-1) + 1)
    for k in draft_lengths:
        counts[k] += 1
    speculative = cycles > 0

    compared = mismatches = first_index = None
    details: list[dict] = []
    ref_method = reference_method(method, by_method, baseline)
    if compare_outputs and ref_method in by_method:
        reference = {(r.prompt_id, r.turn): r.output_ids for r in by_method[ref_method]}
        compared = mismatches = 0
        for r in mine:
            key = (r.prompt_id, r.turn)
            if key not in reference:
                continue
            compared += 1
            index = first_difference(r.output_ids, reference[key])
            if index is not None:
                mismatches += 1
                details.append({"prompt_id": r.prompt_id, "turn": r.turn, "index": index})
        first_index = details[0]["index"] if details else None

    return MethodSummary(
        method=method,
        baseline=baseline,
        hf_baseline=hf_baseline,
        dtype=",".join(dict.fromkeys(r.dtype for r in mine if r.dtype)),
        prompts=len({r.prompt_id for r in mine}),
        generations=len(mine),
        new_tokens=new_tokens,
        seconds=seconds,
        tokens_per_s=new_tokens / seconds,
        speedup=speedup,
        speedup_mean=speedup_mean,
        speedup_hf=speedup_hf,
        speedup_hf_mean=speedup_hf_mean,
        cycles=cycles,
        tau=(sum(accepted) + cycles - sum(r.target_cut for r in mine)) / cycles if speculative else None,
        accept_rates=acceptance_rates([v for r in mine for v in r.verified], draft_lengths),
        draft_length_counts=counts,
        mean_draft_length=sum(draft_lengths) / cycles if speculative else None,
        draft_share=sum(r.draft_seconds for r in mine) / seconds if speculative else None,
        verify_share=sum(r.verify_seconds for r in mine) / seconds if speculative else None,
        mean_ttft=sum(r.ttft for r in mine) / len(mine),
        peak_memory_mb=max(r.peak_memory_mb for r in mine),
        compared=compared,
        mismatches=mismatches,
        mismatch_details=details,
        first_mismatch_index=first_index,
        reference=ref_method,
        lookup_share=sum(r.lookup_cycles for r in mine) / cycles
        if any(r.lookup_cycles for r in mine)
        else None,
        store_share=sum(r.store_cycles for r in mine) / cycles if any(r.store_cycles for r in mine) else None,
    )


def reference_method(method: str, methods: Iterable[str], baseline: str) -> str:
    own = baseline + variant(method)
    if own != baseline and method != own and own in methods:
        return own
    return baseline


def summarise(
    records: Sequence[RunRecord],
    baseline: str = "ours-plain",
    hf_baseline: str = "hf-generate",
    compare_outputs: bool = True,
) -> list[MethodSummary]:
    """One summary per method, in order of first appearance in `records`.

    Speedups and mismatches are None for every method when the baseline (or HF) method is absent.
    compare_outputs=False (sampled runs, whose outputs differ by design): mismatches are not counted.
    """
    by_method: dict[str, list[RunRecord]] = {}
    seen: set[tuple[str, str, int]] = set()
    for r in records:
        key = (r.method, r.prompt_id, r.turn)
        if key in seen:
            raise ValueError(
                f"summarise: duplicate record for method={key[0]!r} prompt_id={key[1]!r} turn={key[2]}"
            )
        seen.add(key)
        by_method.setdefault(r.method, []).append(r)
    return [
        _summarise_method(m, rs, by_method, baseline, hf_baseline, compare_outputs)
        for m, rs in by_method.items()
    ]


# ---------------------------------------------------------------------------------------------- tables


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


COMPACT_ACCEPT_POSITIONS = 3


def table_rows(
    summaries: Sequence[MethodSummary], compact: bool = False
) -> tuple[list[str], list[list[str]]]:
    """Header and formatted cells shared by the markdown and terminal tables.

    compact=True keeps the columns a reader compares at a glance (tok/s, x plain, x HF, tau,
    accept@1-3, draft share, mismatches): ten in all, whatever the draft lengths; the report files
    keep every column.
    """
    k_max = max((len(s.accept_rates) for s in summaries), default=0)
    if compact:
        k_max = min(k_max, COMPACT_ACCEPT_POSITIONS)
    header = ["method", "tok/s", "x plain", "x HF", "tau"]
    header += [f"accept@{i}" for i in range(1, k_max + 1)]
    lookup = not compact and any(s.lookup_share is not None for s in summaries)
    store = not compact and any(s.store_share is not None for s in summaries)
    extra = [] if compact else ["TTFT (s)", "peak MB"]
    header += ["draft share"] + (["lookup"] if lookup else []) + (["store"] if store else []) + extra
    header += ["mismatches"]
    rows = []
    for s in summaries:
        accept = [_fmt(s.accept_rates[i], ".2f") if i < len(s.accept_rates) else "-" for i in range(k_max)]
        mismatches = "-" if s.mismatches is None else f"{s.mismatches}/{s.compared}"
        if s.mismatches is not None and s.reference and s.reference != s.baseline:
            mismatches += f" vs {s.reference}"
        rows.append(
            [
                s.method,
                _fmt(s.tokens_per_s, ".2f"),
                _fmt(s.speedup, ".2f", "x"),
                _fmt(s.speedup_hf, ".2f", "x"),
            ]
            + [_fmt(s.tau, ".2f")]
            + accept
            + [_fmt(None if s.draft_share is None else 100 * s.draft_share, ".1f", "%")]
            + ([_fmt(None if s.lookup_share is None else 100 * s.lookup_share, ".0f", "%")] if lookup else [])
            + ([_fmt(None if s.store_share is None else 100 * s.store_share, ".0f", "%")] if store else [])
            + ([] if compact else [_fmt(s.mean_ttft, ".3f"), _fmt(s.peak_memory_mb, ".1f")])
            + [mismatches]
        )
    return header, rows


def to_markdown(summaries: Sequence[MethodSummary]) -> str:
    """A GitHub markdown table, one row per method."""
    header, rows = table_rows(summaries)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# Methods of another implementation (HF's, llama.cpp's): their outputs may differ from ours by floating-point
# order alone, so their mismatches are shown but are not failures of the lossless guarantee.
REFERENCE_PREFIXES = ("hf-", "llama.cpp")


def is_lossless_method(method: str, reference: str = "") -> bool:
    """Must this method's outputs equal its reference's? Not for HF's, nor across numerics (FP8, q4, not)."""
    same_numerics = not reference or variant(method) == variant(reference)
    return not method.startswith(REFERENCE_PREFIXES) and same_numerics


def failures(summaries: Sequence[MethodSummary]) -> list[str]:
    """One human-readable line per method of ours whose outputs differ from its reference's."""
    lines = []
    for s in summaries:
        if s.mismatches and is_lossless_method(s.method, s.reference):
            d = s.mismatch_details[0]
            lines.append(
                f"FAIL: {s.method}: {s.mismatches} of {s.compared} outputs differ from {s.reference or s.baseline} "
                f"(first: prompt {d['prompt_id']!r} turn {d['turn']} at token {d['index']})"
            )
    return lines


def print_table(
    summaries: Sequence[MethodSummary], file: TextIO | None = None, color: bool = True, compact: bool = False
) -> bool:
    """Print an aligned table (compact: see `table_rows`); mismatches in red and a FAIL line per failing
    method.

    Returns True when no method's outputs differ from the baseline's.
    """
    file = sys.stdout if file is None else file
    header, rows = table_rows(summaries, compact=compact)
    widths = [max(len(c) for c in col) for col in zip(header, *rows)]
    print(
        "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths))), file=file
    )
    for s, row in zip(summaries, rows):
        cells = [c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        if s.mismatches and color and is_lossless_method(s.method, s.reference):
            # Pad first, then colour the text only: escape codes must not count towards the width.
            cells[-1] = " " * (widths[-1] - len(row[-1])) + f"{RED}{row[-1]}{RESET}"
        print("  ".join(cells), file=file)
    fails = failures(summaries)
    for line in fails:
        print(f"{BOLD_RED}{line}{RESET}" if color else line, file=file)
    return not fails


def _json_default(obj: Any) -> Any:
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(
        f"write_report: config value of type {type(obj).__name__} is not JSON-serialisable: {obj!r}"
    )


PLOTS = ("speedup", "acceptance", "draft_length")  # eval.plots.plot_<name>, written as <name>.png
# what write_report writes besides report.json (eval.bench refuses an --out holding them without a run)
REPORT_FILES = ("report.md", *(f"{name}.png" for name in PLOTS))


def write_report(
    records: Sequence[RunRecord], summaries: Sequence[MethodSummary], config: dict, out_dir: str | os.PathLike
) -> dict[str, Path]:
    """Write report.json (config + records + summaries), report.md and three PNG plots.

    Returns the written paths keyed "json", "markdown", "speedup", "acceptance", "draft_length".
    """
    from eval import plots  # matplotlib is only needed when a report is written

    out = Path(out_dir)
    payload = {
        "config": config,
        "records": [asdict(r) for r in records],
        "summaries": [asdict(s) for s in summaries],
    }
    text = json.dumps(payload, indent=2, allow_nan=False, default=_json_default)
    paths = {
        "json": atomic_write(out / "report.json", text),
        "markdown": atomic_write(out / "report.md", to_markdown(summaries)),
    }
    figures = {name: getattr(plots, f"plot_{name}")(summaries) for name in PLOTS}
    for name, fig in figures.items():
        paths[name] = atomic_write(out / f"{name}.png", plots.to_png(fig))
    return paths


def load_report(path: str | os.PathLike) -> tuple[dict, list[RunRecord], list[MethodSummary]]:
    """Read back a report.json written by `write_report`."""
    data = json.loads(Path(path).read_text())
    for key in ("config", "records", "summaries"):
        if key not in data:
            raise ValueError(f"{path}: missing top-level key {key!r}")
    records = [RunRecord.from_dict(r) for r in data["records"]]
    summaries = [MethodSummary.from_dict(s) for s in data["summaries"]]
    return data["config"], records, summaries
