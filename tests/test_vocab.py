"""Draft vocabulary: counts over assistant tokens, exact maps, round trips, validation catches shifts."""

from __future__ import annotations

import datasets
import pytest
import torch

from eagle3 import vocab as v

COUNTS = torch.tensor([0, 5, 3, 5, 0, 1, 9, 0, 3, 0])


def test_select_hand_made_counts():
    d2t, t2d = v.select_draft_vocab(COUNTS, 4)
    # by count: 6 (9), 1 (5), 3 (5), then 2 and 8 tie at 3 -> the smaller id, 2
    assert d2t.tolist() == [1, 1, 1, 3]  # draft 0..3 -> target 1, 2, 3, 6
    assert t2d.tolist() == [False, True, True, True, False, False, True, False, False, False]
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool
    d2t5, t2d5 = v.select_draft_vocab(COUNTS, 5)
    assert (torch.arange(5) + d2t5).tolist() == [1, 2, 3, 6, 8]
    v.validate_vocab_maps(d2t5, t2d5, 10)


def test_select_fills_with_lowest_unseen_ids():
    counts = torch.zeros(10, dtype=torch.long)
    counts[5], counts[7] = 2, 1
    d2t, t2d = v.select_draft_vocab(counts, 4)
    assert (torch.arange(4) + d2t).tolist() == [0, 1, 5, 7]
    assert d2t.tolist() == [0, 0, 3, 4]
    assert t2d.nonzero().flatten().tolist() == [0, 1, 5, 7]


def test_select_full_vocab_is_identity():
    d2t, t2d = v.select_draft_vocab(COUNTS, 10)
    assert d2t.tolist() == [0] * 10 and bool(t2d.all())


def test_select_random_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 50, (5000,), generator=g)
    d2t, t2d = v.select_draft_vocab(counts, 700)
    v.validate_vocab_maps(d2t, t2d, 5000)
    expected = sorted(sorted(range(5000), key=lambda i: (-int(counts[i]), i))[:700])
    assert (torch.arange(700) + d2t).tolist() == expected


def test_select_rejects_bad_sizes():
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in \[1, 10\], got 11"):
        v.select_draft_vocab(COUNTS, 11)
    with pytest.raises(ValueError, match="1-D"):
        v.select_draft_vocab(COUNTS.view(2, 5), 3)


def test_grow_keeps_every_old_id_and_adds_the_most_frequent():
    _, t2d = v.select_draft_vocab(COUNTS, 4)  # ids 1, 2, 3, 6
    counts = torch.tensor([7, 0, 0, 0, 2, 7, 0, 1, 9, 2])  # the new data: old ids rare, 8 / 0 / 5 frequent
    d2t, grown = v.grow_draft_vocab(t2d, counts, 7)
    v.validate_vocab_maps(d2t, grown, 10)
    assert (torch.arange(7) + d2t).tolist() == [0, 1, 2, 3, 5, 6, 8]  # 0 and 5 tie at 7: both fit
    d2t, grown = v.grow_draft_vocab(t2d, counts, 6)
    assert (torch.arange(6) + d2t).tolist() == [0, 1, 2, 3, 6, 8]  # 8, then 0 before 5 (a tie: smaller id)
    d2t, same = v.grow_draft_vocab(t2d, counts, 4)
    assert torch.equal(same, t2d)
    with pytest.raises(ValueError, match="must hold 4 to 10 ids, got 3"):
        v.grow_draft_vocab(t2d, counts, 3)
    with pytest.raises(ValueError, match="must hold 4 to 10 ids, got 11"):
        v.grow_draft_vocab(t2d, counts, 11)


def test_count_tokens_only_assistant_tokens():
    pairs = [([1, 2, 3, 3], [0, 1, 1, 0]), ([3, 9], [1, 1])]
    counts = v.count_tokens(pairs, vocab_size=10)
    assert counts.tolist() == [0, 0, 1, 2, 0, 0, 0, 0, 0, 1]
    assert counts.dtype == torch.long
    rows = [{"input_ids": [4, 4], "loss_mask": [1, 1]}]
    assert v.count_tokens([pairs, rows], 10).tolist() == [0, 0, 1, 2, 2, 0, 0, 0, 0, 1]
    assert v.count_tokens([(torch.tensor([5, 6]), torch.tensor([1, 0], dtype=torch.int8))], 10)[5] == 1


