"""Our Llama 4 against transformers' Llama4ForCausalLM (random tiny models, loaded through our HF loader),
plus the cache, rollback, MoE dispatch, parameter counts and bad-input errors."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import Llama4Config as HFConfig
from transformers import Llama4ForCausalLM, Llama4ForConditionalGeneration, Llama4TextConfig

from maverick.checkpoint import CheckpointError, count_parameters, load_hf, read_state_dict, save_hf
from maverick.config import Llama4Config, get_config
from maverick.generate import Decoder
from maverick.model import Llama4

VARIANTS = {
    "interleaved-moe": {},
    "moe-every-layer-qknorm": {"interleave_moe_layer_step": 1, "moe_layers": None, "use_qk_norm": True},
    "dense-no-chunk": {"interleave_moe_layer_step": 0, "moe_layers": [], "attention_chunk_size": None},
    "no-temperature-tuning": {"attn_temperature_tuning": False, "use_qk_norm": True},
    "llama3-rope-scaling": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    },
}


def tiny(**overrides) -> Llama4Config:
    return dataclasses.replace(get_config("tiny-moe"), **overrides)


def hf_text_config(cfg: Llama4Config) -> Llama4TextConfig:
    d = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")}
    return Llama4TextConfig(**d)


def make_hf(cfg: Llama4Config, path, seed=0) -> Llama4ForCausalLM:
    torch.manual_seed(seed)
    hf = Llama4ForCausalLM(hf_text_config(cfg)).eval()
    hf.save_pretrained(path)
    return hf


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_hf(variant, tmp_path):
    cfg = tiny(**VARIANTS[variant])
    hf = make_hf(cfg, tmp_path)
    ours = load_hf(tmp_path)
    x = torch.randint(0, cfg.vocab_size, (2, 70), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(x).logits
        got = ours(x).logits
    assert rel_err(got, ref) < 1e-5


def test_an_empty_no_rope_layers_is_derived_as_transformers_does():
    """Scout's published config.json says "no_rope_layers": []: transformers derives the NoPE layers from
    the interval, and so do we (the checkpoint was refused: 0 entries for 4 layers)."""
    d = {
        k: v
        for k, v in get_config("tiny-moe").to_hf_dict().items()
        if k not in ("architectures", "model_type")
    }
    d["no_rope_layers"] = []
    assert Llama4Config.from_hf_dict(d).no_rope_layers == Llama4TextConfig(**d).no_rope_layers


def test_a_config_json_without_a_field_reads_as_transformers_reads_it(tmp_path):
    """Fields a hand-written config.json leaves out take transformers' defaults (ours are Maverick's): a
    missing use_qk_norm is True there, and loading it as False gave logits 3.8 off. A llama3 scaling kept in
    rope_parameters beside "rope_scaling": null is the scaling transformers applies."""
    d = {"hidden_size": 64, "intermediate_size": 128, "intermediate_size_mlp": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(d))
    ours, hf = Llama4Config.from_json(tmp_path), Llama4TextConfig(**d)
    for name in ("use_qk_norm", "num_local_experts", "interleave_moe_layer_step", "max_position_embeddings"):
        assert getattr(ours, name) == getattr(hf, name), name
    assert ours.moe_layers == hf.moe_layers and ours.use_qk_norm is True
    del d[
        "head_dim"
    ]  # transformers' 128, not hidden / heads (ours computed 16: a checkpoint it loads refused)
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert Llama4Config.from_json(tmp_path).head_dim == Llama4TextConfig(**d).head_dim == 128
    d["head_dim"] = 16
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}  # fmt: skip
    cfg = Llama4Config.from_hf_dict(d | {"rope_scaling": None, "rope_parameters": scaling})
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0
    assert cfg.rope_theta == 10000.0


def test_wrong_nope_numbering_is_caught(tmp_path):
    """Control: counting NoPE layers from 0 (torchtitan's mistake) must break parity."""
    cfg = tiny()
    hf = make_hf(cfg, tmp_path)
    wrong_cfg = dataclasses.replace(
        cfg, no_rope_layers=[int(i % 4 != 0) for i in range(cfg.num_hidden_layers)]
    )
    sd, _ = read_state_dict(tmp_path)
    from maverick.checkpoint import build_model

    wrong = build_model(wrong_cfg, sd)
    x = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_err(wrong(x).logits, hf(x).logits) > 1e-2


def test_conditional_generation_checkpoint(tmp_path):
    """Llama4ForConditionalGeneration: `language_model.` keys load, vision keys are skipped and counted."""
    tc = get_config("tiny-moe").to_hf_dict()
    tc = {k: v for k, v in tc.items() if k not in ("architectures", "model_type")}
    vc = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    vc |= dict(patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    torch.manual_seed(0)
    full = Llama4ForConditionalGeneration(HFConfig(text_config=tc, vision_config=vc)).eval()
    full.save_pretrained(tmp_path)
    sd, skipped = read_state_dict(tmp_path)
    assert skipped > 0 and not any(k.startswith(("vision", "multi_modal")) for k in sd)
    ours = load_hf(tmp_path)
    x = torch.randint(0, 512, (1, 30))
    with torch.no_grad():
        ref = full.language_model(x).logits if hasattr(full, "language_model") else full(input_ids=x).logits
        assert rel_err(ours(x).logits, ref) < 1e-5


def test_sharded_save_round_trip(tmp_path):
    cfg = tiny()
    make_hf(cfg, tmp_path / "hf")
    m = load_hf(tmp_path / "hf")
    save_hf(m, tmp_path / "ours", max_shard_bytes=200_000)
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    m2 = load_hf(tmp_path / "ours")
    x = torch.randint(0, cfg.vocab_size, (1, 20))
    with torch.no_grad():
        assert torch.equal(m(x).logits, m2(x).logits)
    # and transformers reads what we wrote
    hf = Llama4ForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert rel_err(m(x).logits, hf(x).logits) < 1e-5


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    cfg = tiny()
    hf = make_hf(cfg, path, seed=3)
    return hf, load_hf(path), cfg


def test_incremental_decoding_matches_full_forward(pair):
    _, m, cfg = pair
    x = torch.randint(0, cfg.vocab_size, (2, 60), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = m(x).logits
        for step in (1, 3):
            cache = m.new_cache(2, 128)
            parts = [m(x[:, :13], cache=cache).logits]  # prefill ends off a chunk boundary (chunk 16)
            for s in range(13, 60, step):
                parts.append(m(x[:, s : s + step], cache=cache).logits)
            inc = torch.cat(parts, dim=1)
            assert rel_err(inc, full) < 1e-5, step


def test_long_prefill_into_an_empty_cache_takes_the_causal_kernel(pair, monkeypatch):
    """A prefill of more than EXACT_ATTENTION_MAX_T tokens into an empty cache attends with SDPA's
    is_causal over its own keys (chunked layers keep their mask): the bits of a cache-free forward, the
    masked kernel's logits within 1e-5, and right-padded rows of unequal length each as if alone; decoding
    continues from it as from the full forward."""
    _, m, cfg = pair
    causal = []
    sdpa = F.scaled_dot_product_attention

    def spy(*a, **kw):
        causal.append(kw.get("is_causal", False))
        return sdpa(*a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    plain = [i for i in range(cfg.num_hidden_layers) if not cfg.is_chunked(i)]
    assert 0 < len(plain) < cfg.num_hidden_layers  # both kinds of layer in the tiny config
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, cfg.vocab_size, (2, 90), generator=g)
    with torch.no_grad():
        full = m(x).logits
        cache = m.new_cache(2, 192)
        causal.clear()
        pre = m(x[:, :80], cache=cache).logits
        assert causal == [i in plain for i in range(cfg.num_hidden_layers)]
        assert torch.equal(pre, m(x[:, :80]).logits)  # the same kernel over the same keys
        causal.clear()  # explicit positions: the mask, as before
        masked = m(x[:, :80], cache=m.new_cache(2, 192), positions=torch.arange(80).expand(2, 80)).logits
        assert not any(causal) and rel_err(pre, masked) < 1e-5
        causal.clear()  # a cache already in use: the mask
        rest = [m(x[:, 80:90], cache=cache).logits]
        assert not any(causal) and rel_err(rest[0], full[:, 80:]) < 1e-5
    prompts = [x[0, :70].tolist(), x[1, :88].tolist()]
    batched = Decoder(m, max_len=128, batch_size=2).generate(prompts, max_new_tokens=6).tokens
    assert batched == [Decoder(m, max_len=128).generate([p], max_new_tokens=6).tokens[0] for p in prompts]


def test_rollback_equals_never_written(pair):
    """Write 5 draft tokens, keep 0 in row 0 and 2 in row 1, continue: equals never having written them."""
    _, m, cfg = pair
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, cfg.vocab_size, (2, 23), generator=g)
    junk = torch.randint(0, cfg.vocab_size, (2, 5), generator=g)
    with torch.no_grad():
        cache = m.new_cache(2, 64)
        m(x[:, :18], cache=cache)
        m(junk, cache=cache)
        cache.truncate(torch.tensor([18, 20]))
        got = m(x[:, 18:], cache=cache).logits  # row 0 at positions 18.., row 1 at 20..
        assert torch.equal(cache.lengths, torch.tensor([23, 25]))
        ref0 = m(x[:1]).logits[:, 18:]
        ref1 = m(torch.cat([x[1:, :18], junk[1:, :2], x[1:, 18:]], dim=1)).logits[:, 20:]
    assert rel_err(got[:1], ref0) < 1e-5
    assert rel_err(got[1:], ref1) < 1e-5


def test_batched_prompts_of_unequal_length(pair):
    """Right-padded prefill with per-row lengths equals each prompt decoded alone (no left padding)."""
    _, m, cfg = pair
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (7, 23, 15)]
    dec = Decoder(m, max_len=64, batch_size=3)
    batched = dec.generate(prompts, max_new_tokens=12).tokens
    for p, got in zip(prompts, batched):
        alone = Decoder(m, max_len=64).generate([p], max_new_tokens=12).tokens[0]
        assert got == alone


def test_dropping_finished_rows_and_fused_attention(pair):
    """Throughput options for data generation: dropping rows as they stop gives each row the tokens it gets
    in the full batch; the fused attention (exact=False, fp32 model here) decodes the same tokens."""
    _, m, cfg = pair
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (7, 23, 15, 4)]
    full = Decoder(m, max_len=64, batch_size=4).generate(prompts, max_new_tokens=16).tokens
    stop = {full[0][3], full[2][9]}  # rows end at different steps (some maybe never)
    ends = [next((i + 1 for i, t in enumerate(row) if t in stop), 16) for row in full]
    assert len(set(ends)) >= 2
    for exact in (True, False):
        dec = Decoder(m, max_len=64, batch_size=4, exact=exact)
        got = dec.generate(prompts, max_new_tokens=16, stop_ids=stop, drop_finished=True).tokens
        assert got == [row[:n] for row, n in zip(full, ends)]
        assert dec.cache.batch_size == 4  # ready for the next full batch


