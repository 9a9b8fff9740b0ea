"""The draft head's reduced vocabulary and its maps to and from the target vocabulary.

EAGLE-3 scores only the `draft_vocab_size` tokens the target most often produces, which makes its
lm_head (and softmax) several times cheaper than the target's. Two buffers, in the EAGLE-3 / vLLM /
SGLang convention, connect the vocabularies:

    d2t  LongTensor[V']  offsets:  target_id = draft_id + d2t[draft_id]
    t2d  BoolTensor[V]   t2d[target_id] is True iff the target token is in the draft vocab

The drafts made here number the kept target ids in increasing order, so draft_id = (number of kept ids
below target_id), i.e. cumsum(t2d) - 1, and d2t is non-decreasing. A draft from elsewhere need only map
one-to-one (`eagle3.draft.check_vocab_maps`, what `load_draft` checks): code that carries rows between
drafts matches them by target id (train.fit.carry_head_rows). Frequencies are counted over the
assistant tokens only (loss_mask == 1): those are what the draft must predict at inference; counting
the prompt's tokens would spend draft vocab on system-prompt boilerplate.

A map that is off by one does not crash anything; it silently collapses acceptance. Hence
`validate_vocab_maps` for the maps made here, and `check_vocab_maps` on every draft loaded.

Shape legend: V target vocab, V' draft vocab, N any number of ids.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

IGNORE_INDEX = -100  # draft id given to target tokens outside the draft vocab (cross-entropy's default)


def _iter_pairs(source: Any) -> Iterable[tuple[Sequence[int], Sequence[int]]]:
    """(input_ids, loss_mask) pairs from a datasets.Dataset / DatasetDict, an iterable of pairs or of
    rows with those keys, or a list of any of these."""
    ds = sys.modules.get("datasets")  # a Dataset can only exist if `datasets` was imported
    if ds is not None and isinstance(source, ds.DatasetDict):
        for split in source.values():
            yield from _iter_pairs(split)
        return
    if ds is not None and isinstance(source, ds.Dataset):
        missing = {"input_ids", "loss_mask"} - set(source.column_names)
        if missing:
            raise ValueError(f"dataset lacks columns {sorted(missing)} (has {source.column_names})")
        for batch in source.select_columns(["input_ids", "loss_mask"]).iter(batch_size=1024):
            yield from zip(batch["input_ids"], batch["loss_mask"])
        return
    if isinstance(source, Mapping):
        raise TypeError(
            "count_tokens: got a mapping; pass a dataset, or an iterable of (input_ids, loss_mask)"
        )
    for item in source:
        if isinstance(item, Mapping):
            yield item["input_ids"], item["loss_mask"]
        elif isinstance(item, tuple | list) and len(item) == 2 and _is_id_sequence(item[0]):
            yield item[0], item[1]
        else:  # a nested source (a dataset, or a list of pairs)
            yield from _iter_pairs(item)


def _is_id_sequence(x: Any) -> bool:
    if isinstance(x, Tensor):
        return x.dim() == 1
    return isinstance(x, Sequence) and not isinstance(x, str) and (len(x) == 0 or isinstance(x[0], int))


def count_tokens(sources: Any, vocab_size: int) -> Tensor:
    """counts LongTensor[V]: how often each target id appears where loss_mask is 1.

    `sources`: a datasets.Dataset or DatasetDict with columns input_ids / loss_mask, an iterable of
    (input_ids, loss_mask) pairs or of dicts with those keys, or a list mixing these.
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)  # [V]
    for n, (ids, mask) in enumerate(_iter_pairs(sources)):
        ids_t = torch.as_tensor(ids, dtype=torch.long)  # [N]
        mask_t = torch.as_tensor(mask).bool()  # [N]
        if ids_t.shape != mask_t.shape or ids_t.dim() != 1:
            raise ValueError(
                f"sequence {n}: input_ids {tuple(ids_t.shape)} and loss_mask {tuple(mask_t.shape)} differ"
            )
        kept = ids_t[mask_t]
        if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= vocab_size):
            bad = int(kept.max()) if int(kept.max()) >= vocab_size else int(kept.min())
            raise ValueError(f"sequence {n}: token id {bad} outside the vocabulary [0, {vocab_size})")
        counts += torch.bincount(kept, minlength=vocab_size)
    return counts


def select_draft_vocab(counts: Tensor, draft_vocab_size: int) -> tuple[Tensor, Tensor]:
    """(d2t LongTensor[V'], t2d BoolTensor[V]) keeping the draft_vocab_size most frequent ids.

    Ties go to the smaller id; when fewer than V' ids were seen, the lowest unseen ids fill the rest
    (so the result is deterministic and always exactly V' long). Kept ids are sorted by id.
    """
    if counts.dim() != 1:
        raise ValueError(f"counts must be 1-D [vocab], got shape {tuple(counts.shape)}")
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}], got {draft_vocab_size}")
    # stable sort keeps the id order among equal counts: ties -> smaller id, unseen -> lowest ids
    order = torch.sort(counts.long(), descending=True, stable=True).indices  # [V]
    kept = torch.sort(order[:draft_vocab_size]).values  # [V'] target ids, increasing
    d2t = kept - torch.arange(draft_vocab_size)  # [V']
    t2d = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
    t2d[kept] = True
    return d2t, t2d


