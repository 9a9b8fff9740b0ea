"""Tensor and expert parallel inference for a built Llama 4, on torch.distributed (launch with torchrun:
gloo on CPU, nccl on GPU). The model file keeps the architecture; `shard_model` applies the parallelism
to a built model (real or meta tensors), `load_hf_sharded` reads each rank's slices straight from HF
safetensors, and `memory_report` sizes a rank on the meta device.

    torchrun --nproc-per-node 2 -m maverick.generate --target CKPT --prompt "Hello" --max-new-tokens 16
    torchrun --nproc-per-node 3 -m maverick.generate --prompt "Hello"   # SmolLM2 GGUF: 9 q / 3 kv heads
    python -m maverick.parallel --report          # bytes per rank, Maverick and Scout at 8 ranks

The layout (`layout` is the one table every path reads; shape legend as in model.py, w ranks, r rank):
- Attention: heads split over ranks. q_proj, k_proj, v_proj hold their heads' rows (column parallel),
  o_proj the matching input columns (row parallel); rank r has query heads r*Hq/w .. and the kv heads
  they read. Where ranks outnumber kv heads (w > Hkv), each kv head is replicated on the w/Hkv ranks
  whose query heads read it. The KV cache holds the local kv heads only.
- Dense MLP and the MoE's shared expert: gate/up rows and down columns split over ranks (I/w each).
  The shared expert is tensor parallel, not replicated: replicated it would cost every Maverick rank
  6.0 GB (bf16, 24 layers) instead of 0.75 GB, and its partial sum joins the routed outputs' in the
  one reduction the MoE needs anyway, so splitting it adds no collective.
- Routed experts: expert parallel, rank r holds experts r*E/w .. (r+1)*E/w - 1. The router is
  replicated (E x H: 31 MB in bf16 for Maverick's 24 MoE layers): split, its logits would need a
  gather before the top-1; replicated, every rank routes every token identically from its replicated
  input. The activations entering the MoE are replicated too (tensor parallel attention ends in a sum
  over ranks), so rank r takes the tokens of its experts from its own copy and adds their outputs to its
  partial sum: no exchange, and each token's routed expert runs on exactly one rank, the same one
  whatever the call's row count (see ExpertParallelMoE). A sequence-parallel layout would need the
  all_to_all dispatch and combine instead.
- Embedding and lm_head: split by vocabulary rows (V/w): an embedding lookup is masked to the rank's
  rows and summed over ranks (one rank holds each row, so the sum is exact), the logits are gathered.
- Norms replicated.

Loading (`load_hf_sharded`) reads bf16 / fp32 checkpoints; FP8 routed experts come from converting the
loaded local experts (`fp8_experts.convert_experts_to_fp8`: per-expert scales, so the same numbers as
converting the full model and cutting it). Meta's FP8 release (per-expert compressed-tensors keys)
loads in one process only.

Each rank's o_proj, down_proj and MoE (shared expert + routed outputs of its experts' tokens) produce partial
sums, reduced once per sub-block in `ParallelDecoderLayer.forward`. Calls on the exact path (at most
`EXACT_ATTENTION_MAX_T` new tokens: decoding, verification) reduce by all_gather and a sum in rank
order, so a row's bits do not depend on how many rows share the call: a ring all_reduce chunks by size
(measured, gloo, 4 ranks: the same rows summed in calls of 1..8 rows differ from the 9-row call in about
half their elements). That keeps greedy speculative decoding with a parallel target token-identical to
decoding with it. Longer calls (prefill) use all_reduce.

Why plain sharded weights and explicit collectives rather than DTensor / `parallelize_module`: the
model's inference kernels read weights directly, not through module calls (`fused_linear` concatenates
q/k/v and gate/up weights and runs oneDNN-packed copies, `forward_flat` bypasses submodules), so the
input hooks `ColwiseParallel` / `RowwiseParallel` install never run. Measured (torch 2.13, tiny-dense,
2 gloo ranks, the standard plan on q/k/v/o and gate/up/down): fp32 fails with "aten.mm.default got mixed
torch.Tensor and DTensor" (a plain activation meets a DTensor weight inside `group_linear`), bf16 with no
sharding rule for `mkldnn._reorder_linear_weight`. With local plain tensors every kernel (packing,
row-count-safe chunking, exact attention, tree attention, FP8 experts) runs unchanged on the rank's slice.

Everything that is not the target (the EAGLE-3 draft, sampling, acceptance) runs replicated: all ranks
see the same gathered logits and take the same decisions, so they issue the same collectives. A draft
length policy that reads wall-clock times (DraftLengthTuner) would diverge between ranks (seen: gloo
aborts on the mismatched calls): eagle3.tuner.RankAgreed makes its choices rank 0's (`rank0_value`), and
SpecDecoder wraps a DraftLengthTuner in it when its target is sharded; FixedK and HeuristicK need nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn

from maverick.checkpoint import CheckpointError, _safetensors_files, _text_key
from maverick.cli import (
    ArgumentParser,
    UserError,
    positive_int,
    run_cli,
)
from maverick.config import Llama4Config, get_config
from maverick.model import EXACT_ATTENTION_MAX_T, DecoderLayer, Llama4, MoE, Output, rope_inv_freq
from maverick.target import load_target


@dataclass(frozen=True)
class Shard:
    """This process's place: rank r of w in `group` (None: the default process group)."""

    rank: int
    world: int
    group: dist.ProcessGroup | None = None


