"""The compiled target engine: a built `Llama4`'s decode and verify steps as compiled graphs.

Eager decoding of a small model is bound by the cost per operation, not by the weights: a SmolLM2 step
is ~30 layers x ~25 small ops, each paying Python dispatch. `CompiledTarget` wraps a built model and runs
every short call (decode: 1 token; chain verify: k + 1 tokens) as one whole-model graph compiled by
inductor: the static KV cache passed in and written in place, elementwise work (residual + RMSNorm, RoPE,
SwiGLU, the attention's softmax) fused, no Python inside a step, and on CPU inductor's C++ wrapper
(`cpp_wrapper`: the graph is one C++ call instead of a Python function of ~400 kernel launches; measured
on frozen graphs, plain 4-bit decoding 148 against 123 tok/s; on the unfrozen 4-bit graphs below, no
difference: 6.72 against 6.60 ms a step). On CUDA the same graphs are replayed as CUDA graphs
(`triton.cudagraphs`, what `mode="reduce-overhead"` sets). Long calls (prefill) run on the eager model. A
tree verify (batch 1) runs a graph of its own (`_TreeStep`), built at the first tree call: every node gets
the bits a chain verify or decode steps of its root-to-node path get (`_tree_attend`; tested on CPU; a CUDA
engine does not take trees yet).

How a step is compiled. On CPU (`aot`, the default there) the buckets are AOTInductor packages
(maverick/aot.py): exported once, compiled, kept on disk under a hash of the weights, shapes, options and
this file's and model.py's source, and loaded by a later engine without tracing anything. Every bucket of
2 rows or more runs one package whose row count is a dynamic dimension (`package_rows`; a 1-row bucket,
the 4-bit engine's decode step, has its own): each bucket gets the bits of a package built for it alone
(tested; measured on SmolLM2 bf16 and 4-bit) within 3% of its step time, for one build and one copy of
the weights instead of one per bucket. A dense engine's package is frozen: it holds its own oneDNN-packed
copy of the weights (331 MB for SmolLM2). A 4-bit engine's are not: their weights are kept apart from the
code, and once loaded every package reads the model's own tensors (`maverick.aot.share_tensors`); the
head (oneDNN-packed, which a package cannot take as a shared tensor) runs after the graph. SmolLM2 (AMD
EPYC Zen 4, 2 threads): the dense engine (five buckets) builds in 69 s and loads in 2.8 s, adding 684 MB
to the process; the 4-bit one (six buckets, two packages) builds in 91 s and loads in 2.3 s, adding 211
MB (with a package per bucket: 224-229 s and 228-254 s to build, 430 MB added by the 4-bit engine, 87.7
and 21.5 s to load under torch.compile). Elsewhere (CUDA, or aot=False) `torch.compile` traces the step
in every process and takes its compiled graphs from inductor's FX graph cache.

Where a step's time goes (4-bit SmolLM2, decode at a 300-token context, 6.6 ms, torch.profiler, AMD EPYC
Zen 4, 2 threads): the int4 linears 37%, the head (oneDNN bf16) 18%, the graph's fused kernels and its
wrapper 26%, dynamo's guard checks before each call 9%, the attention's bmm 6%. Most guards were on the
module tree (2,157 of 2,607 checks); each engine now compiles its own copy of the step's code and keeps only the
guards on its inputs (`_inputs_only`): 6.15 -> 5.63 ms a decode step, the same bits (measured in one run).

Weights. A dense bf16 model is compiled with `freezing`: its weights become constants that inductor
packs for oneDNN and calls directly. A model loaded with q4=True (maverick/q4.py) runs its projections
through torch's int4 kernel on the GGUF's own 4-bit codes, inside the graph: ~3.5x fewer bytes streamed
per step than bf16. Under torch.compile the 4-bit packs, and the head packed for oneDNN once here, are graph inputs, not frozen
constants, so that its graphs load from inductor's FX graph cache (~3 s a bucket); the dense engine stays
frozen there because its 121 linears through an opaque op on unfrozen packed weights ran at 72 instead of
99 tok/s (measured), and `cache_frozen_graphs` lets its frozen graphs into inductor's cache (66 s for
five buckets instead of 284 s; a hit still traces, freezes and packs the weights).
Not taken, measured on AMD EPYC Zen 4 (2 threads): the GGUF's one 8-bit matrix, the tied head (Q8_0), as
an inductor-generated dequantising reduction took 2.2 ms for 1 row and 13.1 for 24, against 0.95 and 2.1
ms for oneDNN's bf16 matmul on the packed dense head; `_weight_int8pack_mm` (0.61 ms for 1 row) takes one
scale per output row, not Q8_0's one per 32 inputs. Inductor's WoQ int4 GEMM template (max_autotune) on
AVX-512 computes in fp32 as the ATen kernel does and was slower (3072x576: 55 against 40 us for 1 row,
351 against 275 for 24); its AMX micro-kernel is for the Xeon.

Row counts. A call of T tokens runs the graph of the smallest row bucket >= T (`rows`), padded with
token 0 at the positions after the real ones: causal masking keeps the padding out of every real row,
and the padding's cache writes land past the committed length, which nothing reads. Where that bucket is
an AOT package of dynamic rows, the call runs it at T rows, unpadded (`bucket`): every row keeps the bits
of its bucket's padded call (tested; on SmolLM2 every T of 2-24 against decoding token by token, bf16
and 4-bit), and on the 4-bit engine 5 rows cost 9.9 ms where the 8-row bucket costs 11.4. Greedy
speculative decoding is bit-exact with plain decoding on this engine only if a token's logits have the
same bits in every bucket; the smallest bucket is the smallest row count from which oneDNN's bf16
matmuls keep each row's bits (`maverick.linear.invariant_rows`: 1 on the Xeon with AMX, 2 on AMD Zen 4
for the dense model, whose down projection needs 2; 1 for the 4-bit model, whose one dense matmul is the
head), and tests/test_compiled.py measures the invariance of the compiled graphs themselves.

Attention reads the slots in use, not the whole cache: a call attends to the committed length plus its
rows rounded up to blocks of SPAN slots, a dynamic dimension (one graph per bucket serves every length;
a graph over the whole cache spent 4.5 of 8.7 ms per step on a 2,432-slot cache, measured). It is two
fp32 bmm with the mask and softmax fused between them, each on at least `model.bmm_min_rows()` rows
(padded), the count from which this CPU's fp32 bmm keeps every row's bits. probs @ v runs per block of
SPAN slots and sums the blocks in order: one bmm over all S slots changed bits with S (measured), while
the masked blocks past the keys in use add exact zeros at the end, so a row's bits do not depend on the
span (tested). Written instead as broadcast multiplies and reductions (the fallback where no row count
keeps bmm's bits) it cost ~17 of a 25 ms SmolLM2 step on AMD Zen 4 (measured).

Compiled artifacts go under `.cache/` in the repository: AOT packages in `.cache/aoti`, inductor's caches
in `.cache/inductor` (or $TORCHINDUCTOR_CACHE_DIR). `compile()` builds or loads every bucket up front and
reports the seconds apart from the time to first token.
"""

