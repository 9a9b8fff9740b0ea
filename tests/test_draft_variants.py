"""The draft's norm variants (EAGLE-3.1 and speculators'): the math vLLM's llama_eagle3 runs for them, their
checkpoint keys, clear errors when weights and config.json disagree, lossless speculative decoding with
such a draft, and the training-time test computing what decoding computes.

The reference below is written from vLLM's llama_eagle3 (main branch, read 2026-12), not from our module:
`combine_hidden_states` applies `input_norm` to the concatenated features (norm_before_fc), then
`fc_norm[i]` to each aux layer's part (fc_norm), then `fc`; the first layer's residual is `hidden_norm(h)`
with norm_before_residual, else h; the model returns norm(out) for the logits and, as the state the next
draft step reads, norm(out) with norm_output, else out.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from eagle3.draft import NORM_VARIANTS, DraftConfig, Eagle3Draft, load_draft, save_draft
from eagle3.spec import SpecDecoder, TreeConfig
from eagle3.tuner import DraftLengthTuner
from maverick.checkpoint import CheckpointError
from maverick.cli import UserError
from maverick.config import get_config
from maverick.generate import Decoder
from maverick.model import Llama4
from train.ttt import ttt_unroll

FEATURES = (1, 2, 3)
EAGLE31 = {"fc_norm": True, "norm_output": True}
ALL = dict.fromkeys(NORM_VARIANTS, True)
VARIANTS = {
    "eagle3": {},
    "eagle3.1": EAGLE31,
    "norm_before_fc": {"norm_before_fc": True},
    "norm_before_residual": {"norm_before_residual": True},
    "all": ALL,
}


def make_draft(target_cfg, seed=0, std=0.1, **variant) -> Eagle3Draft:
    cfg = DraftConfig.for_target(
        target_cfg, draft_vocab_size=target_cfg.vocab_size, feature_layers=FEATURES, **variant
    )
    d = Eagle3Draft(cfg)
    g = torch.Generator().manual_seed(seed)
    d.init_weights(std=std, generator=g)
    with torch.no_grad():  # norms away from 1, so a norm applied in the wrong place shows
        for p in d.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5, generator=g)
    d.t2d.fill_(True)
    return d.eval()


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference(d: Eagle3Draft, embeds, features):
    """One draft step over T positions 0..T-1 (causal), fp32, straight from the state dict: (the state the
    next step reads [B, T, H], draft logits [B, T, V'])."""
    c, w, eps = d.config, d.state_dict(), d.config.rms_norm_eps
    x = features
    if c.norm_before_fc:
        x = rms(x, w["input_norm.weight"], eps)
    if c.fc_norm:
        parts = x.chunk(len(FEATURES), -1)
        x = torch.cat([rms(p, w[f"fc_norm.{i}.weight"], eps) for i, p in enumerate(parts)], -1)
    hidden = x @ w["fc.weight"].T
    m = "midlayer."
    normed_hidden = rms(hidden, w[m + "hidden_norm.weight"], eps)
    residual = normed_hidden if c.norm_before_residual else hidden
    a = torch.cat([rms(embeds, w[m + "input_layernorm.weight"], eps), normed_hidden], -1)
    B, T, _ = a.shape
    nq, nkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim

    def heads(name, n):
        return (a @ w[m + f"self_attn.{name}.weight"].T).view(B, T, n, D).transpose(1, 2)

    q, k, v = heads("q_proj", nq), heads("k_proj", nkv), heads("v_proj", nkv)
    ang = torch.arange(T).float()[:, None] * (1.0 / c.rope_theta ** (torch.arange(0, D, 2).float() / D))
    cos, sin = ang.cos(), ang.sin()

    def rope(t):  # HF Llama's rotate_half pairs
        t1, t2 = t[..., : D // 2], t[..., D // 2 :]
        return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), -1)

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
    s = (q @ k.transpose(-1, -2)) / D**0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, nq * D)
    h = residual + o @ w[m + "self_attn.o_proj.weight"].T
    n = rms(h, w[m + "post_attention_layernorm.weight"], eps)
    mlp = F.silu(n @ w[m + "mlp.gate_proj.weight"].T) * (n @ w[m + "mlp.up_proj.weight"].T)
    out = h + mlp @ w[m + "mlp.down_proj.weight"].T
    final = rms(out, w["norm.weight"], eps)
    return (final if c.norm_output else out), final @ w["lm_head.weight"].T


@pytest.mark.parametrize("variant", list(VARIANTS))
@torch.no_grad()
def test_draft_step_is_vllms_math(variant):
    target = dataclasses.replace(get_config("tiny-dense"), rope_scaling=None)
    d = make_draft(target, **VARIANTS[variant])
    g = torch.Generator().manual_seed(1)
    H = d.config.hidden_size
    emb, feats = torch.randn(2, 11, H, generator=g), torch.randn(2, 11, 3 * H, generator=g) * 4
    state, logits = reference(d, emb, feats)
    pos = torch.arange(11)[None].expand(2, 11)
    h = d(emb, d.project(feats), pos)
    assert torch.allclose(h, state, atol=1e-5, rtol=1e-5)
    assert torch.allclose(d.logits(h), logits, atol=1e-5, rtol=1e-5)
    if variant != "eagle3":  # the variant changes the numbers: the flags are not ignored
        plain = make_draft(target)
        assert not torch.allclose(plain.logits(plain(emb, plain.project(feats), pos)), logits, atol=1e-3)