def test_greedy_generation_equals_hf(pair):
    hf, m, cfg = pair
    prompt = torch.randint(3, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=40, do_sample=False, min_new_tokens=40, pad_token_id=0)
    ours = Decoder(m, max_len=64).generate([prompt[0].tolist()], max_new_tokens=40).tokens[0]
    assert ours == ref[0, 9:].tolist()


@pytest.mark.parametrize("pad", [0, 1, 3])
def test_compact_ignores_padding_entries_whatever_they_hold(pad):
    """A batch of trees: row 1 keeps 2 nodes and pads its keep list. Before, a padding entry p < n_keep was
    written onto slot start + p, over the node compacted there (pad 1: slot 5 kept stale node 1)."""
    from maverick.kv_cache import KVCache

    c = KVCache(1, 2, 16, 1, 1)
    c.k[0, :, 0, :, 0] = torch.arange(16.0)  # slot s holds s
    c.lengths.fill_(10)
    c.bound = 10
    c.compact(torch.tensor([4, 4]), torch.tensor([[0, 2, 5], [0, 3, pad]]), torch.tensor([3, 2]))
    assert c.k[0, 0, 0, 4:7, 0].tolist() == [4, 6, 9] and c.k[0, 1, 0, 4:6, 0].tolist() == [4, 7]
    assert c.lengths.tolist() == [7, 6]