def init_from_env() -> Shard | None:
    """Join the process group torchrun describes (WORLD_SIZE, RANK, MASTER_ADDR, ...): nccl with one GPU
    per rank (LOCAL_RANK) where CUDA is available, gloo on CPU. None in a single process. The group is
    destroyed at exit (a gloo group left to the interpreter's teardown aborts the process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return None
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    return Shard(dist.get_rank(), dist.get_world_size())


def device_for(shard: Shard | None) -> torch.device:
    """cuda:LOCAL_RANK where the group runs nccl, else the CPU."""
    if shard is not None and torch.cuda.is_available() and dist.get_backend(shard.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- the layout: which slice of each parameter a rank holds ----


def _split(n: int, shard: Shard, what: str) -> tuple[int, int]:
    if n % shard.world:
        raise ValueError(f"{what}={n} does not split over {shard.world} ranks")
    k = n // shard.world
    return shard.rank * k, (shard.rank + 1) * k


def head_ranges(cfg: Llama4Config, shard: Shard) -> tuple[tuple[int, int], tuple[int, int]]:
    """(query heads, kv heads) of this rank as [start, stop). Query head h reads kv head h // (Hq / Hkv),
    so the rank's query block reads a block of kv heads (w <= Hkv) or part of one (w > Hkv, replicated)."""
    Hq, Hkv, w, r = cfg.num_attention_heads, cfg.num_key_value_heads, shard.world, shard.rank
    q = _split(Hq, shard, "num_attention_heads")
    if Hkv >= w:
        return q, _split(Hkv, shard, "num_key_value_heads")
    if w % Hkv:
        raise ValueError(f"{w} ranks do not replicate num_key_value_heads={Hkv} evenly")
    kv0 = r * Hkv // w
    return q, (kv0, kv0 + 1)


Slice = tuple[int, int, int] | None  # (dim, start, stop), None: replicated


def layout(cfg: Llama4Config, shard: Shard) -> dict[str, Slice]:
    """Every state-dict key of the model -> the slice rank `shard.rank` holds (None: the whole tensor)."""
    D = cfg.head_dim
    (q0, q1), (k0, k1) = head_ranges(cfg, shard)
    v0, v1 = _split(cfg.vocab_size, shard, "vocab_size")
    out: dict[str, Slice] = {"model.embed_tokens.weight": (0, v0, v1), "model.norm.weight": None}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (0, v0, v1)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = out[p + "post_attention_layernorm.weight"] = None
        a = p + "self_attn."
        out[a + "q_proj.weight"] = (0, q0 * D, q1 * D)
        out[a + "k_proj.weight"] = out[a + "v_proj.weight"] = (0, k0 * D, k1 * D)
        out[a + "o_proj.weight"] = (1, q0 * D, q1 * D)
        f = p + "feed_forward."
        if cfg.is_moe(i):
            i0, i1 = _split(cfg.intermediate_size, shard, "intermediate_size")
            e0, e1 = _split(cfg.num_local_experts, shard, "num_local_experts")
            out[f + "router.weight"] = None
            out[f + "experts.gate_up_proj"] = out[f + "experts.down_proj"] = (0, e0, e1)
            mlp = f + "shared_expert."
        else:
            i0, i1 = _split(cfg.intermediate_size_mlp, shard, "intermediate_size_mlp")
            mlp = f
        out[mlp + "gate_proj.weight"] = out[mlp + "up_proj.weight"] = (0, i0, i1)
        out[mlp + "down_proj.weight"] = (1, i0, i1)
    return out


