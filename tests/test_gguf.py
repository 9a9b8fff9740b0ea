"""GGUF reader: dequantisation bit-exact against gguf.quants, config and names from the real SmolLM2
file, parity with HF's own GGUF loader (after undoing its q/k permutation), and clear errors."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from maverick.gguf_loader import (
    ROPE_FREQS,
    SUPPORTED_TYPES,
    _open,
    default_gguf_path,
    dequantize,
    expected_shapes,
    llama3_rope_factors,
    our_name,
    read_gguf,
)

# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------


def f16_bytes(v: float) -> np.ndarray:
    return np.array([v], dtype=np.float16).view(np.uint8)


def bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns: equality here is bit-exact (tells -0.0 from 0.0, NaN payloads apart)."""
    return x.contiguous().view(torch.int32)


def reference(data: np.ndarray, qtype: Q) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(data, qtype), dtype=np.float32))


def encode(x: np.ndarray, qtype: Q) -> np.ndarray:
    return gguf.quants.quantize(x.astype(np.float32), qtype)


def interleaved_to_rotate_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Per head: rows [0, 2, 4, ...] then [1, 3, 5, ...] (HF's inverse of llama.cpp's permutation)."""
    D = w.shape[0] // n_heads
    return w.reshape(n_heads, D // 2, 2, -1).transpose(1, 2).reshape(w.shape)


# A tiny dense llama: H must be a multiple of 256 so a tensor can be written as Q6_K.
TINY = dict(V=96, H=256, nH=4, nKV=2, D=64, I=384, L=2)


def tiny_tensors(*, tie: bool = True, seed: int = 0) -> dict[str, np.ndarray]:
    """GGUF name -> fp32 array in PyTorch [out, in] order."""
    g = np.random.default_rng(seed)
    V, H, nH, nKV, D, I, L = (TINY[k] for k in ("V", "H", "nH", "nKV", "D", "I", "L"))
    t = {"token_embd.weight": g.normal(size=(V, H)), "output_norm.weight": 1 + 0.1 * g.normal(size=H)}
    if not tie:
        t["output.weight"] = g.normal(size=(V, H))
    for i in range(L):
        p = f"blk.{i}."
        t |= {
            p + "attn_norm.weight": 1 + 0.1 * g.normal(size=H),
            p + "ffn_norm.weight": 1 + 0.1 * g.normal(size=H),
            p + "attn_q.weight": g.normal(size=(nH * D, H)),
            p + "attn_k.weight": g.normal(size=(nKV * D, H)),
            p + "attn_v.weight": g.normal(size=(nKV * D, H)),
            p + "attn_output.weight": g.normal(size=(H, nH * D)),
            p + "ffn_gate.weight": g.normal(size=(I, H)),
            p + "ffn_up.weight": g.normal(size=(I, H)),
            p + "ffn_down.weight": g.normal(size=(H, I)),
        }
    return {k: v.astype(np.float32) for k, v in t.items()}


def write_tiny(path, tensors, types=None, *, arch="llama", meta=None, raw_shapes=None):
    """Write `tensors` (name -> fp32 array, or raw uint8 bytes when types[name] is a block type, in the
    PyTorch shape raw_shapes[name] if given)."""
    types, raw_shapes = types or {}, raw_shapes or {}
    V, H, nH, nKV, D, I, L = (TINY[k] for k in ("V", "H", "nH", "nKV", "D", "I", "L"))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(nH)
    w.add_head_count_kv(nKV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_rope_dimension_count(D)
    w.add_vocab_size(V)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for key, value in (meta or {}).items():
        (w.add_string if isinstance(value, str) else w.add_float32)(key, value)
    for name, x in tensors.items():
        qtype = types.get(name, Q.F32 if x.ndim == 1 else Q.Q8_0)
        if name in raw_shapes:  # bytes as int8: the writer takes raw_shape as the elements' shape
            w.add_tensor(name, x.view(np.int8), raw_shape=raw_shapes[name], raw_dtype=qtype)
        elif x.dtype == np.uint8:
            w.add_tensor(name, x, raw_dtype=qtype)
        elif qtype == Q.F32:
            w.add_tensor(name, x)
        elif qtype == Q.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, encode(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_path():
    try:
        return default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def reader(real_path):
    """One parse of the real file's header for the reference checks (GGUFReader takes seconds)."""
    return gguf.GGUFReader(real_path)


