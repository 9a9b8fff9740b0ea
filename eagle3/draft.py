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

from maverick.checkpoint import atomic_dir, check_state_dict
from maverick.config import Llama4Config
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
    feature_layers: tuple[
        int, ...
    ]  # target layers whose INPUT hidden states are the features (low, mid, high)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.feature_layers = tuple(self.feature_layers)  # a list when read from JSON

    @classmethod
    def for_target(
        cls, target: Llama4Config, draft_vocab_size: int, feature_layers=None, **kw
    ) -> DraftConfig:
        """Shapes follow the target (the draft shares its embeddings); features default to the hidden states
        entering layers 2, L//2 and L-3."""
        L = target.num_hidden_layers
        fl = tuple(feature_layers) if feature_layers is not None else (2, L // 2, L - 3)
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
            # vLLM counts aux layers as layer OUTPUTS: the input of layer i is the output of layer i-1
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": [i - 1 for i in self.feature_layers],
                "use_aux_hidden_state": True,
            },
        }
        return d

    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> DraftConfig:
        arch = d.get("architectures") or []
        if not any("Eagle3" in a or "eagle3" in a.lower() for a in arch):
            raise ValueError(
                f"{source}: architectures {arch} is not an EAGLE-3 draft (LlamaForCausalLMEagle3)"
            )
        if d.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"{source}: num_hidden_layers={d['num_hidden_layers']}, an EAGLE-3 draft has 1")
        for key in ("hidden_size", "num_attention_heads", "vocab_size", "intermediate_size"):
            if key not in d:
                raise ValueError(f"{source}: missing field {key!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names and k not in ("extra", "feature_layers")}
        kw.setdefault("num_key_value_heads", d["num_attention_heads"])
        kw.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
        kw.setdefault("draft_vocab_size", d["vocab_size"])
        kw.setdefault("target_hidden_size", d["hidden_size"])
        if kw.get("target_hidden_size") is None:
            kw["target_hidden_size"] = d["hidden_size"]
        rp = d.get("rope_parameters") or {}
        kw.setdefault("rope_theta", rp.get("rope_theta", 10000.0))
        if kw.get("rope_scaling") is None and rp.get("rope_type", "default") != "default":
            kw["rope_scaling"] = rp
        ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids is None:
            raise ValueError(
                f"{source}: no eagle_config.eagle_aux_hidden_state_layer_ids; pass feature_layers for this target"
            )
        kw["feature_layers"] = tuple(int(i) + 1 for i in ids)
        extra = {k: v for k, v in d.items() if k not in names and k not in _DERIVED}
        return cls(**kw, extra=extra)


_DERIVED = {
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
        self.fc = Linear(len(c.feature_layers) * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool) if c.draft_vocab_size == c.vocab_size
                             else torch.zeros(c.vocab_size, dtype=torch.bool))  # fmt: skip
        self.register_buffer("inv_freq", _inv_freq(c), persistent=False)

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
        """Target features [.., n*H_target] -> draft hidden [.., H]."""
        return self.fc(features.to(self.fc.weight.dtype))

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
        Returns the layer output h [B, T, H] (before `norm`); logits come from `logits(h)`."""
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
        """Residual on the hidden state, then the MLP block."""
        h = hidden + attn_out
        return h + self.midlayer.mlp(self.midlayer.post_attention_layernorm(h))

    def logits(self, h: Tensor) -> Tensor:
        """Draft-vocab logits [.., V']."""
        return self.lm_head(self.norm(h))


# ---- the released EAGLE-3 checkpoint format ----

_OPTIONAL_KEYS = {"embed_tokens.weight"}  # some releases carry the target's embeddings; we share the target's


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
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"no config.json in draft directory {path}")
    cfg = DraftConfig.from_hf_dict(json.loads(cfg_file.read_text()), source=str(cfg_file))
    # a datastore (eagle3/datastore.py) may ship beside the weights: it is not part of the draft
    files = sorted(f for f in path.glob("*.safetensors") if not f.name.startswith("datastore"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in draft directory {path}")
    sd: dict[str, Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                sd[k.removeprefix("model.") if k.startswith("model.midlayer") else k] = sf.get_tensor(k)
    with torch.device("meta"):
        draft = Eagle3Draft(cfg)
    expected = draft.state_dict()
    check_state_dict(expected, {k: v for k, v in sd.items() if k not in _OPTIONAL_KEYS}, f"{path} (draft)")
    d2t, t2d = sd["d2t"].long(), sd["t2d"].bool()
    ids = torch.arange(len(d2t)) + d2t
    if int(t2d.sum()) != len(d2t) or not bool(t2d[ids.clamp(0, len(t2d) - 1)].all()) or ids.max() >= len(t2d):
        raise ValueError(f"{path}: d2t and t2d disagree (d2t does not map onto the ids that t2d marks)")
    tensors = {
        k: (v.to(device) if k in ("d2t", "t2d") else v.to(device=device, dtype=dtype))
        for k, v in sd.items()
        if k in expected
    }
    tensors["d2t"], tensors["t2d"] = d2t.to(device), t2d.to(device)
    draft.load_state_dict(tensors, strict=True, assign=True)
    draft.inv_freq = _inv_freq(cfg).to(device)
    return draft.eval()


def _inv_freq(c: DraftConfig) -> Tensor:
    D = c.head_dim
    cfg = Llama4Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=1, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=D, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
        moe_layers=[], no_rope_layers=[1], num_local_experts=0,
    )  # fmt: skip
    return rope_inv_freq(cfg)
