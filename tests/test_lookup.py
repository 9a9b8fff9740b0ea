"""Prompt lookup: the n-gram index proposes what a scan of the sequence finds, and decoding with it stays
identical to plain decoding (greedy) and to the target's distribution (sampling)."""

from __future__ import annotations

import random

import pytest
import torch

from eagle3.lookup import LookupConfig, NgramIndex
from eagle3.spec import SpecDecoder, TreeConfig
from eagle3.tuner import DraftLengthTuner, FixedK
from maverick.generate import Decoder
from maverick.sampling import SamplingParams
from tests.test_spec import N_ROWS, TV_BOUND, V_SMALL, empirical, exact_marginals, make_draft, make_target


def propose_brute_force(tokens, config):
    """What `NgramIndex.propose` must return, by scanning the sequence (the reference)."""
    seq = list(tokens)
    for g in range(config.max_ngram, config.min_ngram - 1, -1):
        if len(seq) < g + 1:
            continue
        suffix = seq[-g:]
        for end in range(len(seq) - 2, g - 2, -1):  # most recent first; the suffix itself excluded
            if seq[end - g + 1 : end + 1] == suffix:
                out, i = [], end + 1  # the copy reads on into what it has copied
                while len(out) < config.max_tokens:
                    out.append(seq[i] if i < len(seq) else out[i - len(seq)])
                    i += 1
                return out
    return []


def test_propose_hand_made():
    cfg = LookupConfig(max_ngram=3, min_ngram=2, max_tokens=6)
    # suffix (9, 1, 2) never occurred before; (1, 2) did, ending at index 1: copy what followed it, and
    # past the end of the sequence the copy reads on into itself (the loop 3 9 1 2 continues)
    assert NgramIndex(cfg, [1, 2, 3, 9, 1, 2]).propose() == [3, 9, 1, 2, 3, 9]
    # the most recent earlier occurrence wins, and the longest suffix first
    assert NgramIndex(cfg, [5, 1, 2, 7, 1, 2, 8, 1, 2]).propose() == [8, 1, 2, 8, 1, 2]
    assert NgramIndex(cfg, [4, 1, 2, 7, 5, 1, 2, 8, 5, 1, 2]).propose() == [8, 5, 1, 2, 8, 5]
    assert NgramIndex(cfg, [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]).propose() == [3, 4, 5, 6, 7, 8]  # no wrap
    assert NgramIndex(cfg, [1, 2, 3, 4]).propose() == []  # nothing recurs
    assert NgramIndex(cfg, [1, 1]).propose() == []  # a 1-gram match is below min_ngram
    assert NgramIndex(LookupConfig(min_ngram=1, max_tokens=3), [1, 1]).propose() == [1, 1, 1]
    assert NgramIndex(cfg, [1, 2, 3, 4, 5, 1, 2]).propose(2) == [3, 4]