def test_count_tokens_from_datasets():
    ds = datasets.Dataset.from_dict(
        {"id": ["a", "b"], "input_ids": [[1, 2, 3], [3, 3]], "loss_mask": [[0, 1, 1], [1, 0]]}
    )
    dd = datasets.DatasetDict(train=ds, heldout=ds.select([1]))
    assert v.count_tokens(ds, 5).tolist() == [0, 0, 1, 2, 0]
    assert v.count_tokens(dd, 5).tolist() == [0, 0, 1, 3, 0]
    assert v.count_tokens([ds, [([4], [1])]], 5).tolist() == [0, 0, 1, 2, 1]
    with pytest.raises(ValueError, match="lacks columns"):
        v.count_tokens(ds.remove_columns("loss_mask"), 5)


def test_count_tokens_errors():
    with pytest.raises(ValueError, match=r"sequence 1: token id 12 outside the vocabulary \[0, 10\)"):
        v.count_tokens([([1], [1]), ([12, 2], [1, 1])], 10)
    with pytest.raises(ValueError, match="sequence 0: input_ids"):
        v.count_tokens([([1, 2], [1])], 10)
    # an out-of-range id that is not an assistant token is not counted, so not an error
    assert v.count_tokens([([12, 2], [0, 1])], 10)[2] == 1


def test_round_trips():
    d2t, t2d = v.select_draft_vocab(COUNTS, 5)  # kept 1, 2, 3, 6, 8
    draft = torch.arange(5)
    target = v.draft_ids_to_target(draft, d2t)
    assert target.tolist() == [1, 2, 3, 6, 8]
    back, ok = v.target_ids_to_draft(target, t2d)
    assert back.tolist() == draft.tolist() and bool(ok.all())

    ids = torch.tensor([[0, 6, 7], [8, 1, 9]])
    d, ok = v.target_ids_to_draft(ids, t2d)
    assert d.tolist() == [[-100, 3, -100], [4, 0, -100]]
    assert ok.tolist() == [[False, True, False], [True, True, False]]
    assert torch.equal(v.draft_ids_to_target(d[ok], d2t), ids[ok])


def test_round_trip_out_of_range_ids_raise():
    d2t, t2d = v.select_draft_vocab(COUNTS, 5)
    with pytest.raises(ValueError, match=r"draft ids must be in \[0, 5\)"):
        v.draft_ids_to_target(torch.tensor([5]), d2t)
    with pytest.raises(ValueError, match=r"target ids must be in \[0, 10\)"):
        v.target_ids_to_draft(torch.tensor([10]), t2d)


def test_validate_catches_a_shifted_map():
    d2t, t2d = v.select_draft_vocab(COUNTS, 5)  # kept 1, 2, 3, 6, 8
    v.validate_vocab_maps(d2t, t2d, 10)
    with pytest.raises(
        ValueError, match="d2t and t2d disagree: draft id 2 maps to target id 4, which t2d marks as not kept"
    ):
        v.validate_vocab_maps(d2t + 1, t2d, 10)  # the classic off-by-one: every id shifted by one
    with pytest.raises(ValueError, match="d2t and t2d disagree: draft id 0 maps to target id 0"):
        v.validate_vocab_maps(d2t - 1, t2d, 10)


def test_validate_other_errors():
    d2t, t2d = v.select_draft_vocab(COUNTS, 5)
    with pytest.raises(ValueError, match="t2d has length 10, the target vocab has 12"):
        v.validate_vocab_maps(d2t, t2d, 12)
    with pytest.raises(ValueError, match="d2t has length 4 but t2d marks 5"):
        v.validate_vocab_maps(d2t[:4], t2d, 10)
    swapped = d2t.clone()
    swapped[1], swapped[2] = d2t[2] + 1, d2t[1] - 1  # targets 1, 3, 2, 6, 8
    with pytest.raises(ValueError, match="d2t is not sorted: draft ids 1 and 2 map to target ids 3 and 2"):
        v.validate_vocab_maps(swapped, t2d, 10)
    with pytest.raises(ValueError, match="outside"):
        v.validate_vocab_maps(d2t + 5, t2d, 10)
    with pytest.raises(ValueError, match="1-D int64"):
        v.validate_vocab_maps(d2t.int(), t2d, 10)
    with pytest.raises(ValueError, match="1-D bool"):
        v.validate_vocab_maps(d2t, t2d.long(), 10)