@pytest.fixture(scope="module")
def ckpt(real_path):
    return read_gguf(real_path)


@pytest.fixture(scope="module")
def hf_state(hf_smollm2):
    """HF's own GGUF loader's tensors (numpy dequantisation, q/k un-permuted to rotate_half)."""
    return {k: v.detach() for k, v in hf_smollm2.state_dict().items()}


# ---------------------------------------------------------------------------------------------------
# dequantisation
# ---------------------------------------------------------------------------------------------------


def test_q4_0_block_layout_by_hand():
    # byte j: low nibble j -> element j, high nibble 15 - j -> element j + 16; x = (q - 8) * d
    d = f16_bytes(0.5)
    qs = np.array([j | ((15 - j) << 4) for j in range(16)], dtype=np.uint8)
    block = np.concatenate([d, qs])[None]  # [1, 18]
    ours = dequantize(block, Q.Q4_0, (32,))
    want = [(j - 8) * 0.5 for j in range(16)] + [(15 - j - 8) * 0.5 for j in range(16)]
    assert ours.tolist() == want
    assert ours[:3].tolist() == [-4.0, -3.5, -3.0] and ours[16:19].tolist() == [3.5, 3.0, 2.5]
    assert torch.equal(bits(ours), bits(reference(block, Q.Q4_0).flatten()))


def test_q4_1_and_q8_0_blocks_by_hand():
    # Q4_1: fp16 d = 0.25, fp16 m = -1, all codes 4 (low) and 9 (high): x = q * d + m
    block = np.concatenate([f16_bytes(0.25), f16_bytes(-1.0)])
    block = np.concatenate([block, np.full(16, 4 | (9 << 4), np.uint8)])[None]
    ours = dequantize(block, Q.Q4_1, (32,))
    assert ours.tolist() == [0.0] * 16 + [1.25] * 16
    assert torch.equal(bits(ours), bits(reference(block, Q.Q4_1).flatten()))
    # Q8_0: fp16 d = 2, int8 q = -16..15: x = q * d
    q = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    block = np.concatenate([f16_bytes(2.0), q])[None]
    ours = dequantize(block, Q.Q8_0, (32,))
    assert ours.tolist() == [2.0 * v for v in range(-16, 16)]
    assert torch.equal(bits(ours), bits(reference(block, Q.Q8_0).flatten()))


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda q: q.name)
def test_synthetic_blocks_match_gguf_reference(qtype):
    g = np.random.default_rng(1)
    x = g.normal(size=(24, 64)) * np.exp(g.uniform(-8, 8, size=(24, 1)))  # scales from 3e-4 to 3e3
    x[0] = 0.0  # all-zero blocks: d = 0
    x[1, :32] = -1.0  # constant block
    x[2, 5] = 60000.0  # outlier near fp16 max
    data = (
        encode(x, qtype)
        if qtype not in (Q.F32, Q.F16)
        else x.astype(np.float32 if qtype == Q.F32 else np.float16)
    )
    ours = dequantize(data, qtype, (24, 64))
    ref = reference(data, qtype).reshape(24, 64)
    assert ours.dtype == torch.float32 and ours.shape == (24, 64)
    assert torch.equal(bits(ours), bits(ref))
    # and the quantisation error is what the format allows (guards against a reference that is wrong too)
    err = (ours - torch.from_numpy(x.astype(np.float32))).abs().max(dim=1).values
    scale = torch.from_numpy(np.abs(x).max(axis=1).astype(np.float32))
    tol = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 8e-3, Q.Q4_0: 0.15, Q.Q4_1: 0.15}[qtype]
    assert bool((err <= tol * scale + 1e-30).all()), err / scale


def test_real_tensors_match_gguf_reference(ckpt, reader):
    seen = set()
    for t in reader.tensors:
        ref = reference(t.data, t.tensor_type).reshape(ckpt.state_dict[our_name(t.name)].shape)
        assert torch.equal(bits(ckpt.state_dict[our_name(t.name)]), bits(ref)), t.name
        seen.add(t.tensor_type)
    assert seen == {Q.Q4_1, Q.Q8_0, Q.F32}
    emb = ckpt.state_dict["model.embed_tokens.weight"]
    assert emb.shape == (49152, 576) and 0.01 < emb.std().item() < 1.0


