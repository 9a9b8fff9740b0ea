"""The EAGLE-3 draft's cache calls as one compiled graph on CPU: the one-token draft step and the catch-up on
the accepted tokens after a verify.

Eager, a draft call is ~30 small ops, each paying Python dispatch: 0.9 ms for a one-token step and 0.7 ms
for a two-token catch-up on SmolLM2's draft (AMD EPYC Zen 4, 2 threads), 13% of a speculative cycle on the
compiled 4-bit target (maverick/compiled.py). `CompiledDraft` runs `Eagle3Draft.forward` on a cache of its
own as one inductor graph (C++ wrapper): the new tokens' rows at cache slots start .. start + T - 1, the
attention over the slots in use in blocks of SPAN (a dynamic dimension, as the target engine's), the row
count dynamic too (at least 2 rows; one row would be specialised into a second graph). One graph serves
every call. It is frozen (oneDNN-packed weights) and kept on disk as an AOTInductor package
(maverick/aot.py), named by a hash of the draft's weights, config, shapes and source: SmolLM2's draft builds in
~10 s and a later run loads it in ~1 s (with aot=False, torch.compile takes it from inductor's cache,
`cache_frozen_graphs`: ~3 s).

The draft need not keep bits across row counts: whatever it proposes, verification keeps the target's
tokens (greedy speculative decoding still equals plain decoding, tested). Calls it does not cover (no cache,
a cache not its own, a tree mask, explicit positions other than the cache's lengths) run the eager draft.
On CUDA `SpecDecoder(compile_draft=True)` keeps its CUDA-graph step instead (eagle3/spec.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle3.draft import Eagle3Draft
from eagle3.draft import __file__ as draft_source
from maverick.aot import load_or_build, package_key, require_cpu_engines, weights_digest
from maverick.compiled import (
    SPAN,
    _inputs_only,
    _own_forward,
    cache_frozen_graphs,
    span_carrier,
    use_repo_cache,
)
from maverick.compiled import __file__ as compiled_source
from maverick.kv_cache import KVCache
from maverick.linear import PACKED_MAX_ROWS
from maverick.linear import __file__ as linear_source
from maverick.model import __file__ as model_source

MIN_ROWS = 2  # a dynamic row count of 1 would be specialised: one-token steps pad to 2 rows


class _DraftStep(nn.Module):
    """`Eagle3Draft.forward` for T rows at cache slots start .. start + T - 1: embeds, hidden [B, T, H],
    start [B], k_cache / v_cache [1, B, Hkv, slots, D] (written in place), span [blocks, 0] -> h [B, T, H]."""

    def __init__(self, draft: Eagle3Draft):
        super().__init__()
        self.draft = draft

    def forward(self, embeds: Tensor, hidden: Tensor, start: Tensor, k_cache: Tensor, v_cache: Tensor, span):
        d = self.draft
        a = d.midlayer.self_attn
        B, T, _ = hidden.shape
        S = span.shape[0] * SPAN
        dev = hidden.device
        pos = start[:, None] + torch.arange(T, device=dev)  # [B, T]
        cos, sin = d.rope(pos)
        q, k, v = a.qkv(d.attn_input(embeds, hidden), cos, sin)  # q [B, Hq, T, D], k/v [B, Hkv, T, D]
        idx = (
            torch.zeros(1, 1, 1, dtype=torch.long, device=dev),
            torch.arange(B, device=dev)[:, None, None],
            torch.arange(a.n_kv, device=dev)[None, :, None],
            pos[:, None, :],
        )
        k_cache.index_put_(idx, k.to(k_cache.dtype))  # k [B, Hkv, T, D] at [0, b, h, pos[b, t]]
        v_cache.index_put_(idx, v.to(v_cache.dtype))
        visible = torch.arange(S, device=dev)[None, None, :] <= pos[:, :, None]  # [B, T, S]
        mask = torch.where(visible, 0.0, float("-inf")).to(q.dtype)[:, None]  # [B, 1, T, S]
        keys, values = k_cache[0, :, :, :S].to(q.dtype), v_cache[0, :, :, :S].to(q.dtype)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=a.n_heads != a.n_kv)
        return d.finish(hidden, a.o_proj(o.transpose(1, 2).reshape(B, T, -1)))


class CompiledDraft:
    """An `Eagle3Draft` whose cache calls run one compiled graph (see the module docstring); everything else
    (`logits`, `project`, `config`, the vocabulary maps, parameters) is the draft's own. CPU only.

    max_len: the tokens its caches hold (slots: max_len + a call's rows, rounded up to SPAN blocks, + a
    spare slot so that a span never reaches the cache's end)."""

    def __init__(
        self, draft: Eagle3Draft, max_len: int, max_rows: int = 32, cpp_wrapper: bool = True, aot: bool = True
    ):
        if next(draft.parameters()).device.type != "cpu":
            raise ValueError(
                "CompiledDraft runs on CPU; on CUDA SpecDecoder(compile_draft=True) uses CUDA graphs"
            )
        require_cpu_engines("the compiled draft")
        use_repo_cache()
        cache_frozen_graphs()
        self.base = draft
        self.max_len = max_len
        self.max_rows = max_rows
        # at least 3 blocks: the exported key span is a dynamic 2..slots // SPAN blocks, and a range needs two
        self.slots = max(-(-(max_len + max_rows) // SPAN), 3) * SPAN
        self.step = _DraftStep(draft).eval()
        self.aot = aot
        self.options = {"freezing": True} if aot else {"cpp_wrapper": cpp_wrapper, "freezing": True}
        self._runners: dict[int, Callable] = {}  # AOT: batch size -> loaded package
        self.package: Path | None = None  # AOT: the last package built or loaded
        self.loaded: bool | None = None  # AOT: whether it came from disk
        self._fn = torch.compile(
            _own_forward(self.step), dynamic=False, fullgraph=True, options={"guard_filter_fn": _inputs_only}
        )
        self._spans: dict[int, Tensor] = {}

    def __getattr__(self, name):  # logits, project, config, d2t, draft_to_target_ids, parameters, ...
        return getattr(self.base, name)

    def new_cache(self, batch_size: int, max_len: int | None = None, dtype=None) -> KVCache:
        if max_len is not None and max_len > self.max_len:
            raise ValueError(
                f"a draft cache of {max_len} slots asked of a compiled draft built for {self.max_len}"
            )
        cache = self.base.new_cache(batch_size, self.slots + 1, dtype)
        cache.max_len = self.slots
        cache.slice_to_bound = False
        cache.compiled_draft = True
        return cache

    @torch.no_grad()
    def __call__(
        self,
        embeds: Tensor,
        hidden: Tensor,
        positions: Tensor | None,
        cache: KVCache | None = None,
        mask: Tensor | None = None,
        tree_mask: Tensor | None = None,
    ) -> Tensor:
        """`Eagle3Draft.forward`: compiled on a cache of this draft for up to `max_rows` new tokens continuing
        from the cache's lengths; eager otherwise."""
        T = hidden.shape[1]
        if not getattr(cache, "compiled_draft", False):
            return self.base(embeds, hidden, positions, cache, mask, tree_mask)
        if positions is not None:  # the cache's lengths onwards are the compiled call's own positions
            ahead = cache.lengths[:, None] + torch.arange(T, device=positions.device)
            positions = None if torch.equal(positions, ahead) else positions
        if (
            positions is not None
            or mask is not None
            or tree_mask is not None
            or T > self.rows_limit(hidden.shape[0])
        ):
            with cache.sliced_to_use():  # eager (e.g. the prefill's catch-up) on the slots in use
                return self.base(embeds, hidden, positions, cache, mask, tree_mask)
        R = max(T, MIN_ROWS)
        end = int(cache.lengths.max()) + R  # padded rows included: the span covers them
        if end > cache.max_len:
            raise RuntimeError(f"draft KV cache overflow: {end} slots, the cache holds {cache.max_len}")
        if R != T:  # padded rows: after the real ones (causal), written past them, never committed
            embeds = F.pad(embeds, (0, 0, 0, R - T))
            hidden = F.pad(hidden, (0, 0, 0, R - T))
        embeds, hidden = embeds.to(hidden.dtype).contiguous(), hidden.contiguous()
        args = (
            embeds,
            hidden,
            cache.lengths,
            cache.k,
            cache.v,
            span_carrier(self._spans, end, "cpu"),
        )
        if self.aot:
            runner = self._runners.get(hidden.shape[0]) or self._package(args)
            h = runner(*args)
        else:
            torch._dynamo.mark_dynamic(embeds, 1)  # no bounds: a cached graph serves any max_rows
            torch._dynamo.mark_dynamic(hidden, 1)
            with torch._inductor.config.patch(self.options), torch._dynamo.config.patch(recompile_limit=64):
                h = self._fn(*args)
        cache.advance(T)
        return h[:, :T]

    def rows_limit(self, batch: int) -> int:
        """The most new tokens a compiled call of `batch` rows takes: max_rows, and at most 64 rows in all (the
        linears run one row-count-safe call of up to 64 rows: a graph exported past that for a batch of 3 stopped
        torch.export); 0 when no more than MIN_ROWS fit (an exported dynamic dimension needs a range: such
        batches run eager)."""
        limit = min(self.max_rows, PACKED_MAX_ROWS // batch)
        return limit if limit > MIN_ROWS else 0

    def _package(self, args: tuple[Tensor, ...]) -> Callable:
        """The step's AOTInductor package for this batch size, loaded from disk or built (maverick/aot.py):
        rows 2..max_rows and the key span dynamic."""
        key = package_key(
            weights_digest(self.step),
            (__file__, draft_source, model_source, linear_source, compiled_source),  # what its graph traces
            engine="draft",
            config=repr(self.base.config),  # what shapes the graph beyond its weights: norm_output, eps, ...
            batch=args[1].shape[0],
            max_rows=self.max_rows,
            slots=self.slots,
            options=self.options,
        )
        rows = torch.export.Dim("rows", min=MIN_ROWS, max=self.rows_limit(args[1].shape[0]))
        blocks = torch.export.Dim("blocks", min=2, max=self.slots // SPAN)
        dynamic = ({1: rows}, {1: rows}, None, None, None, {0: blocks})
        runner, self.package, self.loaded = load_or_build(self.step, args, dynamic, self.options, key)
        self._runners[args[1].shape[0]] = runner
        return runner
