"""A preallocated, fixed-shape KV cache indexed by explicit slots, with the moves speculative decoding needs.

Layout: k/v [layers, B, Hkv, S, D]. Row b holds `lengths[b]` committed tokens in slots 0..lengths[b]-1,
and slot == position for committed tokens. A forward of T new tokens writes them at slots
lengths[b] .. lengths[b]+T-1 (their RoPE positions may differ: tree nodes sit at start + depth) and
then `advance(T)` moves the committed length. Speculative decoding then keeps what the target accepted:
- chain: `truncate(start + n_accepted)`; stale slots past the length are never read, because attention
  only sees slots < lengths[b] plus the tokens of the current call (see `attention_mask`).
- tree: `compact(start, keep_idx, n_keep)` moves the accepted nodes' K/V to slots start.. start+n-1.

Nothing here syncs with the host: lengths is a tensor. `bound` is a Python-side upper bound of
max(lengths) that the attention uses to slice the cache to the part in use (on CPU that saves reading
the whole preallocated cache every step); `truncate` resets it from the new lengths.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
from torch import Tensor, nn


class KVCache(nn.Module):
    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        shape = (n_layers, batch_size, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer(
            "lengths", torch.zeros(batch_size, dtype=torch.long, device=device), persistent=False
        )
        self.max_len = max_len
        self.bound = 0
        self.slice_to_bound = True  # turn off under torch.compile to keep shapes fixed
        self.window: int | None = None
        # short calls use model.exact_attention (row-count invariant); False: the fused kernel, faster
        # with many rows, for jobs that need no bit-exactness between decoding and verification
        self.exact = True

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    def reset(self) -> None:
        self.lengths.zero_()
        self.bound = 0

    def set_window(self, n: int | None) -> None:
        """Fix the key window of short calls (decode, verify) to n slots for a whole generation, so every
        token attends over the same number of keys however it is batched (see model.exact_attention)."""
        self.window = None if n is None else min(n, self.max_len)

    def kv_len(self, n_new: int) -> int:
        """How many slots the attention of a call with n_new tokens must look at."""
        if not self.slice_to_bound:  # fixed shapes (compiled step): no Python-side bookkeeping to guard on
            return self.max_len
        need = self.bound + n_new
        if need > self.max_len:
            raise RuntimeError(f"KV cache overflow: {need} slots needed, cache holds {self.max_len}")
        if self.window is not None and n_new <= 64:
            if need > self.window:
                raise RuntimeError(f"KV window overflow: {need} slots needed, window is {self.window}")
            return self.window
        return min(self.max_len, -(-need // 64) * 64)  # round up so shapes repeat

    @property
    def _one_row(self) -> bool:
        """A single row whose length the host knows (`bound`): writes are plain slices, no index tensors."""
        return self.batch_size == 1 and self.slice_to_bound

    def write_index(self, n_new: int) -> tuple[Tensor, Tensor] | None:
        """(rows [B, 1], slots [B, T]) where a call with n_new tokens writes; one per forward, shared by layers.
        None for a single row (`write` slices at `bound`)."""
        if self._one_row:
            return None
        dev = self.lengths.device
        return torch.arange(self.batch_size, device=dev)[:, None], self.lengths[:, None] + torch.arange(
            n_new, device=dev
        )

    def write(
        self,
        layer: int,
        k_new: Tensor,
        v_new: Tensor,
        kv_len: int,
        index: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Write k/v [B, Hkv, T, D] at slots lengths + arange(T) (`index`: `write_index(T)`, computed here
        when not given); return this layer's [B, Hkv, kv_len, D]."""
        if self._one_row:  # lengths[0] == bound: a slice assignment, cheaper than index_put
            s, T = self.bound, k_new.shape[2]
            self.k[layer, 0, :, s : s + T] = k_new[0]
            self.v[layer, 0, :, s : s + T] = v_new[0]
        else:
            rows, slots = index if index is not None else self.write_index(k_new.shape[2])
            # advanced indices (rows, slots) around a slice put their dims first: target is [B, T, Hkv, D]
            self.k[layer][rows, :, slots] = k_new.transpose(1, 2).to(self.k.dtype)
            self.v[layer][rows, :, slots] = v_new.transpose(1, 2).to(self.v.dtype)
        return self.k[layer, :, :, :kv_len], self.v[layer, :, :, :kv_len]

    def advance(self, n: int) -> None:
        self.lengths += n
        if self.slice_to_bound:
            self.bound += n

    @contextmanager
    def sliced_to_use(self):
        """Within: a fixed-shape cache (a compiled engine's) sliced to the slots in use, as an eager call on it
        (a prefill) needs; after: fixed-shape again."""
        self.slice_to_bound = True
        self.bound = int(self.lengths.max())
        try:
            yield self
        finally:
            self.slice_to_bound = False

    def truncate(self, lengths: Tensor | int) -> None:
        """Roll back (or forward, within what was written) to the given committed lengths."""
        if isinstance(lengths, int):
            self.lengths.fill_(lengths)
            self.bound = lengths
        else:
            self.lengths.copy_(lengths)
            if self.slice_to_bound:  # one small host read; skipped in the fixed-shape (compiled) mode
                self.bound = int(lengths.max())

    def select_rows(self, rows: Tensor) -> None:
        """Keep only these batch rows (in this order): batched jobs drop finished rows to save their work."""
        self.k, self.v, self.lengths = self.k[:, rows], self.v[:, rows], self.lengths[rows]
        if self.slice_to_bound:
            self.bound = int(self.lengths.max()) if len(rows) else 0

    def prefix_view(self, n_slots: int) -> KVCache:
        """A cache over this one's first n_slots slots, sharing its storage and its `lengths` tensor, in the
        fixed-shape mode: a batched decode step whose rows all hold fewer than n_slots tokens attends over
        n_slots keys instead of max_len (train/fastgen.py captures one such step per slot bucket)."""
        view = copy.copy(self)  # every attribute, so one added to KVCache is not missing from the view
        view._buffers = dict(self._buffers)  # its own buffer table (same tensors): the slices go there only
        view.k, view.v = self.k[..., :n_slots, :], self.v[..., :n_slots, :]
        view.max_len, view.bound, view.slice_to_bound, view.window = n_slots, 0, False, None
        return view

    def compact(self, start: Tensor, keep_idx: Tensor, n_keep: Tensor) -> None:
        """Keep accepted tree nodes: slot start+keep_idx[b, j] -> start+j for j < n_keep[b].

        keep_idx [B, A] holds node offsets relative to `start` (nodes were written at start + node);
        entries at j >= n_keep[b] are ignored, whatever they hold (slot start+j, past the new length, is
        copied onto itself: every write lands on its own slot).
        """
        B, A = keep_idx.shape
        rows = torch.arange(B, device=keep_idx.device)[:, None]
        j = torch.arange(A, device=keep_idx.device)
        dst = start[:, None] + j  # [B, A]
        src = torch.where(j < n_keep[:, None], start[:, None] + keep_idx, dst)
        for buf in (self.k, self.v):
            picked = buf[:, rows, :, src].clone()  # [B, A, layers, Hkv, D] (advanced dims first)
            buf[:, rows, :, dst] = picked
        self.truncate(start + n_keep)