def test_compiled_decoder_keeps_fixed_shapes_in_every_cache(monkeypatch):
    """Decoder(compile=True) attends over the whole preallocated cache (no Python-bound slicing that would
    recompile the step at every length): the caches it makes for a new batch size or after dropping
    finished rows too (before, only its first). torch.compile is left out here: the shapes are the point."""
    import maverick.generate as generate

    monkeypatch.setattr(generate.torch, "compile", lambda f, **kw: f)
    m = Llama4(get_config("tiny-dense"))
    m.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    dec = Decoder(m.eval(), max_len=64, compile=True)
    seen = []
    real = dec.model.forward

    def spy(*a, cache=None, **kw):
        seen.append(cache.slice_to_bound)
        return real(*a, cache=cache, **kw)

    monkeypatch.setattr(dec.model, "forward", spy)
    got = dec.generate([[5, 6, 7], [8, 9]], 6, stop_ids=[], drop_finished=True)
    assert len(got.tokens) == 2 and seen and not any(seen) and dec.cache.slice_to_bound is False


def test_tree_write_and_compact(pair):
    """Tree nodes written with an ancestor mask then compacted equal the chain of the accepted path."""
    _, m, cfg = pair
    g = torch.Generator().manual_seed(8)
    x = torch.randint(0, cfg.vocab_size, (1, 14), generator=g)
    # tree: 0 -> 1 -> 3, 0 -> 2; tokens per node; accepted path nodes [0, 1, 3]
    nodes = torch.tensor([[11, 22, 33, 44]])
    parents = [-1, 0, 0, 1]
    depth = torch.tensor([[0, 1, 1, 2]])
    mask = torch.zeros(1, 4, 4, dtype=torch.bool)
    for i in range(len(parents)):
        j = i
        while j >= 0:
            mask[0, i, j] = True
            j = parents[j]
    with torch.no_grad():
        cache = m.new_cache(1, 64)
        m(x, cache=cache)
        tree_logits = m(nodes, cache=cache, positions=14 + depth, tree_mask=mask).logits
        cache.compact(torch.tensor([14]), torch.tensor([[0, 1, 3, 0]]), torch.tensor([3]))
        after = m(torch.tensor([[55]]), cache=cache).logits

        ref_cache = m.new_cache(1, 64)
        m(x, cache=ref_cache)
        chain_logits = m(torch.tensor([[11, 22, 44, 55]]), cache=ref_cache).logits
    assert rel_err(tree_logits[:, [0, 1, 3]], chain_logits[:, :3]) < 1e-5
    assert rel_err(after[:, 0], chain_logits[:, 3]) < 1e-5