from __future__ import annotations

import os
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from maverick.aot import (
    SHARED,
    load_or_build,
    package_key,
    require_cpu_engines,
    share_tensors,
    weights_digest,
)
from maverick.kv_cache import KVCache
from maverick.linear import packed_linear, packed_matmul, packed_weight
from maverick.model import Llama4, Output, _rms, apply_rope, bmm_min_rows, rope_tables
from maverick.model import __file__ as model_source
from maverick.q4 import GROUP, Q4Weight, group_pack, live_pack

CACHE_DIR = Path(__file__).resolve().parent.parent / ".cache" / "inductor"
# verify buckets; the decode bucket (1 or 2) is added in front. 2 holds a one-token draft (the tuned draft's most
# common cycle: 155 of 254 in a bench run; the 4-bit engine's verify costs ~0.28 ms a padded row), 12 tuned
# k <= 8 and prompt-lookup copies of 10 tokens (+ 1), 24 a lookup streak of 20; every bucket is a graph
# to compile (~50-70 s on 2 cores)
DEFAULT_ROWS = (2, 4, 8, 12, 24)
SPAN = 64  # a call attends to the slots in use rounded up to a multiple of this (a dynamic dimension)
MIN_DYNAMIC_ROWS = 2  # AOT: the buckets from this many rows up share one package of a dynamic row count
SLOTS_ROUND = 1024  # an engine's cache holds a multiple of this many slots


