"""Regeneration at GPU speed: batched greedy decoding with continuous batching, multi-turn, on a static cache.

`maverick.generate.Decoder` decodes one batch to its end: rows that finish early idle (or are dropped, which
changes the batch's shape), and each call starts from an empty cache. Here B cache rows stay busy:

- a row that finishes its conversation is refilled with the next one: its prompt is prefilled into that
  row's slots alone (rows waiting for a prefill are gathered, `refill_min` at a time, into one forward over
  a small temporary cache, and scattered back), then the row joins the batched decode steps;
- multi-turn: when a row's answer ends with a stop token and its conversation has another user turn, that
  turn's ids (the chat template's segment; train/answers.py) are prefilled after the answer, on top of the
  row's cache: the target answers each turn after its own earlier answers, as a serving engine would;
- an answer ends at a stop token or after `max_new_tokens`; a conversation ends at its last turn, at an
  answer cut by the length limit, or when the next turn would not fit in `max_len`.

The decode step has fixed shapes: B rows, one token each, keys over the first n slots of the cache
(`KVCache.prefix_view`), n the smallest multiple of `slot_bucket` above every row's length. On CUDA each
bucket's step is captured once as a CUDA graph (`torch.cuda.CUDAGraph`, before any row holds data: the
warm-up runs write the cache) and replayed, which removes the ~600 kernel launches per step that bound the
eager GPU decoding at ~5-9k tokens/s; on CPU the same step runs eagerly. Rows not decoding (free, or waiting
for their next turn's prefill) run along and are held in place: the step adds `active` to their lengths
instead of 1, so their committed tokens stay and their writes land past them.

The greedy tokens are those of `Decoder` decoding each conversation on its own (tests/test_fastgen.py, fp32
on CPU; a `cuda` test compares the graph replays with the eager step).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from maverick.kv_cache import KVCache
from maverick.model import Llama4


@dataclass
class Conversation:
    id: str
    prompts: list[list[int]]  # ids before each answer (train/answers.py)


@dataclass
class Answered:
    id: str
    prompts: list[list[int]] = field(
        default_factory=list
    )  # the turns answered (a prefix of the conversation's)
    answers: list[list[int]] = field(default_factory=list)

    def record(self) -> dict:
        return {"id": self.id, "prompts": self.prompts, "answers": self.answers}


@dataclass
class GenStats:
    conversations: int = 0
    turns: int = 0
    new_tokens: int = 0
    prefill_tokens: int = 0
    steps: int = 0
    seconds: float = 0.0
    skipped: int = 0  # conversations whose first prompt does not fit

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


class FastGenerator:
    def __init__(
        self,
        model: Llama4,
        batch_size: int,
        max_len: int,
        max_new_tokens: int,
        stop_ids: Sequence[int],
        graphs: bool | None = None,
        slot_bucket: int = 128,
        refill_min: int | None = None,
        prefill_rows: int | None = None,
    ):
        """graphs: capture the decode step in CUDA graphs (default: on CUDA). refill_min: prefill waiting
        rows once this many wait (default B // 16, at least 1), or whenever no row is decoding or no new
        conversation is left. prefill_rows: rows per prefill forward, padded to the longest of them
        (default 32 on CUDA, where each forward costs ~600 launches; 2 on a CPU, where the padding's
        compute is what costs: 48 ShareGPT first turns, 16 rows, took 79.5 s with 32, 36.0 s with 2 on
        AMD EPYC Zen 4)."""
        self.model = model.eval()
        self.B, self.max_len, self.max_new = batch_size, max_len, max_new_tokens
        self.stop = np.array(sorted(set(stop_ids)), dtype=np.int64)
        self.slot_bucket = slot_bucket
        self.refill_min = refill_min or max(1, batch_size // 16)
        dev = model.device
        self.prefill_rows = prefill_rows or (32 if dev.type == "cuda" else 2)
        self.cache = model.new_cache(batch_size, max_len, exact=False)
        self.cache.slice_to_bound = False
        self.tok = torch.zeros(batch_size, dtype=torch.long, device=dev)  # fed to the step, then its output
        self.active = torch.zeros(batch_size, dtype=torch.long, device=dev)
        self.graphs = dev.type == "cuda" if graphs is None else graphs
        self._buckets = list(range(slot_bucket, max_len, slot_bucket)) + [max_len]
        self._views = {n: self.cache.prefix_view(n) for n in self._buckets}
        self._captured: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_error: str | None = None
        self.capture_seconds = 0.0
        if self.graphs:
            t = time.perf_counter()
            try:
                self._capture_all()
                self.capture_seconds = time.perf_counter() - t
            except Exception as exc:  # keep generating, eagerly, rather than lose a lent GPU's minutes
                torch.cuda.synchronize()
                self.graphs, self._captured = False, {}
                self.graph_error = f"{type(exc).__name__}: {exc}"
                self.cache.lengths.zero_()
                print(f"CUDA graph capture failed, decoding eagerly: {self.graph_error}", flush=True)

    # ---- the decode step ----
    def _step(self, view: KVCache) -> None:
        """One token for every row: tok <- argmax of the next-token logits; lengths advance by `active`."""
        logits = self.model(self.tok[:, None], cache=view, logits="all").logits[:, -1]
        self.cache.lengths.sub_(1 - self.active)  # the forward advanced every row by one
        self.tok.copy_(logits.argmax(-1))

    def _capture_all(self) -> None:
        """Capture each bucket's step. Run while no row holds data: warm-up runs write slot 0 of every row."""
        self.cache.lengths.zero_()
        self.active.zero_()
        pool = None
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for n in self._buckets:
                    for _ in range(2):
                        self._step(self._views[n])
            torch.cuda.current_stream().wait_stream(side)
            for n in reversed(self._buckets):  # the largest first: later graphs fit in its memory pool
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self._step(self._views[n])
                pool = g.pool() if pool is None else pool
                self._captured[n] = g
        torch.cuda.synchronize()
        self.cache.lengths.zero_()

    def decode_step(self, n_slots: int) -> None:
        n = next(b for b in self._buckets if b >= n_slots)
        if self.graphs:
            self._captured[n].replay()
        else:
            self._step(self._views[n])

    # ---- prefills ----
    def _prefill(self, rows: list[int], chunks: list[list[int]], lengths: np.ndarray) -> None:
        """Write chunks[i] after the lengths[rows[i]] tokens already in row rows[i]; tok[row] <- the greedy
        next token. The rows are gathered into a small cache, run together, and scattered back."""
        dev = self.model.device
        k = len(rows)
        start = lengths[rows]
        n_new = np.array([len(c) for c in chunks])
        T = int(n_new.max())
        # right padding writes every row's T slots: the temporary cache may outgrow max_len, the padding's
        # slots past a row's tokens are never copied back beyond max_len nor read
        S = -(-(int(start.max()) + T) // 64) * 64
        keep = min(S, self.max_len)
        c = self.cache
        L, _, Hkv, _, D = c.k.shape
        tmp = KVCache(L, k, S, Hkv, D, c.k.dtype, dev)
        tmp.exact = False
        idx = torch.as_tensor(rows, device=dev)
        old = int(start.max())
        if old:
            tmp.k[:, :, :, :old] = c.k[:, idx, :, :old]
            tmp.v[:, :, :, :old] = c.v[:, idx, :, :old]
        tmp.lengths.copy_(torch.as_tensor(start, device=dev))
        tmp.bound = old
        tokens = torch.zeros(k, T, dtype=torch.long)
        for i, ch in enumerate(chunks):
            tokens[i, : len(ch)] = torch.as_tensor(ch)
        last = torch.as_tensor(n_new - 1, device=dev)[:, None]
        logits = self.model(tokens.to(dev), cache=tmp, logits=last).logits[:, 0]
        c.k[:, idx, :, :keep] = tmp.k[:, :, :, :keep]
        c.v[:, idx, :, :keep] = tmp.v[:, :, :, :keep]
        lengths[rows] = start + n_new
        c.lengths[idx] = torch.as_tensor(lengths[rows], device=dev)
        self.tok[idx] = logits.argmax(-1)
        self.active[idx] = 1

    # ---- the loop ----
    @torch.no_grad()
    def run(
        self,
        conversations: Iterable[Conversation],
        on_done: Callable[[Answered], None],
        deadline: float | None = None,
        stop: Callable[[], bool] | None = None,
        on_step: Callable[[], None] | None = None,
    ) -> GenStats:
        """Answer every conversation (on_done gets each finished one, in finishing order) or stop at
        `deadline` (time.perf_counter() value) or when `stop()` (asked after each finished conversation)
        says so: conversations still running then are dropped, not reported (a rerun redoes them).
        `on_step()` is called after each batched decode step (train/profiling.py's StepProfiler.step)."""
        B, max_new, max_len = self.B, self.max_new, self.max_len
        stats = GenStats()
        t0 = time.perf_counter()
        source: Iterator[Conversation] = iter(conversations)
        exhausted = False
        conv: list[Conversation | None] = [None] * B
        done_turns: list[Answered | None] = [None] * B
        lengths = np.zeros(B, dtype=np.int64)  # committed tokens per row (host copy of cache.lengths)
        out = np.zeros((B, max_new), dtype=np.int64)
        count = np.zeros(B, dtype=np.int64)
        decoding = np.zeros(B, dtype=bool)
        waiting: dict[int, list[int]] = {}  # row -> ids to prefill (its next turn, or a new conversation)
        self.cache.lengths.zero_()
        self.active.zero_()

        def admit(r: int) -> bool:
            nonlocal exhausted
            while not exhausted:
                c = next(source, None)
                if c is None:
                    exhausted = True
                    break
                if not c.prompts or not c.prompts[0] or len(c.prompts[0]) + max_new > max_len:
                    stats.skipped += 1
                    continue
                conv[r], done_turns[r] = c, Answered(c.id)
                lengths[r] = 0
                waiting[r] = list(c.prompts[0])
                return True
            return False

        stopped = False

        def finish(r: int) -> None:
            nonlocal stopped
            a = done_turns[r]
            stats.conversations += 1
            on_done(a)
            stopped = stopped or (stop is not None and stop())
            conv[r] = done_turns[r] = None
            lengths[r] = 0
            self.cache.lengths[r] = 0

        for r in range(B):
            if not admit(r):
                break
        while True:
            if deadline is not None and time.perf_counter() >= deadline:
                break
            if stopped:
                break
            if waiting and (len(waiting) >= self.refill_min or not decoding.any() or exhausted):
                rows = sorted(waiting, key=lambda r: len(waiting[r]))  # similar lengths share a forward
                chunks = [waiting.pop(r) for r in rows]
                stats.prefill_tokens += sum(map(len, chunks))
                for i in range(0, len(rows), self.prefill_rows):
                    self._prefill(rows[i : i + self.prefill_rows], chunks[i : i + self.prefill_rows], lengths)
                decoding[rows] = True
                count[rows] = 0
                self._record(rows, out, count)
            if not decoding.any():
                break
            # rows whose last token ended their answer leave the batch before the next step
            ended = np.flatnonzero(decoding & (np.isin(out[np.arange(B), np.maximum(count - 1, 0)], self.stop)
                                               | (count >= max_new)))  # fmt: skip
            for r in ended.tolist():
                decoding[r] = False
                self.active[r] = 0
                c, a = conv[r], done_turns[r]
                k = len(a.answers)
                ans = out[r, : count[r]].tolist()
                a.prompts.append(list(c.prompts[k]))
                a.answers.append(ans)
                stats.turns += 1
                stats.new_tokens += len(ans)
                nxt = k + 1
                # the answer's last token is not in the cache yet: the next turn's prefill starts with it
                if (
                    ans[-1] in self.stop
                    and nxt < len(c.prompts)
                    and lengths[r] + 1 + len(c.prompts[nxt]) + max_new <= max_len
                ):
                    waiting[r] = [ans[-1]] + list(c.prompts[nxt])
                else:
                    finish(r)
                    admit(r)
            if not decoding.any():
                continue
            self.decode_step(int(lengths.max()) + 1)
            stats.steps += 1
            lengths += decoding
            self._record(np.flatnonzero(decoding).tolist(), out, count)
            if on_step is not None:
                on_step()
        stats.seconds = time.perf_counter() - t0
        return stats

    def _record(self, rows: list[int], out: np.ndarray, count: np.ndarray) -> None:
        """Append tok[row] to each given row's answer (one host read for the whole batch)."""
        if not rows:
            return
        toks = self.tok.cpu().numpy()
        out[rows, count[rows]] = toks[rows]
        count[rows] += 1