def test_moe_fast_dispatch_equals_reference_loop(pair):
    _, m, cfg = pair
    moe = m.model.layers[1].feed_forward
    x = torch.randn(3, 17, cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        fast, ref = moe(x), moe.forward_reference(x)
    assert torch.allclose(fast, ref, rtol=1e-5, atol=1e-6)
    assert len(set(moe.route(x.view(-1, cfg.hidden_size))[0].tolist())) > 1  # several experts used


def test_feature_layers(pair):
    hf, m, cfg = pair
    x = torch.randint(0, cfg.vocab_size, (1, 20))
    with torch.no_grad():
        out = m(x, feature_layers=(0, 2, 3), logits=None)
        hs = hf(x, output_hidden_states=True).hidden_states
    H = cfg.hidden_size
    assert out.logits is None and out.features.shape == (1, 20, 3 * H)
    for j, i in enumerate((0, 2, 3)):
        assert rel_err(out.features[..., j * H : (j + 1) * H], hs[i]) < 1e-5


def test_parameter_counts():
    assert count_parameters(get_config("maverick-400b")) == (400_711_848_960, 17_184_691_200)
    assert count_parameters(get_config("scout-109b")) == (107_769_861_120, 17_172_894_720)


def test_config_json_round_trip(tmp_path):
    for name in ("maverick-400b", "scout-109b", "tiny-moe", "tiny-dense"):
        cfg = get_config(name)
        cfg.save_json(tmp_path / "config.json")
        assert Llama4Config.from_json(tmp_path) == cfg
        hf = hf_text_config(cfg)  # transformers accepts what we write
        assert hf.moe_layers == cfg.moe_layers and list(hf.no_rope_layers) == cfg.no_rope_layers


def test_bad_config_heads():
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by num_key_value_heads=4"):
        tiny(num_attention_heads=6, num_key_value_heads=4)


def test_bad_checkpoints(tmp_path):
    cfg = tiny()
    make_hf(cfg, tmp_path)
    f = tmp_path / "model.safetensors"
    sd = load_file(str(f))
    for name, edit, msg in [
        ("missing", lambda d: d.pop("model.norm.weight"), "missing key.*model.norm.weight"),
        (
            "extra",
            lambda d: d.__setitem__("model.bogus.weight", torch.zeros(1)),
            "unexpected key.*model.bogus",
        ),
        (
            "shape",
            lambda d: d.__setitem__("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3)),
            r"model.layers.0.self_attn.q_proj.weight.*shape \(3, 3\), expected \(64, 64\)",
        ),
    ]:
        bad = dict(sd)
        edit(bad)
        d = tmp_path / name
        d.mkdir()
        save_file(bad, str(d / "model.safetensors"))
        (d / "config.json").write_text((tmp_path / "config.json").read_text())
        with pytest.raises(CheckpointError, match=msg):
            load_hf(d)
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_hf_dir = tmp_path / "empty"
        load_hf_dir.mkdir()
        (load_hf_dir / "config.json").write_text("{}")
        load_hf(load_hf_dir)


def test_meta_build_has_no_storage():
    with torch.device("meta"):
        m = Llama4(get_config("maverick-400b"))
    assert m.lm_head.weight.is_meta


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_equals_the_written_out_formula(dtype):
    """_rms (F.rms_norm) gives the bits of HF's LlamaRMSNorm arithmetic: fp32 mean of squares, rsqrt,
    multiply, cast back."""
    from maverick.model import _rms

    x = torch.randn(3, 7, 576, generator=torch.Generator().manual_seed(0)).to(dtype) * 4
    xf = x.float()
    ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    torch.testing.assert_close(_rms(x, 1e-5), ref, rtol=0, atol=0)


def test_rope_equals_the_pairwise_formula():
    """apply_rope (x * cos + swapped pairs * signed sin) gives the bits of rotating each pair (x0, x1) to
    (x0 cos - x1 sin, x0 sin + x1 cos), on a strided input like the fused q/k/v output it reads."""
    from maverick.model import apply_rope, rope_inv_freq, rope_tables

    cfg = tiny()
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(2, 5, 7, cfg.head_dim, generator=g) * 3).bfloat16()
    x = qkv[:, :, :5]  # not contiguous
    positions = torch.randint(0, 5000, (2, 5), generator=g)
    cos, sin = rope_tables(positions, rope_inv_freq(cfg))
    freqs = positions[..., None].float() * rope_inv_freq(cfg)
    c, s = freqs.cos()[:, :, None], freqs.sin()[:, :, None]
    xf = x.float()
    x0, x1 = xf[..., 0::2], xf[..., 1::2]
    ref = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).bfloat16()
    assert torch.equal(apply_rope(x, cos, sin), ref)