def test_dequantize_rejects_wrong_sizes_and_types():
    with pytest.raises(ValueError, match=r"Q4_0 data of 18 bytes does not hold shape \(64,\)"):
        dequantize(np.zeros(18, np.uint8), Q.Q4_0, (64,))
    with pytest.raises(ValueError, match="Q6_K is not supported.*Q4_1"):
        dequantize(np.zeros(210, np.uint8), Q.Q6_K, (256,))


# ---------------------------------------------------------------------------------------------------
# the real SmolLM2 file: config, names, HF parity
# ---------------------------------------------------------------------------------------------------


def test_config_from_real_file(ckpt):
    c = ckpt.config
    assert (c["vocab_size"], c["hidden_size"], c["num_hidden_layers"]) == (49152, 576, 30)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert c["intermediate_size"] == c["intermediate_size_mlp"] == 1536
    assert c["rms_norm_eps"] == 1e-5 and c["rope_theta"] == 100000.0 and c["rope_scaling"] is None
    assert c["max_position_embeddings"] == 8192
    assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]) == (1, 2, 2)
    assert c["tie_word_embeddings"] is True
    assert c["moe_layers"] == [] and c["no_rope_layers"] == [1] * 30 and c["attention_chunk_size"] is None
    assert c["use_qk_norm"] is False and c["attn_temperature_tuning"] is False
    assert c["num_local_experts"] == 0 and c["interleave_moe_layer_step"] == 0
    assert ckpt.metadata["general.architecture"] == "llama" and ckpt.metadata["llama.block_count"] == 30
    assert "tokenizer.ggml.tokens" not in ckpt.metadata  # arrays are left out


def test_config_is_a_valid_hf_llama4_text_config(ckpt):
    transformers = pytest.importorskip("transformers")
    hf = transformers.Llama4TextConfig(**ckpt.config)
    assert hf.layer_types == ["full_attention"] * 30 and hf.moe_layers == []
    assert hf.rope_parameters["rope_theta"] == 100000.0 and hf.head_dim == 64


def test_all_272_tensors_map_with_checked_shapes(ckpt, reader):
    assert len(reader.tensors) == 272
    assert sorted(our_name(t.name) for t in reader.tensors) == sorted(ckpt.state_dict)
    shapes = expected_shapes(ckpt.config)
    assert len(shapes) == 272 and "lm_head.weight" not in shapes  # tied
    assert {k: tuple(v.shape) for k, v in ckpt.state_dict.items()} == shapes
    assert ckpt.state_dict["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert ckpt.state_dict["model.layers.29.feed_forward.down_proj.weight"].shape == (576, 1536)
    assert all(v.dtype == torch.float32 for v in ckpt.state_dict.values())


def test_matches_hf_gguf_loader_exactly(ckpt, hf_state):
    cfg, ours = ckpt.config, ckpt.state_dict
    assert torch.equal(hf_state["lm_head.weight"], ours["model.embed_tokens.weight"])  # tied in HF too
    checked = 0
    for hf_key, hf_w in hf_state.items():
        if hf_key == "lm_head.weight":
            continue
        w = ours[hf_key.replace(".mlp.", ".feed_forward.")]
        if ".q_proj." in hf_key:
            w = interleaved_to_rotate_half(w, cfg["num_attention_heads"])
        elif ".k_proj." in hf_key:
            w = interleaved_to_rotate_half(w, cfg["num_key_value_heads"])
        assert torch.equal(w, hf_w), hf_key
        checked += 1
    assert checked == 272


def test_control_q_without_conversion_differs_from_hf(ckpt, hf_state):
    """The parity test can fail: our stored (interleaved) q rows are not HF's rotate_half rows."""
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(ckpt.state_dict[key], hf_state[key])
    wrong_heads = interleaved_to_rotate_half(ckpt.state_dict[key], 3)  # kv head count for q: wrong
    assert not torch.equal(wrong_heads, hf_state[key])


# ---------------------------------------------------------------------------------------------------
# synthetic files: untied output, dtypes, RoPE scaling
# ---------------------------------------------------------------------------------------------------


def test_untied_mixed_types_to_bfloat16(tmp_path):
    t = tiny_tensors(tie=False)
    types = {"token_embd.weight": Q.F16, "output.weight": Q.BF16, "blk.0.attn_q.weight": Q.Q4_0}
    types |= {"blk.1.ffn_up.weight": Q.Q4_1, "blk.1.attn_norm.weight": Q.F16}
    path = write_tiny(tmp_path / "tiny.gguf", t, types)
    ck = read_gguf(path, dtype=torch.bfloat16)
    assert ck.config["tie_word_embeddings"] is False and ck.config["vocab_size"] == 96
    assert set(ck.state_dict) == set(expected_shapes(ck.config)) and "lm_head.weight" in ck.state_dict
    for name, x in t.items():
        qtype = types.get(name, Q.F32 if x.ndim == 1 else Q.Q8_0)
        data = x if qtype == Q.F32 else x.astype(np.float16) if qtype == Q.F16 else encode(x, qtype)
        want = reference(data, qtype).reshape(x.shape).to(torch.bfloat16)
        got = ck.state_dict[our_name(name)]
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), name
    assert ck.config["rope_theta"] == 500000.0


