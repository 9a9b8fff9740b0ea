"""The Llama 4 text-decoder config: one small typed dataclass, read from and written to HF `config.json`.

The same class describes the dense Llama-family models we load from GGUF (SmolLM2): every layer uses
RoPE, no MoE layers, no chunked attention, no QK norm, no temperature tuning.

HF conventions kept as they are so a config.json round-trips:
- `no_rope_layers[i] == 1` means layer i USES RoPE (the name is misleading; it is HF's).
- `moe_layers` lists the MoE layer indices; HF derives it from `interleave_moe_layer_step` when absent:
  range(step - 1, L, step), so step 2 gives the odd layers (Maverick) and step 1 every layer (Scout).
- `intermediate_size` is the expert (and shared expert) width, `intermediate_size_mlp` the dense width.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from maverick.cli import UserError
from maverick.files import atomic_write


def dense_llama_fields(num_layers: int) -> dict[str, Any]:
    """The Llama4Config fields that make a plain (Llama 2/3-style) dense model: no experts, RoPE on every
    layer, no chunked attention, QK norm or temperature tuning (the GGUF and HF Llama loaders' shared part)."""
    return {
        "num_local_experts": 0,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 0,
        "moe_layers": [],
        "no_rope_layers": [1] * num_layers,
        "attention_chunk_size": None,
        "use_qk_norm": False,
        "attn_temperature_tuning": False,
    }


def check_numbers(
    values: Mapping[str, Any],
    counts: Iterable[str] = (),
    positives: Iterable[str] = (),
    where: str = "config.json",
    allow_null: bool = False,
) -> None:
    """Config fields that size or scale a model, checked before any arithmetic: each of `counts` an int >= 1,
    each of `positives` a number > 0. A field absent from `values` is not checked (its default applies), a
    null one only when `allow_null` is False. Otherwise a UserError: '<where>: <field> must be ...'."""
    for key in counts:
        v = values.get(key)
        if key in values and not (v is None and allow_null) and not (type(v) is int and v >= 1):
            raise UserError(f"{where}: {key} must be a positive integer, got {v!r}")
    for key in positives:
        v = values.get(key)
        if key in values and not (v is None and allow_null) and not (type(v) in (int, float) and v > 0):
            raise UserError(f"{where}: {key} must be a positive number, got {v!r}")


# fields that are counts; each must be an int >= 1
_COUNTS = ("vocab_size", "hidden_size", "intermediate_size", "intermediate_size_mlp", "num_hidden_layers",
           "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")  # fmt: skip


LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_scaling_problem(scaling: dict) -> str | None:
    """What is wrong with a rope_scaling dict (None: nothing): a type other than llama3, or llama3 without
    one of its four numbers (rope_inv_freq would stop on a bare KeyError)."""
    rtype = scaling.get("rope_type", scaling.get("type"))
    if rtype not in ("llama3", "default"):
        return f"rope_scaling type {rtype!r} not supported (llama3 only)"
    missing = [k for k in LLAMA3_ROPE_KEYS if k not in scaling] if rtype == "llama3" else []
    return f"llama3 rope_scaling lacks {', '.join('rope_scaling.' + k for k in missing)}" if missing else None


def fill_llama3_context(scaling: dict | None, max_positions: int) -> dict | None:
    """A llama3 rope_scaling without `original_max_position_embeddings` read as transformers reads it: the
    model's max_position_embeddings (it warns that the two should differ, and computes with it)."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "llama3":
        return scaling
    return {"original_max_position_embeddings": max_positions} | scaling


@dataclass
class Llama4Config:
    vocab_size: int = 202048
    hidden_size: int = 5120
    intermediate_size: int = 8192  # routed experts and the shared expert
    intermediate_size_mlp: int = 16384  # dense SwiGLU layers
    num_hidden_layers: int = 48
    num_attention_heads: int = 40
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # None, or {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}
    rope_scaling: dict | None = None
    max_position_embeddings: int = 1048576
    num_local_experts: int = 128
    num_experts_per_tok: int = 1
    interleave_moe_layer_step: int = 2
    moe_layers: list[int] | None = None
    no_rope_layers: list[int] | None = None  # 1 = uses RoPE (HF convention)
    no_rope_layer_interval: int = 4
    attention_chunk_size: int | None = 8192
    use_qk_norm: bool = False
    attn_temperature_tuning: bool = True
    floor_scale: int = 8192
    attn_scale: float = 0.1
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    extra: dict = field(
        default_factory=dict, repr=False, compare=False
    )  # unknown HF fields, written back unchanged

    def __post_init__(self):
        self._check_types()
        L = self.num_hidden_layers
        if not self.no_rope_layers:  # None or [] (Scout's config.json): from the interval, as transformers
            self.no_rope_layers = [int((i + 1) % self.no_rope_layer_interval != 0) for i in range(L)]
        if self.moe_layers is None:
            step = self.interleave_moe_layer_step
            self.moe_layers = (
                list(range(step - 1, L, step)) if step > 0 and self.num_local_experts > 0 else []
            )
        self.no_rope_layers = [int(x) for x in self.no_rope_layers]
        self.moe_layers = sorted(int(x) for x in self.moe_layers)
        self.validate()

    def _check_types(self) -> None:
        """Fields read from a config.json have the types they size things with (before any arithmetic)."""
        check_numbers(vars(self), _COUNTS, ("rms_norm_eps", "rope_theta"), "invalid Llama4Config")
        for key in ("num_local_experts", "interleave_moe_layer_step", "no_rope_layer_interval"):
            v = getattr(self, key)
            if not (type(v) is int and v >= 0):
                raise ValueError(f"invalid Llama4Config: {key} must be an integer >= 0, got {v!r}")

    def validate(self) -> None:
        def need(ok: bool, msg: str):
            if not ok:
                raise ValueError(f"invalid Llama4Config: {msg}")

        need(self.num_hidden_layers > 0, f"num_hidden_layers={self.num_hidden_layers} must be > 0")
        need(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"num_attention_heads={self.num_attention_heads} is not divisible by "
            f"num_key_value_heads={self.num_key_value_heads}",
        )
        need(self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even for RoPE pairs")
        need(
            len(self.no_rope_layers) == self.num_hidden_layers,
            f"no_rope_layers has {len(self.no_rope_layers)} entries for {self.num_hidden_layers} layers",
        )
        need(
            all(0 <= i < self.num_hidden_layers for i in self.moe_layers),
            f"moe_layers {self.moe_layers} out of range for {self.num_hidden_layers} layers",
        )
        need(not self.moe_layers or self.num_local_experts > 0, "moe_layers given but num_local_experts is 0")
        need(
            self.num_experts_per_tok == 1 or not self.moe_layers, "only top-1 routing (Llama 4) is supported"
        )
        if self.rope_scaling is not None:
            problem = rope_scaling_problem(self.rope_scaling)
            need(problem is None, str(problem))

    # ---- derived ----
    def uses_rope(self, layer: int) -> bool:
        return bool(self.no_rope_layers[layer])

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    def is_chunked(self, layer: int) -> bool:
        """Chunked local attention applies on RoPE layers only; NoPE layers see the full causal context."""
        return self.attention_chunk_size is not None and self.uses_rope(layer)

    @property
    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else ([e] if isinstance(e, int) else list(e))

    # ---- HF config.json ----
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], hf_defaults: bool = False) -> Llama4Config:
        """Accepts Llama4TextConfig fields, or a Llama4Config with a nested `text_config`. hf_defaults: a field
        the dict leaves out takes transformers' Llama4TextConfig default where it differs from ours (a
        config.json written by hand: transformers reads a missing use_qk_norm as True)."""
        if "text_config" in d:
            d = d["text_config"]
        d = dict(d)
        if hf_defaults:
            d = HF_TEXT_DEFAULTS | d
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        # HF v5 keeps rope_theta / scaling in `rope_parameters`; older files use rope_theta + rope_scaling. As
        # transformers reads them: a non-empty rope_scaling wins, and the winner's rope_theta over the top level
        rp = d.pop("rope_parameters", None)
        if rp and not d.get("rope_scaling"):  # null too
            rp = dict(rp)
            if "rope_theta" in rp:
                d["rope_theta"] = rp.pop("rope_theta")
            if rp.get("rope_type", "default") != "default":
                d["rope_scaling"] = rp
        elif d.get("rope_scaling") and "rope_theta" in d["rope_scaling"]:
            d["rope_scaling"] = dict(d["rope_scaling"])
            d["rope_theta"] = d["rope_scaling"].pop("rope_theta")
        # transformers' default max_position_embeddings here, not ours (Maverick's)
        d["rope_scaling"] = fill_llama3_context(
            d.get("rope_scaling"),
            d.get("max_position_embeddings", HF_TEXT_DEFAULTS["max_position_embeddings"]),
        )
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={d['hidden_act']!r} is not supported (SwiGLU with silu only)")
        if d.get("head_dim") is None and "hidden_size" in d and "num_attention_heads" in d:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        kwargs = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names}
        cfg = cls(**kwargs, extra=extra)
        # transformers masks by the given layer_types (chunked only with a chunk size); we derive them
        given = extra.get("layer_types")
        if given is not None:
            chunked = [cfg.is_chunked(i) for i in range(cfg.num_hidden_layers)]
            if [t == "chunked_attention" and cfg.attention_chunk_size is not None for t in given] != chunked:
                raise ValueError(
                    f"layer_types {given} differ from what no_rope_layers and attention_chunk_size make of the "
                    f"layers (chunked: {chunked}); layer types of their own are not supported"
                )
        return cfg

    def to_hf_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        d.update(self.extra)
        d["model_type"] = "llama4_text"
        d.setdefault("architectures", ["Llama4ForCausalLM"])
        d["hidden_act"] = "silu"
        d["attention_bias"] = False
        rp = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rp.update(self.rope_scaling)
            rp["rope_type"] = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "llama3"))
        d["rope_parameters"] = rp
        d["layer_types"] = [
            "chunked_attention" if self.is_chunked(i) else "full_attention"
            for i in range(self.num_hidden_layers)
        ]
        return d

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> Llama4Config:
        """An HF checkpoint's config.json (or its directory); missing fields as transformers reads them."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(d, hf_defaults=True)

    def save_json(self, path: str | os.PathLike) -> None:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        atomic_write(path, json.dumps(self.to_hf_dict(), indent=2, sort_keys=True))