def _narrow(t: Tensor, s: Slice) -> Tensor:
    return t if s is None else t.narrow(s[0], s[1], s[2] - s[1])


# ---- the parallel modules (class swaps on a built model, as FSDP2's fully_shard does) ----


def all_sum(x: Tensor, shard: Shard) -> Tensor:
    """Sum of x [B, T, ...] over ranks, the same bits on every rank. Calls of at most
    EXACT_ATTENTION_MAX_T new tokens: all_gather, then a sum in rank order (row-count invariant, see the
    module docstring); longer calls: all_reduce."""
    if x.dim() >= 2 and x.shape[1] <= EXACT_ATTENTION_MAX_T:
        parts = [torch.empty_like(x) for _ in range(shard.world)]
        dist.all_gather(parts, x.contiguous(), group=shard.group)
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out
    x = x.contiguous()
    dist.all_reduce(x, group=shard.group)
    return x


def rank0_value(value: int, shard: Shard | None) -> int:
    """Rank 0's `value` on every rank. Decisions read from the clock (a time budget, a tuner's measured
    costs) differ between ranks, and ranks that disagree on the next forward's shape, or on whether to run
    one, wait for each other forever: each such decision is rank 0's."""
    if shard is None:
        return value
    t = torch.tensor([int(value)], device=device_for(shard))
    dist.broadcast(t, src=0, group=shard.group)
    return int(t.item())


@contextlib.contextmanager
def rank0_prints(shard: Shard | None):
    """A context in which only rank 0 writes to stdout (the other ranks' prints go to /dev/null)."""
    if shard is None or shard.rank == 0:
        yield
        return
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        yield


def rank0_says(flag: bool, shard: Shard | None) -> bool:
    """Rank 0's `flag` on every rank (rank0_value)."""
    return bool(rank0_value(int(flag), shard))


def all_gather_last(x: Tensor, shard: Shard) -> Tensor:
    """Concatenate every rank's x [..., n] on the last dim, in rank order."""
    parts = [torch.empty_like(x) for _ in range(shard.world)]
    dist.all_gather(parts, x.contiguous(), group=shard.group)
    return torch.cat(parts, dim=-1)


class VocabParallelEmbedding(nn.Embedding):
    """Rows vocab_start .. vocab_start + num_embeddings of the embedding; tokens outside give zeros, and the
    sum over ranks has exactly one nonzero term per row."""

    shard: Shard
    vocab_start: int

    def forward(self, tokens: Tensor) -> Tensor:
        local = tokens - self.vocab_start
        inside = (local >= 0) & (local < self.num_embeddings)
        emb = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return all_sum(torch.where(inside[..., None], emb, emb.new_zeros(())), self.shard)


class ExpertParallelMoE(MoE):
    """The MoE with local experts expert_start .. expert_start + local_experts - 1 and a tensor parallel
    shared expert; returns this rank's partial sum: its shared-expert part plus the routed outputs of the
    tokens whose expert it holds.

    The input is replicated (every rank holds the whole residual stream after the attention's sum), so each
    rank takes its experts' tokens from it directly: no exchange. A token's routed output joins the partial
    sum of its expert's rank, a function of the token alone, and `all_sum` adds the partials in rank order:
    a row's bits do not depend on how many rows share the call. (The tokens went out to the experts' ranks
    and back to the rank holding their block of rows before; that rank changed with the row count, and a
    verify's later rows got other bits than decoding them one by one.)
    """

    shard: Shard
    expert_start: int
    local_experts: int

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x_ND = x.reshape(-1, shape[-1])
        expert_N, score_N = self.route(x_ND)  # replicated: the same on every rank
        out_ND = self.shared_expert(x_ND)  # partial: this rank's I/w columns
        local_N = expert_N - self.expert_start
        mine_M = ((local_N >= 0) & (local_N < self.local_experts)).nonzero().squeeze(1)  # in position order
        if mine_M.numel():
            by_expert_M = mine_M[torch.argsort(local_N[mine_M], stable=True)]
            counts_E = torch.bincount(local_N[mine_M], minlength=self.local_experts).tolist()
            routed_MD = self.experts.grouped(x_ND[by_expert_M] * score_N[by_expert_M, None], counts_E)
            out_ND[by_expert_M] += routed_MD
        return out_ND.view(shape)

    def forward_reference(self, x: Tensor) -> Tensor:
        raise NotImplementedError("the per-expert reference loop needs every expert: run it in one process")


