"""The Llama 4 text decoder, written from scratch. Architecture only: FP8, compile and parallelism are
applied to a built model from their own files.

Parameter names and layouts are HF's (`model.layers.{i}.self_attn.q_proj.weight`, fused experts
`feed_forward.experts.gate_up_proj` [E, H, 2I] laid out [in, out]), so an HF checkpoint maps 1:1.

Shape legend: B batch, T new tokens, S cache slots in view, H hidden, Hq/Hkv heads, D head dim,
E experts, I expert width, N tokens flattened (B*T).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from maverick.config import Llama4Config
from maverick.decode_attention import decode_attention
from maverick.kv_cache import KVCache, attention_mask
from maverick.linear import Linear, fused_linear, short_linear, weight_matmul


def init_weights(module: nn.Module, std: float = 0.02, generator: torch.Generator | None = None) -> None:
    """Random init for tests and fresh drafts: norms at 1, every other parameter N(0, std)."""
    norms = {id(m.weight) for m in module.modules() if isinstance(m, RMSNorm)}  # a draft's fc_norm.{i} too
    for name, p in module.named_parameters():
        if name.endswith("norm.weight") or id(p) in norms:
            nn.init.ones_(p)
        else:
            nn.init.normal_(p, std=std, generator=generator)


class RMSNorm(nn.Module):
    """Normalise in fp32, cast back, then scale (the order matters for bf16 bit-parity with HF/Meta)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return _rms(x, self.eps) * self.weight


def _rms(x: Tensor, eps: float) -> Tensor:
    """x * rsqrt(mean(x^2) + eps), computed in fp32 and cast back: the same bits as writing it out in
    Python (tests/test_model.py), with a few Python-level ops less per call (decoding is op-bound)."""
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


