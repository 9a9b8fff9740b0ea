"""Tests for maverick.sampling and eagle3.sampling: exact greedy cases, hand-computed filters, and
losslessness.

Losslessness is tested statistically on a tiny bigram "language": V = 5 tokens, the target
p(.|prev) and the draft q(.|prev) are fixed random tables with q deliberately different from p
(total variation 0.33 at the context token). One speculative cycle (chain k = 3, or a depth-2 tree
with 3 children at the root and 2 under each child) is simulated from a fixed context in many
seeded trials; the first and second emitted tokens must follow p(.|ctx) and sum_x p(x|ctx) p(.|x).
"""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eagle3.sampling import (
    tree_attention_mask,
    tree_depths,
    verify_chain_greedy,
    verify_chain_sampling,
    verify_tree_greedy,
    verify_tree_sampling,
)
from maverick.sampling import SamplingParams, logits_to_probs, sample

V = 5
CTX = 0
K = 3
N_TRIALS = 20_000
_g = torch.Generator().manual_seed(3)
TARGET_LOGITS = torch.randn(V, V, generator=_g) * 1.5  # row = previous token
DRAFT_LOGITS = TARGET_LOGITS + torch.randn(V, V, generator=_g) * 1.5
PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.9, top_k=4, top_p=0.9)]
# depth-2 tree: root 0 -> children 1, 2, 3; node 1 -> 4, 5; node 2 -> 6, 7; node 3 -> 8, 9
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]


def _tv_bound(n: int, v: int = V, delta: float = 1e-3) -> float:
    """A (1 - delta)-probability bound on TV(empirical of n i.i.d. draws, truth) over v outcomes.

    E|p_hat_i - p_i| <= sqrt(p_i (1 - p_i) / n) (Jensen), and sum_i sqrt(p_i (1 - p_i)) <= sqrt(v - 1)
    (Cauchy-Schwarz), so E[TV] <= 0.5 sqrt((v - 1) / n). Changing one draw moves TV by at most 1/n,
    so McDiarmid gives P(TV > E[TV] + t) <= exp(-2 n t^2), i.e. t = sqrt(ln(1/delta) / (2n)).
    For n = 20,000 and v = 5: 0.0071 + 0.0131 = 0.0202. The draws are seeded, so the test is
    deterministic; delta says how unlucky a seed would have to be to fail a correct sampler.
    """
    return 0.5 * math.sqrt((v - 1) / n) + math.sqrt(math.log(1 / delta) / (2 * n))


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


def _empirical(x: torch.Tensor) -> torch.Tensor:
    assert (x >= 0).all(), "every trial must have emitted the token"
    return torch.bincount(x, minlength=V).float() / x.numel()


def _tables(params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    return logits_to_probs(TARGET_LOGITS, params), logits_to_probs(DRAFT_LOGITS, params)


def _exact(p_tab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return p_tab[CTX], p_tab[CTX] @ p_tab


# ----------------------------------------------------------------------------------------------
# logits_to_probs and sample


def test_logits_to_probs_hand_computed():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 3.0])
    # T = 1, top-3 keeps logits {3, 2, 1}: softmax = (0.6652, 0.2447, 0.0900); top-p 0.8 keeps the
    # first two (mass before the third is 0.9100 >= 0.8) -> renormalised = sigmoid(+-1).
    got = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.8))
    s1 = 1 / (1 + math.exp(-1))
    torch.testing.assert_close(got, torch.tensor([1 - s1, 0, 0, 0, s1]), atol=1e-6, rtol=0)
    # T = 2 halves the gaps: same support, sigmoid(+-0.5)
    got = logits_to_probs(logits, SamplingParams(temperature=2.0, top_k=3, top_p=0.8))
    s5 = 1 / (1 + math.exp(-0.5))
    torch.testing.assert_close(got, torch.tensor([1 - s5, 0, 0, 0, s5]), atol=1e-6, rtol=0)
    # top-k only: softmax over {3, 2, 1}
    e = torch.tensor([math.e**2, math.e, 0, 0, math.e**3])
    got = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    torch.testing.assert_close(got, e / e.sum(), atol=1e-6, rtol=0)
    # filters off: plain softmax(logits / T); greedy: one-hot of the argmax
    got = logits_to_probs(logits[None].double(), SamplingParams(temperature=0.5))
    assert got.dtype == torch.float32 and got.shape == (1, 5)
    torch.testing.assert_close(got[0], torch.softmax(logits / 0.5, -1))
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams()), torch.tensor([0.0, 0, 0, 0, 1]))
    # the order, HF's: temperature before top-p. At T = 2 the top-p 0.8 nucleus is {3, 2, 1} (mass before the
    # third 0.689); top-p before the temperature (llama.cpp's order) would keep {3, 2} (0.636 before the second)
    got = logits_to_probs(logits, SamplingParams(temperature=2.0, top_p=0.8))
    e = torch.tensor([math.e**1, math.e**0.5, 0, 0, math.e**1.5])
    torch.testing.assert_close(got, e / e.sum(), atol=1e-6, rtol=0)


