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

    store = Datastore.load("eagle3/drafts/smollm2-135m-instruct/datastore.safetensors")
    SpecDecoder(target, draft, lookup=LookupConfig(), datastore=store)

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

FORMAT = "maverick-eagle datastore v1"
_SEP = -1  # between runs: no n-gram spans it and no continuation crosses it
_BITS = 16  # per token in a key
_OFFSET = 2 ** (_BITS - 1)  # the first token is offset so that a 4-gram's key fits a signed 64-bit int


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
        if not self.sizes or not all(1 <= n <= 64 // _BITS for n in self.sizes):
            raise ValueError(f"Datastore.sizes must be n-gram sizes in 1..{64 // _BITS}, got {tuple(sizes)}")
        if max_tokens < 1 or max_candidates < 1:
            raise ValueError(
                f"Datastore needs max_tokens >= 1 and max_candidates >= 1, got {max_tokens}, {max_candidates}"
            )
        self.max_tokens, self.max_candidates = max_tokens, max_candidates
        flat: list[int] = []
        n_runs = 0
        for run in runs:
            run = [int(t) for t in run]
            if not run:
                continue
            bad = [t for t in run if not 0 <= t < 2**_BITS]
            if bad:
                raise ValueError(f"Datastore: run {n_runs} has token ids outside [0, {2**_BITS}): {bad[:4]}")
            flat += run
            flat.append(_SEP)
            n_runs += 1
        self.n_runs = n_runs
        # padded with separators so that reading max_tokens past any position stays in bounds
        self.tokens = torch.tensor(flat + [_SEP] * max_tokens, dtype=torch.long)
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
        key = windows[ok, 0] - _OFFSET
        for j in range(1, n):
            key = key * 2**_BITS + windows[ok, j]
        order = torch.sort(key, stable=True)
        return order.values, (starts[ok] + n)[order.indices]

    def _key(self, gram: Sequence[int]) -> int | None:
        if not all(0 <= t < 2**_BITS for t in gram):
            return None
        key = int(gram[0]) - _OFFSET
        for t in gram[1:]:
            key = key * 2**_BITS + int(t)
        return key

    def propose(self, context: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """The voted continuation of the longest suffix of `context` (of the store's sizes) that occurs in
        the store, at most max_tokens (default the store's) tokens; [] when none occurs."""
        m = self.max_tokens if max_tokens is None else min(max_tokens, self.max_tokens)
        for n in self.sizes:
            if len(context) < n:
                continue
            key = self._key(context[-n:])
            keys, pos = self._index[n]
            if key is None or keys.numel() == 0:
                continue
            k = torch.tensor([key])
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
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        save_file({"tokens": real.contiguous()}, str(tmp), metadata=info)
        os.replace(tmp, path)

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
                    raise ValueError(f"{path}: not a datastore (metadata format {info.get('format')!r})")
                if "tokens" not in f.keys():
                    raise ValueError(f"{path}: missing tensor 'tokens'")
                tokens = f.get_tensor("tokens").long()
        except (OSError, SafetensorError) as exc:  # a cut-off or corrupt file
            raise ValueError(f"{path}: cannot read the datastore ({exc})") from exc
        if tokens.dim() != 1 or (tokens.numel() and int(tokens[-1]) != _SEP):
            raise ValueError(f"{path}: 'tokens' must be 1-D runs each ended by {_SEP}")
        settings = {
            "sizes": tuple(json.loads(info.get("sizes", "[4, 3]"))),
            "max_tokens": int(info.get("max_tokens", 10)),
            "max_candidates": int(info.get("max_candidates", 256)),
        } | overrides
        return cls(_split_runs(tokens), **settings)


def _split_runs(tokens: Tensor) -> list[list[int]]:
    ends = (tokens == _SEP).nonzero()[:, 0].tolist()
    runs, start = [], 0
    flat = tokens.tolist()
    for e in ends:
        runs.append(flat[start:e])
        start = e + 1
    return runs