def grow_draft_vocab(t2d: Tensor, counts: Tensor, draft_vocab_size: int) -> tuple[Tensor, Tensor]:
    """(d2t, t2d) of a larger draft vocabulary that keeps every id of `t2d` and adds the most frequent
    others of `counts` [V] (ties and unseen ids as in `select_draft_vocab`) up to draft_vocab_size ids."""
    old = int(t2d.sum())
    if counts.shape != t2d.shape:
        raise ValueError(f"counts {tuple(counts.shape)} and t2d {tuple(t2d.shape)} differ in vocabulary")
    if not old <= draft_vocab_size <= t2d.numel():
        raise ValueError(
            f"a grown draft vocabulary must hold {old} to {t2d.numel()} ids, got {draft_vocab_size}"
        )
    # kept ids first whatever their count: above every count, in id order among themselves
    rank = torch.where(t2d.bool(), counts.long().max() + 1, counts.long())
    return select_draft_vocab(rank, draft_vocab_size)


def draft_ids_to_target(ids: Tensor, d2t: Tensor) -> Tensor:
    """Target ids of draft ids (any shape): ids + d2t[ids]."""
    ids = torch.as_tensor(ids, dtype=torch.long, device=d2t.device)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= d2t.numel()):
        raise ValueError(
            f"draft ids must be in [0, {d2t.numel()}), got range [{int(ids.min())}, {int(ids.max())}]"
        )
    return ids + d2t[ids]


def target_ids_to_draft(ids: Tensor, t2d: Tensor) -> tuple[Tensor, Tensor]:
    """(draft_ids, in_vocab) for target ids of any shape, in this module's increasing order (t2d alone
    cannot tell another); ids outside the draft vocab get IGNORE_INDEX (-100) and in_vocab False, so using
    them as cross-entropy labels ignores them."""
    ids = torch.as_tensor(ids, dtype=torch.long, device=t2d.device)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= t2d.numel()):
        raise ValueError(
            f"target ids must be in [0, {t2d.numel()}), got range [{int(ids.min())}, {int(ids.max())}]"
        )
    rank = torch.cumsum(t2d.long(), 0) - 1  # [V] draft id of each kept target id
    in_vocab = t2d[ids]
    draft = torch.where(in_vocab, rank[ids], torch.full_like(ids, IGNORE_INDEX))
    return draft, in_vocab


def validate_vocab_maps(d2t: Tensor, t2d: Tensor, vocab_size: int) -> None:
    """Raise ValueError unless d2t / t2d are a consistent EAGLE-3 pair for a target of vocab_size."""
    if d2t.dtype != torch.long or d2t.dim() != 1:
        raise ValueError(f"d2t must be a 1-D int64 tensor, got {d2t.dtype} of shape {tuple(d2t.shape)}")
    if t2d.dtype != torch.bool or t2d.dim() != 1:
        raise ValueError(f"t2d must be a 1-D bool tensor, got {t2d.dtype} of shape {tuple(t2d.shape)}")
    if t2d.numel() != vocab_size:
        raise ValueError(f"t2d has length {t2d.numel()}, the target vocab has {vocab_size}")
    n_kept = int(t2d.sum())
    if d2t.numel() != n_kept:
        raise ValueError(f"d2t has length {d2t.numel()} but t2d marks {n_kept} target ids as kept")
    target = torch.arange(d2t.numel(), device=d2t.device) + d2t  # [V']
    if target.numel() == 0:
        return
    if int(target.min()) < 0 or int(target.max()) >= vocab_size:
        raise ValueError(
            f"d2t maps draft ids to target ids [{int(target.min())}, {int(target.max())}] outside [0, {vocab_size})"
        )
    steps = target[1:] - target[:-1]
    if target.numel() > 1 and int(steps.min()) <= 0:
        bad = int(torch.nonzero(steps <= 0)[0])
        raise ValueError(
            f"d2t is not sorted: draft ids {bad} and {bad + 1} map to target ids "
            f"{int(target[bad])} and {int(target[bad + 1])} (must strictly increase)"
        )
    off = ~t2d.to(target.device)[target]
    if bool(off.any()):
        bad = int(torch.nonzero(off)[0])
        raise ValueError(
            f"d2t and t2d disagree: draft id {bad} maps to target id {int(target[bad])}, which t2d marks as not kept"
        )
