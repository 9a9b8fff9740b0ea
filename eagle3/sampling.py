"""Speculative verification: the part of speculative decoding that makes it lossless.

A draft proposes tokens; one target forward pass scores them all; this file decides how many to keep
and which token to emit after them. Everything here is a pure tensor function, independent of any
model, so the decoding loop (``eagle3`` decode code) and the tests can call it directly.

Why the rules below are lossless (Leviathan et al. 2023, Chen et al. 2023): a draft token x ~ q kept
with probability min(1, p(x)/q(x)), and on rejection replaced by a sample of norm(max(0, p - q)),
is distributed exactly as p. Applied position by position along a chain, the emitted sequence has
the target's distribution; after k acceptances the target's distribution at position k gives one
extra "bonus" token for free. The SAME temperature / top-k / top-p processing must be applied to the
target logits and the draft logits (``maverick.sampling.logits_to_probs`` for both: the basic rules live
down the stack, where plain decoding uses them too), otherwise the output follows the processed target
only by accident.

Trees (SpecInfer, Miao et al. 2024): the children of a node are i.i.d. draws from the draft q at
that node. Try them in order; a rejected child turns the target into the residual
p <- norm(max(0, p - q)), which is exactly the distribution the next child must be checked against
(the rejection step applied recursively), and if every child is rejected the residual is sampled.

Shape legend: B batch rows, k draft tokens per row, V vocabulary, N tree nodes, m most children of
any tree node.

NOTE (host syncs): the chain functions never read a device value on the host (no ``.item()``, no
boolean indexing, no data-dependent Python branches), so a CUDA decode step containing them can be
captured in a graph. ``torch.multinomial`` with one sample uses the exponential-race fast path,
whose validity check is ``_assert_async`` in current torch (no sync). The tree functions sync once
per call: they compute every node's decision on the device and copy one small tensor to the host
for the walk down the tree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from maverick.sampling import sample, uniform

__all__ = [
    "verify_chain_greedy",
    "verify_chain_sampling",
    "verify_tree_greedy",
    "verify_tree_sampling",
    "tree_attention_mask",
    "tree_depths",
]


# ----------------------------------------------------------------------------------------------
# Chains (batched, no host sync)


def _check_chain_shapes(draft_tokens: torch.Tensor, target: torch.Tensor, name: str) -> tuple[int, int]:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, k], got shape {tuple(draft_tokens.shape)}")
    B, k = draft_tokens.shape
    if target.dim() != 3 or target.shape[0] != B or target.shape[1] != k + 1:
        raise ValueError(
            f"{name} must be [B, k+1, V] = [{B}, {k + 1}, V] for draft_tokens {tuple(draft_tokens.shape)}, "
            f"got {tuple(target.shape)}"
        )
    return B, k


def _within(lengths: torch.Tensor, k: int) -> torch.Tensor:
    """[B, k] bool: draft position i < lengths[b]."""
    return torch.arange(k, device=lengths.device)[None] < lengths[:, None]


def verify_chain_greedy(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, lengths: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy chain verification: keep the longest prefix equal to the target's argmax.

    draft_tokens [B, k]; target_logits [B, k+1, V] where position i scores the token after draft
    position i-1 (position 0 follows the last committed token). Returns n_accepted [B] long in
    0..k and next_token [B] long: the target argmax at position n_accepted (the correction at the
    first mismatch, or the bonus token when all k were accepted). lengths [B] (optional): row b's
    draft is only its first lengths[b] tokens (the rest is padding, never accepted).
    """
    _check_chain_shapes(draft_tokens, target_logits, "target_logits")
    k = draft_tokens.shape[1]
    target_top = target_logits.argmax(-1)  # [B, k+1]
    match = draft_tokens == target_top[:, :k]  # [B, k]
    if lengths is not None:
        match &= _within(lengths, k)
    # cumprod zeroes everything after the first mismatch: sum = length of the matching prefix
    n_accepted = match.long().cumprod(-1).sum(-1)  # [B]
    next_token = target_top.gather(1, n_accepted[:, None]).squeeze(1)  # [B]
    return n_accepted, next_token