def rope_inv_freq(cfg: Llama4Config) -> Tensor:
    D = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float) / D))
    sc = cfg.rope_scaling
    if sc and sc.get("rope_type", sc.get("type")) == "llama3":
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old_ctx = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        # between the two wavelengths, interpolate (empty when lo == hi, as in Scout)
        smooth = (old_ctx / wavelen - lo) / (hi - lo) if hi != lo else torch.zeros_like(wavelen)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos and signed sin [B, T, 1, D] for `apply_rope`, in the interleaved layout: for the pair (2i, 2i+1)
    at angle a, cos is (cos a, cos a) and sin is (-sin a, sin a)."""
    freqs = positions[..., None].float() * inv_freq  # [B, T, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    interleave = lambda a, b: torch.stack((a, b), -1).flatten(-2)[:, :, None]  # noqa: E731
    return interleave(cos, cos), interleave(-sin, sin)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Interleaved (complex-pair) RoPE: each pair (x0, x1) = (x[2i], x[2i+1]) rotates to
    (x0 cos - x1 sin, x1 cos + x0 sin), in fp32, cast back. x [B, T, h, D], cos/sin from `rope_tables`.
    Written as x * cos + swap_pairs(x) * signed_sin: 4 ops instead of 10 for the same bits (x1 * -sin is
    -(x1 * sin) exactly, and a + -b is a - b)."""
    xf = x.float()
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x1, x0) per pair
    return (xf * cos + swapped * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: Llama4Config, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        H, D = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(H, self.n_heads * D, bias=False)
        self.k_proj = Linear(H, self.n_kv * D, bias=False)
        self.v_proj = Linear(H, self.n_kv * D, bias=False)
        self.o_proj = Linear(self.n_heads * D, H, bias=False)
        self.use_rope = cfg.uses_rope(layer)
        self.qk_norm = cfg.use_qk_norm and self.use_rope
        self.temperature_tuning = cfg.attn_temperature_tuning and not self.use_rope
        self.floor_scale, self.attn_scale, self.eps = cfg.floor_scale, cfg.attn_scale, cfg.rms_norm_eps
        self.chunked = cfg.is_chunked(layer)

    def temperature(self, positions: Tensor) -> Tensor:
        """A NoPE layer's query scale at `positions`: 1 + attn_scale * log(floor((pos + 1) / floor_scale) + 1),
        1.0 early on."""
        return torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0

    def forward(self, x: Tensor, ctx: _Ctx) -> Tensor:
        return self.o_proj(self.attend(fused_linear(x, (self.q_proj, self.k_proj, self.v_proj)), ctx))

    def attend(self, qkv: Tensor, ctx: _Ctx) -> Tensor:
        """The projected q/k/v [B, T, (Hq + 2 Hkv) D] -> the attention output [B, T, Hq D], before o_proj:
        RoPE / QK norm / temperature tuning, the cache write, and the attention kernel for the call."""
        B, T, _ = qkv.shape
        Hq, Hkv = self.n_heads, self.n_kv
        qkv = qkv.view(B, T, Hq + 2 * Hkv, self.head_dim)
        qk, v = qkv[:, :, : Hq + Hkv], qkv[:, :, Hq + Hkv :]  # q and k heads side by side: one rotation
        if self.use_rope:
            qk = apply_rope(qk, ctx.cos, ctx.sin)
        q, k = qk[:, :, :Hq], qk[:, :, Hq:]
        if self.qk_norm:  # weightless RMSNorm after RoPE, RoPE layers only
            q, k = _rms(q, self.eps), _rms(k, self.eps)
        elif self.temperature_tuning:
            q = (q * self.temperature(ctx.positions)[:, :, None, None]).to(q.dtype)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, h, T, D]
        if ctx.cache is not None:
            k, v = ctx.cache.write(self.layer, k, v, ctx.kv_len, ctx.write_index)  # [B, Hkv, S, D]
        mask = ctx.chunk_mask if self.chunked else ctx.full_mask
        if ctx.tree is not None:
            o = tree_attention(q, k, v, ctx.tree, self.chunked)
        elif ctx.causal and not self.chunked:  # the plain causal mask over the call's own T keys
            # an empty cache's first T slots hold them
            k, v = k[:, :, :T].to(q.dtype), v[:, :, :T].to(q.dtype)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_heads != self.n_kv)
        elif ctx.full_bias is not None:  # a short call on the exact path (Llama4.forward)
            o = exact_attention(q, k, v, ctx.chunk_bias if self.chunked else ctx.full_bias)
        elif ctx.n_valid is not None:  # batched decoding, not exact (train/fastgen.py, Decoder(exact=False))
            n_valid = None if self.chunked else ctx.n_valid  # a chunked layer's window: the mask
            if q.is_cuda:  # the kernel takes one dtype; a CPU's product reads an fp32 cache as it is
                k, v = k.to(q.dtype), v.to(q.dtype)
            o = decode_attention(q, k, v, mask, n_valid)
        else:  # a cache may hold bf16 values in fp32 (exact decoding): the cast back is lossless
            k, v = k.to(q.dtype), v.to(q.dtype)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv)
        return o.transpose(1, 2).reshape(B, T, -1)


# NOTE (bit-exact speculative decoding): greedy speculative decoding must emit exactly the tokens of
# plain decoding, so a token's logits must not depend on how many tokens share its forward (1 when
# decoding, k+1 when verifying, a tree's nodes). Measured on this CPU: bf16 nn.Linear (oneDNN) gives
# the same row whatever the row count, but PyTorch's fused CPU attention kernel does not (a few rows in
# a hundred differ in the last bit, enough to flip near-tied argmaxes), and an fp32 matmul changes its
# summation order with the length of the reduced dimension. So calls with few new tokens use this plain
# fp32 attention, over a key window of fixed length (KVCache.window), which is row-count invariant;
# long prefills keep the fused kernel.
EXACT_ATTENTION_MAX_T = 64


@dataclass
class TreeLayout:
    """Where each tree node's keys sit, computed once per verify call (`tree_layout`). A node must see its keys
    laid out as a chain would (the committed prefix, then its ancestors in depth order at the slots of
    their positions) so that its reductions run in a decode step's order.

    keys [T, S]: the cache slot of each (node, chain slot). Every node on one root-to-leaf path can use that
    leaf's layout (its slots past the node's own position are masked out, weight 0), so the values are
    gathered once per leaf: leaf_keys [L, S]; paths [L, M] the nodes of each leaf's path by depth (short
    paths repeat their leaf); leaf_of, depth [T]: the leaf whose call computes node t, at row block depth.
    bias / chunk_bias [T, S]: `additive` masks in chain order (the slots up to each node's position; on
    chunked layers only those in its chunk; None without chunked layers), the same for every layer."""

    keys: Tensor
    leaf_keys: Tensor
    paths: Tensor
    leaf_of: Tensor
    depth: Tensor
    bias: Tensor
    chunk_bias: Tensor | None