def test_untied_4bit_embedding_and_head_load_on_the_int4_path(tmp_path):
    """`llama-quantize --pure Q4_0` keeps output.weight and packs every matrix: the bf16 4-bit load packs
    the head and looks the embedding up by row (it handed nn.Embedding to the int4 linear: AttributeError),
    giving the logits of the dequantised weights within the int4 kernel's rounding."""
    from maverick.gguf_model import load_gguf_model

    t = tiny_tensors(tie=False)
    path = write_tiny(tmp_path / "pure.gguf", t, {"token_embd.weight": Q.Q4_0, "output.weight": Q.Q4_0})
    dense = load_gguf_model(path, dtype=torch.bfloat16)
    packed = load_gguf_model(path, dtype=torch.bfloat16, q4=True)
    x = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        a, b = dense(x).logits.float(), packed(x).logits.float()
    assert not packed.config.tie_word_embeddings and (a - b).norm() / a.norm() < 2e-2


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_llama3_rope_factors_numbers():
    f = llama3_rope_factors(500000.0, 64, LLAMA3)
    assert f.shape == (32,) and f[0].item() == 1.0 and f[-1].item() == 8.0  # short kept, long / factor
    mid = f[(f > 1) & (f < 8)]
    assert len(mid) > 0 and bool((mid[1:] >= mid[:-1]).all())
    # HF's own llama3 inv_freq agrees with inv_freq / factors
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        head_dim=64,
        rope_parameters={"rope_theta": 500000.0, **LLAMA3},
    )
    hf_inv, _ = rope_utils.ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    inv = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    torch.testing.assert_close(inv / f, hf_inv.float(), rtol=1e-6, atol=0)


def test_llama3_scaling_from_metadata(tmp_path):
    meta = {"llama.rope.scaling.type": "llama3", "llama.rope.scaling.factor": 8.0}
    meta |= {"llama.rope.scaling.low_freq_factor": 1.0, "llama.rope.scaling.high_freq_factor": 4.0}
    meta |= {"llama.rope.scaling.original_context_length": 64.0}
    ck = read_gguf(write_tiny(tmp_path / "m.gguf", tiny_tensors(), meta=meta))
    assert ck.config["rope_scaling"] == LLAMA3
    del meta["llama.rope.scaling.factor"]
    with pytest.raises(ValueError, match=r"missing metadata keys \['llama.rope.scaling.factor'\]"):
        read_gguf(write_tiny(tmp_path / "m2.gguf", tiny_tensors(), meta=meta))
    with pytest.raises(ValueError, match="RoPE scaling type 'yarn'.*llama3 only"):
        read_gguf(write_tiny(tmp_path / "m3.gguf", tiny_tensors(), meta={"llama.rope.scaling.type": "yarn"}))


def test_rope_freqs_tensor_is_checked_against_rope_scaling(tmp_path):
    t = tiny_tensors() | {ROPE_FREQS: llama3_rope_factors(500000.0, 64, LLAMA3).numpy()}
    path = write_tiny(tmp_path / "rf.gguf", t)
    ck = read_gguf(path, rope_scaling=LLAMA3)
    assert ck.config["rope_scaling"] == LLAMA3 and ROPE_FREQS not in ck.state_dict
    with pytest.raises(ValueError, match="rope_freqs.weight holds llama3 RoPE scaling factors"):
        read_gguf(path)
    with pytest.raises(ValueError, match="rope_freqs.weight .* does not match"):
        read_gguf(path, rope_scaling=LLAMA3 | {"factor": 16.0})