def test_logits_to_probs_top_p_keeps_the_top_token_and_ties_in_top_k():
    logits = torch.tensor([[5.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    got = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.01))
    torch.testing.assert_close(got[0], torch.tensor([1.0, 0, 0, 0]))
    assert (got[1] > 0).sum() == 1 and got[1].sum().item() == pytest.approx(1.0)
    # top_k = 2 with a three-way tie at the k-th value keeps all three (HF semantics)
    got = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(got[1], torch.tensor([1 / 3, 1 / 3, 1 / 3, 0]))


def test_a_tiny_temperature_is_the_argmax_not_nan():
    """--temperature 1e-39 divided the logits to inf, and softmax made NaN (a traceback at the first draw); bf16
    logits too."""
    logits = torch.tensor([[2.0, 1.0, 3.0, -1.0], [0.5, 0.5, 0.0, 0.0]])
    for t in (1e-39, 1e-45, 1e-30, 1e-46, 1e-300, 5e-324):  # below ~7e-46 float32 rounds t to 0
        probs = logits_to_probs(logits, SamplingParams(temperature=t))
        assert torch.equal(probs, torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 0.5, 0.0, 0.0]])), t
        assert torch.equal(logits_to_probs(logits.bfloat16(), SamplingParams(temperature=t)), probs), t


def test_sampling_params_reject_bad_values():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_sample_is_seedable_and_shaped():
    probs = torch.softmax(torch.randn(3, 4, 7, generator=torch.Generator().manual_seed(1)), -1)
    a = sample(probs, torch.Generator().manual_seed(5))
    b = sample(probs, torch.Generator().manual_seed(5))
    assert a.shape == (3, 4) and a.dtype == torch.long and torch.equal(a, b)
    one_hot = torch.zeros(6, 7)
    one_hot[torch.arange(6), torch.tensor([0, 6, 3, 3, 2, 1])] = 1
    assert sample(one_hot).tolist() == [0, 6, 3, 3, 2, 1]


# ----------------------------------------------------------------------------------------------
# greedy chain and tree: exact


def _logits_with_argmax(top: list[list[int]], v: int = 8) -> torch.Tensor:
    t = torch.tensor(top)
    noise = torch.rand(*t.shape, v, generator=torch.Generator().manual_seed(0))
    return noise + 5.0 * torch.nn.functional.one_hot(t, v)


def test_verify_chain_greedy_rows_with_different_lengths():
    draft = torch.tensor([[1, 2, 3], [1, 2, 0], [1, 2, 3], [7, 7, 7]])
    target = _logits_with_argmax([[1, 2, 3, 4], [1, 5, 0, 2], [4, 2, 3, 1], [7, 7, 6, 0]])
    n, nxt = verify_chain_greedy(draft, target)
    # row 1: position 2 matches again after the mismatch at 1 but must not count
    assert n.tolist() == [3, 1, 0, 2]
    assert nxt.tolist() == [4, 5, 4, 6]
    assert n.dtype == torch.long and nxt.dtype == torch.long
    # k = 0: nothing to verify, the next token is the target's argmax
    n0, nxt0 = verify_chain_greedy(draft[:, :0], target[:, :1])
    assert n0.tolist() == [0, 0, 0, 0] and nxt0.tolist() == [1, 1, 4, 7]


def test_verify_chain_sampling_with_one_hot_probs_equals_greedy():
    gen = torch.Generator().manual_seed(0)
    draft = torch.randint(0, 8, (64, 4), generator=gen)
    target_logits = torch.randn(64, 5, 8, generator=gen)
    target_logits[:32, :4].scatter_(-1, draft[:32, :, None], 10.0)  # half the rows agree a lot
    greedy = SamplingParams()
    p = logits_to_probs(target_logits, greedy)
    q = torch.nn.functional.one_hot(draft, 8).float()
    n_s, nxt_s = verify_chain_sampling(draft, q, p, gen)
    n_g, nxt_g = verify_chain_greedy(draft, target_logits)
    assert torch.equal(n_s, n_g) and torch.equal(nxt_s, nxt_g)
    assert set(n_g.tolist()) >= {0, 4}


