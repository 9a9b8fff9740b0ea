"""Speculative decoding is lossless: greedy output identical to plain decoding (chain, tree, batched),
an oracle draft is always accepted, and sampled tokens follow the target's exact distribution."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import eagle3.spec as spec_mod
from eagle3.compiled_draft import SPAN, CompiledDraft
from eagle3.draft import DraftConfig, Eagle3Draft
from eagle3.sampling import verify_chain_sampling as real_verify_chain
from eagle3.spec import SpecDecoder, TreeConfig
from eagle3.tuner import DraftLengthTuner, FixedK, HeuristicK
from maverick.aot import supported
from maverick.config import get_config
from maverick.generate import Decoder
from maverick.model import Llama4
from maverick.sampling import SamplingParams

FEATURES = (1, 2, 3)


def make_target(std=0.1, seed=0, **overrides):
    cfg = dataclasses.replace(get_config("tiny-moe"), **overrides)
    torch.manual_seed(seed)
    t = Llama4(cfg)
    t.init_weights(std=std)
    return t.eval()


def make_draft(target, std=0.1, seed=1, cls=Eagle3Draft, **kw):
    c = target.config
    dc = DraftConfig.for_target(c, draft_vocab_size=c.vocab_size, feature_layers=FEATURES)
    torch.manual_seed(seed)
    d = cls(dc, **kw)
    d.init_weights(std=std)
    d.t2d.fill_(True)
    return d.eval()


class OracleDraft(Eagle3Draft):
    """Knows the target's greedy continuation `seq`; its state encodes the position, and the pair at
    position t proposes seq[t + 2], which is what a perfect draft must say. Off-by-one mistakes in the
    decoder's positions, rollback or catch-up would make it miss."""

    def __init__(self, cfg, seq):
        super().__init__(cfg)
        self.seq = torch.tensor(seq)

    def forward(self, embeds, hidden, positions, cache=None, mask=None, tree_mask=None):
        T = hidden.shape[1]
        if positions is None:
            positions = cache.lengths[:, None] + torch.arange(T)
        if cache is not None:
            cache.advance(T)
        return positions[..., None].float().expand(*positions.shape, hidden.shape[-1]).clone()

    def logits(self, h):
        nxt = self.seq[(h[..., 0].long() + 2).clamp(max=len(self.seq) - 1)]
        return F.one_hot(nxt, self.config.draft_vocab_size).float() * 10


@pytest.fixture(scope="module")
def target():
    return make_target()


def prompts(n, lengths=(13, 21, 6), seed=3, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lengths[:n]]


POLICIES = {
    "k1": lambda: FixedK(1),
    "k3": lambda: FixedK(3),
    "k6": lambda: FixedK(6),
    "heuristic": lambda: HeuristicK(),
    "tuned": lambda: DraftLengthTuner(),
}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_chain_greedy_identical_random_draft(target, policy):
    """Prompt 13 + 40 new tokens crosses the chunk boundaries (chunk 16) of the tiny Llama 4 MoE."""
    p = prompts(1)[0]
    ref = Decoder(target, max_len=128).generate([p], 40).tokens[0]
    got = SpecDecoder(target, make_draft(target), max_len=128, policy=POLICIES[policy]()).generate([p], 40)
    assert got.tokens[0] == ref


@pytest.mark.parametrize("tree", [TreeConfig(3, 3, 10), TreeConfig(4, 2, 30), TreeConfig(5, 4, 8)])
def test_tree_greedy_identical_random_draft(target, tree):
    p = prompts(1)[0]
    ref = Decoder(target, max_len=128).generate([p], 40).tokens[0]
    got = SpecDecoder(target, make_draft(target), max_len=160, tree=tree).generate([p], 40)
    assert got.tokens[0] == ref


TUNED_TREES = [TreeConfig(2, 2, 3), TreeConfig(3, 3, 10), TreeConfig(4, 2, 30)]


