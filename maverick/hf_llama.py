"""HF `LlamaForCausalLM` checkpoints <-> our model: the one converter for that format, with one key map.

A Llama-family model (Llama 2/3.x, SmolLM2, ...) runs as a dense Llama-4-family config, the same one the
GGUF path builds: every layer uses RoPE (`no_rope_layers[i] == 1`), no MoE layers, no chunked attention,
no QK norm, no attention temperature tuning. Llama's `mlp.{gate,up,down}_proj` become our dense
`feed_forward.{gate,up,down}_proj`; every other parameter keeps its name.

q/k rows: HF Llama rotates the half-split pairs (i, i + D/2) of each head (`rotate_half`); our attention
rotates interleaved pairs (2i, 2i+1) (Llama 4's complex RoPE, as llama.cpp stores GGUF q/k). So each head's
HF row i becomes our row 2i and HF row i + D/2 our row 2i + 1, once at load (`to_interleaved`), and back
at save (`to_half_split`). The same permutation of q and k leaves every dot product q.k unchanged, so
v_proj and o_proj stay as they are.

Only what this model computes is accepted; anything else is an error naming the config field or the key:
`architectures` other than LlamaForCausalLM, `attention_bias` / `mlp_bias` (and any bias key), RoPE types
other than default and llama3, `hidden_act` other than silu. Buffers HF recomputes (`rotary_emb.inv_freq`,
saved by old conversions) are dropped, as HF's own loader does.

Functions here work on config dicts and state dicts only; reading and writing files is
maverick/checkpoint.py's (`load_hf`, `save_hf(..., layout="llama")`).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from maverick.cli import UserError
from maverick.config import Llama4Config, check_numbers, dense_llama_fields, fill_llama3_context

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"

# HF Llama key inside model.layers.{i}. -> ours
_LAYER_KEYS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "self_attn.q_proj.weight": "self_attn.q_proj.weight",
    "self_attn.k_proj.weight": "self_attn.k_proj.weight",
    "self_attn.v_proj.weight": "self_attn.v_proj.weight",
    "self_attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp.gate_proj.weight": "feed_forward.gate_proj.weight",
    "mlp.up_proj.weight": "feed_forward.up_proj.weight",
    "mlp.down_proj.weight": "feed_forward.down_proj.weight",
}
_TOP_KEYS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_OUR_LAYER_KEYS = {v: k for k, v in _LAYER_KEYS.items()}
_DERIVED = re.compile(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")  # recomputed, not weights
_PERMUTED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight")


def is_llama(d: dict[str, Any]) -> bool:
    """Whether an HF config.json dict describes a Llama-architecture checkpoint (model_type or
    architectures say so); `config_from_hf` then says whether it is one we can run."""
    return d.get("model_type") == MODEL_TYPE or any(
        a.startswith("Llama") and not a.startswith("Llama4") for a in d.get("architectures") or []
    )


# ---------------------------------------------------------------------------------------------------
# Config


def _rope(d: dict[str, Any], source: str) -> tuple[float, dict | None]:
    """(rope_theta, our rope_scaling) from HF v5 `rope_parameters` or older `rope_theta` + `rope_scaling`, read
    as transformers reads them: a non-empty `rope_scaling` wins over `rope_parameters`, and the winner's
    rope_theta over the top-level one."""
    rp, field = d.get("rope_scaling"), "rope_scaling"
    if not rp:
        rp, field = d.get("rope_parameters") or {}, "rope_parameters"
    rp = dict(rp)
    theta = float(rp.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rtype = rp.pop("rope_type", rp.pop("type", "default"))
    if rtype == "default":
        return theta, None
    if rtype != "llama3":
        raise UserError(f"{source}: {field}.rope_type is {rtype!r}; supported: 'default', 'llama3'")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    rp = fill_llama3_context(rp | {"rope_type": rtype}, d.get("max_position_embeddings", 2048))
    missing = [k for k in keys if k not in rp]
    if missing:
        raise UserError(f"{source}: llama3 {field} lacks {', '.join(f'{field}.{k}' for k in missing)}")
    scaling = {"rope_type": "llama3"} | {k: float(rp[k]) for k in keys[:3]}
    scaling["original_max_position_embeddings"] = int(rp["original_max_position_embeddings"])
    return theta, scaling


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> Llama4Config:
    """Our dense Llama-4-family config for an HF LlamaConfig dict; unsupported fields are errors naming them."""
    archs = d.get("architectures") or [ARCHITECTURE]
    if archs != [ARCHITECTURE] or d.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise UserError(
            f"{source}: architectures={archs} model_type={d.get('model_type')!r}; supported: "
            f"[{ARCHITECTURE!r}] (model_type 'llama') or Llama4ForCausalLM / Llama4ForConditionalGeneration"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if d.get(flag):
            raise UserError(f"{source}: {flag}=true is not supported (our Llama linears have no biases)")
    if d.get("hidden_act", "silu") != "silu":
        raise UserError(f"{source}: hidden_act={d['hidden_act']!r} is not supported (SwiGLU with silu only)")
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if k not in d:
            raise UserError(f"{source}: required field {k!r} is missing")
    counts = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings")  # fmt: skip
    rp = d.get("rope_parameters") or {}
    scales = {"rope_parameters.rope_theta": rp.get("rope_theta") if isinstance(rp, dict) else None}
    check_numbers(d | scales, counts, ("rms_norm_eps", "rope_theta", *scales), source, allow_null=True)
    theta, scaling = _rope(d, source)
    L, nH = int(d["num_hidden_layers"]), int(d["num_attention_heads"])
    I = int(d["intermediate_size"])
    return Llama4Config(
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=I,
        intermediate_size_mlp=I,
        num_hidden_layers=L,
        num_attention_heads=nH,
        num_key_value_heads=int(d.get("num_key_value_heads") or nH),
        head_dim=int(d.get("head_dim") or d["hidden_size"] // nH),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        **dense_llama_fields(L),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        pad_token_id=d.get("pad_token_id"),
    )


def check_plain(cfg: Llama4Config) -> None:
    """A config the Llama layout can hold: dense, RoPE on every layer, nothing Llama-4-only."""
    bad = []
    if cfg.moe_layers:
        bad.append(f"moe_layers={cfg.moe_layers}")
    if not all(cfg.no_rope_layers):
        bad.append("NoPE layers (no_rope_layers has zeros)")
    if cfg.attention_chunk_size is not None:
        bad.append(f"attention_chunk_size={cfg.attention_chunk_size}")
    if cfg.use_qk_norm:
        bad.append("use_qk_norm=true")
    if cfg.attn_temperature_tuning:
        bad.append("attn_temperature_tuning=true")
    if bad:
        raise UserError(f"not a plain Llama, cannot save in the {ARCHITECTURE} layout: {', '.join(bad)}")


def hf_config(cfg: Llama4Config, dtype: torch.dtype) -> dict[str, Any]:
    """The LlamaConfig dict (config.json) of a plain-Llama config; `config_from_hf` reads it back equal."""
    check_plain(cfg)
    rp = {"rope_type": "default", "rope_theta": cfg.rope_theta} | (cfg.rope_scaling or {})
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size_mlp,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rp,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "dtype": str(dtype).removeprefix("torch."),
    }


# ---------------------------------------------------------------------------------------------------
# Weights


def to_interleaved(w: Tensor, n_heads: int) -> Tensor:
    """q/k_proj rows [n_heads * D, H] from HF's half-split order to our interleaved pairs (a copy)."""
    D = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, D // 2, -1).transpose(1, 2).reshape(w.shape).contiguous()