def test_variant_round_trip_keys_and_config(tmp_path):
    target = get_config("tiny-dense")
    d = make_draft(target, **ALL)
    save_draft(d, tmp_path / "d")
    c = json.loads((tmp_path / "d" / "config.json").read_text())
    assert all(c[k] is True for k in NORM_VARIANTS)
    sd = load_file(str(tmp_path / "d" / "model.safetensors"))
    H = target.hidden_size
    assert sd["input_norm.weight"].shape == (3 * H,)
    assert [sd[f"fc_norm.{i}.weight"].shape for i in range(3)] == [(H,)] * 3
    loaded = load_draft(tmp_path / "d")
    assert all(getattr(loaded.config, k) for k in NORM_VARIANTS)
    g = torch.Generator().manual_seed(2)
    emb, feats = torch.randn(1, 7, H, generator=g), torch.randn(1, 7, 3 * H, generator=g)
    with torch.no_grad():
        pos = torch.arange(7)[None]
        a = d.logits(d(emb, d.project(feats), pos))
        b = loaded.logits(loaded(emb, loaded.project(feats), pos))
    assert torch.equal(a, b)
    # an EAGLE-3 draft writes the four keys false and none of the tensors
    save_draft(make_draft(target), tmp_path / "e")
    c = json.loads((tmp_path / "e" / "config.json").read_text())
    assert all(c[k] is False for k in NORM_VARIANTS)
    names = load_file(str(tmp_path / "e" / "model.safetensors"))
    assert not [k for k in names if k.startswith(("input_norm.", "fc_norm."))]


def test_fresh_norms_start_at_one():
    d = Eagle3Draft(DraftConfig.for_target(get_config("tiny-dense"), 128, FEATURES, **ALL))
    d.init_weights(std=0.5, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in d.named_parameters() if "norm" in n)


def test_config_and_weights_that_disagree_are_clear_errors(tmp_path):
    target = get_config("tiny-dense")
    save_draft(make_draft(target, **EAGLE31), tmp_path / "d")
    cfg_file = tmp_path / "d" / "config.json"
    c = json.loads(cfg_file.read_text())

    cfg_file.write_text(json.dumps(c | {"fc_norm": False}))
    with pytest.raises(UserError, match=r"fc_norm.0.weight.*\['fc_norm'\].*not set"):
        load_draft(tmp_path / "d")

    cfg_file.write_text(json.dumps(c | {"norm_before_fc": True}))
    with pytest.raises(CheckpointError, match=r"missing key\(s\) \['input_norm.weight'\]"):
        load_draft(tmp_path / "d")

    cfg_file.write_text(json.dumps(c | {"norm_output": "yes"}))
    with pytest.raises(UserError, match=r"config.json: norm_output must be true or false, got 'yes'"):
        load_draft(tmp_path / "d")

    # vLLM reads eagle_config.norm_before_fc first (NVIDIA's checkpoints keep it there)
    nested = c | {"norm_before_fc": False, "eagle_config": c["eagle_config"] | {"norm_before_fc": True}}
    assert DraftConfig.from_hf_dict(nested).norm_before_fc
    sd = load_file(str(tmp_path / "d" / "model.safetensors"))
    save_file(
        sd | {"input_norm.weight": torch.ones(3 * target.hidden_size)},
        str(tmp_path / "d" / "model.safetensors"),
    )
    cfg_file.write_text(json.dumps(nested))
    assert load_draft(tmp_path / "d").config.norm_before_fc


@pytest.mark.parametrize("variant", ["eagle3.1", "all"])
@torch.no_grad()
def test_training_unroll_equals_decoding_with_cache(variant):
    """The training-time test of a variant draft computes what cached decoding computes: step i at index t
    == the catch-up on the true pairs up to t, then i steps on the draft's own states."""
    target = get_config("tiny-dense")
    d = make_draft(target, std=0.2, **VARIANTS[variant])
    emb = torch.nn.Embedding(target.vocab_size, target.hidden_size)
    g = torch.Generator().manual_seed(1)
    T, H = 12, target.hidden_size
    ids = torch.randint(0, target.vocab_size, (1, T), generator=g)
    feats = torch.randn(1, T, 3 * H, generator=g)
    unrolled = dict(ttt_unroll(d, emb, ids, feats, steps=4))
    for t in (0, 4, 7):
        cache = d.new_cache(1, 32)
        h = d(emb(ids[:, 1 : t + 2]), d.project(feats[:, : t + 1]), torch.arange(t + 1)[None], cache=cache)
        h = h[:, -1:]
        assert torch.allclose(d.logits(h)[0, 0], unrolled[0][0, t], atol=1e-4)
        for i in range(1, 4):
            h = d(emb(ids[:, t + 1 + i : t + 2 + i]), h, torch.tensor([[t + i]]), cache=cache)
            assert torch.allclose(d.logits(h)[0, 0], unrolled[i][0, t], atol=1e-4), (
                t,
                i,
            )  # fp32 reassociation ~2e-5


@pytest.fixture(scope="module")
def target():
    t = Llama4(get_config("tiny-moe"))
    t.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    return t.eval()


def test_speculative_decoding_with_an_eagle31_draft_is_lossless(target):
    """Greedy chain (tuned draft length) and tree decoding with an EAGLE-3.1 draft emit plain decoding's
    tokens, and the draft is consulted (it proposes, some tokens are accepted)."""
    p = torch.randint(3, 512, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = Decoder(target, max_len=128).generate([p], 40).tokens[0]
    d = make_draft(target.config, seed=1, **EAGLE31)
    chain = SpecDecoder(target, d, max_len=128, policy=DraftLengthTuner()).generate([p], 40)
    assert chain.tokens[0] == ref
    assert sum(chain.stats["spec"].draft_lengths) > 0
    tree = SpecDecoder(target, d, max_len=160, tree=TreeConfig(4, 2, 30)).generate([p], 40)
    assert tree.tokens[0] == ref