def test_tuned_trees_greedy_identical_and_each_tree_tried(target):
    """Several trees: the policy (a DraftLengthTuner made for them) picks one per cycle, each tried
    tree_min_trials times first; the tokens stay plain decoding's, and every cycle's depth is its pick's."""
    p = prompts(1)[0]
    ref = Decoder(target, max_len=128).generate([p], 40).tokens[0]
    dec = SpecDecoder(target, make_draft(target), max_len=160, tree=TUNED_TREES)
    assert isinstance(dec.policy, DraftLengthTuner) and dec.tree == TreeConfig(4, 2, 30)  # the largest sizes
    got = dec.generate([p], 40)
    assert got.tokens[0] == ref
    picks = [e["config"] for e in dec.policy.log if e.get("kind") == "tree"]
    assert len(picks) == got.stats["spec"].cycles
    assert [c.depth for c in picks] == got.stats["spec"].draft_lengths
    assert all(dec.policy.tree_counts[c] >= dec.policy.tree_min_trials for c in TUNED_TREES)
    assert dec.policy.tree_counts == {c: picks.count(c) for c in TUNED_TREES}


def test_tuned_trees_settle_on_the_tree_with_the_most_tokens_per_second(target, monkeypatch):
    """With the clock stopped at 1 s a cycle, the best tree is the one whose cycles emit the most tokens:
    an oracle draft accepts every path, so the deepest tree wins once each was tried."""
    p = prompts(1)[0]
    ref = Decoder(target, max_len=128).generate([p], 60).tokens[0]
    clock = iter(range(10**6))
    monkeypatch.setattr(spec_mod.time, "perf_counter", lambda: float(next(clock)))
    draft = make_draft(target, cls=OracleDraft, seq=p + ref)
    policy = DraftLengthTuner(tree_configs=TUNED_TREES, probe_every=1000)
    dec = SpecDecoder(target, draft, max_len=160, tree=TUNED_TREES, policy=policy)
    got = dec.generate([p], 60)
    assert got.tokens[0] == ref
    picks = [e["config"] for e in policy.log if e.get("kind") == "tree"]
    n = len(TUNED_TREES) * policy.tree_min_trials
    assert len(picks) > n and set(picks[n:]) == {TreeConfig(4, 2, 30)}


def test_several_trees_need_a_policy_that_picks_among_them(target):
    d = make_draft(target)
    with pytest.raises(ValueError, match="several trees need a policy"):
        SpecDecoder(target, d, max_len=160, tree=TUNED_TREES, policy=FixedK(3))
    with pytest.raises(ValueError, match="not the trees given"):
        SpecDecoder(
            target, d, max_len=160, tree=TUNED_TREES[:2], policy=DraftLengthTuner(tree_configs=TUNED_TREES)
        )


def test_drafts_past_the_exact_attention_rows_are_refused(target):
    """A verify of more than EXACT_ATTENTION_MAX_T (64) tokens attends by another kernel and loses plain
    decoding's bits (seen in bf16: a 65-token verify changed every row, 4 of 6 outputs of tree 4,8,64
    differed): the setting that asks for one is named, up front."""
    from eagle3.lookup import LookupConfig
    from maverick.cli import UserError
    from maverick.model import EXACT_ATTENTION_MAX_T

    assert EXACT_ATTENTION_MAX_T == 64
    d = make_draft(target)
    with pytest.raises(UserError, match="the tree's total_tokens 64: a verify keeps"):
        SpecDecoder(target, d, max_len=256, tree=TreeConfig(4, 8, 64))
    with pytest.raises(UserError, match="prompt lookup's streak_tokens 64"):
        SpecDecoder(target, d, max_len=256, lookup=LookupConfig(streak_tokens=64))
    with pytest.raises(UserError, match="the draft length 70"):
        SpecDecoder(target, d, max_len=256, policy=HeuristicK(k_init=2, k_max=70))
    assert SpecDecoder(target, d, max_len=256, tree=TreeConfig(4, 8, 63)).k_max == 63


def test_max_len_is_checked_against_the_longest_draft_not_the_first(target):
    """HeuristicK starts at k_init and grows to k_max: a request is sized by k_max up front, not refused
    by a KV cache overflow half-way (seen: k_init 1, k_max 16, an oracle draft, overflow at 136 of 131 slots)."""
    p = prompts(1)[0]
    ref = Decoder(target, max_len=256).generate([p], 108).tokens[0]
    draft = make_draft(target, cls=OracleDraft, seq=p + ref)
    tight = SpecDecoder(target, draft, max_len=len(p) + 108 + 8 + 2, policy=HeuristicK(k_init=1, k_max=16))
    with pytest.raises(ValueError, match="exceed max_len"):
        tight.generate([p], 108)
    roomy = SpecDecoder(target, draft, max_len=len(p) + 108 + 17 + 2, policy=HeuristicK(k_init=1, k_max=16))
    got = roomy.generate([p], 108)
    assert got.tokens[0] == ref and max(r["k"] for r in roomy.policy.log) == 16