# ---------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------


def assert_header_is_gguf_readers(path, ref=None) -> None:
    """`_open` (our parser) reads what gguf's GGUFReader reads: every scalar and string field, every array's
    length, every tensor's name, type, shape, offset and bytes."""
    ours, ref = _open(path), ref or gguf.GGUFReader(path)
    arrays = {k for k, f in ref.fields.items() if f.types[0] == gguf.GGUFValueType.ARRAY}
    want = {k: f.contents() for k, f in ref.fields.items() if k not in arrays and not k.startswith("GGUF.")}
    assert ours.metadata == want
    assert [type(v) for v in ours.metadata.values()] == [type(v) for v in want.values()]
    # GGUFReader counts an array of arrays by its leaves; ours by its elements (checked by hand below)
    flat = {k for k in arrays if ref.fields[k].types[1] != gguf.GGUFValueType.ARRAY}
    assert set(ours.array_lengths) == arrays
    assert {k: ours.array_lengths[k] for k in flat} == {k: len(ref.fields[k].data) for k in flat}
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.name, a.tensor_type, a.shape) == (b.name, b.tensor_type, tuple(b.shape.tolist()))
        assert (a.data_offset, a.n_bytes) == (b.data_offset, int(b.n_bytes))
        assert np.array_equal(a.data, np.asarray(b.data).view(np.uint8).reshape(-1)), a.name


def test_header_parser_reads_what_gguf_reads(real_path, reader, tmp_path):
    """On the real file, and on a tiny one with a field of every value type, arrays of strings, numbers and
    arrays, and a data alignment of 64."""
    assert_header_is_gguf_readers(real_path, reader)
    t = tiny_tensors()
    w = gguf.GGUFWriter(str(tmp_path / "types.gguf"), "llama")
    w.add_custom_alignment(64)
    for kind, value in [("uint8", 200), ("int8", -5), ("uint16", 60000), ("int16", -300), ("uint32", 7),
                        ("int32", -7), ("float32", 0.1), ("bool", True), ("string", "héllo"),
                        ("uint64", 2**40), ("int64", -(2**40)), ("float64", 0.1)]:  # fmt: skip
        getattr(w, f"add_{kind}")(f"x.{kind}", value)
    w.add_array("x.strings", ["a", "", "ü" * 3])
    w.add_array("x.ints", [1, 2, 3])
    w.add_array("x.nested", [[1, 2], [3]])
    for name, x in list(t.items())[:3]:
        w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_header_is_gguf_readers(tmp_path / "types.gguf")
    h = _open(tmp_path / "types.gguf")
    assert (
        h.metadata["x.string"] == "héllo" and h.metadata["x.uint64"] == 2**40 and h.metadata["x.bool"] is True
    )
    assert h.array_lengths["x.nested"] == 2 and all(t.data_offset % 64 == 0 for t in h.tensors)


def test_header_faults_name_the_file(tmp_path, real_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"GGUF" + (3).to_bytes(4, "big") + bytes(16))
    with pytest.raises(ValueError, match="bad.gguf: big-endian GGUF files are not supported"):
        read_gguf(p)
    p.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match=r"bad.gguf: not a readable GGUF file \(24 bytes.*GGUF version 1"):
        read_gguf(p)
    with open(real_path, "rb") as f:
        p.write_bytes(f.read(1_000_000))  # inside the token list
    with pytest.raises(ValueError, match=r"not a readable GGUF file \(1000000 bytes.*strings.*past the end"):
        read_gguf(p)
    key = b"general.alignment"
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    p.write_bytes(head + struct.pack("<II", 4, 0))  # an alignment of 0
    with pytest.raises(ValueError, match=r"not a readable GGUF file .*general.alignment is 0"):
        read_gguf(p)
    p.write_bytes(head + struct.pack("<I", 13))  # no such value type
    with pytest.raises(ValueError, match=r"not a readable GGUF file .*unknown metadata value type 13"):
        read_gguf(p)
    p.write_bytes(b"")
    with pytest.raises(ValueError, match=r"bad.gguf: not a readable GGUF file \(0 bytes"):
        read_gguf(p)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf: GGUF file not found"):
        read_gguf(tmp_path / "nope.gguf")