def attention_mask(
    positions: Tensor,
    start: Tensor | None,
    kv_len: int,
    chunk: int | None,
    new_mask: Tensor | None = None,
) -> Tensor:
    """Boolean mask [B, 1, T, kv_len]: True where query t of row b may attend to key slot s.

    positions [B, T]: RoPE positions of the new tokens; start [B]: slot of the first new token (None:
    no cache, keys are just the new tokens, kv_len == T); new_mask [B or 1, T, T]: which new tokens see
    which (default causal; a tree passes ancestor-or-self). Committed slots s < start hold position s
    and are all visible (they precede every new token); on chunked layers a key at position k is seen
    from position p only if k // chunk == p // chunk (absolute positions, in prefill and decode alike).
    """
    B, T = positions.shape
    dev = positions.device
    if new_mask is None:
        new_mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None]
    new_mask = new_mask.expand(B, T, T)
    if start is None:
        visible = new_mask
        key_pos = positions
    else:
        slot = torch.arange(kv_len, device=dev)
        rel = slot[None, :] - start[:, None]  # [B, S] offset into the new tokens
        is_prefix = rel < 0
        is_new = (rel >= 0) & (rel < T)
        rel_c = rel.clamp(0, T - 1)
        key_pos = torch.where(is_prefix, slot[None, :].expand(B, -1), positions.gather(1, rel_c))
        new_vis = new_mask.gather(2, rel_c[:, None, :].expand(B, T, kv_len))
        visible = is_prefix[:, None, :] | (is_new[:, None, :] & new_vis)
    if chunk is not None:
        visible = visible & (key_pos[:, None, :] // chunk == positions[:, :, None] // chunk)
    return visible[:, None]