def test_a_custom_policys_draft_length_is_checked_each_cycle(target):
    """The constructor sizes the verify and max_len for the draft length a policy declares (choices, k_max
    or k; 8 when it declares none); a custom policy drafting past it was run anyway (seen with a 70-token
    draft of the shipped target: greedy output unlike plain decoding's, no error). Now the k is named."""
    from eagle3.tuner import _Policy

    class Always(_Policy):  # only the documented methods
        def __init__(self, k):
            super().__init__()
            self.n = k

        def choose_k(self):
            return self.n

    p = prompts(1)[0]
    ref = Decoder(target, max_len=128).generate([p], 20).tokens[0]
    assert (
        SpecDecoder(target, make_draft(target), max_len=128, policy=Always(8)).generate([p], 20).tokens[0]
        == ref
    )
    for k in (9, 70, -1):
        dec = SpecDecoder(target, make_draft(target), max_len=128, policy=Always(k))
        with pytest.raises(
            ValueError, match=rf"Always.choose_k\(\) returned k={k}: .* drafts of 0..8 tokens"
        ):
            dec.generate([p], 20)


def test_batched_chain_per_row_lengths(target):
    """Rows with different prompt lengths and different accepted lengths per cycle."""
    ps = prompts(3)
    refs = [Decoder(target, max_len=128).generate([p], 30).tokens[0] for p in ps]
    # a draft that agrees sometimes: the target's own weights perturbed a little is not available for a
    # draft head, so use an oracle for row 0's sequence; other rows get mostly rejections
    seq = ps[0] + refs[0]
    dec = SpecDecoder(target, make_draft(target, cls=OracleDraft, seq=seq), max_len=128, policy=FixedK(4))
    got = dec.generate(ps, 30)
    assert got.tokens == refs
    rows = list(zip(*got.stats["spec"].accepted_rows))
    assert max(rows[0]) == 4 and max(rows[1]) < 4  # rows really accepted different lengths


def test_on_output_streams_exactly_the_returned_tokens(target):
    """on_output's pieces join up to each row's output, cut at a stop token and at the budget, while a
    cycle may emit past both (on_cycle sees those); the prefill's token comes first."""
    ps = prompts(2)
    ref = Decoder(target, max_len=128).generate(ps, 30).tokens
    seq = ps[0] + ref[0]
    stop = [ref[0][17]]  # row 0 stops inside an accepted run of the oracle
    for tree in (None, TreeConfig(3, 2, 6)):
        rows = ps if tree is None else ps[:1]
        dec = SpecDecoder(
            target, make_draft(target, cls=OracleDraft, seq=seq), max_len=128, policy=FixedK(4), tree=tree
        )
        pieces, cycles = [], []
        got = dec.generate(rows, 30, stop_ids=stop, on_output=pieces.append, on_cycle=cycles.append)
        joined = [sum((p[b] for p in pieces), []) for b in range(len(rows))]
        assert joined == got.tokens and len(pieces) == len(cycles) + 1
        assert got.tokens[0] == ref[0][: ref[0].index(stop[0]) + 1]
        assert sum(map(len, (c[0] for c in cycles))) + 1 > len(
            got.tokens[0]
        )  # the control: cycles ran past it
        # the stats count what reached the output: per row, 1 (the prefill's) + accepted + 1 per cycle it ran,
        # less the target tokens cut (a row's last cycle's, at most)
        spec = got.stats["spec"]
        ran = [[] for _ in rows]
        for cycle in spec.accepted_rows:
            still = [b for b in range(len(rows)) if 1 + sum(ran[b]) < len(got.tokens[b])]
            assert len(cycle) == len(still)
            for b, a in zip(still, cycle):
                ran[b].append(a + 1)
        over = [1 + sum(r) - len(t) for r, t in zip(ran, got.tokens)]
        assert set(over) <= {0, 1} and sum(over) == spec.target_cut
        assert spec.tau == sum(len(t) - 1 for t in got.tokens) / sum(map(len, ran)) and spec.accepted[-1] >= 0
        # row 0's verify accepted accepted + cut (the acceptance rates per draft position read that): the
        # cycle that met the stop token cut the rest of its accepted run
        last = len(ran[0]) - 1  # row 0's last cycle
        assert [a + x for a, x in zip(spec.accepted, spec.cut)][: last + 1] == [
            len(c[0]) - 1 for c in cycles
        ][: last + 1]
        assert spec.cut[last] > 0 and not any(spec.cut[:last])


