"""The EAGLE-3 draft head, in the checkpoint format of released EAGLE-3 drafts (vLLM / SGLang load it).

One decoder layer that reads two things per position t:
- a hidden state: at the first draft step the target's features at t (hidden states entering three
  target layers, low/mid/high, concatenated [3H] and projected by `fc` to H); at later steps the draft's
  own previous output (the layer output before `norm`);
- the (target-shared, frozen) embedding of token t+1.
q/k/v read concat(input_layernorm(embedding), hidden_norm(hidden)) [2H]; the residual is the hidden
state itself; then post_attention_layernorm + SwiGLU; `norm` + `lm_head` score a reduced draft vocab,
mapped back with `d2t` (target_id = draft_id + d2t[draft_id]).

Positions: the pair (feature_t, token_{t+1}) sits at RoPE position t; draft step i from there sits at
t + i. Training (train/ttt.py) uses the same convention, so what is trained is what is served. RoPE is
HF Llama's rotate_half layout, the layout vLLM / SGLang apply to these drafts.

Aux layers (which target hidden states are the features) in config.json, in both engines' conventions
(read from their code; /work/shared/REFERENCE.md "Serving engines' draft conventions"):
- top-level `eagle_aux_hidden_state_layer_ids`: vLLM's: the hidden state ENTERING target layer i (vLLM
  captures the residual stream before layer i's call). This is `DraftConfig.feature_layers` as is, e.g.
  [2, 15, 27] on a 30-layer target.
- nested `eagle_config.eagle_aux_hidden_state_layer_ids`: SGLang's and SpecForge's: the OUTPUT of layer
  i (SGLang adds 1 when it captures), i.e. feature_layers - 1, e.g. [1, 14, 26].
`from_hf_dict` reads either and, when both are present, refuses a config where they name different
states. The weight file names are the released drafts' (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`,
`t2d`); vLLM maps `midlayer.` to `layers.0.` and q/k/v, gate/up into its fused projections, and raises on
any other tensor name in any *.safetensors file of the directory: nothing else may sit there.

Shape legend: B batch, T positions, H hidden, V' draft vocab, S cache slots.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from maverick.checkpoint import check_state_dict
from maverick.cli import UserError, read_json_object
from maverick.config import Llama4Config, check_numbers, fill_llama3_context, rope_scaling_problem
from maverick.files import atomic_dir
from maverick.kv_cache import KVCache, attention_mask
from maverick.linear import Linear
from maverick.model import MLP, RMSNorm, init_weights, rope_inv_freq


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    # target layers whose INPUT hidden states are the features (low, mid, high): vLLM's aux-layer ids
    feature_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    # Norm variants (config.json keys as vLLM's llama_eagle3 reads them; all False: the EAGLE-3 draft).
    # EAGLE-3.1 is fc_norm + norm_output (train with --eagle-3.1). See `NORM_VARIANTS` for which engines load them.
    norm_before_fc: bool = False  # one RMSNorm over the concatenated features before fc (`input_norm`)
    fc_norm: bool = False  # an RMSNorm on each aux-layer feature before fc (`fc_norm.{i}`)
    norm_output: bool = False  # the state carried to the next draft step is norm(h), not h
    norm_before_residual: bool = False  # the layer's residual is hidden_norm(hidden), not hidden
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.feature_layers = tuple(self.feature_layers)  # a list when read from JSON

    @classmethod
    def for_target(
        cls, target: Llama4Config, draft_vocab_size: int, feature_layers=None, **kw
    ) -> DraftConfig:
        """Shapes follow the target (the draft shares its embeddings); features default to the hidden states
        entering layers 2, L//2 and L-3."""
        fl = (
            tuple(feature_layers)
            if feature_layers is not None
            else default_feature_layers(target.num_hidden_layers)
        )
        base = dict(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size_mlp,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=target.hidden_size,
            feature_layers=fl,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
        )
        base.update(kw)
        return cls(**base)

    def to_hf_dict(self) -> dict:
        d = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("extra", "feature_layers")
        }
        d.update(self.extra)
        d |= {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            # the same three states in each engine's convention (module docstring): vLLM reads the
            # top-level key (state entering layer i), SGLang / SpecForge the nested one (output of layer i)
            VLLM_AUX_KEY: list(self.feature_layers),
            "eagle_config": {
                VLLM_AUX_KEY: [i - 1 for i in self.feature_layers],
                "use_aux_hidden_state": True,
            },
        }
        return d

    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> DraftConfig:
        if not isinstance(d, dict):
            raise UserError(f"{source}: expected a JSON object, got {type(d).__name__}")
        arch = d.get("architectures") or []
        if not (isinstance(arch, list) and all(isinstance(a, str) for a in arch)):
            raise UserError(f"{source}: architectures must be a list of names, got {arch!r}")
        if not isinstance(d.get("eagle_config") or {}, dict):
            raise UserError(f"{source}: eagle_config must be a JSON object, got {d['eagle_config']!r}")
        if not any("Eagle3" in a or "eagle3" in a.lower() for a in arch):
            raise UserError(
                f"{source}: architectures {arch} is not an EAGLE-3 draft (LlamaForCausalLMEagle3)"
            )
        if d.get("num_hidden_layers", 1) != 1:
            raise UserError(f"{source}: num_hidden_layers={d['num_hidden_layers']}, an EAGLE-3 draft has 1")
        if d.get("hidden_act", "silu") != "silu":  # vLLM's and SGLang's LlamaMLP refuse it too
            raise UserError(
                f"{source}: hidden_act={d['hidden_act']!r}; an EAGLE-3 draft's MLP is SwiGLU ('silu')"
            )
        for key in ("hidden_size", "num_attention_heads", "vocab_size", "intermediate_size"):
            if key not in d:
                raise UserError(f"{source}: missing field {key!r}")
        check_numbers(d, counts=_COUNTS, where=source, allow_null=True)  # a null one is derived below
        check_numbers(d, positives=("rms_norm_eps", "rope_theta"), where=source)
        if not isinstance(d.get("rope_scaling") or {}, dict):
            raise UserError(
                f"{source}: rope_scaling must be a JSON object or null, got {d['rope_scaling']!r}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        # a null count is derived as a missing one is (vLLM and SGLang read a null draft_vocab_size as the
        # target's vocabulary); a null rope_scaling is no scaling
        kw = {
            k: v
            for k, v in d.items()
            if k in names and k not in ("extra", "feature_layers") and (v is not None or k == "rope_scaling")
        }
        kw.setdefault("num_key_value_heads", d["num_attention_heads"])
        kw.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
        kw.setdefault("draft_vocab_size", d["vocab_size"])
        kw.setdefault("target_hidden_size", d["hidden_size"])
        kw.setdefault("rms_norm_eps", 1e-6)  # transformers' LlamaConfig default, which the engines build on
        rp = d.get("rope_parameters") or {}
        kw.setdefault("rope_theta", rp.get("rope_theta", 10000.0))
        if kw.get("rope_scaling") is None and rp.get("rope_type", "default") != "default":
            kw["rope_scaling"] = rp
        # as transformers' LlamaConfig reads it (the engines build on it): its max_position_embeddings default
        kw["rope_scaling"] = fill_llama3_context(
            kw.get("rope_scaling"), d.get("max_position_embeddings") or 2048
        )
        if kw.get("rope_scaling") and (problem := rope_scaling_problem(kw["rope_scaling"])):
            raise UserError(f"{source}: {problem}")
        kw["feature_layers"] = feature_layers_from_hf(d, source)
        nested = d.get("eagle_config") or {}
        for key in NORM_VARIANTS:
            # vLLM lets eagle_config.norm_before_fc (NVIDIA's checkpoints) win over the top-level key
            where, value = (f"eagle_config.{key}", nested[key]) if key in nested else (key, d.get(key, False))
            if type(value) is not bool:
                raise UserError(f"{source}: {where} must be true or false, got {value!r}")
            kw[key] = value
        extra = {k: v for k, v in d.items() if k not in names and k not in _DERIVED}
        return cls(**kw, extra=extra)


# the draft shipped for the SmolLM2 target: every command's default --draft
DEFAULT_DRAFT = Path(__file__).resolve().parent / "drafts" / "smollm2-135m-instruct"
VLLM_AUX_KEY = "eagle_aux_hidden_state_layer_ids"
# config.json fields that are counts (checked before they size anything)
_COUNTS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
           "vocab_size", "draft_vocab_size", "target_hidden_size", "max_position_embeddings")  # fmt: skip

