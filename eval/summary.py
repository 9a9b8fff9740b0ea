"""The summary of one benchmark method, and the numerics suffixes of method names: what tables
(eval/report.py) and plots (eval/plots.py) both read.

It lives in its own module so that the report, which draws the plots, and the plots, which read
summaries, import it from below instead of from each other.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields


@dataclass
class MethodSummary:
    """Aggregates of one method over all its records; None where a number does not apply."""

    method: str
    baseline: str
    hf_baseline: str
    dtype: str  # distinct dtypes of the records, comma-joined
    prompts: int
    generations: int  # records, i.e. (prompt, turn) pairs
    new_tokens: int
    seconds: float
    tokens_per_s: float
    speedup: float | None  # tokens/s over the baseline's, on the (prompt, turn) pairs both ran
    speedup_mean: float | None  # mean over shared prompts of per-prompt tokens/s ratios
    speedup_hf: float | None
    speedup_hf_mean: float | None
    cycles: int
    tau: float | None  # mean over cycles of accepted + 1
    accept_rates: list[float]  # [i - 1]: acceptance rate at draft position i
    draft_length_counts: list[int]  # [k]: cycles that drafted k tokens
    mean_draft_length: float | None
    draft_share: float | None  # draft_seconds / seconds
    verify_share: float | None
    mean_ttft: float
    peak_memory_mb: float
    compared: int | None  # (prompt, turn) pairs the baseline also ran
    mismatches: int | None
    mismatch_details: list[dict]  # {"prompt_id", "turn", "index"} per differing output
    first_mismatch_index: int | None  # token index of the first difference in the first mismatch
    reference: str = ""  # the method whose outputs the mismatches are counted against ("" = baseline)
    lookup_share: float | None = None  # share of cycles drafted by copying (lookup or datastore; None: none)
    store_share: float | None = None  # of all cycles, the share copied from the datastore (None: none)

    @classmethod
    def from_dict(cls, data: dict) -> MethodSummary:
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        unknown, missing = sorted(set(data) - names), sorted(required - set(data))
        if unknown or missing:
            raise ValueError(f"MethodSummary: unknown field(s) {unknown}, missing field(s) {missing}")
        return cls(**data)


# Methods named "<method>+fp8" decode with the FP8 target, "<method>+q4" with the target whose GGUF Q4
# linears stay packed (maverick/q4.py): other numerics. Their outputs are checked against the plain decoding
# of the same target (lossless within its numerics), and that plain decoding against the bf16 one (how much
# the numerics change the output: shown, not a failure).
FP8_SUFFIX = "+fp8"
Q4_SUFFIX = "+q4"
COMPILED_SUFFIX = "-compiled"  # the target's steps on the compiled engine (maverick/compiled.py)
Q4_COMPILED_SUFFIX = Q4_SUFFIX + COMPILED_SUFFIX  # the 4-bit target on the compiled engine
VARIANT_SUFFIXES = (Q4_COMPILED_SUFFIX, FP8_SUFFIX, Q4_SUFFIX, COMPILED_SUFFIX)  # longest match first


def variant(method: str) -> str:
    """The numerics suffix of a method name ("+fp8", "+q4", "-compiled", "+q4-compiled"), or "" for the
    bf16/fp32 target."""
    return next((v for v in VARIANT_SUFFIXES if method.endswith(v)), "")