def test_a_cut_cycle_counts_the_draft_tokens_it_kept_as_accepted(target):
    """An oracle draft (k 4: 5 tokens a cycle) and budgets that end inside the third cycle, after 2 of its 4
    draft tokens (budget 13) or all 4 (15): accepted counts the draft tokens that reached the output, cut
    those the budget cut, target_cut the cycle's own token. Before, the target's cut token was counted as a
    cut draft token (budget 13: accepted 1, cut 3; 15: accepted 3, cut 1), unlike highlight_html's count
    of the draft tokens in the output. tau (tokens emitted per cycle) and accepted + cut are as they were."""
    from eval.notebook_utils import run_record, token_sources
    from eval.report import summarise

    p = prompts(1)[0]
    ref = Decoder(target, max_len=128).generate([p], 20).tokens[0]
    dec = SpecDecoder(target, make_draft(target, cls=OracleDraft, seq=p + ref), max_len=128, policy=FixedK(4))
    for budget, kept in [(13, 2), (15, 4), (16, 4)]:
        cycles = []
        got = dec.generate([p], budget, on_cycle=cycles.append)
        st = got.stats["spec"]
        assert got.tokens[0] == ref[:budget] and st.cycles == 3
        assert st.accepted == [4, 4, kept] and st.cut == [0, 0, 4 - kept]
        assert st.target_cut == (budget < 16) and st.tau == (budget - 1) / 3
        drafted = sum(not t for _, t in token_sources(got.tokens[0], [c[0] for c in cycles]))
        assert drafted == sum(st.accepted)
        assert summarise([run_record("m", "p", got, peak_mb=0.0)])[0].tau == st.tau


def test_batch_rows_that_finish_early_stay_frozen(target):
    """Row 0 (an oracle draft: 5 tokens a cycle) stops early while row 1 decodes on: the batch ends when
    every row is done (at a stop token or the budget), and row 0's caches keep their length meanwhile, so a
    long budget cannot overflow them (it did: a finished row kept growing with every cycle)."""
    ps = prompts(2)
    ref = Decoder(target, max_len=128).generate(ps, 60).tokens
    stop = [ref[0][6]]
    want = [Decoder(target, max_len=128).generate([p], 60, stop_ids=stop).tokens[0] for p in ps]
    assert len(want[0]) <= 7 and len(want[1]) > 30  # the control: the rows really end far apart
    dec = SpecDecoder(
        target, make_draft(target, cls=OracleDraft, seq=ps[0] + ref[0]), max_len=128, policy=FixedK(4)
    )
    got = dec.generate(ps, 60, stop_ids=stop)
    assert got.tokens == want
    assert int(dec.tcache.lengths[0]) <= len(ps[0]) + len(want[0]) + 4  # not one slot per later cycle
    assert all(len(r) == 1 for r in got.stats["spec"].accepted_rows[-3:])  # only row 1's counted at the end


def test_stop_ids_as_a_tensor_or_an_array_stop_both_decoders(target):
    """A tensor's (or numpy array's) elements hash by identity: `set(stop_ids)` never held a token id, and
    both decoders ran on to the budget (seen: 30 of 30 tokens where a list stops at 6)."""
    import numpy as np

    p = prompts(1)[0]
    ref = Decoder(target, max_len=128).generate([p], 30).tokens[0]
    stop = [ref[6]]
    want = ref[: ref.index(stop[0]) + 1]
    assert len(want) < 30  # the control: a list stops it
    dec = Decoder(target, max_len=128)
    spec = SpecDecoder(target, make_draft(target), max_len=128, policy=FixedK(3))
    for given in (torch.tensor(stop), np.array(stop), torch.tensor(stop[0])):
        assert dec.generate([p], 30, stop_ids=given).tokens[0] == want
        assert spec.generate([p], 30, stop_ids=given).tokens[0] == want


def test_tree_for_sampling_is_cut_to_two_children_and_the_budget():
    tree = TreeConfig(3, 4, 12)
    assert tree.for_sampling(None) is tree and tree.for_sampling(SamplingParams()) is tree
    assert tree.for_sampling(SamplingParams(temperature=0.7)) == TreeConfig(
        2, 2, 6
    )  # 2 + 4 <= 12 < 2 + 4 + 8
    assert TreeConfig(5, 8, 48).for_sampling(SamplingParams(temperature=1.0)) == TreeConfig(4, 2, 30)