# The norm variants of `DraftConfig`. Which engines load a draft that sets one (read from their code, 2026-12):
# - vLLM's llama_eagle3 (main branch) reads all four, weights `input_norm.weight` and `fc_norm.{i}.weight`.
#   Older releases that read only norm_before_residual raise on those tensors (a draft with fc_norm or
#   norm_before_fc) and ignore norm_output, which has no tensor of its own: such a draft runs wrong there.
# - SGLang's llama_eagle3 reads none of them and skips tensors it does not know: it would serve such a
#   draft without its norms, with no error and a collapsed acceptance.
# - SpecForge's `norm_output` means another thing: there `norm` goes before lm_head only when it is true, and the
#   next draft step always reads the state before `norm`. Its EAGLE-3.1 drafts (fc_norm + norm_output) load
#   here without an error but compute vLLM's function, not SpecForge's (the second draft step differs).
# Serve a draft that sets any of them with this project or a current vLLM; an all-false draft loads everywhere.
# The engines also size `fc` for exactly three feature layers: a draft of another count runs only here.
NORM_VARIANTS = ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / mid / high taps: the hidden states entering layers 2, L//2 and L-3. A target of fewer
    than 7 layers gets three increasing taps spread over 0..L instead ((2, 2, 1) for 4 layers would not be
    layer order, which the engines concatenate in), or every state it has when it has fewer than three."""
    taps = (2, num_layers // 2, num_layers - 3)
    if taps[0] < taps[1] < taps[2]:
        return taps
    small = sorted({num_layers // 4, num_layers // 2, (3 * num_layers) // 4})
    return tuple(small) if len(small) == 3 else tuple(range(min(3, num_layers + 1)))


def feature_layers_from_hf(d: dict, source: str = "config.json") -> tuple[int, ...]:
    """feature_layers (states entering target layer i) from a config.json: the top-level (vLLM)
    `eagle_aux_hidden_state_layer_ids` as is, the nested (SGLang) `eagle_config.` one plus 1; both
    present must agree."""
    top = d.get(VLLM_AUX_KEY)
    nested = (d.get("eagle_config") or {}).get(VLLM_AUX_KEY)
    for key, ids in ((VLLM_AUX_KEY, top), (f"eagle_config.{VLLM_AUX_KEY}", nested)):
        if ids is not None and not (isinstance(ids, list) and ids and all(type(i) is int for i in ids)):
            raise UserError(f"{source}: {key} must be a non-empty list of integers, got {ids!r}")
    if top is None and nested is None:
        raise UserError(
            f"{source}: no {VLLM_AUX_KEY} (top level, vLLM's: the states entering those target layers) "
            f"and no eagle_config.{VLLM_AUX_KEY} (SGLang's: the outputs of those layers)"
        )
    for key, ids in ((VLLM_AUX_KEY, top), (f"eagle_config.{VLLM_AUX_KEY}", nested)):
        if ids is not None and any(a >= b for a, b in zip(ids, ids[1:])):
            raise UserError(
                f"{source}: {key} {ids} must increase: vLLM and SGLang concatenate the features in layer order "
                "whatever order the config lists, so `fc` would read them in another order than it was trained on"
            )
    if top is not None and nested is not None and [i + 1 for i in nested] != top:
        raise UserError(
            f"{source}: {VLLM_AUX_KEY} {top} (vLLM: states entering those layers) and "
            f"eagle_config.{VLLM_AUX_KEY} {nested} (SGLang: outputs of those layers) name different states; "
            f"the nested ids must be the top-level ones minus 1"
        )
    return tuple(top) if top is not None else tuple(i + 1 for i in nested)


def check_draft_fits(
    config: DraftConfig, target: Llama4Config, source: str = "the draft's config.json"
) -> None:
    """Before any work: the draft was made for a target of this vocabulary, hidden size and depth (a draft of
    another target fails here, naming its config, not deep inside a matmul)."""
    for key, mine, theirs in (
        ("vocab_size", config.vocab_size, target.vocab_size),
        ("target_hidden_size", config.target_hidden_size, target.hidden_size),
    ):
        if mine != theirs:
            what = "vocabulary" if key == "vocab_size" else "hidden size"
            raise UserError(
                f"{source}: {key}={mine}, but the target's {what} is {theirs}: a draft of another target"
            )
    if config.hidden_size != target.hidden_size:  # it reads the target's token embeddings
        raise UserError(
            f"{source}: hidden_size={config.hidden_size}, but the target's embeddings (which the draft reads) "
            f"are {target.hidden_size} wide; a draft with embeddings of its own size is not supported"
        )
    check_feature_layers(config.feature_layers, target.num_hidden_layers, source)


def check_feature_layers(
    feature_layers: tuple[int, ...], num_target_layers: int, source: str = "the draft's config.json"
) -> None:
    """Before any work: every aux layer must exist in the target (index L = after its last layer), each
    once, in increasing order (the serving engines concatenate features in layer order). `source` names where
    the ids came from: a config.json (the message names both keys) or an option."""
    if source.startswith("--"):  # a command-line option, not a config file
        what = f"{source} {list(feature_layers)}"
    else:
        what = (
            f"{source}: {VLLM_AUX_KEY} {list(feature_layers)} (states entering those target layers; "
            f"eagle_config.{VLLM_AUX_KEY} {[i - 1 for i in feature_layers]})"
        )
    bad = [i for i in feature_layers if not 0 <= i <= num_target_layers]
    if bad:
        raise UserError(
            f"{what} name layer(s) {bad} outside the target's {num_target_layers} layers (0..{num_target_layers})"
        )
    if any(a >= b for a, b in zip(feature_layers, feature_layers[1:])):
        raise UserError(
            f"{what} must increase, each layer once: vLLM and SGLang concatenate the features in layer order"
        )


_DERIVED = {
    VLLM_AUX_KEY,
    "architectures",
    "model_type",
    "num_hidden_layers",
    "hidden_act",
    "tie_word_embeddings",
    "eagle_config",
}


def rotate_half_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF Llama RoPE: the first and second halves of the head dim are the pair. x [B, h, T, D], cos/sin [B, 1, T, D/2]."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class DraftAttention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, 2H] -> q [B, Hq, T, D], k/v [B, Hkv, T, D] with RoPE applied."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        return rotate_half_rope(q, cos, sin), rotate_half_rope(k, cos, sin), v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        B, _, T, _ = q.shape
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, cache: KVCache | None, kv_len: int):
        q, k, v = self.qkv(x, cos, sin)
        if cache is not None:
            k, v = cache.write(0, k, v, kv_len)
        return self.attend(q, k, v, mask)


class MidLayer(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DraftAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)


class Eagle3Draft(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.config = c
        self.source = "the draft's config.json"  # where the config was read (load_draft), for messages
        n, Ht = len(c.feature_layers), c.target_hidden_size
        if c.norm_before_fc:
            self.input_norm = RMSNorm(n * Ht, c.rms_norm_eps)
        if c.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(Ht, c.rms_norm_eps) for _ in range(n))
        self.fc = Linear(n * Ht, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool) if c.draft_vocab_size == c.vocab_size
                             else torch.zeros(c.vocab_size, dtype=torch.bool))  # fmt: skip
        self.register_buffer("inv_freq", _inv_freq(c), persistent=False)

    def _apply(self, fn, recurse=True):
        """As `Llama4._apply`: the RoPE frequencies stay fp32 under `.to(dtype)` (rounded to bf16, cos of the
        angle at position 1000 was 1.1 off)."""
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = _inv_freq(self.config).to(self.inv_freq.device)
        return self

    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        init_weights(self, std, generator)

    def set_vocab(self, d2t: Tensor, t2d: Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"vocab maps of shape d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not fit this draft "
                f"(d2t {tuple(self.d2t.shape)}, t2d {tuple(self.t2d.shape)})"
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def draft_to_target_ids(self) -> Tensor:
        """[V'] target id of each draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        c = self.config
        dtype = dtype or self.fc.weight.dtype
        return KVCache(
            1, batch_size, max_len, c.num_key_value_heads, c.head_dim, dtype, self.fc.weight.device
        )

    def project(self, features: Tensor) -> Tensor:
        """Target features [.., n*H_target] -> draft hidden [.., H]; the norm variants normalise the whole
        concatenation (norm_before_fc), then each aux layer's part (fc_norm), in vLLM's order."""
        x = features.to(self.fc.weight.dtype)
        if self.config.norm_before_fc:
            x = self.input_norm(x)
        if self.config.fc_norm:
            x = torch.cat(
                [norm(part) for norm, part in zip(self.fc_norm, x.chunk(len(self.fc_norm), -1))], -1
            )
        return self.fc(x)

    def forward(
        self,
        embeds: Tensor,
        hidden: Tensor,
        positions: Tensor | None,
        cache: KVCache | None = None,
        mask: Tensor | None = None,
        tree_mask: Tensor | None = None,
    ) -> Tensor:
        """One draft step over T positions. embeds [B, T, H] (of tokens t+1), hidden [B, T, H] (projected
        features or previous draft output), positions [B, T]. With a cache, keys go to cache slots
        lengths + arange(T) and the cache advances. `mask` [B, 1, T, S] overrides the attention mask
        (training-time test); `tree_mask` [B or 1, T, T] restricts which new tokens see which.
        Returns the state h [B, T, H] that the next draft step reads: the layer output before `norm` (after
        it with norm_output); logits come from `logits(h)`."""
        T = hidden.shape[1]
        if positions is None:  # continue from the cache's committed length
            positions = cache.lengths[:, None] + torch.arange(T, device=hidden.device)
        cos, sin = self.rope(positions)
        kv_len = cache.kv_len(T) if cache is not None else T
        if mask is None:
            mask = attention_mask(
                positions, cache.lengths if cache is not None else None, kv_len, None, tree_mask
            )
        attn_in = self.attn_input(embeds, hidden)
        h = self.finish(hidden, self.midlayer.self_attn(attn_in, cos, sin, mask, cache, kv_len))
        if cache is not None:
            cache.advance(T)
        return h

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        return freqs.cos()[:, None], freqs.sin()[:, None]

    def attn_input(self, embeds: Tensor, hidden: Tensor) -> Tensor:
        """concat(input_layernorm(embeds), hidden_norm(hidden)) [B, T, 2H]."""
        m = self.midlayer
        return torch.cat((m.input_layernorm(embeds.to(hidden.dtype)), m.hidden_norm(hidden)), dim=-1)

    def finish(self, hidden: Tensor, attn_out: Tensor) -> Tensor:
        """Residual on the hidden state (on hidden_norm of it with norm_before_residual), then the MLP
        block; with norm_output, `norm` of the result."""
        m, c = self.midlayer, self.config
        h = (m.hidden_norm(hidden) if c.norm_before_residual else hidden) + attn_out
        h = h + m.mlp(m.post_attention_layernorm(h))
        return self.norm(h) if c.norm_output else h

    def logits(self, h: Tensor) -> Tensor:
        """Draft-vocab logits [.., V'] of a state from `forward` / `finish` (already normed with norm_output)."""
        return self.lm_head(h if self.config.norm_output else self.norm(h))


# ---- the released EAGLE-3 checkpoint format ----

_OPTIONAL_KEYS = {"embed_tokens.weight"}  # some releases carry the target's embeddings; we share the target's
EMBED_PROBE_ROWS = 64  # rows of a file's embed_tokens kept to compare with the target's (`embeddings_note`)


def save_draft(
    draft: Eagle3Draft, path: str | os.PathLike, extra_files: dict[str, str] | None = None
) -> None:
    """config.json + model.safetensors, written to a temp dir and renamed into place."""
    path = Path(path)
    with atomic_dir(path) as tmp:
        sd = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()}
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(draft.config.to_hf_dict(), indent=2, sort_keys=True))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)