def test_exact_attention_bias_equals_masking():
    """exact_attention with an additive 0/-inf bias gives the bits of the masked_fill formulation, GQA included."""
    from maverick.model import additive, exact_attention

    g = torch.Generator().manual_seed(1)
    B, Hq, Hkv, T, S, D = 2, 6, 2, 3, 40, 16
    q = torch.randn(B, Hq, T, D, generator=g).bfloat16()
    k, v = torch.randn(2, B, Hkv, S, D, generator=g)
    mask = torch.rand(B, 1, T, S, generator=g) < 0.7
    mask[..., 0] = True
    qf = q.float().reshape(B, Hkv, (Hq // Hkv) * T, D)
    scores = (qf @ k.transpose(-1, -2)) * D**-0.5
    scores = scores.view(B, Hkv, Hq // Hkv, T, S).masked_fill(~mask[:, :, None], float("-inf")).softmax(-1)
    ref = (scores.view(B, Hkv, -1, S) @ v).view(B, Hq, T, D).bfloat16()
    assert torch.equal(exact_attention(q, k, v, additive(mask)), ref)


@pytest.mark.parametrize("fallback", [False, True], ids=["padded-rows", "per-position"])
def test_exact_attention_gives_each_position_its_one_token_bits(monkeypatch, fallback):
    """Every query position of a T-token call gets the bits of calling it alone, for T = 1..16 and key
    windows of 3 lengths (bf16 q/k/v as the model passes them); the per-position fallback too."""
    import maverick.model as mm

    if fallback:
        monkeypatch.setattr(mm, "bmm_min_rows", lambda: None)
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D = 1, 9, 3, 64  # SmolLM2's heads
    for S in (64, 320, 1024):
        k, v = torch.randn(2, B, Hkv, S, D, generator=g).bfloat16()
        q = torch.randn(B, Hq, 16, D, generator=g).bfloat16()
        bias = mm.additive(torch.rand(B, 1, 16, S, generator=g) < 0.9)
        one = torch.cat(
            [mm.exact_attention(q[:, :, i : i + 1], k, v, bias[:, :, i : i + 1]) for i in range(16)], 2
        )
        for T in range(1, 17):
            got = mm.exact_attention(q[:, :, :T], k, v, bias[:, :, :T])
            assert torch.equal(got, one[:, :, :T]), (S, T)


@pytest.mark.parametrize("fallback", [False, True], ids=["shared-scores", "per-node"])
def test_tree_attention_gives_each_node_the_bits_of_its_decode_step(monkeypatch, fallback):
    """Each node of a tree verify gets the bits of a one-token decode step over its path laid out as a chain
    (prefix, ancestors, itself at slots start..start+depth), for random trees of 2..30 nodes, key windows
    of 3 lengths, with and without chunked attention; the per-node fallback too."""
    import maverick.model as mm
    from eagle3.sampling import tree_attention_mask

    if fallback:
        monkeypatch.setattr(mm, "bmm_min_rows", lambda: None)
    g = torch.Generator().manual_seed(5)
    Hq, Hkv, D = 9, 3, 64
    for case in range(24):
        S = (64, 320, 1024)[case % 3]
        chunk = 48 if case % 4 == 3 else None
        T = int(torch.randint(2, 31, (1,), generator=g))
        start = int(torch.randint(1, S - T, (1,), generator=g))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)]
        anc = tree_attention_mask(parents)[None]
        depth = anc[0].sum(-1) - 1
        positions = (start + depth)[None]
        tree = mm.tree_layout(anc, start, S, positions, chunk)
        q = torch.randn(1, Hq, T, D, generator=g).bfloat16()
        k, v = torch.randn(2, 1, Hkv, S, D, generator=g).bfloat16().float()  # the fp32 cache
        got = mm.tree_attention(q, k, v, tree, chunked=chunk is not None)
        slot = torch.arange(S)
        for t in range(T):
            path = anc[0, t].nonzero()[:, 0]
            order = torch.arange(S)
            order[start : start + len(path)] = start + path
            keep = slot <= start + depth[t]
            if chunk:
                keep &= slot // chunk == (start + depth[t]) // chunk
            bias = mm.additive(keep)[None, None, None]
            one = mm.exact_attention(q[:, :, t : t + 1], k[:, :, order], v[:, :, order], bias)
            assert torch.equal(got[:, :, t : t + 1], one), (case, t)


def test_bmm_min_rows_holds_on_this_cpu():
    """From bmm_min_rows() rows up, each row of an fp32 bmm has its bits of a 192-row call (checked here on
    other random data and key lengths than the probe's)."""
    from maverick.model import bmm_min_rows

    rows = bmm_min_rows()
    if rows is None:
        pytest.skip("this CPU's fp32 bmm has no row count to pad to (per-position attention is used)")
    g = torch.Generator().manual_seed(7)
    for S in (128, 512):
        a, b = torch.randn(3, 192, 64, generator=g), torch.randn(3, S, 64, generator=g).mT
        ref = torch.bmm(a, b)
        for n in range(rows, 40):
            assert torch.equal(torch.bmm(a[:, :n], b), ref[:, :n]), (S, n)


def test_one_row_cache_writes_by_slice_like_the_batched_index():
    """A one-row cache writes at `bound` with a slice; rows dropped from a batch leave `bound` right."""
    from maverick.kv_cache import KVCache

    g = torch.Generator().manual_seed(2)
    one, two = KVCache(2, 1, 32, 2, 4), KVCache(2, 2, 32, 2, 4)
    for c in (one, two):
        c.truncate(torch.tensor([5] * c.batch_size))
    assert one.write_index(3) is None and two.write_index(3) is not None
    k, v = torch.randn(2, 1, 2, 3, 4, generator=g)
    ko, vo = one.write(1, k, v, 16)
    kt, vt = two.write(1, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), 16)
    assert torch.equal(ko[0], kt[0]) and torch.equal(vo[0], vt[1]) and torch.equal(one.k[1, 0, :, 5:8], k[0])
    two.truncate(torch.tensor([9, 4]))
    two.select_rows(torch.tensor([1]))
    assert two.bound == 4 and int(two.lengths[0]) == 4