def test_sampling_with_a_tree_through_the_api_verifies_the_cut_tree(target):
    """Only the CLIs cut a tree for sampling (TreeConfig.for_sampling); given to SpecDecoder, the uncut
    tree was verified whole, past total_tokens, which max_len and the 64-row verify limit were checked with
    (seen: tree 3,4,8 drafts 84 nodes a cycle: a KV cache overflow, 98 slots of max_len 96). Now the decoder
    cuts it: 2,2,6, whose 6 nodes fit."""
    p = prompts(1)[0]
    sampling = SamplingParams(0.8)
    assert TreeConfig(1, 2, 1).for_sampling(sampling) == TreeConfig(1, 1, 1)  # never past total_tokens
    for tree, nodes in [(TreeConfig(3, 4, 8), {6}), ([TreeConfig(3, 4, 8), TreeConfig(1, 3, 3)], {6, 2})]:
        dec = SpecDecoder(target, make_draft(target), max_len=96, tree=tree)
        st = dec.generate([p], 24, sampling, generator=torch.Generator().manual_seed(0)).stats["spec"]
        assert set(st.tree_nodes) == nodes and set(st.draft_lengths) == {n.bit_length() - 1 for n in nodes}


@pytest.mark.parametrize("k", [1, 4, 7])
def test_oracle_draft_always_accepted_chain(target, k):
    p = prompts(1)[0]
    ref = Decoder(target, max_len=128).generate([p], 48).tokens[0]
    dec = SpecDecoder(target, make_draft(target, cls=OracleDraft, seq=p + ref), max_len=128, policy=FixedK(k))
    got = dec.generate([p], 48)
    assert got.tokens[0] == ref
    acc = got.stats["spec"].accepted
    assert all(a == k for a in acc[:-1])  # every cycle but possibly the last accepts all k


def test_oracle_draft_always_accepted_tree(target):
    p = prompts(1)[0]
    ref = Decoder(target, max_len=128).generate([p], 48).tokens[0]
    tree = TreeConfig(depth=4, top_k=3, total_tokens=12)
    dec = SpecDecoder(target, make_draft(target, cls=OracleDraft, seq=p + ref), max_len=160, tree=tree)
    got = dec.generate([p], 48)
    assert got.tokens[0] == ref
    assert all(a == 4 for a in got.stats["spec"].accepted[:-1])


def exact_marginals(t, prompt, sampling, V):
    """Exact distributions of the 2nd and 3rd generated tokens (the first two that speculative cycles
    emit; the 1st comes from the prefill)."""
    assert V == t.config.vocab_size
    return tuple(exact_joint(t, prompt, sampling, 2)[1:3])


def empirical(tokens, V):
    return torch.bincount(torch.tensor(tokens), minlength=V).float() / len(tokens)


# N rows: E[TV] <= 0.5 * sqrt(V / N) = 0.037 (Cauchy-Schwarz on the multinomial deviations) and
# McDiarmid adds sqrt(ln(1/delta) / (2N)) = 0.034 at delta = 1e-3: bound 0.075 for N = 3000, V = 16.
N_ROWS, V_SMALL, TV_BOUND = 3000, 16, 0.075


def accept_all(draft_tokens, draft_probs, target_probs, generator=None, lengths=None):
    """A wrong chain verification rule (negative control): accept every draft token, then sample the bonus."""
    k = draft_tokens.shape[1]
    return torch.full_like(draft_tokens[:, 0], k), torch.multinomial(
        target_probs[:, k], 1, generator=generator
    )[:, 0]


class BigramDraft(Eagle3Draft):
    """A draft that agrees with the target often enough for every acceptance length to occur: its state is the
    embedding of the token it is given, its logits the target's after the test's prompt and that token, with
    noise, over a draft vocabulary that leaves target tokens out (the random drafts accept almost nothing at
    these sizes: 2,939 of 3,000 first cycles accepted no token, and none the bonus)."""

    def __init__(self, cfg, embed: torch.Tensor, table: torch.Tensor):
        super().__init__(cfg)
        self.E, self.table = embed, table

    def forward(self, embeds, hidden, positions, cache=None, mask=None, tree_mask=None):
        if cache is not None:
            cache.advance(hidden.shape[1])
        return embeds.clone()

    def logits(self, h):
        return self.table[(h[..., None, :] == self.E).all(-1).float().argmax(-1)]