def load_draft(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Eagle3Draft:
    """Read a draft directory as vLLM does: config.json and EVERY *.safetensors file in it (so a file that
    is not part of the draft is an error here too, as it is there). Errors name the file and key."""
    path = draft_dir(path)
    cfg_file = path / "config.json"
    cfg = DraftConfig.from_hf_dict(read_json_object(cfg_file), source=str(cfg_file))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in draft directory {path}")
    sd: dict[str, Tensor] = {}
    origin: dict[str, str] = {}  # the file each tensor came from
    with torch.device("meta"):
        draft = Eagle3Draft(cfg)
    expected = draft.state_dict()
    for f in files:
        tensors = read_safetensors(f)
        unknown = sorted(k for k in tensors if k not in expected and k not in _OPTIONAL_KEYS)
        variant = {k.split(".")[0] for k in unknown} & {"input_norm", "fc_norm"}
        if variant:
            flags = sorted("norm_before_fc" if v == "input_norm" else v for v in variant)
            raise UserError(
                f"{f}: tensor(s) {unknown[:5]} belong to the norm variant(s) {flags}, which {cfg_file} does "
                f"not set: set them true there (a trainer that wrote the weights but not the flags?)"
            )
        if unknown:
            raise UserError(
                f"{f}: tensor(s) {unknown[:5]} are not part of an EAGLE-3 draft; vLLM loads every *.safetensors "
                f"file in a draft directory and stops on them: keep other files outside it (a datastore: "
                f"{path.name}.datastore.safetensors beside the directory)"
            )
        if twice := sorted(set(sd) & set(tensors)):
            raise UserError(
                f"{f}: tensor(s) {twice[:5]} stand in {origin[twice[0]]} too: which is the draft's?"
            )
        sd.update(tensors)
        origin.update(dict.fromkeys(tensors, f.name))
    check_state_dict(expected, {k: v for k, v in sd.items() if k not in _OPTIONAL_KEYS}, f"{path} (draft)")
    check_dtypes(sd, str(path))
    d2t, t2d = sd["d2t"].long(), sd["t2d"].bool()
    check_vocab_maps(d2t, t2d, str(path))
    embed = sd.get("embed_tokens.weight")
    if embed is not None:
        if tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise UserError(
                f"{path}: embed_tokens.weight is {list(embed.shape)}, not [vocab_size, hidden_size] = "
                f"{[cfg.vocab_size, cfg.hidden_size]} of {cfg_file}"
            )
        # a few rows, to say whether they are the target's (`embeddings_note`)
        rows = torch.linspace(0, cfg.vocab_size - 1, min(EMBED_PROBE_ROWS, cfg.vocab_size)).long().unique()
        draft.file_embed_rows = (rows, embed[rows].float())
    tensors = {
        k: (v.to(device) if k in ("d2t", "t2d") else v.to(device=device, dtype=dtype))
        for k, v in sd.items()
        if k in expected
    }
    tensors["d2t"], tensors["t2d"] = d2t.to(device), t2d.to(device)
    draft.load_state_dict(tensors, strict=True, assign=True)
    draft.inv_freq = _inv_freq(cfg).to(device)
    draft.source = str(cfg_file)
    return draft.eval()


def embeddings_note(draft: Eagle3Draft, target_embed: nn.Module) -> str | None:
    """What to tell the user when the draft's file carries an `embed_tokens.weight` unlike the target's (None
    when it carries none, or the target's): this project embeds the draft's tokens with the target's table
    (vLLM would keep the draft's own, SGLang shares the target's). Compared on a few rows, in fp32, to 1e-2
    of their largest value: a bf16 copy of the target's table or a quantized target's passes. `target_embed` is
    the target's embedding module, called (a vocabulary-parallel one gathers its rows: call on every rank)."""
    if getattr(draft, "file_embed_rows", None) is None:
        return None
    rows, mine = draft.file_embed_rows
    with torch.no_grad():
        theirs = target_embed(rows.to(target_embed.weight.device)).float().cpu()
    diff = float((mine - theirs).abs().max())
    if diff <= 1e-2 * max(float(theirs.abs().max()), 1e-30):
        return None
    return (
        f"{draft.source}: the draft's weights carry an embed_tokens.weight unlike the target's (max difference "
        f"{diff:.3g} on {len(rows)} rows); the target's is used (vLLM would use the draft's own)"
    )


def check_dtypes(sd: dict[str, Tensor], source: str) -> None:
    """Weights are floating point, d2t integers, t2d booleans (or integers of 0 and 1): anything else was
    written by mistake, and casting it would load numbers no one trained."""
    for k, v in sd.items():
        if k == "d2t":
            ok = not v.is_floating_point() and not v.is_complex() and v.dtype != torch.bool
        elif k == "t2d":
            ok = v.dtype == torch.bool or (
                not v.is_floating_point() and not v.is_complex() and bool(((v == 0) | (v == 1)).all())
            )
        else:
            ok = v.is_floating_point()
        if not ok:
            want = {"d2t": "integers", "t2d": "booleans"}.get(k, "floating point")
            raise UserError(f"{source}: {k} is {str(v.dtype).removeprefix('torch.')}, not {want}")


def draft_dir(path: str | os.PathLike) -> Path:
    """A draft directory, or a training run's --out holding one in draft/ (train.fit, train.stage)."""
    path = Path(path)
    for p in (path, path / "draft"):
        if (p / "config.json").is_file():
            return p
    raise FileNotFoundError(f"{path}: no draft (config.json) there or in {path / 'draft'}")


def read_safetensors(f: Path) -> dict[str, Tensor]:
    """Every tensor of one weight file (released drafts' `model.midlayer.*` read as `midlayer.*`); a
    truncated or corrupt file is a UserError naming it."""
    sd: dict[str, Tensor] = {}
    try:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                sd[k.removeprefix("model.") if k.startswith("model.midlayer") else k] = sf.get_tensor(k)
    except Exception as exc:  # safetensors raises its own SafetensorError / OSError without the path
        raise UserError(
            f"{f}: not a readable safetensors file ({type(exc).__name__}: {exc}); truncated or corrupt?"
        ) from exc
    return sd


def check_vocab_maps(d2t: Tensor, t2d: Tensor, source: str) -> None:
    """d2t (draft id -> offset to its target id) and t2d (target ids in the draft vocab) must describe
    one injective map: each draft id its own target id, in range, and exactly the ids t2d marks."""
    ids = torch.arange(len(d2t)) + d2t.cpu()
    V = len(t2d)
    out = ((ids < 0) | (ids >= V)).nonzero().flatten()
    if len(out):
        i = int(out[0])
        raise UserError(f"{source}: d2t maps draft id {i} to target id {int(ids[i])}, outside 0..{V - 1}")
    uniq, counts = ids.unique(return_counts=True)
    if bool((counts > 1).any()):
        tid = int(uniq[counts > 1][0])
        dup = (ids == tid).nonzero().flatten().tolist()
        raise UserError(f"{source}: d2t maps draft ids {dup} to the same target token {tid}")
    if int(t2d.sum()) != len(d2t) or not bool(t2d.cpu()[ids].all()):
        raise UserError(f"{source}: d2t and t2d disagree (d2t does not map onto the ids that t2d marks)")


def _inv_freq(c: DraftConfig) -> Tensor:
    D = c.head_dim
    cfg = Llama4Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=1, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=D, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
        moe_layers=[], no_rope_layers=[1], num_local_experts=0,
    )  # fmt: skip
    return rope_inv_freq(cfg)