# transformers' Llama4TextConfig defaults where ours (Maverick's) differ: what a config.json without the field means
HF_TEXT_DEFAULTS = {"use_qk_norm": True, "num_local_experts": 16, "interleave_moe_layer_step": 1,
                    "max_position_embeddings": 131072, "head_dim": 128}  # fmt: skip


# ---- the registry of named configs ----


def _maverick() -> Llama4Config:
    return Llama4Config()


def _scout() -> Llama4Config:
    return Llama4Config(
        num_local_experts=16,
        interleave_moe_layer_step=1,
        intermediate_size_mlp=16384,
        use_qk_norm=True,
        max_position_embeddings=10485760,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
    )


def _tiny_moe() -> Llama4Config:
    """A debug Llama 4: interleaved dense/MoE, NoPE every 4th layer, chunk 16, temperature tuning with a
    small floor_scale so it actually changes q within a short sequence."""
    return Llama4Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        intermediate_size_mlp=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        interleave_moe_layer_step=2,
        attention_chunk_size=16,
        floor_scale=8,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
    )


def _tiny_dense() -> Llama4Config:
    """A debug dense Llama (the GGUF path's shape of config)."""
    return Llama4Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        intermediate_size_mlp=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=0,
        interleave_moe_layer_step=0,
        moe_layers=[],
        no_rope_layers=[1, 1, 1, 1],
        attention_chunk_size=None,
        attn_temperature_tuning=False,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        max_position_embeddings=4096,
    )


CONFIGS = {
    "maverick-400b": _maverick,
    "scout-109b": _scout,
    "tiny-moe": _tiny_moe,
    "tiny-dense": _tiny_dense,
}


def get_config(name: str, **overrides) -> Llama4Config:
    if name not in CONFIGS:
        raise KeyError(f"unknown config {name!r}; known: {', '.join(sorted(CONFIGS))}")
    cfg = CONFIGS[name]()
    return dataclasses.replace(cfg, **overrides) if overrides else cfg
