"""What the notebooks share, so that they only call the package: settings from the environment, the
draft's location, HTML that shows which tokens the draft wrote, run records, router loads, results.

Why these live here rather than in the notebooks:
  - the test suite (tests/test_notebooks.py) executes every notebook and reads back the numbers it
    wrote to `$NB_RESULTS`; the rules for reading the environment (`NB_SMALL`, `NB_THREADS`,
    `MAVERICK_DRAFT`, `NB_WORKDIR`) and for writing the results must be the same in all four;
  - highlighting is easy to get subtly wrong (the first token comes from the prefill, not from a cycle;
    the last cycle may be cut by a stop token or the token budget; byte-level BPE splits characters
    across tokens), so it is written once and tested here, not re-derived in each notebook.

Environment:
    NB_SMALL=1        the small settings (CPU test suite: seconds, not minutes)
    NB_THREADS=n      torch.set_num_threads(n) (unset: torch's default)
    NB_RESULTS=path   write the notebook's key numbers there as JSON (atomically)
    NB_WORKDIR=dir    where a notebook writes dumps / checkpoints (default: a fresh temporary dir)
    MAVERICK_DRAFT    the EAGLE-3 draft directory (default: eval.bench.DEFAULT_DRAFT, the shipped one)
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from eval.report import RunRecord
from maverick.files import atomic_write
from maverick.generate import Generation

# Backgrounds of accepted draft tokens, alternating per cycle so neighbouring cycles stay apart.
CYCLE_COLOURS = ("#b7eb8f", "#91d5ff")


# ---------------------------------------------------------------------------------------- environment


def small_mode() -> bool:
    """True when NB_SMALL=1: the notebooks then pick sizes that run in seconds on a busy CPU."""
    return os.environ.get("NB_SMALL", "0") == "1"


def set_threads_from_env() -> int:
    """Apply NB_THREADS (if set) to torch; return the thread count in use."""
    value = os.environ.get("NB_THREADS")
    if value:
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"NB_THREADS must be a positive integer, got {value!r}") from None
        if n < 1:
            raise ValueError(f"NB_THREADS must be a positive integer, got {value!r}")
        torch.set_num_threads(n)
    return torch.get_num_threads()


def draft_path() -> Path:
    """The draft a notebook uses: $MAVERICK_DRAFT, else the shipped draft (eval.bench.DEFAULT_DRAFT)."""
    value = os.environ.get("MAVERICK_DRAFT")
    if value:
        return Path(value).expanduser()
    from eval.bench import DEFAULT_DRAFT

    return DEFAULT_DRAFT


def require_draft(path: str | os.PathLike | None = None) -> Path:
    """`path` (default `draft_path()`) if it holds a draft (config.json); else a FileNotFoundError saying
    how to get one."""
    p = Path(path) if path is not None else draft_path()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"no EAGLE-3 draft at {p} (config.json missing): train one with notebooks/02_train_draft.ipynb "
            "or `python -m train.fit`, then point MAVERICK_DRAFT at its draft/ directory"
        )
    return p


def workdir(prefix: str = "nb-") -> Path:
    """$NB_WORKDIR (created if needed), else a fresh temporary directory."""
    value = os.environ.get("NB_WORKDIR")
    if value:
        p = Path(value).expanduser()
        p.mkdir(parents=True, exist_ok=True)
        return p
    return Path(tempfile.mkdtemp(prefix=prefix))


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.tolist()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    if hasattr(obj, "tolist"):  # numpy arrays
        return obj.tolist()
    raise TypeError(f"write_results: {type(obj).__name__} is not JSON serialisable")


def write_results(results: Mapping[str, Any], path: str | os.PathLike | None = None) -> Path | None:
    """Write `results` as JSON to `path` (default $NB_RESULTS) via a temporary name + rename; no-op
    (returns None) when neither is given. Non-finite floats are refused: JSON has no NaN."""
    target = path if path is not None else os.environ.get("NB_RESULTS")
    if not target:
        return None
    text = json.dumps(dict(results), default=_jsonable, indent=2, sort_keys=True, allow_nan=False)
    return atomic_write(target, text + "\n")


# ------------------------------------------------------------------------------------ speculative runs


class CycleRecorder:
    """`on_cycle` callback of SpecDecoder.generate: keeps each cycle's emitted tokens of one row
    (accepted draft tokens, then the target's correction / bonus token)."""

    def __init__(self, row: int = 0):
        self.row = row
        self.cycles: list[list[int]] = []

    def __call__(self, emitted: Sequence[Sequence[int]]) -> None:
        self.cycles.append([int(t) for t in emitted[self.row]])

    def reset(self) -> None:
        self.cycles = []


def token_sources(tokens: Sequence[int], cycles: Sequence[Sequence[int]]) -> list[tuple[int, bool]]:
    """(cycle, from_target) per output token: the first token is the prefill's (cycle -1, target), then
    each cycle's tokens in order, the last of a cycle being the target's. `tokens` is the output as
    returned (cut at a stop token or the budget), so the last cycle may be cut short.

    Raises ValueError if the cycles do not reproduce `tokens` (a recorder attached to another run)."""
    tokens = [int(t) for t in tokens]
    if not tokens:
        return []
    out = [(-1, True)]
    flat = [tokens[0]]
    for c, cyc in enumerate(cycles):
        for j, t in enumerate(cyc):
            out.append((c, j == len(cyc) - 1))
            flat.append(int(t))
    if flat[: len(tokens)] != tokens:
        n = next((i for i, (a, b) in enumerate(zip(flat, tokens)) if a != b), min(len(flat), len(tokens)))
        raise ValueError(
            f"the recorded cycles do not reproduce the output: they give {len(flat)} tokens and differ "
            f"from the {len(tokens)} output tokens at index {n}"
        )
    return out[: len(tokens)]


def token_pieces(tokenizer, ids: Sequence[int]) -> list[str]:
    """The text each token adds to the decoded output. A token that ends inside a multi-byte character
    (byte-level BPE) adds "" and the character goes to the token that completes it."""
    ids = [int(t) for t in ids]
    pieces, shown = [], ""
    for i in range(len(ids)):
        text = tokenizer.decode(ids[: i + 1], skip_special_tokens=False)
        if text.endswith("\ufffd"):
            pieces.append("")
            continue
        common = len(os.path.commonprefix([text, shown]))
        pieces.append(text[common:])
        shown = text
    return pieces


def highlight_html(tokenizer, tokens: Sequence[int], cycles: Sequence[Sequence[int]]) -> str:
    """HTML of the output with the accepted draft tokens of each cycle on a coloured background
    (alternating per cycle); the target's own tokens (the prefill token and each cycle's last) stay
    plain. Hover a token for its cycle."""
    sources = token_sources(tokens, cycles)
    pieces = token_pieces(tokenizer, tokens)
    spans = []
    for i, ((c, from_target), piece) in enumerate(zip(sources, pieces)):
        text = html.escape(piece)
        if from_target:
            where = "prefill" if c < 0 else f"cycle {c}"
            spans.append(f'<span title="token {i}: target ({where})">{text}</span>')
        else:
            colour = CYCLE_COLOURS[c % len(CYCLE_COLOURS)]
            spans.append(
                f'<span style="background:{colour}" title="token {i}: draft, accepted (cycle {c})">{text}</span>'
            )
    drafted = sum(not t for _, t in sources)
    legend = (
        f'<div style="font-size:smaller;margin-bottom:4px">{len(tokens)} tokens, {len(cycles)} cycles: '
        f'<span style="background:{CYCLE_COLOURS[0]}">draft</span>'
        f'<span style="background:{CYCLE_COLOURS[1]}">tokens</span> accepted ({drafted}), '
        "plain = the target's token of each cycle</div>"
    )
    body = "".join(spans)
    return f'{legend}<div style="font-family:monospace;white-space:pre-wrap;line-height:1.5">{body}</div>'


def tokens_per_s(gen: Generation) -> float:
    return gen.new_tokens / gen.seconds


def run_record(
    method: str,
    prompt_id: str,
    gen: Generation,
    dtype: str = "bf16",
    turn: int = 0,
    device: str = "cpu",
    peak_mb: float | None = None,
) -> RunRecord:
    """One eval.report.RunRecord from a plain or speculative Generation of one prompt (a batch's stats
    hold row 0's draft lengths only: give each prompt its own generate call); the memory column is `peak_mb`
    or else the process's peak on `device` since the last `eval.bench.reset_peak_memory` (as eval.bench
    records it, which resets it before each generation: do the same for each generation's own peak)."""
    from eval.bench import peak_memory_mb

    if len(gen.tokens) != 1:
        raise ValueError(f"run_record takes a Generation of one prompt, got {len(gen.tokens)} rows")
    spec = gen.stats.get("spec")
    kw: dict[str, Any] = {}
    if spec is not None:
        acc = list(spec.accepted)
        kw = dict(
            cycles=spec.cycles,
            accepted=acc,
            draft_lengths=list(spec.draft_lengths),
            cut=list(spec.cut),
            target_cut=spec.target_cut,
            draft_seconds=spec.draft_seconds,
            verify_seconds=spec.verify_seconds,
            lookup_cycles=spec.lookup_cycles,
            store_cycles=spec.store_cycles,
        )
    return RunRecord(
        method=method,
        prompt_id=str(prompt_id),
        turn=turn,
        new_tokens=len(gen.tokens[0]),
        seconds=gen.seconds,
        ttft=gen.ttft,
        output_ids=list(gen.tokens[0]),
        dtype=dtype,
        peak_memory_mb=peak_memory_mb(device) if peak_mb is None else peak_mb,
        **kw,
    )


def pooled_tau(gens: Sequence[Generation]) -> float:
    """Acceptance length over all cycles of several speculative generations (tokens emitted per cycle:
    SpecStats.tau)."""
    cycles = sum(g.stats["spec"].row_cycles for g in gens)
    if not cycles:
        raise ValueError("pooled_tau: the generations ran no speculative cycle")
    return sum(g.stats["spec"].emitted for g in gens) / cycles


def finite(x: float | None) -> float | None:
    """x, or None where it is not a finite number (JSON has no NaN / inf)."""
    return None if x is None or not math.isfinite(x) else float(x)


# ------------------------------------------------------------------------------------------ Llama 4 MoE


@torch.no_grad()
def router_loads(model, tokens: Tensor) -> dict[int, Tensor]:
    """Tokens routed to each expert, per MoE layer: {layer: counts [E]} for one forward of `tokens`
    [B, T]. Each MoE layer's input (after post_attention_layernorm) is captured with a forward pre-hook
    and routed with the layer's own `MoE.route`, so the counts are the forward's routing decisions."""
    from maverick.model import MoE

    loads: dict[int, Tensor] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        ff = layer.feed_forward
        if isinstance(ff, MoE):

            def hook(module, args, i=i):
                x = args[0]
                expert_N, _ = module.route(x.reshape(-1, x.shape[-1]))
                loads[i] = torch.bincount(expert_N, minlength=module.num_experts).cpu()

            handles.append(ff.register_forward_pre_hook(hook))
    if not handles:
        raise ValueError("router_loads: the model has no MoE layer (config.moe_layers is empty)")
    try:
        model(tokens, logits=None)
    finally:
        for h in handles:
            h.remove()
    return loads