def use_repo_cache() -> None:
    """Point inductor's caches at .cache/inductor in the repository unless the user chose a directory (an
    earlier torch.compile, e.g. maverick/codes.py's at import, has set the variable to inductor's default
    in /tmp: that one is replaced; inductor reads the variable at each cache access)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    cur = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if cur is None or os.path.abspath(cur) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(CACHE_DIR)


def cache_frozen_graphs() -> None:
    """Let inductor's FX graph cache serve frozen CPU graphs (torch 2.13; once per process).

    Inductor caches frozen graphs by design: a frozen weight enters the cache key by its metadata only, and
    a cache hit takes the weights' values from the graph module being compiled, so an engine of other
    weights gets its own numbers (tested). Only the check that no constant is a oneDNN (mkldnn) tensor,
    which cannot be pickled, stops it: freezing packs every bf16 linear weight into one. Frozen packed
    weights are never pickled (looked up by name), so this lets them through with their dtype and shape as
    their key, as inductor does for every other frozen weight. The dense engine's five buckets then load in
    about a minute in a later run instead of compiling for ~4-5 minutes. Where torch's internals differ,
    nothing is patched (the graphs compile every run, as before)."""
    from torch._inductor import codecache
    from torch._inductor.freezing_utils import is_frozen_param

    validator, pickler = (
        getattr(codecache, "CacheabilityValidator", None),
        getattr(codecache, "FxGraphCachePickler", None),
    )
    if validator is None or pickler is None or getattr(pickler, "_maverick_frozen", False):
        return
    if not (hasattr(validator, "check_tensor") and hasattr(pickler, "_reduce_tensor")):
        return
    check, reduce = validator.check_tensor, pickler._reduce_tensor

    def check_tensor(t):
        if not (t.is_mkldnn and is_frozen_param(t)):
            check(t)

    def reduce_tensor(self, t):
        if t.is_mkldnn and is_frozen_param(t):
            return codecache._ident, (("frozen mkldnn", t.dtype, tuple(t.shape)),)
        return reduce(self, t)

    validator.check_tensor = staticmethod(check_tensor)
    pickler._reduce_tensor = reduce_tensor
    pickler._maverick_frozen = True


def min_invariant_rows(model: Llama4, head_only: bool = False) -> int:
    """The fewest rows from which every bf16 weight matrix of `model` (head_only: the head, the one dense
    matrix of a 4-bit engine) gives each row the same bits through oneDNN's packed kernel (the kernel
    inductor's freezing uses for CPU linears); 1 off CPU or bf16."""
    if model.device.type != "cpu" or model.dtype != torch.bfloat16:
        return 1
    from maverick.linear import _SUPPORTED, invariant_rows, packed_linear, packed_weight

    if not _SUPPORTED:
        return 1
    linears = [model.lm_head] if head_only else [m for m in model.modules() if isinstance(m, nn.Linear)]
    shapes = {tuple(m.weight.shape) for m in linears}
    lo = 1
    for N, K in sorted(shapes):
        w = torch.randn(N, K, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        packed = packed_weight(w)
        lo = max(
            lo, invariant_rows(lambda x, p=packed: packed_linear(x, p, None), "packed", (N, K), w.dtype)[0]
        )
    return lo


def _q4_packs(model: Llama4) -> dict[str, list[Q4Weight]] | None:
    """Every layer's live 4-bit packs (maverick/q4.py) by "<layer>_<qkv|o|gate_up|down>": one pack for the
    group, or one per projection where they do not stack; None unless every projection of every layer has
    one (a model loaded with q4=True from a Q4 GGUF)."""
    out = {}
    for name, layers in _groups(model):
        packs = [live_pack(m) for m in layers]
        if any(p is None for p in packs):
            return None
        group = group_pack(layers)
        out[name] = [group] if group is not None else packs
    return out


def _groups(model: Llama4):
    """("<layer>_<qkv|o|gate_up|down>", the projections multiplied side by side) for every layer."""
    for i, layer in enumerate(model.model.layers):
        a, f = layer.self_attn, layer.feed_forward
        yield f"{i}_qkv", (a.q_proj, a.k_proj, a.v_proj)
        yield f"{i}_o", (a.o_proj,)
        yield f"{i}_gate_up", (f.gate_proj, f.up_proj)
        yield f"{i}_down", (f.down_proj,)


class _Call(NamedTuple):
    """What every layer's attention reads of one compiled call (`_Step.layers`)."""

    write: Tensor  # [B, T]: the cache slots of the new keys and values
    tree: tuple[Tensor, Tensor] | None  # `_TreeStep`'s (keys, window), None for a chain
    cos: Tensor  # [B, T, 1, D]: RoPE at the positions
    sin: Tensor
    temperature: Tensor | None  # [B, T]: the NoPE layers' scale, None without them
    k_cache: Tensor  # [L, B, Hkv, slots, D]
    v_cache: Tensor
    S: int  # the slots attended to
    rows: Tensor  # [B, 1]: the batch index of each row


class _Step(nn.Module):
    """One forward of T new tokens per row at cache slots (= positions) start .. start + T - 1, every
    layer dense. A module, so that inductor's freezing sees the weights as parameters; the caches are
    arguments (never frozen) and are written in place.

    tokens [B, T], start [B], k_cache / v_cache [L, B, Hkv, S, D] -> logits [B, T, V] (model dtype),
    features [B, T, n H] (the states entering `feature_layers`, concatenated; [B, T, 0] for none),
    hidden [B, T, H] (after the final norm)."""

    def __init__(self, model: Llama4, feature_layers: tuple[int, ...], slots: int, head: bool = True):
        super().__init__()
        self.model = model
        self.feature_layers = feature_layers
        # per-position tables for the cache's slots, read by position: RoPE's cos and sin, and the NoPE layers'
        # temperature scale. Computed in a graph they took other bits where the positions were a tensor read
        # (a tree's depths) than where they were an arange (a chain's): measured on SmolLM2, from node 4 on
        cos, sin = rope_tables(torch.arange(slots, device=model.device)[None], model.inv_freq)
        self.register_buffer("rope_cos", cos[0], persistent=False)  # [slots, 1, D]
        self.register_buffer("rope_sin", sin[0], persistent=False)
        a = next(
            (layer.self_attn for layer in model.model.layers if layer.self_attn.temperature_tuning), None
        )
        if a is not None:
            scale = a.temperature(torch.arange(slots, device=model.device))
            self.register_buffer("temperature", scale, persistent=False)  # [slots]
        self.bmm_rows = bmm_min_rows()  # probed here, eagerly: a compiled region cannot run the probe
        self.q4 = _q4_packs(model)
        # head=False: the step returns (features, hidden) and its caller applies the head (a 4-bit AOT package
        # shares the model's tensors, and a oneDNN-packed head cannot be one of them); an unfrozen 4-bit
        # step multiplies by the head packed here, a dense (frozen) one lets freezing pack it
        self.head = head
        self.packed_head = self.q4 is not None and head
        for name, packs in (self.q4 or {}).items():  # buffers: graph inputs (or constants, frozen)
            for j, pack in enumerate(packs):
                self.register_buffer(f"q4w_{name}_{j}", pack.packed, persistent=False)
                self.register_buffer(f"q4sz_{name}_{j}", pack.scale_zero, persistent=False)
        if self.packed_head:  # unfrozen: the head packed for oneDNN here, as freezing would, a buffer
            self.register_buffer("pk_head", packed_weight(model.lm_head.weight), persistent=False)

    def forward(self, tokens: Tensor, start: Tensor, k_cache: Tensor, v_cache: Tensor, span: Tensor):
        pos = start[:, None] + torch.arange(tokens.shape[1], device=tokens.device)  # [B, T]
        return self.layers(tokens, pos, pos, None, k_cache, v_cache, span)

    def layers(
        self, tokens: Tensor, pos: Tensor, write: Tensor, tree, k_cache: Tensor, v_cache: Tensor, span
    ):
        """The whole model on tokens [B, T] at positions `pos`, their keys and values written at cache slots
        `write` [B, T] (a chain: the positions); tree: None, or `_TreeStep`'s layout (batch 1)."""
        m, cfg = self.model, self.model.config
        B, T = tokens.shape
        S = span.shape[0] * SPAN  # the slots attended to: SPAN-slot blocks, dynamic (one graph for all)
        dev = tokens.device
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # [B, T, 1, D]
        temperature = self.temperature[pos] if hasattr(self, "temperature") else None  # [B, T]
        slot = torch.arange(S, device=dev)
        visible = slot[None, None, :] <= pos[:, :, None]  # [B, T, S]: committed slots and the causal new ones
        bias = torch.where(visible, 0.0, float("-inf"))[:, None, None]  # [B, 1, 1, T, S]
        chunk_bias = None
        if any(layer.self_attn.chunked for layer in m.model.layers):
            C = cfg.attention_chunk_size
            same = slot[None, None, :] // C == pos[:, :, None] // C
            chunk_bias = torch.where(visible & same, 0.0, float("-inf"))[:, None, None]
        rows = torch.arange(B, device=dev)[:, None]
        call = _Call(write, tree, cos, sin, temperature, k_cache, v_cache, S, rows)
        x = m.model.embed_tokens(tokens)
        feats: dict[int, Tensor] = {}  # layer -> the state entering it
        for i, layer in enumerate(m.model.layers):
            if i in self.feature_layers:
                feats[i] = x
            a, f = layer.self_attn, layer.feed_forward
            h = layer.input_layernorm(x)
            qkv = self._linear(h, f"{i}_qkv", (a.q_proj, a.k_proj, a.v_proj))
            o = self._attend(a, qkv, i, chunk_bias if a.chunked else bias, call)
            x = x + self._linear(o, f"{i}_o", (a.o_proj,))
            h = layer.post_attention_layernorm(x)
            gate_up = self._linear(h, f"{i}_gate_up", (f.gate_proj, f.up_proj))
            I = f.gate_proj.weight.shape[0]
            x = x + self._linear(F.silu(gate_up[..., :I]) * gate_up[..., I:], f"{i}_down", (f.down_proj,))
        if cfg.num_hidden_layers in self.feature_layers:
            feats[cfg.num_hidden_layers] = x
        h = m.model.norm(x)
        features = torch.cat([feats[i] for i in self.feature_layers], -1) if feats else x[..., :0]
        if not self.head:
            return features, h
        logits = packed_matmul(h, self.pk_head) if self.packed_head else F.linear(h, m.lm_head.weight)
        return logits, features, h

    def _linear(self, x: Tensor, name: str, layers: tuple[nn.Module, ...]) -> Tensor:
        """x times the layers' weights side by side: their 4-bit pack where the model has them (torch's int4
        kernel, maverick/q4.py), else the dense weights concatenated (freezing folds the concatenation)."""
        if self.q4 is None:
            return F.linear(x, torch.cat([m.weight for m in layers]) if len(layers) > 1 else layers[0].weight)
        x2 = x.reshape(-1, x.shape[-1])
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        ys = [
            mm(x2, getattr(self, f"q4w_{name}_{j}"), GROUP, getattr(self, f"q4sz_{name}_{j}"))
            for j in range(len(self.q4[name]))
        ]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, -1)
        return y.view(*x.shape[:-1], y.shape[-1])

    def _attend(self, a, qkv: Tensor, layer: int, bias: Tensor, call: _Call) -> Tensor:
        """`Attention.attend` for the compiled step: qkv [B, T, (Hq + 2 Hkv) D] -> [B, T, Hq D]; this layer's
        cache k/v written at slots `call.write`; attention in fp32 over the first `call.S` slots, `bias`
        masking (in each row's chain order: a tree's rows see their ancestors at the slots of their positions,
        `_tree_attend`)."""
        write, tree, cos, sin, temperature, k_cache, v_cache, S, rows = call
        min_rows = self.bmm_rows
        B, T, _ = qkv.shape
        Hq, Hkv, D = a.n_heads, a.n_kv, a.head_dim
        G = Hq // Hkv
        qkv = qkv.view(B, T, Hq + 2 * Hkv, D)
        qk, v = qkv[:, :, : Hq + Hkv], qkv[:, :, Hq + Hkv :]
        if a.use_rope:
            qk = apply_rope(qk, cos, sin)
        q, k = qk[:, :, :Hq], qk[:, :, Hq:]
        if a.qk_norm:
            q, k = _rms(q, a.eps), _rms(k, a.eps)
        elif a.temperature_tuning:
            q = (q * temperature[:, :, None, None]).to(q.dtype)
        # one index_put_ on the whole cache (not on a layer's view): inductor then writes the T slots in
        # place instead of copying the layer (measured: a view's write copied it, and the cache once per step)
        idx = (
            torch.full((1, 1, 1), layer, device=write.device),
            rows[:, :, None],
            torch.arange(Hkv, device=write.device),
            write[:, :, None],
        )
        k_cache.index_put_(idx, k.to(k_cache.dtype))  # k [B, T, Hkv, D] at [layer, b, h, write[b, t]]
        v_cache.index_put_(idx, v.to(v_cache.dtype))
        q_f = q.float().view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
        k_f, v_f = k_cache[layer, :, :, :S].float(), v_cache[layer, :, :, :S].float()  # [B, Hkv, S, D]
        if tree is not None:
            o = _tree_attend(q_f[0], k_f[0], v_f[0], bias[0, 0], tree, min_rows)[None]
        # no row count keeps fp32 bmm's bits here: reductions (slower, tested invariant)
        elif min_rows is None:
            scores = (q_f[:, :, :, :, None] * k_f[:, :, None, None]).sum(-1)  # [B, Hkv, G, T, S]
            probs = (scores * D**-0.5 + bias).softmax(-1)
            o = (probs[..., None] * v_f[:, :, None, None]).sum(-2)  # [B, Hkv, G, T, D]
        else:  # fp32 bmm of at least `rows` rows, as model.exact_attention: every row keeps its bits
            n = G * T
            pad = (0, 0, 0, max(min_rows - n, 0))
            q_f = F.pad(q_f.reshape(B * Hkv, n, D), pad)
            scores = torch.bmm(q_f, k_f.reshape(B * Hkv, S, D).transpose(1, 2))[:, :n]
            probs = (scores.view(B, Hkv, G, T, S) * D**-0.5 + bias).softmax(-1)
            # probs @ v per block of SPAN slots, the blocks summed in order: a bmm over all S slots sums
            # them in an order that changes with S (measured), the blocks' fixed-size products do not, and
            # the masked blocks past the keys in use add exact zeros at the end
            m = S // SPAN
            p = F.pad(probs.reshape(B * Hkv, n, m, SPAN).transpose(1, 2), pad)  # [B Hkv, m, n', SPAN]
            p = p.reshape(B * Hkv * m, -1, SPAN)
            o = torch.bmm(p, v_f.reshape(B * Hkv * m, SPAN, D)).view(B * Hkv, m, -1, D)
            o = o[:, :, :n].sum(1).view(B, Hkv, G, T, D)
        return o.permute(0, 3, 1, 2, 4).reshape(B, T, Hq * D).to(qkv.dtype)