def to_half_split(w: Tensor, n_heads: int) -> Tensor:
    """The inverse of `to_interleaved`."""
    D = w.shape[0] // n_heads
    return w.reshape(n_heads, D // 2, 2, -1).transpose(1, 2).reshape(w.shape).contiguous()


def _heads(cfg: Llama4Config, key: str) -> int:
    return cfg.num_attention_heads if key.endswith("q_proj.weight") else cfg.num_key_value_heads


def from_hf(sd: dict[str, Tensor], cfg: Llama4Config, source: str = "checkpoint") -> dict[str, Tensor]:
    """An HF Llama state dict -> ours (keys renamed, q/k rows interleaved). Keys outside the map are errors
    naming them; missing keys and shapes are checked where the model is built (checkpoint.build_model)."""
    out: dict[str, Tensor] = {}
    unknown = []
    for key, t in sd.items():
        if _DERIVED.fullmatch(key):
            continue
        m = _LAYER_RE.fullmatch(key)
        if key in _TOP_KEYS:
            out[key] = t
        elif m and m.group(2) in _LAYER_KEYS:
            ours = f"model.layers.{m.group(1)}.{_LAYER_KEYS[m.group(2)]}"
            n = _heads(cfg, ours)
            if ours.endswith(_PERMUTED):
                if t.ndim != 2 or t.shape[0] % n or (t.shape[0] // n) % 2:
                    raise UserError(
                        f"{source}: key {key!r} has shape {tuple(t.shape)}, not [{n} heads x even head_dim, H]"
                    )
                t = to_interleaved(t, n)
            out[ours] = t
        elif key.endswith(".bias"):
            flag = "attention_bias" if ".self_attn." in key else "mlp_bias"
            raise UserError(f"{source}: key {key!r}: biases are not supported (config {flag})")
        else:
            unknown.append(key)
    if unknown:
        more = " ..." if len(unknown) > 5 else ""
        raise UserError(f"{source}: unexpected key(s) for {ARCHITECTURE} {sorted(unknown)[:5]}{more}")
    return out  # a tied head stored beside its embeddings is checked and dropped by checkpoint.build_model


def to_hf(sd: dict[str, Tensor], cfg: Llama4Config) -> dict[str, Tensor]:
    """Our state dict of a plain Llama -> HF Llama keys and q/k row order (the tied head left out)."""
    check_plain(cfg)
    out: dict[str, Tensor] = {}
    for key, t in sd.items():
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        m = _LAYER_RE.fullmatch(key)
        if key in _TOP_KEYS:
            out[key] = t
        elif m and m.group(2) in _OUR_LAYER_KEYS:
            if m.group(2) in _PERMUTED:
                t = to_half_split(t, _heads(cfg, key))
            out[f"model.layers.{m.group(1)}.{_OUR_LAYER_KEYS[m.group(2)]}"] = t
        else:
            raise UserError(f"key {key!r} has no place in the {ARCHITECTURE} layout")
    return out