def test_flat_layers_give_the_bits_of_the_modules(monkeypatch):
    """Decoding and verifying (exact cache, no grad) runs DecoderLayer.forward_flat; with it switched off
    (the submodules' forward), the logits and features are the same bits, for 1 and 2 rows, 1 and 5 tokens,
    bf16 (packed weights) and fp32, and for dense Llama 4 layers (chunked, QK norm, NoPE with temperature
    tuning). A model with MoE layers leaves the whole call to the modules."""
    from maverick import model as M

    torch.manual_seed(0)
    dense = Llama4(get_config("tiny-dense"))
    dense.init_weights(generator=torch.Generator().manual_seed(1))
    moe = Llama4(tiny())
    moe.init_weights(generator=torch.Generator().manual_seed(1))
    llama4_dense = Llama4(tiny(interleave_moe_layer_step=0, moe_layers=[], use_qk_norm=True))
    llama4_dense.init_weights(generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # norms away from 1, so a norm weight left out would show
        for name, p in [*dense.named_parameters(), *moe.named_parameters(), *llama4_dense.named_parameters()]:
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    x = torch.randint(0, dense.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    calls = []
    flat = M.DecoderLayer.forward_flat
    monkeypatch.setattr(M.DecoderLayer, "forward_flat", lambda self, *a: calls.append(1) or flat(self, *a))

    def run(m, B, T):
        cache = m.new_cache(B, 64)
        m(x[:B, :12], cache=cache)
        out = m(x[:B, 12 : 12 + T], cache=cache, feature_layers=(0, 1))
        return out.logits, out.features

    with torch.no_grad():
        dense32 = copy.deepcopy(dense)
        cases = [
            (dense.bfloat16(), True),
            (dense32, True),
            (llama4_dense.bfloat16(), True),
            (moe.bfloat16(), False),
        ]
        for m, expect_flat in cases:
            for B, T in ((1, 1), (1, 5), (2, 1), (2, 5)):
                calls.clear()
                got = run(m, B, T)
                assert bool(calls) == expect_flat
                with monkeypatch.context() as mp:
                    mp.setattr(M.DecoderLayer, "flat_ok", lambda self: False)
                    ref = run(m, B, T)
                assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (B, T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["tiny-moe", "tiny-dense"])
def test_a_verify_gives_each_token_the_bits_of_decoding_it_alone(name, dtype):
    """What greedy speculative decoding's exactness rests on, at the model's level: a T-token call after a
    prefill gives each token the logits of decoding the tokens one by one, bit for bit, at starts across
    the tiny MoE's 16-token attention chunks. fp32 differed in 14 of 32 tiny-MoE cases (MKL's fp32 GEMM and
    the experts' matmuls choose kernels by row count; max 1.7e-6) before its linears went row-count safe."""
    cfg = (
        dataclasses.replace(get_config(name), attention_chunk_size=16)
        if name == "tiny-moe"
        else get_config(name)
    )
    torch.manual_seed(1)
    m = Llama4(cfg)
    m.init_weights(std=0.15)
    m = m.to(dtype).eval()
    x = torch.randint(0, cfg.vocab_size, (1, 80), generator=torch.Generator().manual_seed(5))
    bad = []
    with torch.no_grad():
        for start in (10, 13, 15, 29, 31, 47):
            for T in (2, 5, 8):
                c = m.new_cache(1, 128)
                c.set_window(96)
                m(x[:, :start], cache=c)
                verify = m(x[:, start : start + T], cache=c).logits
                c.truncate(start)
                one = torch.cat([m(x[:, start + i : start + i + 1], cache=c).logits for i in range(T)], 1)
                if not torch.equal(verify, one):
                    bad.append((start, T, float((verify.float() - one.float()).abs().max())))
    assert not bad


def test_router_ties_go_to_hfs_expert(tmp_path):
    """Two experts' router rows made equal tie for every token: we took the lowest index (`max`), HF's and
    Meta's router the one `topk` gives, another on CPU for small expert counts (38 of 40 positions' logits
    unlike HF's, max 4.97; in bf16 with 16 experts natural ties moved 982 of 2048 positions)."""
    cfg = tiny(num_local_experts=16, interleave_moe_layer_step=1, moe_layers=None)
    torch.manual_seed(1)
    hf = Llama4ForCausalLM(hf_text_config(cfg)).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            r = layer.feed_forward.router.weight
            r[9] = r[3] * 3.0  # experts 3 and 9 tie, and mostly win
            r[3] *= 3.0
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    x = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_err(ours(x).logits, hf(x).logits) < 1e-5


def test_rope_frequencies_stay_fp32_under_to_dtype():
    """`.to(torch.bfloat16)` rounded the RoPE frequencies buffer (the loaders make it in fp32): a GGUF target
    loaded in fp32 and cast gave other greedy tokens than one loaded in bf16 after 6-20 tokens, and a draft's
    cos at position 1000 was 1.1 off. Casting back to fp32 did not restore them."""
    from eagle3.draft import DraftConfig, Eagle3Draft
    from maverick.model import rope_inv_freq

    cfg = tiny(rope_theta=500000.0)
    m = Llama4(cfg)
    d = Eagle3Draft(DraftConfig.for_target(cfg, draft_vocab_size=64, feature_layers=(1, 2, 3)))
    want = rope_inv_freq(cfg)
    for cast in (lambda x: x.to(torch.bfloat16), lambda x: x.half(), lambda x: x.float()):
        m, d = cast(m), cast(d)
        assert m.inv_freq.dtype == d.inv_freq.dtype == torch.float32
        assert torch.equal(m.inv_freq, want) and torch.equal(d.inv_freq, want)
    assert m.model.embed_tokens.weight.dtype == torch.float32  # the weights did follow


def test_config_fields_transformers_honours_are_read_as_it_reads_them_or_refused(tmp_path):
    """Each of these loaded without a word and computed another model than transformers': hidden_act 'gelu'
    (logits 2.7 apart), layer_types of their own (6.8), a top-level rope_theta beside rope_parameters'
    (we took the top-level one; transformers the rope_parameters one), tie_word_embeddings true with a
    stored head unlike the embeddings (transformers keeps the head; we tied)."""
    from maverick.checkpoint import hf_model_config, load_hf_tables

    cfg = tiny()
    make_hf(cfg, tmp_path)
    cfg_file = tmp_path / "config.json"
    base = json.loads(cfg_file.read_text())
    assert load_hf(tmp_path).config.rope_theta == cfg.rope_theta  # the control
    for edit, error in (
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        (
            {"layer_types": ["full_attention"] * cfg.num_hidden_layers},
            "layer types of their own are not supported",
        ),
    ):
        cfg_file.write_text(json.dumps(base | edit))
        with pytest.raises(CheckpointError, match=f"{cfg_file}: .*{error}"):
            load_hf(tmp_path)
    rp = base["rope_parameters"] | {"rope_theta": 123456.0}
    cfg_file.write_text(json.dumps(base | {"rope_theta": 10000.0, "rope_parameters": rp}))
    assert hf_model_config(tmp_path)[0].rope_theta == 123456.0
    cfg_file.write_text(json.dumps(base | {"tie_word_embeddings": True}))
    for load in (load_hf, load_hf_tables):  # the tables a draft trains against too (train.fit)
        with pytest.raises(
            CheckpointError, match="tie_word_embeddings=true but key 'lm_head.weight' differs"
        ):
            load(tmp_path)


def test_llama3_scaling_without_its_context_length_reads_as_in_transformers():
    """Llama 4: a llama3 rope_scaling without original_max_position_embeddings takes max_position_embeddings,
    transformers' default (131072) when that is absent too; the frequencies are HF's, bit for bit."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from maverick.model import rope_inv_freq

    d = {"hidden_size": 64, "intermediate_size": 128, "intermediate_size_mlp": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}  # fmt: skip
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    for extra in ({"max_position_embeddings": 4096}, {}):
        for key in ("rope_scaling", "rope_parameters"):
            hf = Llama4TextConfig(**d, **extra, **{key: dict(scaling, rope_theta=500000.0)})
            ours = Llama4Config.from_hf_dict(d | extra | {key: dict(scaling, rope_theta=500000.0)})
            want = hf.rope_parameters["original_max_position_embeddings"]
            assert (
                ours.rope_scaling["original_max_position_embeddings"]
                == want
                == extra.get("max_position_embeddings", 131072)
            )
            hf_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
            assert torch.equal(rope_inv_freq(ours), hf_freq.float())
