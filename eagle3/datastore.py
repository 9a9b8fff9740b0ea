"""A datastore of the target's own answers: retrieval drafts where the sequence has nothing to copy.

Prompt lookup (eagle3/lookup.py) copies from earlier in the same sequence. A small chat model also
repeats itself ACROSS answers ("I hope this helps", "Here are some tips for ..."), so the target's own
answers to other prompts are a second free source of drafts (retrieval-based speculative decoding, as in
REST, He et al. 2023): find earlier occurrences of the sequence's last n tokens in the store and propose
the continuation most of them agree on. No draft forward is run; verification is the same as for any
draft, so the output stays exactly the target's.

Layout: the stored token runs (one per assistant turn, each followed by a separator) are one flat
tensor. For each n-gram size (longest first when proposing) the positions that follow each n-gram are
sorted by a signed 64-bit key of the n tokens (16 bits per token: vocabularies of up to 65,536 tokens, n <= 4),
so finding the occurrences is a binary search. The continuation is voted token by token over (at most
`max_candidates` of) the occurrences: the most common next token wins (ties: the smaller id), the
occurrences that disagree drop out, and the vote goes on with the rest while any is left.

Measured on MT-bench (the target's greedy turn-1 answers, teacher-forced, where prompt lookup found no
match): a store of 1.1M tokens of the target's answers to ShareGPT prompts matched a 4- or 3-gram at 49%
of those positions, with the first copied token right 44% of the time and 0.91 tokens accepted per
proposal (the shipped EAGLE-3 draft: ~39% at its first position). In decoding (run v10-store, the shipped
1.97M-token store): tau 2.62 -> 2.86 and +3.7% tokens/s on the dense bf16 target, but -11% on the 4-bit
target, whose verify cost grows with every extra row (maverick/q4.py), so there the 10-token copies cost
more than they bring.

    store = Datastore.load(beside_draft("eagle3/drafts/smollm2-135m-instruct"))  # ...instruct.datastore.safetensors
    SpecDecoder(target, draft, lookup=LookupConfig(), datastore=store)

The shipped store sits BESIDE the draft directory it was made for, `<draft dir>.datastore.safetensors`
(`beside_draft`), never inside it: vLLM loads every *.safetensors file in a draft directory and stops on
the store's `tokens` tensor.

Built by `python -m train.datastore` (from chat JSON/JSONL: the assistant turns, rendered with the
target's chat template as the target reads them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from maverick.cli import UserError
from maverick.files import atomic_path

FORMAT = "maverick-eagle datastore v1"
_SEP = -1  # between runs: no n-gram spans it and no continuation crosses it
_BITS = 16  # per token in a key
MAX_SIZE = 64 // _BITS  # the longest n-gram a 64-bit key holds
_OFFSET = 2 ** (_BITS - 1)  # the first token is offset so that a 4-gram's key fits a signed 64-bit int


DATASTORE_SUFFIX = ".datastore.safetensors"


def beside_draft(draft_dir: str | os.PathLike) -> Path:
    """Where the datastore made for a draft lives: `<draft dir>.datastore.safetensors`, beside it."""
    d = Path(draft_dir)
    return d.with_name(d.name + DATASTORE_SUFFIX)


class Datastore:
    """Token runs searchable by their n-grams.

    runs: the token id sequences (e.g. the target's answers). sizes: the n-gram sizes matched, tried
    longest first (each 1..4). max_tokens: the longest proposal. max_candidates: occurrences voted on
    (the last ones in store order when there are more).
    """

    def __init__(
        self,
        runs: Iterable[Sequence[int]],
        sizes: Sequence[int] = (4, 3),
        max_tokens: int = 10,
        max_candidates: int = 256,
    ):
        self.sizes = tuple(sorted({int(n) for n in sizes}, reverse=True))
        if not self.sizes or not all(1 <= n <= MAX_SIZE for n in self.sizes):
            raise ValueError(f"Datastore.sizes must be n-gram sizes in 1..{MAX_SIZE}, got {tuple(sizes)}")
        if max_tokens < 1 or max_candidates < 1:
            raise ValueError(
                f"Datastore needs max_tokens >= 1 and max_candidates >= 1, got {max_tokens}, {max_candidates}"
            )
        self.max_tokens, self.max_candidates = max_tokens, max_candidates
        flat: list[int] = []
        for i, run in enumerate(runs):
            run = [int(t) for t in run]
            if run and min(run) < 0:  # -1 would read as a separator
                raise ValueError(
                    f"Datastore: run {i} has negative token ids: {[t for t in run if t < 0][:4]}"
                )
            if run:
                flat += run
                flat.append(_SEP)
        self._set_tokens(torch.tensor(flat, dtype=torch.long))

    def _set_tokens(self, flat: Tensor) -> None:
        """Index the runs `flat` (each ended by a separator)."""
        bad = (flat != _SEP) & ((flat < 0) | (flat >= 2**_BITS))
        if bool(bad.any()):
            raise ValueError(f"Datastore: token ids outside [0, {2**_BITS}): {flat[bad][:4].tolist()}")
        self.n_runs = int((flat == _SEP).sum())
        # padded with separators so that reading max_tokens past any position stays in bounds
        self.tokens = torch.cat([flat, torch.full((self.max_tokens,), _SEP, dtype=torch.long)])
        self._index = {n: self._build(n) for n in self.sizes}

    @property
    def n_tokens(self) -> int:
        """Stored tokens (separators excluded)."""
        return int((self.tokens != _SEP).sum())

    def _build(self, n: int) -> tuple[Tensor, Tensor]:
        """(sorted keys, positions following each n-gram) over the n-grams with a continuation."""
        t = self.tokens
        L = t.shape[0] - self.max_tokens  # the real tokens and their separators
        if L <= n:
            return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
        starts = torch.arange(L - n)
        windows = torch.stack([t[starts + j] for j in range(n + 1)], 1)  # the n-gram and its next token
        ok = (windows != _SEP).all(1)
        order = torch.sort(_keys(windows[ok, :n]), stable=True)
        return order.values, (starts[ok] + n)[order.indices]

    def propose(self, context: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """The voted continuation of the longest suffix of `context` (of the store's sizes) that occurs in
        the store, at most max_tokens (default the store's) tokens; [] when none occurs."""
        m = self.max_tokens if max_tokens is None else min(max_tokens, self.max_tokens)
        for n in self.sizes:
            if len(context) < n:
                continue
            gram = context[-n:]
            keys, pos = self._index[n]
            if keys.numel() == 0 or not all(0 <= t < 2**_BITS for t in gram):
                continue
            k = _keys(torch.tensor([gram]))
            lo = int(torch.searchsorted(keys, k))
            hi = int(torch.searchsorted(keys, k, right=True))
            if hi > lo:
                return self._vote(pos[max(lo, hi - self.max_candidates) : hi], m)
        return []

    def _vote(self, cands: Tensor, m: int) -> list[int]:
        out: list[int] = []
        for j in range(m):
            nxt = self.tokens[cands + j]
            live = nxt != _SEP
            if not bool(live.any()):
                break
            cands, nxt = cands[live], nxt[live]
            values, counts = torch.unique(nxt, return_counts=True)  # sorted: ties go to the smaller id
            best = values[counts.argmax()]
            out.append(int(best))
            cands = cands[nxt == best]
        return out

    # ---- files ----

    def save(self, path: str | Path, meta: dict | None = None) -> None:
        """One safetensors file (the runs as int32 with -1 separators; settings in its metadata), written
        to a temporary name and renamed."""
        path = Path(path)
        real = self.tokens[: self.tokens.shape[0] - self.max_tokens].to(torch.int32)
        info = {
            "format": FORMAT,
            "sizes": json.dumps(list(self.sizes)),
            "max_tokens": str(self.max_tokens),
            "max_candidates": str(self.max_candidates),
            "runs": str(self.n_runs),
            "meta": json.dumps(meta or {}),
        }
        with atomic_path(path) as tmp:
            save_file({"tokens": real.contiguous()}, str(tmp), metadata=info)

    @classmethod
    def load(cls, path: str | Path, **overrides) -> Datastore:
        """A store written by `save`; keyword arguments override its saved settings (sizes, max_tokens,
        max_candidates)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"datastore not found: {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                info = f.metadata() or {}
                if info.get("format") != FORMAT:
                    raise UserError(f"{path}: not a datastore (metadata format {info.get('format')!r})")
                if "tokens" not in f.keys():
                    raise UserError(f"{path}: missing tensor 'tokens'")
                tokens = f.get_tensor("tokens").long()
        except (OSError, SafetensorError) as exc:  # a cut-off or corrupt file
            raise UserError(f"{path}: cannot read the datastore ({exc})") from exc
        if tokens.dim() != 1 or (tokens.numel() and int(tokens[-1]) != _SEP):
            raise UserError(f"{path}: 'tokens' must be 1-D runs each ended by {_SEP}")
        settings = {
            "sizes": tuple(json.loads(info.get("sizes", "[4, 3]"))),
            "max_tokens": int(info.get("max_tokens", 10)),
            "max_candidates": int(info.get("max_candidates", 256)),
        } | overrides
        store = cls((), **settings)  # checks the settings
        store._set_tokens(tokens)
        return store


def is_datastore(path: str | Path) -> bool:
    """Whether `path` is a safetensors file that `Datastore.save` wrote (its metadata's format)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("format") == FORMAT
    except (OSError, SafetensorError):
        return False


def _keys(grams: Tensor) -> Tensor:
    """[M, n] token ids (each < 2^16) -> [M] int64 keys, ordered as the n-grams are lexicographically.
    The first token is offset so that a 4-gram's key stays within a signed 64-bit int."""
    key = grams[:, 0] - _OFFSET
    for j in range(1, grams.shape[1]):
        key = key * 2**_BITS + grams[:, j]
    return key