def _tree_attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, tree, min_rows: int | None) -> Tensor:
    """A tree verify's attention (batch 1) with the bits of decoding each root-to-node path token by token,
    as `model.tree_attention` does for the eager model: q [Hkv, G, T, D], k/v [Hkv, S, D] in cache order
    (node t at slot start + t), bias [1, T, S] in chain order; tree = (keys [T, S]: the cache slot of each
    node's chain slot, window [2 SPAN]: the chain slots of the two SPAN-blocks that hold every node's
    ancestors) -> [Hkv, G, T, D].

    A score is one D-long dot product whose bits do not depend on where its key sits: all scores come from
    one product in cache order and are gathered into each node's chain order for the softmax, as `_attend`
    computes a chain's. The product with the values sums over slots, so it must see each node's values in
    its chain order: the blocks before the window are the same for every node (the committed prefix) and
    run as `_attend` runs them; the two window blocks run per node on values gathered into its chain order,
    and replace those blocks before the blocks are summed in order."""
    Hkv, G, T, D = q.shape
    S = k.shape[1]
    keys, window = tree
    n = G * T
    pad = (0, 0, 0, max((min_rows or 1) - n, 0))
    q_f = F.pad(q.reshape(Hkv, n, D), pad)
    scores = torch.bmm(q_f, k.transpose(1, 2))[:, :n].view(Hkv, G, T, S)  # cache order
    scores = scores.gather(3, keys[None, None].expand(Hkv, G, T, S))  # each node's chain order
    probs = (scores * D**-0.5 + bias).softmax(-1)  # [Hkv, G, T, S]
    m = S // SPAN
    p = F.pad(probs.reshape(Hkv, n, m, SPAN).transpose(1, 2), pad)  # [Hkv, m, n', SPAN]
    o = torch.bmm(p.reshape(Hkv * m, -1, SPAN), v.reshape(Hkv * m, SPAN, D)).view(Hkv, m, -1, D)
    W = window.shape[0]
    wpad = (0, 0, 0, max((min_rows or 1) - G, 0))
    pw = probs.index_select(3, window).view(Hkv, G, T, W // SPAN, SPAN).permute(0, 2, 3, 1, 4)
    pw = F.pad(pw.reshape(-1, G, SPAN), wpad)  # [Hkv T 2, G', SPAN]: a node's rows, one window block
    vw = v.index_select(1, keys.index_select(1, window).flatten())  # [Hkv, T W, D]: each node's chain order
    ow = torch.bmm(pw, vw.view(-1, SPAN, D))[:, :G].view(Hkv, T, W // SPAN, G, D)
    ow = F.pad(ow.permute(0, 2, 3, 1, 4).reshape(Hkv, W // SPAN, n, D), (0, 0, 0, o.shape[2] - n))
    o = o.index_copy(1, window[::SPAN] // SPAN, ow)
    return o[:, :, :n].sum(1).view(Hkv, G, T, D)


class _TreeStep(_Step):
    """`_Step` for a tree verify (batch 1): T nodes written at cache slots start .. start + T - 1, node t at
    position start + depth[t], seeing the committed slots and its ancestors (`_tree_attend`).

    tokens [1, T], start [1], depth [1, T], anc [1, T, T] (anc[0, t, e]: the node at depth e on t's path, for
    e <= depth[t]; t beyond), k_cache / v_cache, span (covering start + T, two blocks at least: the window is
    the two blocks from start's, or the span's last two) -> `_Step`'s outputs for every node."""

    def forward(self, tokens, start, depth, anc, k_cache, v_cache, span):
        T = tokens.shape[1]
        dev = tokens.device
        S = span.shape[0] * SPAN
        pos = start[:, None] + depth
        write = start[:, None] + torch.arange(T, device=dev)
        slot = torch.arange(S, device=dev)
        w = slot - start  # [S]: offset in the nodes' slots
        inside = (w >= 0) & (w < T)
        ancestor = anc[0].gather(1, w.clamp(0, T - 1)[None].expand(T, S))  # [T, S]
        keys = torch.where(inside[None], start + ancestor, slot[None])
        first = torch.clamp(start // SPAN, max=S // SPAN - 2)  # the window's first block
        window = first * SPAN + torch.arange(2 * SPAN, device=dev)
        return self.layers(tokens, pos, write, (keys, window), k_cache, v_cache, span)


class CompiledTarget:
    """A built `Llama4` with compiled short calls, usable wherever decoding takes the model
    (`maverick.generate.Decoder`, `eagle3.spec.SpecDecoder`): same call signature, `new_cache`, `config`,
    `model` (the layers, e.g. the embedding the draft reads).

    max_len: the tokens every cache of this engine holds (its slots: max_len + the largest bucket, room for
    a padded call at the end, rounded up to SLOTS_ROUND).
    feature_layers: the states every compiled call returns (a draft's feature layers): plain decoding
    computes them too, so plain and speculative decoding run the same graphs.
    rows: the verify buckets; the decode bucket (`min_invariant_rows`) is added in front. On CUDA every
    call runs the largest bucket (a GPU reads the weights once for 1 or 24 rows alike).
    autotune: inductor's max_autotune (CPU GEMM templates; long compiles). cpp_wrapper: inductor's C++
    wrapper instead of the Python one (CPU)."""

    compiled = True

    def __init__(
        self,
        model: Llama4,
        max_len: int,
        feature_layers: Sequence[int] = (),
        rows: Sequence[int] = DEFAULT_ROWS,
        autotune: bool = False,
        cpp_wrapper: bool = True,
        aot: bool | None = None,
    ):
        bad = [i for i, layer in enumerate(model.model.layers) if layer.is_moe or not layer.flat_ok()]
        if bad:
            raise ValueError(
                f"the compiled engine runs dense layers of plain bf16/fp32 Linears; layers {bad} are not"
            )
        if model.device.type == "cpu":
            require_cpu_engines("the compiled engine")
        self.aot = model.device.type == "cpu" if aot is None else aot
        if self.aot and model.device.type != "cpu":
            raise ValueError("AOTInductor packages are this engine's CPU path; CUDA runs CUDA graphs")
        use_repo_cache()
        cache_frozen_graphs()
        self.base = model
        self.max_len = max_len
        self.feature_layers = tuple(feature_layers)
        q4 = _q4_packs(model) is not None  # torch's int4 kernel keeps each row's bits from 1 row (q4.py)
        lo = min_invariant_rows(model, head_only=q4)
        self.rows = tuple(sorted({lo, *(r for r in rows if r > lo)}))
        if model.device.type == "cuda":  # GPU matmuls choose kernels by row count; one bucket, ~free there
            self.rows = (max(self.rows),)
        # rounded up to SLOTS_ROUND: the cache's shape is part of every graph, so engines of nearby max_len
        # (a CLI call per prompt) share the graphs cached on disk
        self.slots = -(-(max_len + self.rows[-1]) // SLOTS_ROUND) * SLOTS_ROUND
        # a 4-bit AOT package is not frozen: after loading it runs on the model's own tensors, one copy for
        # every bucket, and the head packed here is applied outside the graph (see the module docstring)
        self.shared = self.aot and q4
        self.step = _Step(model, self.feature_layers, self.slots + 1, head=not self.shared).eval()
        self._pk_head = packed_weight(model.lm_head.weight) if self.shared else None
        # a dense model frozen, a 4-bit one not (see the module docstring)
        options = {"freezing": not q4, "emulate_precision_casts": True}
        if model.device.type == "cuda":
            options["triton.cudagraphs"] = True  # mode="reduce-overhead"
        elif self.aot:
            options["max_autotune"] = autotune
            if self.shared:
                options |= SHARED
        else:
            options |= {"max_autotune": autotune, "cpp_wrapper": cpp_wrapper}
        self.options = options
        self._runners: dict[tuple[int, int], Callable] = {}  # AOT: (bucket, batch) -> loaded package
        self._tree_runners: dict[tuple[int, int], Callable] = {}  # AOT: the same, of the tree graph
        self._built: dict[tuple, tuple] = {}  # AOT: (tree, least rows, most rows, batch) -> load_or_build's
        self._weights: str | None = None  # AOT: weights_digest of the step, taken at the first package
        self.packages: dict[int, Path] = {}  # AOT: bucket -> the package file it runs
        self.loaded: dict[int, bool] = {}  # AOT: bucket -> whether that package came from disk
        self._fn = torch.compile(
            _own_forward(self.step), dynamic=False, fullgraph=True, options={"guard_filter_fn": _inputs_only}
        )
        # tree verifies (batch 1): a graph of their own, built at the first tree call
        self.tree_step = _TreeStep(model, self.feature_layers, self.slots + 1, head=not self.shared).eval()
        self._tree_fn = torch.compile(
            _own_forward(self.tree_step),
            dynamic=False,
            fullgraph=True,
            options={"guard_filter_fn": _inputs_only},
        )
        self.compile_seconds: dict[int, float] = {}  # bucket -> seconds of its first call
        self._spans: dict[int, Tensor] = {}
        # force every call's key span (tests: bits across spans); on CUDA the whole cache, one graph shape
        self.span_slots: int | None = self.slots if model.device.type == "cuda" else None

    # ---- what decoding reads from a model ----

    @property
    def config(self):
        return self.base.config

    @property
    def model(self):
        return self.base.model

    @property
    def device(self) -> torch.device:
        return self.base.device

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    def new_cache(
        self, batch_size: int, max_len: int | None = None, dtype=None, exact: bool = True
    ) -> KVCache:
        """A cache of the engine's fixed `slots` (max_len may only ask for less), in the model dtype: the keys
        and values are rounded to it before they are written, and the attention reads them in fp32."""
        if max_len is not None and max_len > self.max_len:
            raise ValueError(
                f"a cache of {max_len} slots asked of a compiled engine built for {self.max_len}"
            )
        c = self.config
        cache = KVCache(
            c.num_hidden_layers,
            batch_size,
            self.slots + 1,  # a spare slot: a span never reaches the end (a full-length slice specialises)
            c.num_key_value_heads,
            c.head_dim,
            self.dtype,
            self.device,
        )
        cache.max_len = self.slots
        cache.slice_to_bound = False
        cache.compiled = True
        if self.device.type == "cuda":  # CUDA graphs replay on fixed addresses
            torch._dynamo.mark_static_address(cache.k)
            torch._dynamo.mark_static_address(cache.v)
        return cache

    # ---- calls ----

    def bucket(self, T: int) -> int | None:
        """The row count a call of T tokens runs at (None: too many for a compiled step, eager): its bucket's,
        or T itself (at least the package's least) where that bucket runs an AOT package of dynamic rows."""
        R = next((r for r in self.rows if r >= T), None)
        if R is None or not self.aot:
            return R
        lo, hi = self.package_rows(R)
        return max(T, lo) if lo < hi else R

    @torch.no_grad()
    def __call__(
        self,
        tokens: Tensor,
        cache: KVCache | None = None,
        positions: Tensor | None = None,
        tree_mask: Tensor | None = None,
        feature_layers: tuple[int, ...] = (),
        logits: str | Tensor | None = "all",
        inputs_embeds: Tensor | None = None,
    ) -> Output:
        """`Llama4.forward`: compiled for a chain of T <= max(rows) tokens on a cache of this engine, and for a
        tree of T nodes (tree_mask and positions, batch 1); eager otherwise (a prefill, from an empty cache;
        explicit positions without a tree)."""
        B, T = tokens.shape
        R = self.bucket(T)
        ours = getattr(cache, "compiled", False)
        tree = tree_mask is not None and positions is not None and B == 1
        if tree and T > SPAN + 1:  # its window of two SPAN blocks would not hold a deeper node's path
            raise ValueError(f"a tree of {T} nodes: the compiled engine verifies trees of up to {SPAN + 1}")
        if R is None and ours and bool(cache.lengths.any()):  # eager would change a verify's bits
            raise ValueError(
                f"a chain of {T} tokens: the compiled engine's largest bucket is {self.rows[-1]}"
            )
        if R is None or not ours or inputs_embeds is not None or (positions is not None and not tree):
            return self._eager(tokens, cache, positions, tree_mask, feature_layers, logits, inputs_embeds)
        missing = [i for i in feature_layers if i not in self.feature_layers]
        if missing:
            raise ValueError(
                f"feature layers {missing} asked of a compiled engine built for {self.feature_layers}"
            )
        if int(cache.lengths.max()) + R > cache.max_len:
            raise RuntimeError(
                f"KV cache overflow: {R} rows past {int(cache.lengths.max())}, cache holds {cache.max_len}"
            )
        x = tokens.new_zeros(B, R)  # fresh, standard strides: a slice's strides would recompile
        x[:, :T] = tokens
        nodes = (positions[0] - cache.lengths, tree_mask[0]) if tree else None
        lg, feats, h = self.run(R, x, cache, nodes)
        cache.advance(T)
        lg, feats, h = lg[:, :T], feats[:, :T], h[:, :T]
        if feature_layers:
            idx = [self.feature_layers.index(i) for i in feature_layers]
            H = h.shape[-1]
            feats = torch.cat([feats[..., j * H : (j + 1) * H] for j in idx], -1)
        else:
            feats = None
        if isinstance(logits, Tensor):
            lg = lg.gather(1, logits[..., None].expand(-1, -1, lg.shape[-1]))
        elif logits == "last":
            lg = lg[:, -1:]
        elif logits is None:
            lg = None
        elif logits != "all":
            raise ValueError(f"logits must be 'all', 'last', None or an index tensor, got {logits!r}")
        return Output(lg, feats, h)

    @torch.no_grad()
    def run(self, R: int, tokens: Tensor, cache: KVCache, tree: tuple[Tensor, Tensor] | None = None):
        """The compiled graph on tokens [B, R] (R: a bucket, or a row count of a package of dynamic rows,
        `bucket`); the first call of a package compiles it (or loads it from disk). tree: (depth [T],
        tree_mask [T, T]) when the first T tokens are a tree's nodes (batch 1; node i sees j iff j is i or an
        ancestor; ancestors first, by depth): the tree graph (`_TreeStep`) runs instead."""
        first = tree is None and R in self.rows and R not in self.compile_seconds
        t0 = time.perf_counter() if first else None
        span = self._span(cache, R)
        if tree is None:
            args = (tokens, cache.lengths, cache.k, cache.v, span)
            fn, runners = self._fn, self._runners
        else:
            args = (tokens, cache.lengths, *self._tree_inputs(R, *tree), cache.k, cache.v, span)
            fn, runners = self._tree_fn, self._tree_runners
        if self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        if self.aot:
            runner = runners.get((R, tokens.shape[0])) or self._package(R, args, tree is not None)
            out = tuple(runner(*args))
            if self.shared:  # features, hidden: the head applied here (packed_matmul's op, called directly)
                out = (packed_linear(out[1], self._pk_head, None), *out)
        else:
            # inductor's options patched here: passed to torch.compile they skip freezing (2.13); each bucket
            # is a recompile of the engine's own code object (`_own_forward`), past dynamo's default limit of 8
            with torch._inductor.config.patch(self.options), torch._dynamo.config.patch(recompile_limit=64):
                out = fn(*args)
        if self.device.type == "cuda":  # the next replay overwrites a CUDA graph's outputs
            out = tuple(t.clone() for t in out)
        if t0 is not None:
            self.compile_seconds[R] = time.perf_counter() - t0
        return out

    def _tree_inputs(self, R: int, depth: Tensor, tree_mask: Tensor) -> tuple[Tensor, Tensor]:
        """The tree graph's depth [1, R] and ancestors [1, R, R] (each node's, by depth, then itself repeated)
        for a tree of T <= R nodes; the R - T padding rows are nodes of their own at depth 0."""
        if self.step.bmm_rows is None:
            raise ValueError("compiled tree verifies need a row count that keeps fp32 bmm's bits on this CPU")
        T, dev = depth.shape[0], self.device
        order = torch.arange(R, device=dev)
        anc = torch.where(tree_mask.bool(), order[None, :T], R).sort(-1).values  # [T, T] ancestors by depth
        anc = torch.cat([anc, order[T:, None].expand(-1, T)], 0)  # the padding: nodes of their own
        anc = torch.cat([anc, order[:, None].expand(-1, R - T)], 1)
        anc = torch.where(anc == R, order[:, None], anc)
        depth = torch.cat([depth.to(dev), depth.new_zeros(R - T)])[None]
        return depth, anc[None]

    def package_rows(self, R: int) -> tuple[int, int]:
        """The row counts (least, most) of the AOT package that runs bucket R: one package with a dynamic row
        count serves every bucket of 2 rows or more (a dimension of 1 would be specialised), so the buckets
        share one build and one copy of a dense model's frozen weights; a 1-row bucket has its own."""
        c = self.base.config
        # a bucket whose attention rows (G query heads a KV head, times R) are fewer than the fp32 bmm's row
        # count is padded by a number of rows that depends on R: a guard a dynamic R cannot export past (MHA)
        least = max(
            MIN_DYNAMIC_ROWS, -(-(self.step.bmm_rows or 0) * c.num_key_value_heads // c.num_attention_heads)
        )
        many = [r for r in self.rows if r >= least]
        return (many[0], many[-1]) if R >= least and len(many) > 1 else (R, R)

    def _package(self, R: int, args: tuple, tree: bool = False) -> Callable:
        """Bucket R's AOTInductor package (of the tree graph when `tree`) for this batch size (maverick/aot.py):
        loaded from disk when this engine's weights, shapes, options and source were compiled before, else
        exported and compiled. Its rows are `package_rows(R)`: measured on SmolLM2 (bf16 and 4-bit), the
        dynamic package gives every bucket the bits of a package built for that bucket alone, within 3% of its
        step time."""
        if self._weights is None:
            self._weights = weights_digest(self.step)
        B = args[0].shape[0]
        lo, hi = self.package_rows(R)
        built = self._built.get((tree, lo, hi, B))  # another bucket's package: the same one
        if built is None:
            step = self.tree_step if tree else self.step
            key = package_key(
                self._weights,
                (__file__, model_source),
                engine="target-tree" if tree else "target",
                config=repr(self.base.config),  # what shapes the graph beyond its weights: eps, RoPE, ...
                rows=(lo, hi),
                batch=B,
                slots=self.slots,
                features=self.feature_layers,
                bmm_rows=self.step.bmm_rows,
                options=self.options,
            )
            blocks = {0: torch.export.Dim("blocks", min=2, max=self.slots // SPAN)}
            dim = torch.export.Dim("rows", min=lo, max=hi) if hi > lo else None
            rows = {1: dim} if dim is not None else None
            if tree:  # tokens, lengths, depth, ancestors, k, v, span
                square = {1: dim, 2: dim} if dim is not None else None
                dynamic = (rows, None, rows, square, None, None, blocks)
            else:  # tokens, lengths, k, v, span
                dynamic = (rows, None, None, None, blocks)
            share = (lambda runner, path: share_tensors(runner, step, path)) if self.shared else None
            built = self._built[(tree, lo, hi, B)] = load_or_build(
                step, args, dynamic, self.options, key, prepare=share
            )
        runner, path, loaded = built
        if not tree and R in self.rows:
            self.packages[R], self.loaded[R] = path, loaded
        (self._tree_runners if tree else self._runners)[(R, B)] = runner
        return runner

    def _span(self, cache: KVCache, R: int) -> Tensor:
        """`span_carrier` of the committed slots plus R (or the span forced on the engine, `span_slots`);
        static on CUDA, whose graphs replay one shape (the whole cache)."""
        slots = self.span_slots or int(cache.lengths.max()) + R
        return span_carrier(self._spans, slots, self.device, dynamic=self.device.type != "cuda")

    def prefill(self, tokens: Tensor, cache: KVCache, **kw) -> Output:
        """A prefill (`maverick.generate.prefill`), eager whatever its length: a compiled one for prompts that
        fit a bucket gave a prompt other bits beside a longer one (eager)."""
        return self._eager(tokens, cache, **kw)

    def _eager(
        self,
        tokens,
        cache,
        positions=None,
        tree_mask=None,
        feature_layers=(),
        logits="all",
        inputs_embeds=None,
    ) -> Output:
        """The eager model, on this engine's cache too (prefill): its bookkeeping slices to the part in use."""
        if cache is None or not getattr(cache, "compiled", False):
            return self.base(tokens, cache, positions, tree_mask, feature_layers, logits, inputs_embeds)
        with cache.sliced_to_use():
            return self.base(tokens, cache, positions, tree_mask, feature_layers, logits, inputs_embeds)

    def compile(self, batch_size: int = 1) -> dict[int, float]:
        """Compile (or load from the cache) every bucket's graph now, on a scratch cache; returns the
        seconds per bucket (first call minus a second call: the compile alone)."""
        cache = self.new_cache(batch_size)
        for R in self.rows:
            tokens = torch.zeros(batch_size, R, dtype=torch.long, device=self.device)
            self.compile_seconds.pop(R, None)
            self.run(R, tokens, cache)
            t0 = time.perf_counter()
            self.run(R, tokens, cache)
            self.compile_seconds[R] -= time.perf_counter() - t0
        return dict(self.compile_seconds)


def tree_mismatches(
    engine: CompiledTarget, cases: Sequence[tuple[int, int]], seed: int = 0, vocab: int | None = None
) -> list[dict]:
    """Where a tree verify on `engine` does not give a node the logits and features (bit for bit) of its
    root-to-node path verified as a chain, and decoded token by token: per case (prompt tokens, nodes), a
    random prompt and a random tree. [] when every node of every case keeps the bits.
    A measurement an engine must pass before speculative decoding takes trees on it (tests; the GPU
    script's --tree-check)."""
    g = torch.Generator().manual_seed(seed)
    V = vocab or engine.config.vocab_size
    feats = engine.feature_layers
    bad = []
    cache, c = engine.new_cache(1), engine.new_cache(1)  # two caches, reused: CUDA graphs keep addresses
    for n0, T in cases:
        cache.lengths.zero_()
        engine(torch.randint(0, V, (1, n0), generator=g).to(engine.device), cache)  # prefill
        n, k, v = cache.lengths.clone(), cache.k.clone(), cache.v.clone()
        mask, depth = torch.eye(T, dtype=torch.bool), [0]  # node i sees j iff j is i or an ancestor
        for i in range(1, T):
            parent = int(torch.randint(0, i, (1,), generator=g))
            mask[i] |= mask[parent]
            depth.append(depth[parent] + 1)
        tokens = torch.randint(0, V, (T,), generator=g).to(engine.device)
        paths = [mask[t].nonzero()[:, 0].tolist() for t in range(T)]
        mask = mask.to(engine.device)
        pos = (n + torch.tensor(depth, device=engine.device))[None]
        out = engine(tokens[None], cache, positions=pos, tree_mask=mask[None], feature_layers=feats)
        if int(cache.lengths) != n0 + T:
            raise RuntimeError(
                f"a tree of {T} nodes advanced the cache to {int(cache.lengths)}, not {n0 + T}"
            )
        for t, path in enumerate(paths):
            for per_token in (False, True):
                c.k.copy_(k)
                c.v.copy_(v)
                c.lengths.copy_(n)
                for x in [tokens[[j]] for j in path] if per_token else [tokens[path]]:
                    o = engine(x[None], c, feature_layers=feats)
                same = torch.equal(o.logits[0, -1], out.logits[0, t])
                if not (same and torch.equal(o.features[0, -1], out.features[0, t])):
                    way = "tokens" if per_token else "chain"
                    bad.append({"prompt": n0, "node": t, "depth": depth[t], "against": way, "logits": same})
    return bad


def span_carrier(spans: dict[int, Tensor], slots: int, device, dynamic: bool = True) -> Tensor:
    """The shape carrier of a compiled call's key span: `slots` in blocks of SPAN (at least 2: a dynamic size
    of 1 would be specialised, a second graph), an empty tensor of one row per block whose length the graph
    reads, kept in `spans` by block count and marked dynamic so that one graph serves every span."""
    blocks = max(2, -(-slots // SPAN))
    span = spans.get(blocks)
    if span is None:
        span = spans[blocks] = torch.empty(blocks, 0, device=device)
        if dynamic:
            torch._dynamo.mark_dynamic(span, 0)
    return span


def _own_forward(step: nn.Module):
    """`step.forward` on a code object of its own. Dynamo keeps compiled graphs, and the guards that choose
    among them, per code object: with one per engine, a graph is only ever called with its own engine's
    `self`, so the guards on `self` can go (`_inputs_only`)."""
    f = type(step).forward
    own = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    return types.MethodType(own, step)


def _inputs_only(guards) -> list[bool]:
    """Keep dynamo's guards on the call's inputs and globals, drop those on `self`, the engine's module tree
    (2,157 of 2,607 checks on 4-bit SmolLM2: 0.5 ms of a 6.2 ms decode step, measured). Safe because each
    engine has its own code object (`_own_forward`) and its module tree does not change after it is built:
    weights written in place are read live by the 4-bit engine and were folded at compile time by the frozen
    one."""
    return [not (g.name == "self" or g.name.startswith(("self.", "self["))) for g in guards]


def compiled_target(model, max_len: int, feature_layers: Sequence[int] = (), **kw) -> CompiledTarget:
    """`model` as a `CompiledTarget` (returned as is when it already is one, after checking it fits)."""
    if isinstance(model, CompiledTarget):
        if max_len > model.max_len or not set(feature_layers) <= set(model.feature_layers):
            raise ValueError(
                f"a compiled engine of max_len {model.max_len}, features {model.feature_layers} asked for "
                f"max_len {max_len}, features {tuple(feature_layers)}"
            )
        return model
    return CompiledTarget(model, max_len, feature_layers, **kw)


def for_engine(model, engine: str, max_len: int, feature_layers: Sequence[int] = ()):
    """The model a decoder runs for `engine`: "eager", the model itself; "compiled", `compiled_target`."""
    if engine not in ("eager", "compiled"):
        raise ValueError(f"engine must be 'eager' or 'compiled', not {engine!r}")
    return compiled_target(model, max_len, feature_layers) if engine == "compiled" else model
