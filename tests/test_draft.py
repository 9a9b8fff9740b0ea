"""The EAGLE-3 draft checkpoint format: round trip, vLLM-style config, clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.draft import DraftConfig, Eagle3Draft, load_draft, save_draft
from eagle3.vocab import select_draft_vocab
from maverick.config import get_config


def make(tmp_path, draft_vocab=128):
    target = get_config("tiny-dense")
    cfg = DraftConfig.for_target(target, draft_vocab_size=draft_vocab, feature_layers=(1, 2, 3))
    torch.manual_seed(0)
    d = Eagle3Draft(cfg)
    d.init_weights(std=0.1)
    counts = torch.arange(target.vocab_size, 0, -1)
    d.set_vocab(*select_draft_vocab(counts.roll(7), draft_vocab))
    save_draft(d, tmp_path / "draft")
    return d, tmp_path / "draft"


def test_round_trip_reproduces_logits_exactly(tmp_path):
    d, path = make(tmp_path)
    loaded = load_draft(path)
    H = d.config.hidden_size
    g = torch.Generator().manual_seed(1)
    emb, feats = torch.randn(1, 9, H, generator=g), torch.randn(1, 9, 3 * H, generator=g)
    pos = torch.arange(9)[None]
    with torch.no_grad():
        a = d.logits(d(emb, d.project(feats), pos))
        b = loaded.logits(loaded(emb, loaded.project(feats), pos))
    assert torch.equal(a, b)
    assert torch.equal(loaded.d2t, d.d2t) and torch.equal(loaded.t2d, d.t2d)


def test_config_is_the_released_format(tmp_path):
    _, path = make(tmp_path)
    c = json.loads((path / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["num_hidden_layers"] == 1
    assert c["draft_vocab_size"] == 128 and c["target_hidden_size"] == 64
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # layer outputs = inputs - 1
    sd = load_file(str(path / "model.safetensors"))
    assert {
        "fc.weight",
        "midlayer.self_attn.q_proj.weight",
        "midlayer.hidden_norm.weight",
        "norm.weight",
    } <= set(sd)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (64, 128)  # q reads [embeds, hidden]: 2H
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool


def test_wrong_d2t_length_and_missing_key_are_clear_errors(tmp_path):
    _, path = make(tmp_path)
    sd = load_file(str(path / "model.safetensors"))
    bad = dict(sd, d2t=sd["d2t"][:-1])
    save_file(bad, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'d2t' has shape \(127,\), expected \(128,\)"):
        load_draft(path)
    bad = {k: v for k, v in sd.items() if k != "midlayer.mlp.down_proj.weight"}
    save_file(bad, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing key.*midlayer.mlp.down_proj.weight"):
        load_draft(path)
    shifted = dict(sd, d2t=sd["d2t"] + 1)
    save_file(shifted, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        load_draft(path)


def test_rope_scaling_errors_name_the_file_and_field(tmp_path):
    """A draft's (or a Llama 4 directory's) llama3 rope_scaling without its numbers stopped on a bare
    KeyError 'low_freq_factor'; another type was refused without the file's name."""
    from maverick.checkpoint import CheckpointError, load_hf, save_hf
    from maverick.cli import UserError
    from maverick.model import Llama4

    save_draft(Eagle3Draft(DraftConfig.for_target(get_config("tiny-dense"), 512)), tmp_path / "d")
    cfg = tmp_path / "d" / "config.json"
    base = json.loads(cfg.read_text())
    cfg.write_text(json.dumps(base | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}))
    with pytest.raises(UserError, match=f"{cfg}: llama3 rope_scaling lacks rope_scaling.low_freq_factor"):
        load_draft(tmp_path / "d")
    cfg.write_text(json.dumps(base | {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}))
    with pytest.raises(UserError, match=f"{cfg}: rope_scaling type 'linear' not supported"):
        load_draft(tmp_path / "d")
    save_hf(Llama4(get_config("tiny-moe")), tmp_path / "t")
    cfg = tmp_path / "t" / "config.json"
    d = json.loads(cfg.read_text())
    d.pop("rope_parameters", None)
    cfg.write_text(json.dumps(d | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}))
    with pytest.raises(CheckpointError, match="config.json: invalid Llama4Config: llama3 rope_scaling lacks"):
        load_hf(tmp_path / "t")


def test_not_an_eagle3_config(tmp_path):
    _, path = make(tmp_path)
    c = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(c, architectures=["LlamaForCausalLM"])))
    with pytest.raises(ValueError, match="not an EAGLE-3 draft"):
        load_draft(path)