def verify_chain_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless rejection-sampling verification of a batch of draft chains.

    draft_tokens [B, k] were drawn from draft_probs q [B, k, V]; target_probs p [B, k+1, V] (both
    produced by ``logits_to_probs`` with the same params). Token i is accepted with probability
    min(1, p_i(x)/q_i(x)), implemented as u * q_i(x) < p_i(x) with u ~ U[0, 1) so that q_i(x) = 0
    never divides. At the first rejection n the next token is drawn from norm(max(0, p_n - q_n))
    (if that residual is all zero, which happens only when p_n == q_n up to rounding and so a
    rejection had probability ~0, p_n itself is used); when all k are accepted it is drawn from p_k.
    lengths [B] (optional): row b's draft is only its first lengths[b] tokens; its next token is drawn
    from p at that position, as if the chain ended there (draft_probs beyond a row's length are unused).
    Returns n_accepted [B] long and next_token [B] long, with no host sync.
    """
    B, k = _check_chain_shapes(draft_tokens, target_probs, "target_probs")
    if draft_probs.shape != (B, k, target_probs.shape[-1]):
        raise ValueError(
            f"draft_probs must be [B, k, V] = [{B}, {k}, {target_probs.shape[-1]}], got {tuple(draft_probs.shape)}"
        )
    p = target_probs.float()  # [B, k+1, V]
    q = draft_probs.float()  # [B, k, V]
    V = p.shape[-1]
    idx = draft_tokens[..., None]  # [B, k, 1]
    p_x = p[:, :k].gather(-1, idx).squeeze(-1)  # [B, k]
    q_x = q.gather(-1, idx).squeeze(-1)  # [B, k]
    u = uniform(B, k, generator=generator, device=p.device)
    accept = u * q_x < p_x  # [B, k]
    if lengths is not None:
        accept &= _within(lengths, k)
        q = q * _within(lengths, k)[..., None]  # the position after a row's draft is a bonus: q = 0 there
    n_accepted = accept.long().cumprod(-1).sum(-1)  # [B]

    # The bonus position k has no draft: pad q with a zero row so that "max(0, p_k - 0)" = p_k and
    # one gather covers both the rejection and the all-accepted case.
    q_pad = F.pad(q, (0, 0, 0, 1))  # [B, k+1, V]
    pick = n_accepted[:, None, None].expand(B, 1, V)  # [B, 1, V]
    p_n = p.gather(1, pick).squeeze(1)  # [B, V]
    q_n = q_pad.gather(1, pick).squeeze(1)  # [B, V]
    residual = (p_n - q_n).clamp_min(0.0)  # [B, V]
    mass = residual.sum(-1, keepdim=True)  # [B, 1]
    residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(torch.float32).tiny), p_n)
    next_token = sample(residual, generator)  # [B]
    return n_accepted, next_token


# ----------------------------------------------------------------------------------------------
# Trees (batch size 1, one host sync per call)


def _parents_list(parents: torch.Tensor | Sequence[int]) -> list[int]:
    """Validate a parent array on the host: parents[0] == -1 and 0 <= parents[i] < i."""
    par = parents.tolist() if isinstance(parents, torch.Tensor) else [int(x) for x in parents]
    if isinstance(parents, torch.Tensor) and parents.dim() != 1:
        raise ValueError(f"parents must be 1-D [N], got shape {tuple(parents.shape)}")
    if not par or par[0] != -1:
        raise ValueError(f"parents[0] must be -1 (node 0 is the root), got parents={par[:8]}")
    for i, pi in enumerate(par[1:], start=1):
        if not 0 <= pi < i:
            raise ValueError(f"parents[{i}] = {pi} must satisfy 0 <= parents[i] < i (topological order)")
    return par


def _children_table(par: list[int]) -> list[list[int]]:
    """[N, m] child indices in node order, padded with -1 (m = most children of any node)."""
    kids: list[list[int]] = [[] for _ in par]
    for i, pi in enumerate(par[1:], start=1):
        kids[pi].append(i)
    m = max(len(c) for c in kids)
    return [c + [-1] * (m - len(c)) for c in kids]


def _check_tree_shapes(tokens: torch.Tensor, n: int, **rows: torch.Tensor) -> None:
    if tokens.dim() != 1 or tokens.shape[0] != n:
        raise ValueError(f"tokens must be [N] = [{n}] (len(parents)), got shape {tuple(tokens.shape)}")
    for name, t in rows.items():
        if t.dim() != 2 or t.shape[0] != n:
            raise ValueError(f"{name} must be [N, V] with N = {n}, got shape {tuple(t.shape)}")


def _walk(table: list[list[int]], accept: list[list[bool]]) -> list[int]:
    """Follow, from the root, the first accepted child of each node; returns the visited nodes."""
    path, node = [], 0
    while True:
        ranks = [r for r, (c, a) in enumerate(zip(table[node], accept[node])) if c >= 0 and a]
        if not ranks:
            return path
        node = table[node][ranks[0]]
        path.append(node)


def verify_tree_greedy(
    tokens: torch.Tensor, parents: torch.Tensor | Sequence[int], target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of a token tree (one target pass with ``tree_attention_mask``).

    tokens [N] (node 0 = the last committed token), parents [N], target_logits [N, V] where row i
    is the target's prediction after the path root..i. From the root, repeatedly move to the first
    child whose token equals the target argmax at the current node. Returns accepted_nodes (long
    [n], node indices of the path without the root, on tokens.device) and next_token (0-d long):
    the argmax at the last accepted node.
    """
    par = _parents_list(parents)
    N = len(par)
    _check_tree_shapes(tokens, N, target_logits=target_logits)
    table = _children_table(par)
    top = target_logits.argmax(-1)  # [N]
    child_idx = torch.tensor(table, dtype=torch.long, device=tokens.device)  # [N, m]
    valid = child_idx >= 0
    child_tok = tokens[child_idx.clamp_min(0)]  # [N, m]
    match = (child_tok == top[:, None]) & valid  # [N, m]
    accept = match.cpu().tolist()  # the one host sync
    path = _walk(table, accept)
    last = path[-1] if path else 0
    return torch.tensor(path, dtype=torch.long, device=tokens.device), top[last]


def verify_tree_sampling(
    tokens: torch.Tensor,
    parents: torch.Tensor | Sequence[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless multi-candidate rejection sampling over a token tree (SpecInfer).

    tokens [N], parents [N] as in ``verify_tree_greedy``; draft_probs q [N, V]: row i is the draft
    distribution the children of node i were drawn from, i.i.d. (the caller guarantees this at
    temperature > 0; rows of leaves are unused); target_probs p [N, V]: row i is the target after
    the path root..i. Children are tried in index order.

    Every node's outcome depends only on its own p, q, children and random numbers, not on how the
    walk reached it, so all nodes are decided at once on the device (a Python loop over the
    sibling rank, m iterations, not over the data) and the walk itself runs on the host after one
    copy. Each child node owns one uniform and each node owns one fallback draw from its final
    residual; the walk uses only those on its path, which are independent of each other.
    Returns accepted_nodes (long [n], without the root) and next_token (0-d long).
    """
    par = _parents_list(parents)
    N = len(par)
    _check_tree_shapes(tokens, N, draft_probs=draft_probs, target_probs=target_probs)
    if draft_probs.shape != target_probs.shape:
        raise ValueError(
            f"draft_probs {tuple(draft_probs.shape)} and target_probs {tuple(target_probs.shape)} must match"
        )
    table = _children_table(par)
    device = target_probs.device
    p = target_probs.float()  # [N, V] residual target, updated per sibling rank
    q = draft_probs.float()  # [N, V]
    child_idx = torch.tensor(table, dtype=torch.long, device=device)  # [N, m]
    m = child_idx.shape[1]
    valid = child_idx >= 0  # [N, m]
    child_tok = tokens.to(device)[child_idx.clamp_min(0)]  # [N, m]
    u = uniform(N, generator=generator, device=device)[child_idx.clamp_min(0)]
    tiny = torch.finfo(torch.float32).tiny
    accept = torch.zeros(N, m, dtype=torch.bool, device=device)
    for r in range(m):
        x = child_tok[:, r : r + 1]  # [N, 1]
        p_x = p.gather(1, x).squeeze(1)  # [N]
        q_x = q.gather(1, x).squeeze(1)  # [N]
        accept[:, r] = (u[:, r] * q_x < p_x) & valid[:, r]
        # on rejection the next sibling is checked against the residual (rows where this child was
        # accepted never look at later ranks, so updating them too is harmless)
        residual = (p - q).clamp_min(0.0)
        mass = residual.sum(-1, keepdim=True)
        residual = torch.where(mass > 0, residual / mass.clamp_min(tiny), p)
        p = torch.where(valid[:, r : r + 1], residual, p)
    fallback = sample(p, generator)  # [N]: the token emitted if the walk stops at this node
    accept_host = accept.cpu().tolist()  # the one host sync
    path = _walk(table, accept_host)
    last = path[-1] if path else 0
    return torch.tensor(path, dtype=torch.long, device=tokens.device), fallback[last].to(tokens.device)


def tree_attention_mask(parents: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """BoolTensor [N, N]: node i may attend to node j iff j is i or an ancestor of i.

    Computed by pointer doubling on the ancestor relation (ceil(log2 N) boolean matrix products)
    rather than a Python loop over nodes. The result lives on parents' device (CPU for a list).
    """
    par = _parents_list(parents)
    N = len(par)
    device = parents.device if isinstance(parents, torch.Tensor) else torch.device("cpu")
    idx = torch.arange(N, device=device)
    up = torch.tensor(par, dtype=torch.long, device=device).clamp_min(0)  # the root points at itself
    reach = torch.eye(N, dtype=torch.float32, device=device)
    reach[idx, up] = 1.0  # [N, N]: paths of length <= 1
    for _ in range(max(0, math.ceil(math.log2(max(N, 1))))):
        reach = ((reach @ reach) > 0).float()  # paths of length <= 2^t
    return reach > 0


def tree_depths(parents: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """LongTensor [N]: number of edges from the root (root 0), i.e. ancestors excluding the node."""
    return tree_attention_mask(parents).sum(-1) - 1