def test_truncated_real_file(tmp_path, real_path):
    half = real_path.stat().st_size // 2
    with open(real_path, "rb") as f:
        data = f.read(half)
    cut = tmp_path / "half.gguf"
    cut.write_bytes(data)
    with pytest.raises(ValueError, match=r"half.gguf: .*truncated") as e:
        read_gguf(cut)
    assert f"{half} bytes" in str(e.value)
    cut.write_bytes(data[:100])  # inside the metadata
    with pytest.raises(ValueError, match=r"half.gguf: not a readable GGUF file \(100 bytes"):
        read_gguf(cut)


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="x.gguf: not a readable GGUF file"):
        read_gguf(p)


def test_unsupported_tensor_type(tmp_path):
    t = tiny_tensors()
    t["token_embd.weight"] = np.random.default_rng(0).integers(0, 255, (96, 210), dtype=np.uint8)  # Q6_K
    path = write_tiny(tmp_path / "q6k.gguf", t, {"token_embd.weight": Q.Q6_K})
    with pytest.raises(
        ValueError, match=r"q6k.gguf: unsupported GGUF tensor types: token_embd.weight \(Q6_K\)"
    ):
        read_gguf(path)
    with pytest.raises(ValueError, match="supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1"):
        read_gguf(path)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1])
def test_block_rows_across_row_ends_are_refused(tmp_path, qtype):
    """A block type's rows must hold whole blocks (llama.cpp and gguf's reader refuse others): a [4096, 16]
    Q8_0 or Q4_1 tensor, whose blocks of 32 run across row ends, loaded, and its code pack crashed unnamed."""
    t = tiny_tensors()
    raw = encode(t["blk.0.attn_q.weight"].reshape(-1, 32), qtype).reshape(-1)  # 256 x 256, as 4096 x 16
    t["blk.0.attn_q.weight"] = raw.view(np.uint8)
    path = write_tiny(tmp_path / "rows.gguf", t, {"blk.0.attn_q.weight": qtype},
                      raw_shapes={"blk.0.attn_q.weight": (4096, 16)})  # fmt: skip
    with pytest.raises(
        ValueError, match=rf"rows.gguf: tensor blk.0.attn_q.weight \({qtype.name}\) has rows of 16 elements"
    ):
        read_gguf(path)


def test_unsupported_architecture(tmp_path):
    path = write_tiny(tmp_path / "g.gguf", tiny_tensors(), arch="gemma")
    with pytest.raises(ValueError, match=r"g.gguf: general.architecture is 'gemma'; only 'llama'"):
        read_gguf(path)


def test_unknown_wrong_shape_and_missing_tensors(tmp_path):
    t = tiny_tensors()
    t["blk.0.attn_q.bias"] = np.zeros(256, np.float32)
    with pytest.raises(ValueError, match=r"u.gguf: unknown GGUF tensor names .*\['blk.0.attn_q.bias'\]"):
        read_gguf(write_tiny(tmp_path / "u.gguf", t))

    t = tiny_tensors()
    t["blk.1.attn_k.weight"] = t["blk.1.attn_q.weight"]  # [256, 256] where [128, 256] belongs
    msg = r"s.gguf: tensor blk.1.attn_k.weight \(model.layers.1.self_attn.k_proj.weight\) has shape \(256, 256\), expected \(128, 256\)"
    with pytest.raises(ValueError, match=msg):
        read_gguf(write_tiny(tmp_path / "s.gguf", t))

    t = tiny_tensors()
    t["blk.2.ffn_norm.weight"] = t["blk.1.ffn_norm.weight"]  # only 2 layers
    with pytest.raises(
        ValueError, match="blk.2.ffn_norm.weight -> model.layers.2.*not a parameter of a 2-layer model"
    ):
        read_gguf(write_tiny(tmp_path / "l.gguf", t))

    t = tiny_tensors()
    del t["blk.1.ffn_down.weight"]
    with pytest.raises(
        ValueError, match=r"lacks tensors for 1 parameters: \['model.layers.1.feed_forward.down_proj"
    ):
        read_gguf(write_tiny(tmp_path / "d.gguf", t))