SAMPLING_PROMPT = [3, 7, 1, 9, 4]
DRAFT_IDS = [i for i in range(V_SMALL) if i not in (2, 5, 9, 13)]  # 12 of the 16 target tokens


def bigram_draft(t, noise=0.5, seed=7) -> BigramDraft:
    dc = DraftConfig.for_target(t.config, draft_vocab_size=len(DRAFT_IDS), feature_layers=FEATURES)
    with torch.no_grad():
        x = torch.tensor([SAMPLING_PROMPT + [v] for v in range(V_SMALL)])
        table = t(x).logits[:, -1][:, DRAFT_IDS]
    table = table + noise * torch.randn(table.shape, generator=torch.Generator().manual_seed(seed))
    d = BigramDraft(dc, t.model.embed_tokens.weight.detach(), table)
    ids, t2d = torch.tensor(DRAFT_IDS), torch.zeros(V_SMALL, dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab(ids - torch.arange(len(ids)), t2d)
    return d.eval()


def exact_joint(t, prompt, sampling, n: int) -> list[torch.Tensor]:
    """The exact marginal of each of the first n + 1 generated tokens, and the joint of the 2nd and 3rd [V, V]
    (enumerating the V^n prefixes)."""
    from maverick.sampling import logits_to_probs

    V = t.config.vocab_size
    with torch.no_grad():
        joint = logits_to_probs(t(torch.tensor([prompt])).logits[0, -1], sampling)  # [V]
        margs, seqs = [joint], torch.arange(V)[:, None]
        for j in range(1, n + 1):
            x = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], 1)
            joint = (joint.reshape(-1, 1) * logits_to_probs(t(x).logits[:, -1], sampling)).reshape(-1)
            margs.append(joint.view(*[V] * (j + 1)).sum(tuple(range(j))))
            if j == 2:
                pair = joint.view(V, V, V).sum(0)
            seqs = torch.cat([seqs.repeat_interleave(V, 0), torch.arange(V).repeat(len(seqs))[:, None]], 1)
    return margs + [pair]


def _bonus_from_q(draft_tokens, draft_probs, target_probs, generator=None, lengths=None):
    """Wrong (a control): when every draft token is accepted, the bonus drawn from the last draft q, not p."""
    n, nxt = real_verify_chain(draft_tokens, draft_probs, target_probs, generator, lengths)
    k = draft_tokens.shape[1]
    return n, torch.where(
        n == k, torch.multinomial(draft_probs[:, k - 1].float(), 1, generator=generator)[:, 0], nxt
    )


def _target_on_reject(draft_tokens, draft_probs, target_probs, generator=None, lengths=None):
    """Wrong (a control): at a rejection the next token drawn from p itself, not from the residual."""
    n, _ = real_verify_chain(draft_tokens, draft_probs, target_probs, generator, lengths)
    p_n = target_probs.float().gather(1, n[:, None, None].expand(-1, 1, target_probs.shape[-1]))[:, 0]
    return n, torch.multinomial(p_n, 1, generator=generator)[:, 0]


# 20,000 rows: per token E[TV] <= 0.5 * sqrt(V / N) = 0.0141 (Cauchy-Schwarz on the multinomial deviations),
# McDiarmid adds sqrt(ln(1/delta) / (2N)) = 0.0131 at delta = 1e-3: 0.028; the pair's 256 cells: 0.070
N_JOINT, TV_TOKEN, TV_PAIR = 20000, 0.028, 0.070