def test_verify_chain_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match="target_logits"):
        verify_chain_greedy(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="draft_probs"):
        verify_chain_sampling(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 4), torch.zeros(2, 4, 5))


HAND_PARENTS = [-1, 0, 0, 1, 1, 2, 4]
HAND_TOKENS = torch.tensor([9, 3, 5, 2, 7, 1, 0])


@pytest.mark.parametrize(
    ("argmax", "path", "next_token"),
    [
        ([5, 0, 1, 0, 0, 6, 0], [2, 5], 6),  # root -> node 2 (tok 5) -> node 5 (tok 1), leaf
        ([3, 7, 0, 0, 9, 0, 0], [1, 4], 9),  # root -> 1 -> 4, child 6 (tok 0) rejected
        ([3, 7, 0, 0, 0, 0, 8], [1, 4, 6], 8),  # the full depth-3 path plus the bonus
        ([4, 0, 0, 0, 0, 0, 0], [], 4),  # nothing accepted
    ],
)
def test_verify_tree_greedy_hand_made(argmax, path, next_token):
    logits = _logits_with_argmax(argmax, v=10)
    acc, nxt = verify_tree_greedy(HAND_TOKENS, torch.tensor(HAND_PARENTS), logits)
    assert acc.tolist() == path and acc.dtype == torch.long
    assert nxt.dim() == 0 and nxt.item() == next_token


def test_verify_tree_greedy_takes_the_first_of_duplicate_siblings():
    tokens = torch.tensor([0, 4, 4, 2])  # nodes 1 and 2 both carry token 4; node 3 hangs under 2
    acc, nxt = verify_tree_greedy(tokens, [-1, 0, 0, 2], _logits_with_argmax([4, 1, 2, 3], v=6))
    assert acc.tolist() == [1] and nxt.item() == 1


def test_tree_mask_and_depths():
    mask = tree_attention_mask(torch.tensor(HAND_PARENTS))
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0, 0],
            [1, 1, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0],
            [1, 0, 1, 0, 0, 1, 0],
            [1, 1, 0, 0, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
    assert tree_depths(HAND_PARENTS).tolist() == [0, 1, 1, 2, 2, 2, 3]
    # a chain of 37 nodes needs several doubling rounds: row i sees exactly nodes 0..i
    chain = [-1] + list(range(36))
    assert torch.equal(tree_attention_mask(chain), torch.ones(37, 37, dtype=torch.bool).tril())
    assert tree_depths(chain).tolist() == list(range(37))


def test_tree_rejects_bad_parents():
    with pytest.raises(ValueError, match=r"parents\[0\]"):
        tree_attention_mask([0, 0])
    with pytest.raises(ValueError, match=r"parents\[2\] = 2"):
        tree_depths([-1, 0, 2])
    with pytest.raises(ValueError, match="tokens"):
        verify_tree_greedy(torch.tensor([1, 2]), [-1, 0, 1], torch.zeros(3, 4))


# ----------------------------------------------------------------------------------------------
# no host syncs in the chain verifiers


class _SyncSpy(TorchDispatchMode):
    """Records aten ops that read device data on the host or have data-dependent output shapes."""

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "unique", "equal")

    def __init__(self):
        super().__init__()
        self.hits: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if any(s in name for s in self.SYNCING):
            self.hits.append(name)
        return func(*args, **(kwargs or {}))