class ParallelDecoderLayer(DecoderLayer):
    """The decoder layer with its two partial sums (attention's o_proj, the MLP / MoE) reduced over ranks
    before the residual adds. Never takes `forward_flat`, whose direct kernel calls skip the reduction."""

    shard: Shard

    def forward(self, x: Tensor, ctx) -> Tensor:
        x = x + all_sum(self.self_attn(self.input_layernorm(x), ctx), self.shard)
        return x + all_sum(self.feed_forward(self.post_attention_layernorm(x)), self.shard)

    def flat_ok(self) -> bool:
        return False


class ParallelLlama4(Llama4):
    """Llama4 holding one rank's slices: a KV cache of the local kv heads (Llama4.new_cache reads the
    attention's n_kv), logits gathered over the vocabulary shards (every rank returns the full logits)."""

    shard: Shard

    def forward(self, *args, **kwargs) -> Output:
        out = super().forward(*args, **kwargs)
        if out.logits is not None:
            out.logits = all_gather_last(out.logits, self.shard)
        return out


def shard_model(model: Llama4, shard: Shard) -> ParallelLlama4:
    """Cut a built model (real or meta tensors) down to this rank's slices (`layout`) and swap in the
    parallel modules, in place. Real tensors are copied out of the full ones, which can then be freed.
    FP8 experts (maverick/fp8_experts.py, weights and scales as buffers) are cut like the experts; a model
    can also be cut first and its local experts converted after (per-expert scales: the same result)."""
    cfg = model.config
    plan = layout(cfg, shard)
    (q0, q1), (k0, k1) = head_ranges(cfg, shard)
    for key, buf in list(model.named_buffers()):
        if key == "inv_freq":
            continue
        layer_key = key.rsplit(".experts.", 1)[0] + ".experts.gate_up_proj"
        if ".experts." not in key or layer_key not in plan:
            raise KeyError(f"{key}: a buffer the parallel layout does not know")
        mod_name, _, name = key.rpartition(".")
        local = _narrow(buf, plan[layer_key])
        setattr(model.get_submodule(mod_name), name, local if local.is_meta else local.clone())
    for key, param in list(model.named_parameters()):
        if key not in plan:
            raise KeyError(f"{key}: not in the parallel layout")
        mod_name, _, name = key.rpartition(".")
        mod = model.get_submodule(mod_name)
        local = _narrow(param.data, plan[key])
        if plan[key] is not None and not local.is_meta:
            local = local.clone()
        setattr(mod, name, nn.Parameter(local, requires_grad=param.requires_grad))
        if isinstance(mod, nn.Linear):
            mod.out_features, mod.in_features = local.shape
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.lm_head.out_features = model.lm_head.weight.shape[0]
    emb = model.model.embed_tokens
    emb.__class__ = VocabParallelEmbedding
    emb.shard, emb.vocab_start, emb.num_embeddings = (
        shard,
        plan["model.embed_tokens.weight"][1],
        emb.weight.shape[0],
    )
    for i, layer in enumerate(model.model.layers):
        layer.__class__ = ParallelDecoderLayer
        layer.shard = shard
        layer.self_attn.n_heads, layer.self_attn.n_kv = q1 - q0, k1 - k0
        if layer.is_moe:
            moe = layer.feed_forward
            moe.__class__ = ExpertParallelMoE
            moe.shard = shard
            moe.expert_start = plan[f"model.layers.{i}.feed_forward.experts.gate_up_proj"][1]
            moe.local_experts = moe.experts.gate_up_proj.shape[0]
    model.__class__ = ParallelLlama4
    model.shard = shard
    return model


# ---- loading each rank's slices from HF safetensors ----


@dataclass
class LoadStats:
    bytes_read: int = 0  # bytes copied out of the files for this rank
    bytes_in_files: int = 0  # bytes of the text tensors in the files (the whole model)
    tensors: int = 0
    per_key: dict[str, int] = field(default_factory=dict, repr=False)


