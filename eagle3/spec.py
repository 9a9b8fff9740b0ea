"""Speculative decoding with an EAGLE-3 draft: chain (batched, per-row accepted lengths) and EAGLE-2
dynamic trees (batch 1), greedy or lossless sampling, fixed or tuned draft length.

One cycle, chain (B rows; row b has n_b committed tokens in the target cache and `last_b` waiting):
  draft   d_1..d_k from the draft's state, one draft step per token (its own small KV cache);
  verify  ONE target forward over [last, d_1..d_k] at positions n..n+k, returning logits and the
          EAGLE-3 features of all k+1 positions;
  accept  a_b tokens (greedy: longest prefix equal to the target argmax; sampling: min(1, p/q) with a
          residual resample, eagle3/sampling.py) plus one correction / bonus token y_b;
  commit  target cache -> n + a + 1 (rollback of the rejected tail); draft cache -> n, then the draft
          catches up on pairs (target feature at n+j, token at n+j+1) for j = 0..a, the features of
          what was accepted, which puts it where the next cycle starts.

Prompt lookup (`lookup=LookupConfig()`): each cycle, a row whose last tokens occurred earlier in its
sequence (prompt + output) drafts the tokens that followed them (eagle3/lookup.py) instead of running
the draft; rows without a match use the EAGLE-3 draft (with `tree`, a copied draft is verified as a
chain and the other cycles draft trees). Rows of one batch may mix the two: the
verify pass takes the longest draft and each row accepts only within its own. With a `datastore`
(eagle3/datastore.py) a row whose sequence has no match tries the store of the target's own answers next:
retrieval drafts (REST) by copying what the target wrote after the same words elsewhere.

Trees (EAGLE-2): expand `depth` levels, each level the `top_k` best nodes (by cumulative draft log-prob)
get `top_k` children; the best `total_tokens` nodes are verified in one target pass with a tree
attention mask; the accepted path is compacted in the target cache. At temperature > 0 the tree is
first cut by TreeConfig.for_sampling to a full 2-ary tree within `total_tokens`, whose children are
i.i.d. draft samples (no value-dependent pruning: that is what keeps multi-candidate rejection sampling
lossless).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3.compiled_draft import CompiledDraft
from eagle3.datastore import Datastore
from eagle3.draft import Eagle3Draft, check_draft_fits, embeddings_note
from eagle3.lookup import LookupConfig, NgramIndex
from eagle3.sampling import (
    tree_attention_mask,
    verify_chain_greedy,
    verify_chain_sampling,
    verify_tree_greedy,
    verify_tree_sampling,
)
from eagle3.tuner import DraftLengthTuner, FixedK, RankAgreed
from maverick.cli import UserError
from maverick.compiled import for_engine
from maverick.generate import Generation, check_lengths, decode_window, prefill, stop_set
from maverick.model import EXACT_ATTENTION_MAX_T, Llama4
from maverick.sampling import SamplingParams, logits_to_probs, sample


@dataclass(frozen=True)
class TreeConfig:
    depth: int = 5
    top_k: int = 8
    total_tokens: int = 48  # draft nodes verified per cycle (the root excluded)

    def __post_init__(self) -> None:
        if not 1 <= self.depth <= self.total_tokens or self.top_k < 1:  # T nodes reach depth T at most
            raise UserError(
                f"tree {self}: needs 1 <= depth <= total_tokens and top_k >= 1 (depth, top_k, total_tokens)"
            )

    def __str__(self) -> str:
        """D,K,T: how the command lines write a tree (eagle3.generate --tree, eval.bench --tree-candidates)."""
        return f"{self.depth},{self.top_k},{self.total_tokens}"

    @property
    def draft_slots(self) -> int:
        """The draft-cache slots an expansion may write past the committed tokens: a draft call over each
        level's frontier but the last's, top_k nodes each when greedy (a wide tree's (depth - 1) * top_k can
        pass total_tokens), every node when sampled (at most total_tokens in all)."""
        return max((self.depth - 1) * self.top_k, self.total_tokens)

    def for_sampling(self, sampling: SamplingParams | None) -> TreeConfig:
        """The tree to draft under `sampling`: this one when greedy. Sampling verifies a full tree (every node
        drawn, none pruned: pruning by value would bias the output), so at temperature > 0 the tree is cut to
        2 children per node (1 where total_tokens is 1) and the depth at which its node count still fits in
        total_tokens: never more nodes than total_tokens, which SpecDecoder's checks were made with. A cut
        tree cuts to itself."""
        if sampling is None or sampling.greedy:
            return self
        k = min(2, self.top_k, self.total_tokens)
        depth = 1
        while depth < self.depth and sum(k**d for d in range(1, depth + 2)) <= self.total_tokens:
            depth += 1
        return TreeConfig(depth, k, sum(k**d for d in range(1, depth + 1)))


def spare_slots(trees: Sequence[TreeConfig] = ()) -> int:
    """The cache slots past prompt and answer the command lines give a run's drafts: 128, or a wide tree's
    frontiers and 32 (at least the `room` a SpecDecoder of those trees asks for, with the default lookup)."""
    return max(128, max((t.draft_slots for t in trees), default=0) + 32)


@dataclass
class SpecStats:
    cycles: int = 0
    # per cycle, the accepted draft tokens that reached the output (a cycle cut short by a stop token or the
    # budget counts those it kept): row 0's, and every row still decoding's
    accepted: list[int] = field(default_factory=list)
    accepted_rows: list[list[int]] = field(default_factory=list)
    # per cycle, row 0's accepted draft tokens that the stop token or the budget cut from the output
    # (accepted + cut is what the target accepted: the acceptance rates per draft position read it)
    cut: list[int] = field(default_factory=list)
    # row-cycles (of every row) whose own target token, the correction or bonus after the accepted draft
    # tokens, the stop token or the budget cut: every other row-cycle emitted accepted + 1 tokens
    target_cut: int = 0
    draft_lengths: list[int] = field(default_factory=list)  # k per cycle (trees: the depth)
    lookup_rows: list[int] = field(default_factory=list)  # per cycle: rows whose draft was copied
    store_rows: list[int] = field(default_factory=list)  # per cycle: of those, rows copied from the datastore
    tree_nodes: list[int] = field(default_factory=list)  # trees: draft nodes verified per cycle
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0

    @property
    def lookup_cycles(self) -> int:
        """Cycles in which some row's draft was copied (prompt lookup, or the datastore: see store_cycles)."""
        return sum(1 for n in self.lookup_rows if n)

    @property
    def store_cycles(self) -> int:
        """Cycles in which some row's draft came from the datastore."""
        return sum(1 for n in self.store_rows if n)

    @property
    def row_cycles(self) -> int:
        """Cycles summed over rows (a batch's cycle counts once per row still decoding)."""
        return sum(map(len, self.accepted_rows)) or len(self.accepted)

    @property
    def emitted(self) -> int:
        """Tokens the cycles put in the outputs: accepted draft tokens + 1 per row-cycle whose target token
        was kept."""
        acc = [a for row in self.accepted_rows for a in row] or self.accepted
        return sum(a + 1 for a in acc) - self.target_cut

    @property
    def tau(self) -> float:
        """Acceptance length: tokens emitted per cycle (accepted draft tokens + 1; a cycle cut short by a stop
        token or the budget counts what it kept)."""
        return self.emitted / max(self.row_cycles, 1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpecDecoder:
    """Holds target + draft, both caches, and the decoding policy.

    policy: an object with choose_k / record_draft / record_verify / record_acceptance (eagle3/tuner.py:
    FixedK, HeuristicK, DraftLengthTuner; with a tensor parallel target a DraftLengthTuner's choices are rank
    0's, eagle3.tuner.RankAgreed); the caches and verifies are sized for the longest k it declares (its
    choices, k_max or k; 8 if none), and a longer choose_k is refused. tree: a TreeConfig to draft trees
    instead of chains (batch 1), or several: tuned trees, the policy's `choose_tree` picking one per cycle by
    its measured tokens per second (a DraftLengthTuner with these as its tree_configs; made here when policy
    is None); at temperature > 0 each cycle's tree is cut by TreeConfig.for_sampling.
    compile_draft: on CPU, the draft's cache calls (one-token steps and catch-ups) as one compiled graph
    (eagle3/compiled_draft.py; a tree's masked expansion runs eagerly on the slots in use); on CUDA, the
    one-token draft step torch.compiled (CUDA graphs; fixed shapes: it attends over the whole preallocated
    draft cache, so changing k never recompiles). lookup: a LookupConfig to draft by prompt
    lookup where the sequence repeats itself, the EAGLE-3 draft (chain or tree) elsewhere. datastore: a
    Datastore tried after the sequence itself (needs lookup). engine="compiled": the target's decode and
    verify steps on the compiled engine (maverick/compiled.py; `target` may already be one, shared with a
    plain `Decoder`), a tree's verify in a graph of its own.
    """

    def __init__(
        self,
        target: Llama4,
        draft: Eagle3Draft,
        max_len: int = 2048,
        policy=None,
        tree: TreeConfig | Sequence[TreeConfig] | None = None,
        compile_draft: bool = False,
        lookup: LookupConfig | None = None,
        datastore: Datastore | None = None,
        engine: str = "eager",
    ):
        target = for_engine(target, engine, max_len, draft.config.feature_layers)
        trees = [tree] if isinstance(tree, TreeConfig) else list(dict.fromkeys(tree or ()))
        # the largest tree sizes the caches and verifies
        tree = max(trees, key=lambda c: (c.total_tokens, c.depth)) if trees else None
        if len(trees) > 1 and policy is None:
            policy = DraftLengthTuner(tree_configs=trees)
        picks = list(getattr(policy, "tree_configs", None) or [])
        if trees and picks and set(picks) != set(trees):
            raise ValueError(f"the policy picks among the trees {picks}, not the trees given {trees}")
        if len(trees) > 1 and not picks:
            raise ValueError(
                "several trees need a policy that picks one per cycle (DraftLengthTuner(tree_configs=...))"
            )
        if tree is not None and getattr(target, "compiled", False) and target.device.type == "cuda":
            # a GPU engine runs every chain call in one graph; the tree graph's bits there are not yet measured
            # (maverick.compiled.tree_mismatches: scripts/gpu_decode.py --tree-check, a CUDA test)
            raise ValueError("compiled tree verifies are checked on CPU engines only; on CUDA verify chains")
        if datastore is not None and lookup is None:
            raise ValueError("a datastore extends prompt lookup: pass lookup=LookupConfig() with it")
        check_draft_fits(draft.config, target.config, draft.source)
        self.target, self.draft = target, draft
        self.embed = target.model.embed_tokens
        if note := embeddings_note(draft, self.embed):
            warnings.warn(note, stacklevel=2)
        self.feature_layers = tuple(draft.config.feature_layers)
        self.max_len = max_len
        self.policy = policy if policy is not None else FixedK(4)
        shard = getattr(target, "shard", None)  # a tensor parallel target (maverick/parallel.py, torchrun)
        if shard is not None and isinstance(self.policy, DraftLengthTuner):  # its clock differs per rank
            self.policy = RankAgreed(self.policy, shard)
        self.tree = tree  # the largest tree (None: chains)
        self._pick_tree = bool(picks) and tree is not None  # the policy picks each cycle's tree
        self.lookup = lookup
        self.datastore = datastore
        self.compile_draft = compile_draft
        self.d2t_ids = draft.draft_to_target_ids  # [V'] draft id -> target id
        rows = getattr(target, "rows", None)  # a compiled engine: every verify must fit its largest bucket
        pol = self.policy
        # the longest draft a cycle verifies, and the setting it comes from (a datastore's copies are cut to
        # prompt lookup's copy length)
        longest = {
            "the draft length": max(
                getattr(pol, "choices", None) or [getattr(pol, "k_max", getattr(pol, "k", 8))]
            )
        }
        if tree is not None:  # a tree's cycles verify its nodes, not the policy's chains
            longest = {"the tree's total_tokens": tree.total_tokens}
        if lookup is not None:
            longest |= {
                "prompt lookup's max_tokens": lookup.max_tokens,
                "prompt lookup's streak_tokens": lookup.streak_tokens,
            }
        what, k_max = max(longest.items(), key=lambda kv: kv[1])
        if rows is not None and k_max + 1 > rows[-1]:
            raise UserError(
                f"{what} {k_max}: the compiled engine verifies drafts of up to {rows[-1] - 1} tokens"
            )
        if k_max + 1 > EXACT_ATTENTION_MAX_T:  # longer calls attend by another kernel: other bits
            raise UserError(
                f"{what} {k_max}: a verify keeps plain decoding's bits for drafts of up to "
                f"{EXACT_ATTENTION_MAX_T - 1} tokens (maverick.model.EXACT_ATTENTION_MAX_T)"
            )
        self.k_max = k_max  # the most tokens a cycle verifies, the last committed one aside
        # the slots past the committed tokens a cycle may write: a verify's k_max + 1 (both caches), a greedy
        # tree's frontiers (the draft's), and a margin; generate refuses a budget that leaves fewer
        self.room = max(k_max + 1, *(t.draft_slots for t in trees), 8) + 2
        self._k_max_from = what
        cuda = next(draft.parameters()).is_cuda
        # on CPU the draft's cache calls (chain steps and catch-ups) run as one compiled graph, a tree's masked
        # expansion eagerly on the slots in use; on CUDA (where a draft step is launch-bound: CUDA graphs) the
        # one-token step is torch.compiled
        self._step_compiled = compile_draft and cuda
        if compile_draft and not self._step_compiled:
            self.draft = CompiledDraft(draft, max_len)
        self._caches(1)
        self._draft_step = self._draft_step_eager
        if self._step_compiled:
            mode = "reduce-overhead" if cuda else None
            self._draft_step = torch.compile(self._draft_step_eager, dynamic=False, mode=mode)

    def _caches(self, B: int) -> None:
        self.tcache = self.target.new_cache(B, self.max_len)
        self.dcache = self.draft.new_cache(B, self.max_len)
        if self._step_compiled:
            self.dcache.slice_to_bound = False

    # ---- draft pieces ----

    def _draft_step_eager(self, tokens: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
        """One draft token per row: tokens [B], h [B, 1, H] -> (h' [B, 1, H], draft logits [B, V'])."""
        h = self.draft(self.embed(tokens[:, None]), h, None, cache=self.dcache)  # at the cache's lengths
        return h, self.draft.logits(h)[:, 0]

    def _catch_up(self, features: Tensor, next_tokens: Tensor, keep: Tensor) -> Tensor:
        """Pairs (features[:, j], next_tokens[:, j]) from the draft cache's current length; keep[b] of them
        per row are real (0: a frozen row, whose returned state is its first pair's and unused). Returns the
        draft state after the last kept pair [B, 1, H]."""
        start = self.dcache.lengths.clone()
        h = self.draft(self.embed(next_tokens), self.draft.project(features), None, cache=self.dcache)
        self.dcache.truncate(start + keep)
        return h.gather(1, (keep - 1).clamp(min=0)[:, None, None].expand(-1, 1, h.shape[-1]))

    def _draft_dist(self, logits_d: Tensor, sampling: SamplingParams | None) -> Tensor:
        """Draft-vocab logits [.., V'] -> draft probs over the draft vocab (same processing as the target)."""
        return logits_to_probs(logits_d.float(), sampling or SamplingParams())

    def _to_full(self, q_d: Tensor) -> Tensor:
        """Draft-vocab probs [.., V'] -> full-vocab probs [.., V] (zero outside the draft vocab)."""
        full = q_d.new_zeros(*q_d.shape[:-1], self.target.config.vocab_size)
        return full.index_copy_(-1, self.d2t_ids, q_d)

    # ---- generation ----

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 128,
        sampling: SamplingParams | None = None,
        stop_ids: Sequence[int] = (),
        generator: torch.Generator | None = None,
        on_cycle: Callable[[list[list[int]]], None] | None = None,
        on_output: Callable[[list[list[int]]], None] | None = None,
    ) -> Generation:
        """Decode; `on_cycle(tokens_per_row)` sees each cycle's emitted tokens (for highlighting: the
        prefill's token is not a cycle's; a cycle may emit past a stop token or the budget), `on_output(
        tokens_per_row)` the tokens each row's output grows by: the prefill's first, then each cycle's that are
        kept (for streaming: they join up to the returned tokens)."""
        B = len(prompts)
        if self.tree is not None and B != 1:
            raise ValueError("tree drafting runs one prompt at a time (batch size 1)")
        c = self.target.config
        check_lengths(prompts, max_new_tokens, c.max_position_embeddings, vocab_size=c.vocab_size)
        if max_new_tokens == 0:  # nothing to emit: not even the prefill's token
            gen = Generation([[] for _ in prompts], [len(p) for p in prompts], 0.0, 0.0)
            gen.stats = {"spec": SpecStats()}
            return gen
        greedy = sampling is None or sampling.greedy
        if self.tcache.batch_size != B:
            self._caches(B)
        if max(len(p) for p in prompts) + max_new_tokens + self.room > self.max_len:
            raise ValueError(
                f"prompt + {max_new_tokens} new tokens + {self.room} slots for a cycle's drafts exceed "
                f"max_len={self.max_len}"
            )
        dev = self.target.device
        stats = SpecStats()
        t0 = time.perf_counter()

        # prefill: target over the prompts (with features), first token, then the draft catches up
        self.tcache.set_window(decode_window(prompts, max_new_tokens, self.max_len))
        logits, out = prefill(self.target, self.tcache, prompts, feature_layers=self.feature_layers)
        probs = None if greedy else logits_to_probs(logits.float(), sampling)
        last = logits.argmax(-1) if greedy else sample(probs, generator)  # [B]
        lens = self.tcache.lengths.clone()
        T = out.features.shape[1]
        nxt = torch.zeros(B, T, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            nxt[b, : len(p) - 1] = torch.as_tensor(p[1:], device=dev)
        nxt.scatter_(1, (lens - 1)[:, None], last[:, None])
        self.dcache.reset()
        h = self._catch_up(out.features, nxt, lens)
        _sync(dev)
        ttft = time.perf_counter() - t0
        stats.prefill_seconds = ttft

        outs = [[int(t)] for t in last.tolist()]
        if on_output is not None:
            on_output([list(o) for o in outs])
        index = None
        if self.lookup is not None:
            index = [NgramIndex(self.lookup, list(p) + o) for p, o in zip(prompts, outs)]
            streak = [False] * B  # the row's last copy was accepted in full
        stop = stop_set(stop_ids)
        # a row is done at a stop token or its budget; done rows of a batch ride along frozen (_chain_cycle)
        done = [o[-1] in stop or len(o) >= max_new_tokens for o in outs]
        while not all(done):
            # per row: the copied tokens, None (no match: the EAGLE-3 draft drafts) or [] (finished)
            proposals = None
            if index is not None:
                copy_len = [0 if done[b] else self._copy_len(streak[b]) for b in range(B)]
                proposals = [[] if done[b] else (index[b].propose(copy_len[b]) or None) for b in range(B)]
                if self.datastore is not None:
                    stored = [b for b in range(B) if proposals[b] is None]
                    for b in stored:
                        proposals[b] = self.datastore.propose(index[b].tokens, copy_len[b]) or None
                    stats.store_rows.append(sum(proposals[b] is not None for b in stored))
            if self.tree is not None and (proposals is None or proposals[0] is None):
                emitted, h, last = self._tree_cycle(h, last, sampling, generator, stats)
            else:  # trees too verify a copied draft as a chain
                emitted, h, last = self._chain_cycle(h, last, sampling, generator, stats, proposals, done)
            if index is not None:
                for b, (ix, e) in enumerate(zip(index, emitted)):
                    ix.extend(e)
                    copied = proposals[b]  # a list wherever there is an index
                    if copied and self._tunes_copies():
                        self.policy.record_copy(len(copied), len(e) - 1, streak[b])
                    streak[b] = bool(copied) and len(e) > len(copied)  # every copied token kept, + the next
            grown = [len(o) for o in outs]
            live = 0  # the row's place among accepted_rows[-1] (the rows still decoding)
            for b in range(B):
                if done[b]:
                    continue
                for t in emitted[b]:
                    outs[b].append(t)
                    if t in stop or len(outs[b]) >= max_new_tokens:
                        done[b] = True
                        break
                kept = len(outs[b]) - grown[b]
                # the stats count what reached the output (tau: tokens a cycle emits)
                if kept < len(emitted[b]):
                    # the target's token (the cycle's last) is cut first, then accepted draft tokens
                    cut = max(len(emitted[b]) - 1 - kept, 0)
                    stats.target_cut += 1
                    stats.accepted_rows[-1][live] -= cut
                    if b == 0:
                        stats.accepted[-1] -= cut
                        stats.cut[-1] = cut
                live += 1
            if on_cycle is not None:
                on_cycle(emitted)
            if on_output is not None:
                on_output([o[n:] for o, n in zip(outs, grown)])
        gen = Generation(outs, [len(p) for p in prompts], time.perf_counter() - t0, ttft)
        gen.stats = {"spec": stats}
        return gen

    def _tunes_copies(self) -> bool:
        return self.lookup.tune and hasattr(self.policy, "choose_copy")

    def _copy_len(self, streak: bool) -> int:
        """Tokens the next prompt-lookup copy drafts: up to streak_tokens after a copy accepted in full, else
        max_tokens; with a policy that tunes them (DraftLengthTuner), the length the verify cost pays for, of
        1 .. that cap; on a compiled engine only lengths that fill a bucket (+ the cap): where its verifies
        run at their own row count, the 4-bit engine's cost still steps at every 4th row (the int4 kernel),
        and every length of 1 .. 10 was no faster (A/B on 10 MT-bench questions: 0.983 and 0.988 of the
        bucket lengths' tok/s)."""
        cap = self.lookup.streak_tokens if streak else self.lookup.max_tokens
        if not self._tunes_copies():
            return cap
        rows = getattr(self.target, "rows", None)
        lengths = range(1, cap + 1) if rows is None else [r - 1 for r in rows if 1 <= r - 1 < cap] + [cap]
        return self.policy.choose_copy(lengths, streak)

    def _choose_k(self) -> int:
        """The policy's draft length, checked against what the constructor sized the verify and the caches
        for (read from the policy's choices / k_max / k): a longer draft would verify past them, and lose
        plain decoding's bits (or the KV cache room) without a word."""
        k = int(self.policy.choose_k())
        if not 0 <= k <= self.k_max:
            raise ValueError(
                f"{type(self.policy).__name__}.choose_k() returned k={k}: this decoder verifies drafts of 0.."
                f"{self.k_max} tokens ({self._k_max_from}; a policy without choices, k_max or k is taken to "
                "draft up to 8): give the policy a k_max attribute"
            )
        return k

    def _chain_cycle(self, h, last, sampling, generator, stats, proposals=None, frozen=None):
        """One chain cycle. proposals (prompt lookup): per row a list of copied draft tokens, [] for no
        draft, or None where the EAGLE-3 draft should draft; without it every row uses the draft. frozen: per
        row, True for a finished row of a batch: it runs along (the batch keeps its shape) but its caches keep
        their lengths, so it cannot outgrow them while the others go on, and its acceptance is not counted."""
        greedy = sampling is None or sampling.greedy
        dev = last.device
        B = last.shape[0]
        n = self.tcache.lengths.clone()
        if proposals is None:
            proposals = [None] * B
        use_draft = [p is None for p in proposals]
        t0 = time.perf_counter()
        k = self._choose_k() if any(use_draft) else 0
        # draft k tokens (all rows, batched, when any row needs them)
        drafts, qs = [], []
        if k:
            logits_d = self.draft.logits(h)[:, 0]  # [B, V']
            h_step = h
            for j in range(k):
                if greedy:
                    d = self.d2t_ids[logits_d.argmax(-1)]
                else:
                    q_d = self._draft_dist(logits_d, sampling)
                    d = self.d2t_ids[sample(q_d, generator)]
                    qs.append(self._to_full(q_d))
                drafts.append(d)
                if j + 1 < k:
                    h_step, logits_d = self._draft_step(d, h_step)
        lens = [k if p is None else len(p) for p in proposals]
        K = max(lens)
        d_tokens = torch.zeros(B, K, dtype=torch.long, device=dev)
        if k:
            d_tokens[:, :k] = torch.stack(drafts, 1)
        q_all = None
        if not greedy and K:
            V = self.target.config.vocab_size
            q_all = torch.zeros(B, K, V, device=dev)
            if k:
                q_all[:, :k] = torch.stack(qs, 1)
        copied = [b for b, p in enumerate(proposals) if p is not None]
        for b in copied:  # a copied token is a draft with a one-hot distribution
            p = proposals[b]
            d_tokens[b] = 0
            d_tokens[b, : len(p)] = torch.as_tensor(p, device=dev)
            if q_all is not None:
                q_all[b] = 0
                q_all[b, torch.arange(len(p), device=dev), d_tokens[b, : len(p)]] = 1.0
        lengths = None if all(x == K for x in lens) else torch.tensor(lens, device=dev)
        _sync(dev)
        t1 = time.perf_counter()
        # verify all K+1 positions in one target pass
        out = self.target(
            torch.cat([last[:, None], d_tokens], 1), cache=self.tcache, feature_layers=self.feature_layers
        )
        if greedy:
            acc, y = verify_chain_greedy(d_tokens, out.logits, lengths)
        else:
            p = logits_to_probs(out.logits.float(), sampling)
            if K:
                acc, y = verify_chain_sampling(d_tokens, q_all, p, generator, lengths)
            else:
                acc, y = torch.zeros(B, dtype=torch.long, device=dev), sample(p[:, 0], generator)
        live = [True] * B if frozen is None else [not f for f in frozen]
        keep = acc + 1 if all(live) else torch.where(torch.tensor(live, device=dev), acc + 1, 0)
        self.tcache.truncate(n + keep)
        _sync(dev)
        t2 = time.perf_counter()
        # the draft drops its own steps and catches up on the accepted tokens' target features
        self.dcache.truncate(n)
        nxt = torch.cat([d_tokens, torch.zeros_like(last)[:, None]], 1).scatter_(1, acc[:, None], y[:, None])
        h = self._catch_up(out.features, nxt, keep)
        _sync(dev)
        t3 = time.perf_counter()

        acc_l, y_l, d_l = acc.tolist(), y.tolist(), d_tokens.tolist()
        emitted = [d_l[b][: acc_l[b]] + [y_l[b]] for b in range(B)]
        if any(use_draft):  # the policy learns the draft's costs and acceptance from the rows it drafted for
            self.policy.record_draft(k, (t1 - t0) + (t3 - t2))
        self.policy.record_verify(K + 1, t2 - t1)
        drafted = [a for a, u, v in zip(acc_l, use_draft, live) if u and v]
        if drafted:
            self.policy.record_acceptance(k, drafted if len(drafted) > 1 else drafted[0])
        copied_tokens = sum(a + 1 for a, u, v in zip(acc_l, use_draft, live) if v and not u)
        if not any(use_draft) and hasattr(self.policy, "record_catch_up"):  # a copy's cost besides its verify
            self.policy.record_catch_up(K + 1, (t1 - t0) + (t3 - t2))
        if copied_tokens and hasattr(self.policy, "record_cycle"):  # the realised rate counts them too
            self.policy.record_cycle(copied_tokens, 0.0 if any(use_draft) else (t1 - t0) + (t3 - t2))
        stats.cycles += 1
        stats.accepted.append(acc_l[0])
        stats.cut.append(0)
        stats.accepted_rows.append([a for a, v in zip(acc_l, live) if v])
        stats.draft_lengths.append(lens[0])
        stats.lookup_rows.append(sum(1 for p in proposals if p))  # a finished row's [] is no copy
        stats.draft_seconds += (t1 - t0) + (t3 - t2)
        stats.verify_seconds += t2 - t1
        return emitted, h, y

    # ---- trees (batch 1) ----

    def _expand_tree(self, cfg: TreeConfig, h: Tensor, sampling, generator):
        """Grow the draft tree `cfg` from the draft state h [1, 1, H] (which predicts the root's children).

        Returns parallel lists over nodes 1..: token ids, parent index (0 = root), cumulative log-prob,
        depth, and per expanded node the full-vocab draft probs its children were drawn from."""
        greedy = sampling is None or sampling.greedy
        n = int(self.dcache.lengths[0])
        compiled = getattr(self.dcache, "compiled_draft", False)
        tokens, parents, scores, depths = [], [], [], []
        child_q: dict[int, Tensor] = {}
        frontier = [0]  # node ids to expand; node 0 = root
        frontier_h = h  # [1, F, H] states predicting each frontier node's children
        frontier_score = torch.zeros(1, device=h.device)
        slots: dict[int, int] = {}  # node -> draft cache slot
        anc: dict[int, list[int]] = {0: []}  # node -> ancestor nodes (excluding root) incl. itself
        node_h: dict[int, Tensor] = {}  # expanded node -> its draft output state [1, 1, H]
        for depth in range(1, cfg.depth + 1):
            logits_d = self.draft.logits(frontier_h)[0].float()  # [F, V']
            if greedy:
                logp = F.log_softmax(logits_d, -1)
                top_lp, top_id = logp.topk(cfg.top_k, dim=-1)  # [F, k]
            else:
                q_d = self._draft_dist(logits_d, sampling)
                top_id = sample(q_d.repeat_interleave(cfg.top_k, 0), generator).view(-1, cfg.top_k)
                top_lp = q_d.gather(1, top_id).clamp_min(1e-30).log()
                for i, node in enumerate(frontier):
                    child_q[node] = self._to_full(q_d[i])
            cand_score = (frontier_score[:, None] + top_lp).flatten()  # [F*k]
            cand_tok = self.d2t_ids[top_id.flatten()]
            cand_parent = [frontier[i // cfg.top_k] for i in range(len(frontier) * cfg.top_k)]
            new_ids = []
            for c in range(cand_score.shape[0]):
                node = len(tokens) + 1
                tokens.append(cand_tok[c])
                parents.append(cand_parent[c])
                scores.append(cand_score[c])
                depths.append(depth)
                anc[node] = anc[cand_parent[c]] + [node]
                new_ids.append(node)
            if depth == cfg.depth:
                break
            # next frontier: greedy keeps the top_k by cumulative score, sampling keeps every node
            if greedy:
                keep = cand_score.topk(min(cfg.top_k, cand_score.shape[0])).indices.tolist()
            else:
                keep = list(range(cand_score.shape[0]))
            frontier = [new_ids[c] for c in keep]
            frontier_score = cand_score[keep]
            # one draft forward over the frontier: each sees the committed prefix and its own ancestors
            start = int(self.dcache.lengths[0])
            Fn = len(frontier)
            for i, node in enumerate(frontier):
                slots[node] = start + i
            # a compiled draft's cache (fixed shape) runs a masked call eagerly on the slots in use: so the mask
            with self.dcache.sliced_to_use() if compiled else contextlib.nullcontext():
                kv_len = self.dcache.kv_len(Fn)
                mask = torch.zeros(1, 1, Fn, kv_len, dtype=torch.bool)  # built on the host: one copy to a GPU
                mask[..., :n] = True
                for i, node in enumerate(frontier):
                    mask[0, 0, i, [slots[a] for a in anc[node]]] = True
                mask = mask.to(h.device)
                parent_h = self._node_states(frontier, parents, node_h, h)
                tok = torch.stack([tokens[node - 1] for node in frontier])[None]
                pos = torch.full((1, Fn), n + depth - 1, device=h.device)
                frontier_h = self.draft(self.embed(tok), parent_h, pos, cache=self.dcache, mask=mask)
            for i, node in enumerate(frontier):
                node_h[node] = frontier_h[:, i : i + 1]
        return tokens, parents, scores, depths, child_q

    def _node_states(self, frontier, parents, hmap, root_h):
        """The draft states that feed each frontier node: its parent's output (root: the catch-up state)."""
        hs = [root_h if parents[node - 1] == 0 else hmap[parents[node - 1]] for node in frontier]
        return torch.cat(hs, 1)

    def _tree_cycle(self, h, last, sampling, generator, stats):
        greedy = sampling is None or sampling.greedy
        picked = self.policy.choose_tree() if self._pick_tree else self.tree
        # sampling verifies every node: the full tree within total_tokens (the CLIs cut theirs already)
        cfg = picked.for_sampling(sampling)
        dev = last.device
        n = self.tcache.lengths.clone()
        t0 = time.perf_counter()
        tokens, parents, scores, depths, child_q = self._expand_tree(cfg, h, sampling, generator)
        # choose the nodes to verify: greedy keeps the best total_tokens (ancestor-closed since a child never
        # scores above its parent; ties are broken toward earlier, shallower nodes), sampling keeps them all
        if greedy and len(tokens) > cfg.total_tokens:
            sc = torch.stack(scores).tolist()  # one read from the device, not one per node
            order = sorted(range(len(tokens)), key=lambda i: (-sc[i], i))[: cfg.total_tokens]
            keep = sorted(order)
            keep_set = {i + 1 for i in keep}
            for i in keep:  # guard ancestor closure against float ties
                p = parents[i]
                while p != 0 and p not in keep_set:
                    keep_set.add(p)
                    p = parents[p - 1]
            keep = sorted(i - 1 for i in keep_set)
        else:
            keep = list(range(len(tokens)))
        # renumber: root 0, kept nodes 1..N in creation order (parents always precede children)
        new_id = {0: 0}
        for j, i in enumerate(keep):
            new_id[i + 1] = j + 1
        tree_tokens = torch.stack([last[0]] + [tokens[i] for i in keep])
        tree_parents = [-1] + [new_id[parents[i]] for i in keep]
        tree_depth = torch.tensor([0] + [depths[i] for i in keep], device=dev)
        self.dcache.truncate(n)
        _sync(dev)
        t1 = time.perf_counter()

        mask = tree_attention_mask(tree_parents).to(dev)
        out = self.target(
            tree_tokens[None],
            cache=self.tcache,
            positions=(n + tree_depth)[None],
            tree_mask=mask[None],
            feature_layers=self.feature_layers,
        )
        if greedy:
            path, y = verify_tree_greedy(tree_tokens, tree_parents, out.logits[0])
        else:
            p = logits_to_probs(out.logits[0].float(), sampling)
            V = self.target.config.vocab_size
            old_of_new = {v: k for k, v in new_id.items()}
            q = torch.stack(
                [child_q.get(old_of_new[i], torch.zeros(V, device=dev)) for i in range(len(tree_parents))]
            )
            path, y = verify_tree_sampling(tree_tokens, tree_parents, q, p, generator)
        a = int(path.numel())
        keep_idx = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), path])[None]
        self.tcache.compact(n, keep_idx, torch.tensor([a + 1], device=dev))
        _sync(dev)
        t2 = time.perf_counter()
        feats = out.features[:, keep_idx[0]]  # [1, a+1, nH]
        nxt = torch.cat([tree_tokens[path], y.view(1)])[None]
        h = self._catch_up(feats, nxt, torch.tensor([a + 1], device=dev))
        _sync(dev)
        t3 = time.perf_counter()
        emitted = [tree_tokens[path].tolist() + [int(y)]]
        if self._pick_tree:
            self.policy.record_tree(picked, a + 1, t3 - t0)
        elif hasattr(self.policy, "record_cycle"):
            self.policy.record_cycle(a + 1, t3 - t0)
        stats.cycles += 1
        stats.accepted.append(a)
        stats.accepted_rows.append([a])
        stats.cut.append(0)
        stats.draft_lengths.append(cfg.depth)  # the longest path that could be accepted
        stats.tree_nodes.append(len(keep))
        stats.lookup_rows.append(0)
        stats.draft_seconds += (t1 - t0) + (t3 - t2)
        stats.verify_seconds += t2 - t1
        return emitted, h, y.view(1)