def test_chain_verifiers_make_no_host_sync():
    gen = torch.Generator().manual_seed(0)
    draft = torch.randint(0, 8, (4, 3), generator=gen)
    q = torch.softmax(torch.randn(4, 3, 8, generator=gen), -1)
    p = torch.softmax(torch.randn(4, 4, 8, generator=gen), -1)
    with _SyncSpy() as spy:
        verify_chain_greedy(draft, p.log())
        verify_chain_sampling(draft, q, p, gen)
    assert spy.hits == []
    with _SyncSpy() as control:  # the spy does see a sync when there is one
        p.sum().item()
    assert control.hits == ["_local_scalar_dense"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chain_verifiers_make_no_host_sync_on_cuda():
    gen = torch.Generator(device="cuda").manual_seed(0)
    draft = torch.randint(0, 1000, (8, 5), device="cuda", generator=gen)
    q = torch.softmax(torch.randn(8, 5, 1000, device="cuda", generator=gen), -1)
    p = torch.softmax(torch.randn(8, 6, 1000, device="cuda", generator=gen), -1)
    verify_chain_sampling(draft, q, p, gen)  # warm-up: lazy initialisation may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        verify_chain_greedy(draft, p)
        verify_chain_sampling(draft, q, p, gen)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cpu_generator_samples_a_cuda_model_with_the_cpu_stream():
    """The commands seed a CPU generator (--seed); with the model on a GPU, multinomial and rand refused
    it ("Expected a 'cuda' device type for generator"). Now it draws on its own device: the CPU's draws."""
    from maverick.sampling import sample

    g = torch.Generator().manual_seed(0)
    draft = torch.randint(0, 1000, (8, 5), generator=g)
    q = torch.softmax(torch.randn(8, 5, 1000, generator=g), -1)
    p = torch.softmax(torch.randn(8, 6, 1000, generator=g), -1)
    on_cpu = verify_chain_sampling(draft, q, p, torch.Generator().manual_seed(1))
    on_gpu = verify_chain_sampling(draft.cuda(), q.cuda(), p.cuda(), torch.Generator().manual_seed(1))
    assert all(torch.equal(a, b.cpu()) for a, b in zip(on_cpu, on_gpu))
    assert torch.equal(
        sample(p, torch.Generator().manual_seed(2)), sample(p.cuda(), torch.Generator().manual_seed(2)).cpu()
    )


# ----------------------------------------------------------------------------------------------
# losslessness: chain


def _always_accept(draft, q, p, gen):
    """Negative control: keeps every draft token (what a verifier that ignores p/q would do)."""
    n = torch.full((draft.shape[0],), draft.shape[1], dtype=torch.long)
    return n, sample(p[:, -1].float(), gen)


def _chain_cycle(ctx, p_tab, q_tab, gen, verify):
    """One speculative cycle per row from context tokens ctx [T]: (first [T], second [T] or -1)."""
    drafts, cur = [], ctx
    for _ in range(K):
        cur = sample(q_tab[cur], gen)
        drafts.append(cur)
    draft = torch.stack(drafts, 1)  # [T, K]
    prev = torch.cat([ctx[:, None], draft], 1)  # [T, K+1]: the token each position conditions on
    n, nxt = verify(draft, q_tab[prev[:, :K]], p_tab[prev], gen)
    first = torch.where(n >= 1, draft[:, 0], nxt)
    second = torch.where(n >= 2, draft[:, 1], torch.where(n == 1, nxt, -1))
    return first, second, n


def _chain_two_tokens(p_tab, q_tab, verify, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.full((N_TRIALS,), CTX, dtype=torch.long)
    first, second, n = _chain_cycle(ctx, p_tab, q_tab, gen, verify)
    # rows that emitted only one token get their second token from the next cycle
    first_next, _, _ = _chain_cycle(first, p_tab, q_tab, gen, verify)
    return first, torch.where(second < 0, first_next, second), n


@pytest.mark.parametrize("params", PARAMS, ids=["T1", "T0.9-topk4-topp0.9"])
def test_chain_sampling_is_lossless(params):
    p_tab, q_tab = _tables(params)
    assert _tv(p_tab[CTX], q_tab[CTX]) > 0.3  # the draft really is wrong
    first, second, n = _chain_two_tokens(p_tab, q_tab, verify_chain_sampling)
    # every accepted length occurs often, so all code paths (bonus included) are exercised
    assert (torch.bincount(n, minlength=K + 1).float() / N_TRIALS).min() > 0.05
    exact_first, exact_second = _exact(p_tab)
    bound = _tv_bound(N_TRIALS)
    assert bound == pytest.approx(0.0202, abs=1e-4)
    assert _tv(_empirical(first), exact_first) < bound
    assert _tv(_empirical(second), exact_second) < bound


def test_chain_negative_control_violates_the_bound():
    p_tab, q_tab = _tables(PARAMS[0])
    first, second, _ = _chain_two_tokens(p_tab, q_tab, _always_accept)
    exact_first, exact_second = _exact(p_tab)
    bound = _tv_bound(N_TRIALS)
    assert _tv(_empirical(first), exact_first) > 5 * bound  # the first token follows q, TV ~ 0.33
    assert _tv(_empirical(second), exact_second) > 2 * bound


# ----------------------------------------------------------------------------------------------
# losslessness: tree


def _tree_tokens(ctx: torch.Tensor, q_tab: torch.Tensor, gen) -> torch.Tensor:
    """Tokens [T, 10] of TREE_PARENTS trees: i.i.d. children drawn from the draft at each node."""
    level1 = sample(q_tab[ctx][:, None].expand(-1, 3, -1), gen)  # [T, 3]
    level2 = sample(q_tab[level1][:, :, None].expand(-1, -1, 2, -1), gen)  # [T, 3, 2]
    return torch.cat([ctx[:, None], level1, level2.flatten(1)], 1)


def _tree_emit(tokens: torch.Tensor, p_tab, q_tab, gen) -> list[list[int]]:
    out = []
    for tok in tokens:
        acc, nxt = verify_tree_sampling(tok, TREE_PARENTS, q_tab[tok], p_tab[tok], gen)
        out.append(tok[acc].tolist() + [nxt.item()])
    return out


@pytest.mark.parametrize("params", PARAMS, ids=["T1", "T0.9-topk4-topp0.9"])
def test_tree_sampling_is_lossless(params):
    p_tab, q_tab = _tables(params)
    gen = torch.Generator().manual_seed(1)
    ctx = torch.full((N_TRIALS,), CTX, dtype=torch.long)
    emitted = _tree_emit(_tree_tokens(ctx, q_tab, gen), p_tab, q_tab, gen)
    lengths = torch.bincount(torch.tensor([len(e) for e in emitted]), minlength=4)[1:].float() / N_TRIALS
    assert lengths.min() > 0.05  # 0, 1 and 2 accepted all occur often
    first = torch.tensor([e[0] for e in emitted])
    short = [i for i, e in enumerate(emitted) if len(e) == 1]
    second = torch.tensor([e[1] if len(e) > 1 else -1 for e in emitted])
    again = _tree_emit(_tree_tokens(first[short], q_tab, gen), p_tab, q_tab, gen)
    second[short] = torch.tensor([e[0] for e in again])
    exact_first, exact_second = _exact(p_tab)
    bound = _tv_bound(N_TRIALS)
    assert _tv(_empirical(first), exact_first) < bound
    assert _tv(_empirical(second), exact_second) < bound


def test_tree_negative_controls_violate_the_bound():
    """Two wrong tree verifiers, vectorised over trials at the root (first emitted token only)."""
    p_tab, q_tab = _tables(PARAMS[0])
    gen = torch.Generator().manual_seed(2)
    ctx = torch.full((N_TRIALS,), CTX, dtype=torch.long)
    children = _tree_tokens(ctx, q_tab, gen)[:, 1:4]  # [T, 3] i.i.d. from q(.|ctx)
    p, q = p_tab[CTX], q_tab[CTX]
    bound = _tv_bound(N_TRIALS)
    # 1) always accept the first child: the first token follows q
    assert _tv(_empirical(children[:, 0]), p) > 5 * bound
    # 2) the classic bug: every sibling checked against the ORIGINAL p instead of the residual
    u = torch.rand(N_TRIALS, 3, generator=gen)
    accept = u * q[children] < p[children]  # [T, 3]
    residual = (p - q).clamp_min(0)
    fallback = sample(residual.expand(N_TRIALS, V), gen)
    first_acc = torch.where(accept.any(1), accept.long().argmax(1), 0)
    first = torch.where(accept.any(1), children.gather(1, first_acc[:, None]).squeeze(1), fallback)
    assert _tv(_empirical(first), p) > 5 * bound  # ~0.23


def test_tree_without_children_samples_the_target():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.1, 0.6, 0.3]])
    draws = [verify_tree_sampling(torch.tensor([2]), [-1], p, p, gen) for _ in range(2000)]
    assert all(a.numel() == 0 for a, _ in draws)
    freq = torch.bincount(torch.stack([n for _, n in draws]), minlength=3).float() / 2000
    assert _tv(freq, p[0]) < _tv_bound(2000, v=3)


def test_chain_verifiers_respect_per_row_lengths():
    """Padding past a row's draft length is never accepted, even where it equals the target's choice, and
    the next token comes from the position right after the row's draft."""
    logits = torch.full((2, 4, 8), -5.0)
    top = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]])
    logits.scatter_(-1, top[..., None], 5.0)
    draft = torch.tensor([[1, 2, 3], [5, 6, 7]])  # both rows fully match the target
    n, nxt = verify_chain_greedy(draft, logits)
    assert n.tolist() == [3, 3] and nxt.tolist() == [4, 0]
    n, nxt = verify_chain_greedy(draft, logits, torch.tensor([1, 3]))
    assert n.tolist() == [1, 3] and nxt.tolist() == [2, 0]
    # sampling with one-hot p and q: deterministic; the bonus after a short row is p at its length
    p = torch.softmax(logits * 100, -1)
    q = torch.nn.functional.one_hot(draft, 8).float()
    n, nxt = verify_chain_sampling(draft, q, p, torch.Generator().manual_seed(0), torch.tensor([2, 0]))
    assert n.tolist() == [2, 0] and nxt.tolist() == [3, 5]