def load_hf_sharded(
    path: str | os.PathLike,
    shard: Shard,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[ParallelLlama4, LoadStats]:
    """This rank's part of an HF Llama 4 checkpoint directory, read slice by slice (`safe_open` +
    `get_slice`): no rank ever holds a full tensor it does not keep, let alone the full model. The model
    is built on the meta device and sharded there, then the slices are assigned. Every key must be used
    and every stored shape must be the full model's, or the error names the key.

    Row slices (dim 0) are contiguous in the file; the row-parallel o_proj / down_proj column slices are
    strided, so a rank copies only its columns but the memory map touches the pages of whole rows."""
    path = Path(path)
    cfg = Llama4Config.from_json(path)
    with torch.device("meta"):
        model = Llama4(cfg)
    full = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    plan = layout(cfg, shard)
    shard_model(model, shard)
    stats = LoadStats()
    tensors: dict[str, Tensor] = {}
    for f in _safetensors_files(path):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                ours = _text_key(key)
                if ours is None:
                    continue
                if cfg.tie_word_embeddings and ours == "lm_head.weight":
                    continue
                if ours not in plan:
                    raise CheckpointError(f"{f}: unexpected key {key!r}")
                if ours in tensors:
                    raise CheckpointError(
                        f"{f}: key {key!r} maps to {ours!r}, which another key already gave"
                    )
                sl = sf.get_slice(key)
                shape = tuple(sl.get_shape())
                if shape != full[ours]:
                    raise CheckpointError(f"{f}: key {key!r} has shape {shape}, expected {full[ours]}")
                if sl.get_dtype().startswith("F8"):
                    raise CheckpointError(f"{f}: {key!r} is FP8; FP8 checkpoints load in one process only")
                s = plan[ours]
                index = tuple(
                    slice(s[1], s[2]) if s is not None and d == s[0] else slice(None)
                    for d in range(len(shape))
                )
                t = sl[index]
                n = t.numel() * t.element_size()
                stats.bytes_read += n
                stats.per_key[ours] = n
                stats.bytes_in_files += t.element_size() * math.prod(shape)
                stats.tensors += 1
                tensors[ours] = t.to(device=device, dtype=dtype)
    missing = sorted(set(plan) - set(tensors))
    if missing:
        raise CheckpointError(f"{path}: missing key(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    model.load_state_dict(tensors, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg).to(device)
    return model.eval(), stats


def load_model(
    shard: Shard | None,
    dtype: torch.dtype,
    target: str | os.PathLike | None = None,
    q4: bool = False,
    device: str = "cpu",
) -> Llama4:
    """The target a command runs, in one process (on `device`) or as this rank's part (`shard`, under
    torchrun; on this rank's device): `target` is an HF checkpoint directory (sharded: each rank reads only
    its slices) or a GGUF file (every rank reads the small file, then keeps its slices). None: the default
    SmolLM2 GGUF."""
    if shard is None:
        return load_target(target, dtype, device, q4=q4)
    device = device_for(shard)
    if target is not None and Path(target).is_dir():
        return load_hf_sharded(target, shard, dtype, device)[0]
    return shard_model(load_target(target, dtype, q4=q4), shard).to(device)


# ---- memory per rank, on the meta device ----


def fp8_expert_layers(cfg: Llama4Config) -> list[int]:
    """The MoE layers whose routed experts Meta's FP8 release stores in FP8: all but the first and the
    last layer of the model (REFERENCE.md), i.e. Maverick's MoE layers 1..45, Scout's 1..46."""
    return [i for i in cfg.moe_layers if i not in (0, cfg.num_hidden_layers - 1)]


def memory_report(cfg: Llama4Config, world: int, fp8: bool = False, context: int = 8192) -> dict:
    """Bytes one rank holds for `cfg` sharded over `world` ranks, measured on a meta-device model cut by
    `shard_model` (the path a real run takes), weights in bf16; fp8: routed experts of
    `fp8_expert_layers` in FP8 with one fp32 scale per output channel (the release's scheme). Rank 0 is
    reported; every rank holds the same amounts. kv_cache_bytes: a bf16 cache of `context` tokens, batch 1."""
    from maverick.fp8_experts import Float8Experts, Fp8Experts

    shard = Shard(0, world)
    with torch.device("meta"):
        model = shard_model(Llama4(cfg).to(torch.bfloat16), shard)
        params = sum(p.numel() for p in model.parameters())  # tied weights counted once
        if fp8:
            for i in fp8_expert_layers(cfg):
                e = model.model.layers[i].feed_forward.experts
                El, H, I2 = e.gate_up_proj.shape
                f8 = torch.float8_e4m3fn
                meta = Fp8Experts(
                    torch.empty(El, H, I2, dtype=f8), torch.empty(El, I2),
                    torch.empty(El, I2 // 2, H, dtype=f8), torch.empty(El, H),
                )  # fmt: skip
                model.model.layers[i].feed_forward.experts = Float8Experts(meta)
    groups = {"embed_lm_head": 0, "attention": 0, "dense_mlp": 0, "shared_expert": 0, "router": 0}
    groups |= {"routed_experts": 0, "norms": 0}
    seen = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in seen or name == "inv_freq":
            continue
        seen.add(id(t))
        groups[_group(name)] += t.numel() * t.element_size()
    kv = 2 * cfg.num_hidden_layers * model.model.layers[0].self_attn.n_kv * cfg.head_dim * context * 2
    return {
        "world": world,
        "fp8": fp8,
        "params_per_rank": params,
        "weight_bytes": sum(groups.values()),
        "by_group": groups,
        "kv_cache_bytes": kv,
        "kv_context": context,
    }


def _group(name: str) -> str:
    if "embed_tokens" in name or name.startswith("lm_head"):
        return "embed_lm_head"
    if ".self_attn." in name:
        return "attention"
    if ".experts." in name:
        return "routed_experts"
    if ".shared_expert." in name:
        return "shared_expert"
    if ".router." in name:
        return "router"
    if "norm" in name:
        return "norms"
    return "dense_mlp"


def params_per_rank_formula(cfg: Llama4Config, world: int) -> int:
    """The parameter count of one rank, written out from the layout (the check on `memory_report`)."""
    H, D, w = cfg.hidden_size, cfg.head_dim, world
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    kv_local = Hkv // w if Hkv >= w else 1
    attn = H * D * (2 * Hq // w + 2 * kv_local)
    n_moe = len(cfg.moe_layers)
    n_dense = cfg.num_hidden_layers - n_moe
    moe = cfg.num_local_experts * H + 3 * H * cfg.intermediate_size // w
    moe += cfg.num_local_experts // w * 3 * H * cfg.intermediate_size
    dense = 3 * H * cfg.intermediate_size_mlp // w
    embed = (1 if cfg.tie_word_embeddings else 2) * cfg.vocab_size // w * H
    norms = (2 * cfg.num_hidden_layers + 1) * H
    return embed + norms + cfg.num_hidden_layers * attn + n_moe * moe + n_dense * dense


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(
        prog="python -m maverick.parallel",
        description="Memory per rank of a tensor + expert parallel Llama 4.",
    )
    ap.add_argument("--report", action="store_true", help="print the per-rank memory table (the default)")
    ap.add_argument("--configs", default="maverick-400b,scout-109b")
    ap.add_argument("--world", type=positive_int, default=8)
    ap.add_argument(
        "--context", type=positive_int, default=8192, help="tokens of KV cache to size (batch 1, bf16)"
    )
    ap.add_argument("--json", action="store_true", help="print JSON lines instead of the table")
    args = ap.parse_args(argv)
    rows = []
    for name in args.configs.split(","):
        try:
            cfg = get_config(name)
        except KeyError as e:
            raise UserError(f"--configs: {e.args[0]}") from None
        for fp8 in (False, True):
            try:
                r = memory_report(cfg, args.world, fp8, args.context)
            except ValueError as e:
                raise UserError(str(e)) from None
            rows.append({"config": name, **r})
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    gib = 1024**3
    print(f"{'config':<15} {'weights':<6} {'params/rank':>14} {'GiB/rank':>9} {'experts GiB':>11} "
          f"{'KV GiB @' + str(args.context):>12}")  # fmt: skip
    for r in rows:
        print(
            f"{r['config']:<15} {'fp8' if r['fp8'] else 'bf16':<6} {r['params_per_rank']:>14,} "
            f"{r['weight_bytes'] / gib:>9.2f} {r['by_group']['routed_experts'] / gib:>11.2f} "
            f"{r['kv_cache_bytes'] / gib:>12.3f}"
        )
    print(f"(TP/EP {args.world}, batch 1; weights bf16, fp8 = routed experts of the release's FP8 layers)")


if __name__ == "__main__":
    run_cli(main)