def tree_layout(
    tree_mask: Tensor, start: int, kv_len: int, positions: Tensor, chunk: int | None = None
) -> TreeLayout:
    """The layout of a tree verify whose T nodes go to cache slots start.. start+T-1; tree_mask [1, T, T]
    (node i sees j iff j is i or an ancestor: ancestors come first, by depth); positions [1, T]; chunk: the
    chunked layers' chunk size (None: no chunked layers)."""
    anc = tree_mask[0]
    T = anc.shape[-1]
    keys = torch.arange(kv_len, device=anc.device).repeat(T, 1)
    depth = anc.sum(-1) - 1
    for t in range(T):
        keys[t, start : start + int(depth[t]) + 1] = start + anc[t].nonzero()[:, 0]
    leaves = (anc.sum(0) == 1).nonzero()[:, 0]  # nobody's ancestor but their own
    M = int(depth.max()) + 1
    paths = leaves[:, None].repeat(1, M)
    for i, leaf in enumerate(leaves.tolist()):
        path = anc[leaf].nonzero()[:, 0]
        paths[i, : len(path)] = path
    leaf_of = anc[leaves].int().argmax(0)  # the first leaf below each node
    pos = positions[0]
    slot = torch.arange(kv_len, device=anc.device)
    mask = slot[None, :] <= pos[:, None]  # [T, S]
    chunk_bias = None
    if chunk:
        chunk_bias = additive(mask & (slot[None, :] // chunk == pos[:, None] // chunk))
    return TreeLayout(keys, keys[leaves], paths, leaf_of, depth, additive(mask), chunk_bias)


def tree_attention(q: Tensor, k: Tensor, v: Tensor, tree: TreeLayout, chunked: bool = False) -> Tensor:
    """Tree verification (batch 1), bit-identical to decoding each path token by token (see TreeLayout).
    q [1, Hq, T, D], k/v [1, Hkv, S, D] in cache order; chunked: a chunked-attention layer.

    A score is one D-long dot product, whose bits do not depend on where its key sits: the scores of all
    nodes come from one product in cache order (at least `bmm_min_rows()` rows), gathered into each node's
    chain order for the softmax. The product with the values sums over the slots, so it runs on values
    gathered into chain order: one call per leaf, the rows of its path's nodes."""
    rows = bmm_min_rows()
    _, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bias = tree.chunk_bias if chunked else tree.bias  # [T, S]
    if rows is None:  # no row count keeps bits: each node's product on its own gathered keys
        k_t = k[0][:, tree.keys].transpose(0, 1)  # [T, Hkv, S, D]
        v_t = v[0][:, tree.keys].transpose(0, 1)
        o = exact_attention(q[0].transpose(0, 1)[:, :, None], k_t, v_t, bias[:, None, None])
        return o[:, :, 0].transpose(0, 1)[None]  # o: [T, Hq, 1, D]
    q_f = q[0].float().view(Hkv, G, T, D).transpose(1, 2).reshape(Hkv, T * G, D)  # rows node-major
    if T * G < rows:
        q_f = F.pad(q_f, (0, 0, 0, rows - T * G))
    scores = torch.bmm(q_f, k[0].float().transpose(1, 2))[:, : T * G].view(Hkv, T, G, S)
    scores = scores.gather(3, tree.keys[None, :, None, :].expand(Hkv, T, G, S))  # each node's chain order
    probs = scores.mul_(D**-0.5).add_(bias[None, :, None]).softmax(-1)
    L, M = tree.paths.shape  # index_select: ~10x faster than advanced indexing on dim 1 here
    probs = probs.index_select(1, tree.paths.flatten()).view(Hkv * L, M * G, S)  # each leaf's path
    if M * G < rows:
        probs = F.pad(probs, (0, 0, 0, rows - M * G))
    v_l = v[0].float().index_select(1, tree.leaf_keys.flatten()).view(Hkv * L, S, D)
    o = torch.bmm(probs, v_l)[:, : M * G].reshape(Hkv, L * M, G, D)
    o = o.index_select(1, tree.leaf_of * M + tree.depth)  # [Hkv, T, G, D]
    return o.transpose(1, 2).reshape(1, Hq, T, D).to(q.dtype)


def additive(mask: Tensor) -> Tensor:
    """A boolean attention mask as the fp32 bias `exact_attention` adds: 0 where True, -inf where False."""
    return torch.where(mask, 0.0, float("-inf"))


def exact_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
    """Softmax attention in fp32. q [B, Hq, T, D], k/v [B, Hkv, S, D], bias [B, 1, T, S] (`additive`) ->
    [B, Hq, T, D]. GQA: query head h reads kv head h // (Hq // Hkv), so the G = Hq // Hkv query heads of a
    kv head are G*T rows of one matmul. Adding a 0 / -inf bias gives the bits of masking with -inf.

    fp32 `bmm` may give few-row products another kernel (AMD EPYC Zen 4: 1-3 rows, unlike the Xeon with
    AMX this was written on), so each product runs on at least `bmm_min_rows()` rows, the padding rows
    zeros: from that count up every row has the same bits however many rows share the call. Where this
    CPU has no such count, T > 1 takes `per_position_attention`."""
    rows = bmm_min_rows()
    if rows is None and q.shape[2] > 1:
        return per_position_attention(q, k, v, bias)
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    q_f = q.float().reshape(B * Hkv, G * T, D)
    if rows and G * T < rows:
        q_f = F.pad(q_f, (0, 0, 0, rows - G * T))
    scores = torch.bmm(q_f, k.float().reshape(B * Hkv, S, D).transpose(1, 2))  # [B*Hkv, >= G*T, S]
    scores[:, : G * T].view(B, Hkv, G, T, S).mul_(D**-0.5).add_(bias[:, :, None])
    probs = scores.softmax(-1)  # padding rows: zeros, harmless
    o = torch.bmm(probs, v.float().reshape(B * Hkv, S, D))[:, : G * T]  # [B*Hkv, G*T, D]
    return o.reshape(B, Hq, T, D).to(q.dtype)


def per_position_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
    """`exact_attention` as one [G, D] x [D, S] product per (kv head, query position): the matmul shape is
    the same whatever T, so every position gets the bits of a one-token call (at the cost of copying the
    keys and values T times). The fallback for a CPU whose fp32 `bmm` has no row count to pad to."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    q_f = q.float().view(B, Hkv, G, T, D).transpose(2, 3).reshape(B * Hkv * T, G, D)
    k_f = k.float()[:, :, None].expand(B, Hkv, T, S, D).reshape(B * Hkv * T, S, D)
    scores = torch.bmm(q_f, k_f.transpose(1, 2)).view(B, Hkv, T, G, S)
    probs = scores.mul_(D**-0.5).add_(bias[:, :, :, None]).softmax(-1)
    v_f = v.float()[:, :, None].expand(B, Hkv, T, S, D).reshape(B * Hkv * T, S, D)
    o = torch.bmm(probs.view(B * Hkv * T, G, S), v_f).view(B, Hkv, T, G, D)
    return o.permute(0, 1, 3, 2, 4).reshape(B, Hq, T, D).to(q.dtype)


BMM_PROBE_ROWS = 192  # G * T for G = 3 and T up to EXACT_ATTENTION_MAX_T


@functools.cache
def bmm_min_rows() -> int | None:
    """The fewest rows (1, 2, 4, 8 or 16) from which fp32 `bmm` gives every row the bits it has in a call of
    192 rows, on this CPU; None if there is none. Probed once on random data: calls of 1..32 rows and 10
    larger counts up to 192, both products of attention, 3 key lengths, batches of 3 and 6 matrices."""
    g = torch.Generator().manual_seed(0)
    counts = list(range(1, 33)) + [40, 48, 63, 64, 65, 96, 127, 128, 150, BMM_PROBE_ROWS]
    worst = 0  # the largest row count whose rows differ from the reference
    for S in (64, 320, 1000):
        for batch in (3, 6):
            pairs = [
                (
                    torch.randn(batch, BMM_PROBE_ROWS, 64, generator=g),
                    torch.randn(batch, S, 64, generator=g).mT,
                ),
                (torch.randn(batch, BMM_PROBE_ROWS, S, generator=g), torch.randn(batch, S, 64, generator=g)),
            ]
            for a, b in pairs:
                ref = torch.bmm(a, b)
                for n in counts:
                    if not torch.equal(torch.bmm(a[:, :n], b), ref[:, :n]):
                        worst = max(worst, n)
    return next((r for r in (1, 2, 4, 8, 16) if r > worst), None)


class MLP(nn.Module):
    """SwiGLU: dense layers and the MoE's shared expert."""

    def __init__(self, H: int, I: int):
        super().__init__()
        self.gate_proj = Linear(H, I, bias=False)
        self.up_proj = Linear(H, I, bias=False)
        self.down_proj = Linear(I, H, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = fused_linear(x, (self.gate_proj, self.up_proj))
        I = gate_up.shape[-1] // 2
        return self.down_proj(F.silu(gate_up[..., :I]) * gate_up[..., I:])


class Experts(nn.Module):
    """E SwiGLU experts in HF's fused layout: gate_up_proj [E, H, 2I] (gate first), down_proj [E, I, H]."""

    def __init__(self, E: int, H: int, I: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(E, H, 2 * I))
        self.down_proj = nn.Parameter(torch.empty(E, I, H))

    def expert(self, e: int, x_ND: Tensor) -> Tensor:
        gate_NI, up_NI = weight_matmul(x_ND, self.gate_up_proj[e]).chunk(2, dim=-1)
        return weight_matmul(F.silu(gate_NI) * up_NI, self.down_proj[e])

    def grouped(self, x_sorted_ND: Tensor, counts_E: list[int]) -> Tensor:
        """Tokens sorted by expert, counts per expert -> outputs in the same order."""
        outs = [self.expert(e, xs) for e, xs in enumerate(x_sorted_ND.split(counts_E)) if xs.shape[0]]
        return torch.cat(outs) if outs else x_sorted_ND.new_zeros(x_sorted_ND.shape)


class MoE(nn.Module):
    """Llama 4 MoE in named stages: route (top-1, sigmoid of the chosen raw logit, scaling the expert's
    INPUT), reorder tokens by expert, grouped SwiGLU, scatter back, add the shared expert.

    `forward_reference` is the plain per-expert loop kept for reading and for testing the fast path.
    """

    def __init__(self, cfg: Llama4Config):
        super().__init__()
        H, I, E = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts
        self.num_experts = E
        self.router = Linear(H, E, bias=False)
        self.experts = Experts(E, H, I)
        self.shared_expert = MLP(H, I)

    def route(self, x_ND: Tensor) -> tuple[Tensor, Tensor]:
        logits_NE = self.router(x_ND)
        # topk, not max: a tie (bf16 logits tie often) goes to the expert HF's and Meta's router choose
        top_N, expert_N = (t[:, 0] for t in logits_NE.topk(1, dim=-1))
        score_N = torch.sigmoid(top_N.float()).to(x_ND.dtype)  # no renormalisation, no bias
        return expert_N, score_N

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x_ND = x.reshape(-1, shape[-1])
        expert_N, score_N = self.route(x_ND)
        routed_in_ND = x_ND * score_N[:, None]
        order_N = torch.argsort(expert_N, stable=True)
        counts_E = torch.bincount(expert_N, minlength=self.num_experts).tolist()  # host sync: group sizes
        out_sorted_ND = self.experts.grouped(routed_in_ND[order_N], counts_E)
        routed_ND = torch.empty_like(x_ND).index_copy_(0, order_N, out_sorted_ND)
        return (self.shared_expert(x_ND) + routed_ND).view(shape)

    def forward_reference(self, x: Tensor) -> Tensor:
        shape = x.shape
        x_ND = x.reshape(-1, shape[-1])
        expert_N, score_N = self.route(x_ND)
        out_ND = self.shared_expert(x_ND)
        for n in range(x_ND.shape[0]):
            e = int(expert_N[n])
            out_ND[n] += self.experts.expert(e, x_ND[n : n + 1] * score_N[n])[0]
        return out_ND.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Llama4Config, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.is_moe = cfg.is_moe(layer)
        self.feed_forward = MoE(cfg) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size_mlp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, ctx: _Ctx) -> Tensor:
        if ctx.flat:
            return self.forward_flat(x, ctx)
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.feed_forward(self.post_attention_layernorm(x))

    def flat_ok(self) -> bool:
        """Whether `forward_flat` computes this layer: dense, and every projection a plain bias-free `Linear`
        (not FP8)."""
        if self.is_moe:
            return False
        a, f = self.self_attn, self.feed_forward
        lins = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, f.gate_proj, f.up_proj, f.down_proj)
        return all(type(m) is Linear and m.bias is None for m in lins)

    def forward_flat(self, x: Tensor, ctx: _Ctx) -> Tensor:
        """`forward` for short inference calls on the exact path (decoding, verification; `Llama4.forward`
        decides, with `flat_ok`): the same ops on the same (packed) weights, so the same bits
        (tests/test_model.py), without the submodule calls: norms inline, projections through
        `short_linear`, the attention core shared with `Attention.forward` (`attend`). A SmolLM2 decode
        step is ~4% faster on this CPU: at 135M parameters a step costs about as much in Python as in
        weights."""
        a, f = self.self_attn, self.feed_forward
        h = _rms(x, self.input_layernorm.eps) * self.input_layernorm.weight
        o = a.attend(short_linear(h, (a.q_proj, a.k_proj, a.v_proj)), ctx)
        x = x + short_linear(o, (a.o_proj,))
        h = _rms(x, self.post_attention_layernorm.eps) * self.post_attention_layernorm.weight
        gate_up = short_linear(h, (f.gate_proj, f.up_proj))
        I = gate_up.shape[-1] // 2
        return x + short_linear(F.silu(gate_up[..., :I]) * gate_up[..., I:], (f.down_proj,))


@dataclass
class _Ctx:
    """Per-forward state shared by every layer (computed once)."""

    positions: Tensor  # [B, T]
    cos: Tensor  # [B, T, 1, D] (rope_tables)
    sin: Tensor
    full_mask: Tensor  # [B, 1, T, S] bool
    chunk_mask: Tensor | None
    # the masks as `additive` biases for exact attention; None: this call takes the fused kernel
    full_bias: Tensor | None
    chunk_bias: Tensor | None
    tree: TreeLayout | None  # tree verification (see tree_attention)
    chunk: int | None
    cache: KVCache | None
    kv_len: int
    write_index: tuple[Tensor, Tensor] | None  # cache.write_index(T)
    flat: bool = False  # every layer runs DecoderLayer.forward_flat
    causal: bool = False  # no cache or an empty one, no tree, default positions: the plain causal mask
    # [B] batched GPU decoding (one token a row on the fused path, T == 1): row b sees slots 0..lengths[b],
    # its prefix and the token just written; None on every other call
    n_valid: Tensor | None = None


@dataclass
class Output:
    logits: Tensor | None  # [B, T', V] fp32 or model dtype
    features: Tensor | None  # [B, T, n*H]: hidden states entering the requested layers, concatenated
    hidden: Tensor  # [B, T, H]: final hidden state after the last norm


class TextModel(nn.Module):
    def __init__(self, cfg: Llama4Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Llama4(nn.Module):
    """Llama4ForCausalLM's text decoder. `forward` runs with or without a KV cache.

    With a cache, the T new tokens go to slots cache.lengths + arange(T) and the cache advances by T;
    speculative decoding rolls back with `cache.truncate` / `cache.compact`.
    """

    def __init__(self, cfg: Llama4Config):
        super().__init__()
        self.config = cfg
        self.model = TextModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def _apply(self, fn, recurse=True):
        """`.to(dtype)` (`.bfloat16()`, ...) casts every floating buffer: the RoPE frequencies are made again in
        fp32, as the loaders make them (rounded to bf16 they moved greedy outputs after 6-20 tokens)."""
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def new_cache(
        self, batch_size: int, max_len: int, dtype: torch.dtype | None = None, exact: bool = True
    ) -> KVCache:
        """exact: short calls use `exact_attention` (see the note there); exact=False: batched one-token steps
        use `decode_attention`, longer calls the fused kernel. On CPU the cache stores fp32 by default: keys
        and values are rounded to the model dtype before they are written, so fp32 holds them exactly and
        both fp32 attentions read them without a cast per layer and step (twice the memory; the cast of a
        32-row, 1,536-slot bf16 cache cost 6x the attention itself on AMD EPYC; on GPUs, where that memory
        matters more and the cast costs less, the model dtype)."""
        c = self.config
        dtype = dtype or (torch.float32 if self.device.type == "cpu" else self.dtype)
        n_kv = self.model.layers[0].self_attn.n_kv  # the config's, or one rank's share (maverick/parallel.py)
        cache = KVCache(c.num_hidden_layers, batch_size, max_len, n_kv, c.head_dim, dtype, self.device)
        cache.exact = exact
        return cache

    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        init_weights(self, std, generator)

    def forward(
        self,
        tokens: Tensor,
        cache: KVCache | None = None,
        positions: Tensor | None = None,
        tree_mask: Tensor | None = None,
        feature_layers: tuple[int, ...] = (),
        logits: str | Tensor | None = "all",
        inputs_embeds: Tensor | None = None,
    ) -> Output:
        """tokens [B, T]. positions [B, T] default: cache.lengths + arange(T) (or arange(T) without cache).
        tree_mask [B or 1, T, T]: which new tokens see which (default causal).
        feature_layers: return the hidden states entering these layers (index L = after the last layer,
        before the final norm), concatenated on the last dim in the order given; the others are not kept.
        logits: "all", "last", None (skip the head), or an index tensor [B, n] of positions to score.
        """
        B, T = tokens.shape
        cfg = self.config
        start = cache.lengths if cache is not None else None
        # a long call with the plain causal mask (no cache, or a prefill into an empty one): the fused kernel
        # with is_causal skips the masked blocks, half the work of a mask (a 3,195-token bf16 prefill on 2
        # cores: 8.0 -> 5.2 s)
        empty = cache is None or (cache.slice_to_bound and cache.bound == 0)
        causal = empty and tree_mask is None and positions is None and T > EXACT_ATTENTION_MAX_T
        if positions is None:
            base = start[:, None] if start is not None else 0
            positions = base + torch.arange(T, device=tokens.device)[None, :].expand(B, T)
        kv_len = cache.kv_len(T) if cache is not None else T
        full = attention_mask(positions, start, kv_len, None, tree_mask)
        chunked = None
        if any(cfg.is_chunked(i) for i in range(cfg.num_hidden_layers)):
            chunked = attention_mask(positions, start, kv_len, cfg.attention_chunk_size, tree_mask)
        cos, sin = rope_tables(positions, self.inv_freq)
        exact = T <= EXACT_ATTENTION_MAX_T and (cache is None or cache.exact)  # see exact_attention
        tree = None
        if tree_mask is not None and cache is not None and B == 1 and T <= EXACT_ATTENTION_MAX_T:
            chunk = cfg.attention_chunk_size if chunked is not None else None
            tree = tree_layout(tree_mask, int(start[0]), kv_len, positions, chunk)
        ctx = _Ctx(
            positions, cos, sin, full, chunked, additive(full) if exact else None,
            additive(chunked) if exact and chunked is not None else None, tree,
            cfg.attention_chunk_size, cache, kv_len, cache.write_index(T) if cache is not None else None,
        )  # fmt: skip

        ctx.causal = causal
        x = self.model.embed_tokens(tokens) if inputs_embeds is None else inputs_embeds
        if cache is not None and T == 1 and not exact:
            ctx.n_valid = cache.lengths + 1
        ctx.flat = (
            cache is not None and exact
            and not (torch.is_grad_enabled() and x.requires_grad) and not torch.compiler.is_compiling()
            and all(layer.flat_ok() for layer in self.model.layers)
        )  # fmt: skip
        feats: dict[int, Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in feature_layers:
                feats[i] = x
            x = layer(x, ctx)
        if cfg.num_hidden_layers in feature_layers:
            feats[cfg.num_hidden_layers] = x
        if cache is not None:
            cache.advance(T)
        h = self.model.norm(x)
        out_logits = None
        head = self.lm_head
        if exact and not torch.is_grad_enabled():
            # a batch's verify may exceed 64 rows: keep the bits of its decode steps (short_linear)
            head = lambda z: short_linear(z, (self.lm_head,))  # noqa: E731
        if isinstance(logits, Tensor):
            out_logits = head(h.gather(1, logits[..., None].expand(-1, -1, h.shape[-1])))
        elif logits == "all":
            out_logits = head(h)
        elif logits == "last":
            out_logits = head(h[:, -1:])
        elif logits is not None:
            raise ValueError(f"logits must be 'all', 'last', None or an index tensor, got {logits!r}")
        features = torch.cat([feats[i] for i in feature_layers], dim=-1) if feature_layers else None
        return Output(out_logits, features, h)