@pytest.mark.parametrize(
    "sampling, controls",
    [
        (SamplingParams(1.0), (_bonus_from_q, _target_on_reject)),
        (SamplingParams(0.8, top_k=6, top_p=0.9), ()),
    ],
)
def test_sampling_is_lossless(sampling, controls, monkeypatch):
    """Chains of k = 2 over a draft vocabulary of 12 of the 16 tokens: every token of a cycle, the bonus
    included, and the joint of two within a cycle follow the target's exact distribution; each wrong rule fails."""
    t = make_target(std=0.6, seed=5, vocab_size=V_SMALL)
    d = bigram_draft(t)
    exact = exact_joint(t, SAMPLING_PROMPT, sampling, 3)

    def tvs():
        toks, first = [], []
        for seed in range(4):  # 4 x 5,000 rows
            dec, cycles = SpecDecoder(t, d, max_len=32, policy=FixedK(2)), []
            gen = dec.generate([SAMPLING_PROMPT] * (N_JOINT // 4), 4, sampling=sampling,
                               generator=torch.Generator().manual_seed(seed), on_cycle=cycles.append)  # fmt: skip
            toks, first = toks + gen.tokens, first + cycles[0]  # each row's first cycle
        x = torch.tensor(toks)  # [N, 4]: the prefill's token, then the first cycle's 1..3 and on
        got = [empirical(x[:, i].tolist(), V_SMALL) for i in range(4)]
        got.append(empirical((x[:, 1] * V_SMALL + x[:, 2]).tolist(), V_SMALL**2).view(V_SMALL, V_SMALL))
        accepted = torch.bincount(torch.tensor([len(e) - 1 for e in first]), minlength=3)
        return [0.5 * float((g - e).abs().sum()) for g, e in zip(got, exact)], accepted

    tv, accepted = tvs()
    assert max(tv[:4]) < TV_TOKEN and tv[4] < TV_PAIR, tv
    assert (accepted > 0.05 * N_JOINT).all(), accepted  # 0, 1 and 2 draft tokens accepted (2: a bonus token)
    for wrong in controls:
        monkeypatch.setattr(spec_mod, "verify_chain_sampling", wrong)
        assert max(tvs()[0][:4]) > TV_TOKEN, wrong.__name__


@pytest.mark.parametrize(
    "tree", [TreeConfig(depth=2, top_k=2, total_tokens=6), [TreeConfig(2, 2, 6), TreeConfig(1, 2, 2)]]
)
def test_tree_sampling_is_lossless(tree):
    """One tree, and tuned trees (each cycle's tree is picked from earlier cycles' times alone, so each
    cycle stays lossless whichever it drafts): the first cycle's tokens, the bonus included, over a draft that
    agrees often enough to accept whole paths."""
    sampling = SamplingParams(1.0)
    t = make_target(std=0.6, seed=5, vocab_size=V_SMALL)
    exact = exact_joint(t, SAMPLING_PROMPT, sampling, 3)
    dec = SpecDecoder(t, bigram_draft(t), max_len=64, tree=tree)
    g, toks, paths = torch.Generator().manual_seed(1), [], []
    for _ in range(1500):
        cycles = []
        toks.append(
            dec.generate([SAMPLING_PROMPT], 4, sampling=sampling, generator=g, on_cycle=cycles.append).tokens[
                0
            ]
        )
        paths.append(len(cycles[0][0]) - 1)
    x = torch.tensor(toks)
    # N = 1500: 0.5 * sqrt(16 / 1500) + sqrt(ln(1000) / 3000) = 0.052 + 0.048
    tv = [0.5 * float((empirical(x[:, i].tolist(), V_SMALL) - exact[i]).abs().sum()) for i in range(1, 4)]
    assert max(tv) < 0.10, tv
    assert (torch.bincount(torch.tensor(paths), minlength=3)[:3] > 0.05 * 1500).all()  # 0, 1, 2 accepted
    if isinstance(tree, list):
        assert min(dec.policy.tree_counts.values()) >= dec.policy.tree_min_trials  # both trees drafted


@pytest.mark.skipif(not supported(), reason=f"CPU engines refuse torch {torch.__version__}")
def test_compiled_draft_step_identical_and_compiles_once(target):
    """The compiled draft (on CPU one AOTInductor package with a dynamic row count, CompiledDraft): same
    output, and changing k neither recompiles nor needs a second package."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # other tests' compilations count there too
    p = prompts(1)[0]
    ref = Decoder(target, max_len=128).generate([p], 30).tokens[0]

    class Cycling(FixedK):  # a different k every cycle
        k_max = 6  # what the decoder sizes its cache and verify for (checked each cycle)

        def choose_k(self):
            self.k = 1 + (self.k + 2) % 6
            return self.k

    policy = Cycling(1)
    dec = SpecDecoder(target, make_draft(target), max_len=128, policy=policy, compile_draft=True)
    got = dec.generate([p], 30)
    assert got.tokens[0] == ref
    assert len(set(got.stats["spec"].draft_lengths)) > 1
    assert isinstance(dec.draft, CompiledDraft) and list(dec.draft._runners) == [1]  # one package, batch 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["tiny-moe", "tiny-dense"])
def test_greedy_identical_on_cuda(dtype, kind):
    """On the GPU too, chain (fixed and tuned k) and tree output equals plain decoding token for token
    (passed on an H200: 0 mismatches in 36 generations of 48 tokens)."""
    torch.manual_seed(0)
    t = make_target() if kind == "tiny-moe" else Llama4(get_config("tiny-dense"))
    if kind != "tiny-moe":
        t.init_weights(std=0.1)
    d = make_draft(t.eval()).to("cuda", dtype)
    t = t.to("cuda", dtype)
    for p in prompts(3):
        ref = Decoder(t, max_len=160).generate([p], 48).tokens[0]
        for kw in ({"policy": FixedK(3)}, {"policy": DraftLengthTuner()}, {"tree": TreeConfig(3, 3, 10)}):
            assert SpecDecoder(t, d, max_len=192, **kw).generate([p], 48).tokens[0] == ref, (p, kw)


def test_fp32_target_with_near_tied_logits_emits_plain_decodings_tokens():
    """This file's fp32 target passed the tests above only because its logits have no near-ties: with its
    lm_head rows in pairs ~2e-7 apart (relative), chain and tree decoding differed from plain decoding in 12
    of 12 generations (the fp32 linears and experts were not row-count safe; bf16 gave 0 of 12)."""
    t = make_target()
    with torch.no_grad():
        w = t.lm_head.weight
        w[1::2] = w[0::2] * (
            1 + 2e-7 * torch.randn(w[0::2].shape, generator=torch.Generator().manual_seed(0))
        )
    d = make_draft(t)
    for seed in range(3):
        p = prompts(1, lengths=(13,), seed=seed)[0]
        plain = Decoder(t, max_len=160).generate([p], 40).tokens[0]
        chain = SpecDecoder(t, d, max_len=160, policy=FixedK(4)).generate([p], 40).tokens[0]
        tree = SpecDecoder(t, d, max_len=200, tree=TreeConfig(3, 3, 10)).generate([p], 40).tokens[0]
        assert chain == plain and tree == plain, seed


def test_a_wide_trees_frontiers_are_sized_up_front(target):
    """A greedy tree writes (depth - 1) * top_k frontier nodes to the draft cache past the committed tokens:
    5,8,8 writes 32 where the check reserved total_tokens + 3 (11), so a request it accepted stopped on a KV
    cache overflow after 11 of 30 tokens. Now refused up front; with the room it asks for, plain decoding's."""
    p = prompts(1)[0]
    tree = TreeConfig(5, 8, 8)
    ref = Decoder(target, max_len=128).generate([p], 30).tokens[0]
    tight = SpecDecoder(target, make_draft(target), max_len=len(p) + 30 + 11, tree=tree)
    assert tight.room == 32 + 2
    with pytest.raises(ValueError, match="34 slots for a cycle's drafts exceed max_len"):
        tight.generate([p], 30)
    dec = SpecDecoder(target, make_draft(target), max_len=len(p) + 30 + tight.room, tree=tree)
    assert dec.generate([p], 30).tokens[0] == ref


@pytest.mark.skipif(not supported(), reason="the compiled draft needs torch >= 2.13 on CPU")
def test_a_compiled_draft_for_a_short_cache_exports(target):
    """A compiled draft exports its key span as a dynamic 2..slots // SPAN blocks: for max_len <= 96 that
    was 2..2, which torch.export refuses (a traceback at the first draft step)."""
    p = prompts(1)[0]
    ref = Decoder(target, max_len=96).generate([p], 20).tokens[0]
    dec = SpecDecoder(target, make_draft(target), max_len=96, policy=FixedK(3), compile_draft=True)
    assert dec.draft.slots == 3 * SPAN  # 96 + 32 rows in two blocks, and a third
    assert dec.generate([p], 20).tokens[0] == ref


@pytest.mark.parametrize("tree", [TreeConfig(12, 12, 40), TreeConfig(5, 8, 8), TreeConfig(3, 4, 12)])
def test_the_command_lines_room_holds_a_trees_cycle(target, tree):
    """eagle3.generate and eval.bench size their caches with spare_slots: it gave a tree total_tokens + 32
    (at least 128), and `--tree 12,12,40` stopped on a draft cache overflow at 58 of 60 tokens."""
    from eagle3.lookup import LookupConfig
    from eagle3.spec import spare_slots

    dec = SpecDecoder(target, make_draft(target), max_len=512, tree=tree, lookup=LookupConfig())
    assert dec.room <= spare_slots([tree])