@pytest.mark.parametrize("cfg", [LookupConfig(), LookupConfig(4, 1, 5), LookupConfig(2, 2, 16)])
def test_index_equals_brute_force_while_growing(cfg):
    rng = random.Random(0)
    for vocab in (3, 6, 20):
        seq = [rng.randrange(vocab) for _ in range(5)]
        index = NgramIndex(cfg, seq)
        for _ in range(120):
            assert index.propose() == propose_brute_force(index.tokens, cfg)
            step = [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
            index.extend(step)
            seq += step
        assert index.tokens == seq


@pytest.mark.parametrize("kw", [dict(min_ngram=0), dict(min_ngram=3, max_ngram=2), dict(max_tokens=0)])
def test_config_rejects_bad_values(kw):
    with pytest.raises(ValueError, match="LookupConfig"):
        LookupConfig(**kw)


@pytest.fixture(scope="module")
def target():
    return make_target(vocab_size=64)


def repetitive_prompts():
    """Prompts that repeat themselves, so lookup finds matches (and the random target's greedy output
    tends to loop too), and one without repeats."""
    a = [5, 9, 13, 21, 8, 30, 2, 44]
    return [a * 3 + [5, 9], [7, 11, 19, 23, 29, 31, 37, 41, 43, 47, 53], a[:4] * 4]


@pytest.mark.parametrize("policy", [lambda: FixedK(3), lambda: DraftLengthTuner()])
def test_lookup_greedy_identical_to_plain(target, policy):
    ps = repetitive_prompts()
    refs = [Decoder(target, max_len=160).generate([p], 40).tokens[0] for p in ps]
    copied_accepted, copied_lengths = 0, set()
    for p, ref in zip(ps, refs):
        dec = SpecDecoder(target, make_draft(target), max_len=160, policy=policy(), lookup=LookupConfig())
        got = dec.generate([p], 40)
        assert got.tokens[0] == ref
        st = got.stats["spec"]
        copied_accepted += sum(a for a, n in zip(st.accepted, st.lookup_rows) if n)
        copied_lengths |= {k for k, n in zip(st.draft_lengths, st.lookup_rows) if n}
    assert copied_accepted > 0  # copied tokens were accepted
    if isinstance(policy(), FixedK):  # a copy fills max_tokens (it wraps around)
        assert copied_lengths == {LookupConfig().max_tokens}
    else:  # the tuner chooses how many of them the verify's cost pays for
        assert copied_lengths <= set(range(1, LookupConfig().max_tokens + 1))
    # batched: rows mix copied drafts of different lengths with the EAGLE-3 draft in one verify pass
    dec = SpecDecoder(target, make_draft(target), max_len=160, policy=policy(), lookup=LookupConfig())
    got = dec.generate(ps, 40)
    assert got.tokens == refs
    assert any(0 < n < len(ps) for n in got.stats["spec"].lookup_rows)  # some cycles mixed both


@pytest.mark.parametrize("policy, tree", [(lambda: FixedK(3), None), (lambda: DraftLengthTuner(), None),
                                          (lambda: FixedK(3), TreeConfig(3, 2, 6))])  # fmt: skip
def test_the_policys_realised_rate_counts_copied_cycles(target, policy, tree):
    """The rate a policy reports (eval.bench writes it into its config) counts every cycle's tokens and
    time: before, a copied draft's tokens were left out (and an all-copy cycle's catch-up time), so the
    tuned+lookup rate read ~230 where the cycles made ~330 tokens/s; a fixed tree's cycles were not counted."""
    pol = policy()
    dec = SpecDecoder(target, make_draft(target), max_len=160, policy=pol, lookup=LookupConfig(), tree=tree)
    st = dec.generate(repetitive_prompts()[:1], 40).stats["spec"]
    assert sum(n for n in st.lookup_rows) > 0 and pol.tokens == sum(a + 1 for a in st.accepted)
    assert pol.seconds == pytest.approx(st.draft_seconds + st.verify_seconds, rel=1e-9)


def test_a_finished_row_of_a_batch_is_not_counted_as_copied(target):
    """A finished row rides along with the proposal [] (no draft); lookup_rows counted it as a copied row
    (seen: a lookup that can never match, yet lookup_cycles 35 of 39 once row 0 had stopped at its 5th token)."""
    from tests.test_spec import prompts

    ps = prompts(2, vocab=64)
    stop = [Decoder(target, max_len=160).generate(ps[:1], 40).tokens[0][4]]
    never = LookupConfig(min_ngram=40, max_ngram=40)  # no 40-gram recurs in 21 + 40 tokens
    dec = SpecDecoder(target, make_draft(target), max_len=160, policy=FixedK(3), lookup=never)
    got = dec.generate(ps, 40, stop_ids=stop)
    st = got.stats["spec"]
    assert len(got.tokens[0]) <= 5 and any(len(r) == 1 for r in st.accepted_rows)  # row 0 finished first
    assert st.lookup_rows == [0] * st.cycles and st.lookup_cycles == 0


def test_lookup_streak_copies_longer_after_a_full_accept(target):
    """streak_tokens: a copy that follows a fully accepted copy drafts streak_tokens, any other max_tokens;
    the output stays plain decoding's."""
    cfg = LookupConfig(max_tokens=4, streak_tokens=9)
    longer = 0
    for p in repetitive_prompts():
        ref = Decoder(target, max_len=160).generate([p], 40).tokens[0]
        got = SpecDecoder(target, make_draft(target), max_len=160, policy=FixedK(3), lookup=cfg).generate(
            [p], 40
        )
        assert got.tokens[0] == ref
        st = got.stats["spec"]
        for i, (k, n) in enumerate(zip(st.draft_lengths, st.lookup_rows)):
            if not n:
                continue
            after_full = i > 0 and st.lookup_rows[i - 1] and st.accepted[i - 1] == st.draft_lengths[i - 1]
            assert k == (9 if after_full else 4), (i, k)
            longer += k == 9
    assert longer > 0
    with pytest.raises(ValueError, match="streak_tokens"):
        LookupConfig(max_tokens=10, streak_tokens=5)


def test_lookup_with_trees_greedy_identical_to_plain(target):
    """Trees with prompt lookup: a cycle with a match verifies the copy as a chain, the others draft trees;
    both kinds of cycle occur, copied tokens are accepted, and the output is plain decoding's."""
    ps = repetitive_prompts()
    kinds = set()
    copied_accepted = 0
    for p in ps:
        ref = Decoder(target, max_len=160).generate([p], 40).tokens[0]
        dec = SpecDecoder(
            target, make_draft(target), max_len=160, tree=TreeConfig(3, 2, 6), lookup=LookupConfig()
        )
        got = dec.generate([p], 40)
        assert got.tokens[0] == ref
        st = got.stats["spec"]
        assert len(st.lookup_rows) == st.cycles
        kinds |= set(st.lookup_rows)
        copied_accepted += sum(a for a, n in zip(st.accepted, st.lookup_rows) if n)
        assert len(st.tree_nodes) == st.cycles - sum(st.lookup_rows)  # one tree per cycle without a copy
    assert kinds == {0, 1} and copied_accepted > 0


def test_lookup_sampling_is_lossless():
    """min_ngram=1 on a 16-token vocabulary: most rows find a match, some do not, so the batch mixes copied
    (one-hot) drafts and EAGLE-3 drafts of other lengths; the 2nd and 3rd tokens must follow the target's
    exact marginals (bound as in tests/test_spec.py). Checked by mutation: verifying the copied tokens
    with q = 0 instead of one-hot (accept whenever p > 0) gives TV 0.14 / 0.30 here."""
    sampling = SamplingParams(1.0)
    t = make_target(std=0.6, seed=5, vocab_size=V_SMALL)
    d = make_draft(t, std=0.6, seed=6)
    prompt = [14, 3, 14, 7, 1, 9, 4]  # the target's likely first tokens occur in it
    p2, p3 = exact_marginals(t, prompt, sampling, V_SMALL)
    dec = SpecDecoder(t, d, max_len=48, policy=FixedK(2), lookup=LookupConfig(max_ngram=2, min_ngram=1))
    gen = dec.generate([prompt] * N_ROWS, 3, sampling=sampling, generator=torch.Generator().manual_seed(0))
    e2 = empirical([r[1] for r in gen.tokens], V_SMALL)
    e3 = empirical([r[2] for r in gen.tokens], V_SMALL)
    tv2, tv3 = 0.5 * float((e2 - p2).abs().sum()), 0.5 * float((e3 - p3).abs().sum())
    assert tv2 < TV_BOUND and tv3 < TV_BOUND, (tv2, tv3)
    st = gen.stats["spec"]
    assert 0.3 * N_ROWS < st.lookup_rows[0] < 0.9 * N_ROWS  # the first cycle mixed copied and drafted rows
    assert sum(st.accepted_rows[0]) > 0.3 * N_ROWS  # and drafts were accepted


def test_bench_method_names(target):
    from types import SimpleNamespace

    from eval.bench import build_decoder

    args = SimpleNamespace(compile_draft=False, temperature=0.0, top_k=0, top_p=1.0, tree_depth=5,
                           tree_top_k=6, tree_tokens=24)  # fmt: skip
    d = make_draft(target)
    dec = build_decoder("eagle3-tuned+lookup", target, d, 64, args)
    assert dec.lookup.max_tokens == 10 and isinstance(dec.policy, DraftLengthTuner)
    dec = build_decoder("eagle3-k3+lookup", target, d, 64, args)
    assert dec.lookup.max_tokens == 10 and dec.policy.k == 3
    assert build_decoder("eagle3-k3", target, d, 64, args).lookup is None
    dec = build_decoder("eagle3-tree+lookup", target, d, 64, args)
    assert dec.tree == TreeConfig(5, 6, 24)
    assert dec.lookup == LookupConfig(streak_tokens=20)  # the default --lookup-streak-tokens
    args.lookup_tokens, args.lookup_streak_tokens = 14, 10  # --lookup-tokens; a streak below it: off
    assert build_decoder("eagle3-tuned+lookup", target, d, 64, args).lookup == LookupConfig(max_tokens=14)
    # eagle3-tree-tuned: the tuner picks among --tree-candidates, cut for sampling, each once
    args.tree_candidates = [TreeConfig(2, 2, 3), TreeConfig(3, 4, 12), TreeConfig(3, 3, 12)]
    dec = build_decoder("eagle3-tree-tuned+lookup", target, d, 64, args)
    assert dec.policy.tree_configs == args.tree_candidates and dec.tree == TreeConfig(3, 4, 12)
    args.temperature = 1.0  # full trees of 2 children: 2,2,3 cuts to 1,2,2; 3,4,12 and 3,3,12 both to 2,2,6
    dec = build_decoder("eagle3-tree-tuned", target, d, 64, args)
    assert dec.lookup is None and dec.policy.tree_configs == [TreeConfig(1, 2, 2), TreeConfig(2, 2, 6)]


def test_bench_reports_what_the_tree_tuner_picked(tmp_path):
    """eval.bench's eagle3-tree-tuned+lookup on the real target: plain decoding's tokens (exit 0), and the
    report's config holds each candidate tree's cycles, tokens and seconds per cycle."""
    import json

    from eval import bench

    out = tmp_path / "r"
    argv = ["--n", "1", "--turns", "1", "--max-new-tokens", "48", "--methods",
            "ours-plain,eagle3-tree-tuned+lookup,eagle3-tuned+lookup+store", "--tree-candidates", "1,1,1;2,2,3",
            "--out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    # the shipped datastore's share of the cycles is recorded apart from prompt lookup's (a copied draft)
    lines = [
        json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()[1:]
    ]  # after the settings
    stored = [r for line in lines for r in line["records"] if r["method"] == "eagle3-tuned+lookup+store"]
    assert (
        len(stored) == 1 and 0 < stored[0]["store_cycles"] <= stored[0]["lookup_cycles"] < stored[0]["cycles"]
    )
    config = json.loads((out / "report.json").read_text())["config"]
    assert config["trees_tuned"] == [{"depth": 1, "top_k": 1, "total_tokens": 1},
                                     {"depth": 2, "top_k": 2, "total_tokens": 3}]  # fmt: skip
    picked = config["tree_tuner+lookup"]
    assert set(picked) == {"1,1,1", "2,2,3"} and all(
        v["count"] >= 1 and v["seconds"] > 0 for v in picked.values()
    )


def test_report_lookup_share():
    from eval.report import RunRecord, summarise, table_rows

    def rec(method, accepted, lookup_cycles=0):
        return RunRecord(method, "1", 0, len(accepted) + sum(accepted), 1.0, 0.1, cycles=len(accepted),
                         accepted=accepted, draft_lengths=[10] * len(accepted), lookup_cycles=lookup_cycles)  # fmt: skip

    b = rec("b", [0, 2, 10, 0], lookup_cycles=3)
    b.store_cycles = 1  # of the 3 copied drafts, 1 from the datastore
    s = summarise([rec("ours-plain", []), rec("a", [0, 2, 10, 0]), b])
    assert [x.lookup_share for x in s] == [None, None, 0.75] and [x.store_share for x in s] == [
        None,
        None,
        0.25,
    ]
    header, rows = table_rows(s)
    assert [r[header.index("lookup")] for r in rows] == ["-", "-", "75%"]
    assert [r[header.index("store")] for r in rows] == ["-", "-", "25%"]
    assert "store" not in table_rows(s[:2])[0]
    with pytest.raises(ValueError, match="lookup_cycles"):
        rec("c", [1], lookup_cycles=2)
    with pytest.raises(ValueError, match="store_cycles"):
        RunRecord(
            "c",
            "1",
            0,
            2,
            1.0,
            0.1,
            cycles=1,
            accepted=[1],
            draft_lengths=[1],
            lookup_cycles=0,
            store_cycles=1,
        )


def test_lookup_alone_without_the_draft(target):
    """FixedK(0): only copied drafts; cycles without a match verify the last token alone (plain decoding)."""
    ps = repetitive_prompts()
    for p in ps:
        ref = Decoder(target, max_len=160).generate([p], 40).tokens[0]
        policy = FixedK(0)
        dec = SpecDecoder(target, make_draft(target), max_len=160, policy=policy, lookup=LookupConfig())
        got = dec.generate([p], 40)
        assert got.tokens[0] == ref
        st = got.stats["spec"]
        assert all((k > 0) == bool(n) for k, n in zip(st.draft_lengths, st.lookup_rows))
        assert policy.tokens == sum(a + 1 for a in st.accepted)  # copied cycles count in its realised rate
