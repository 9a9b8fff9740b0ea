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


def test_outside_configs_read_as_the_engines_read_them(tmp_path):
    """Null counts gave a bare TypeError (the engines read a null draft_vocab_size as the whole vocabulary); a
    config without rms_norm_eps took 1e-5 where transformers' LlamaConfig (and so vLLM, SGLang, SpecForge)
    take 1e-6; feature ids out of layer order loaded though the engines concatenate in layer order (the
    draft's argmax then agreed at 18% of positions); hidden_act 'gelu' ran SiLU."""
    from maverick.cli import UserError

    _, path = make(tmp_path, draft_vocab=512)  # tiny-dense's whole vocabulary
    cfg = path / "config.json"
    base = json.loads(cfg.read_text())
    for key in ("draft_vocab_size", "head_dim", "target_hidden_size"):  # derived: vocab, H / heads, H
        cfg.write_text(json.dumps(base | {key: None}))
        assert getattr(load_draft(path).config, key) == base[key]
    cfg.write_text(json.dumps({k: v for k, v in base.items() if k != "rms_norm_eps"}))
    assert load_draft(path).config.rms_norm_eps == 1e-6
    for key, ids in (
        ("eagle_aux_hidden_state_layer_ids", [3, 2, 1]),
        ("eagle_aux_hidden_state_layer_ids", [1, 1, 3]),
    ):
        cfg.write_text(json.dumps(base | {key: ids, "eagle_config": {}}))
        with pytest.raises(UserError, match=rf"{cfg}: {key} \[{ids[0]}, .*must increase"):
            load_draft(path)
    cfg.write_text(json.dumps(base | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 0, 1]}}))
    del_top = json.loads(cfg.read_text())
    del del_top["eagle_aux_hidden_state_layer_ids"]
    cfg.write_text(json.dumps(del_top))
    with pytest.raises(
        UserError, match=r"eagle_config.eagle_aux_hidden_state_layer_ids \[2, 0, 1\] must increase"
    ):
        load_draft(path)
    cfg.write_text(json.dumps(base | {"hidden_act": "gelu"}))
    with pytest.raises(UserError, match=f"{cfg}: hidden_act='gelu'"):
        load_draft(path)
    cfg.write_text(json.dumps(base))
    assert load_draft(path).config.rms_norm_eps == base["rms_norm_eps"]  # the control


def test_feature_layers_option_must_increase():
    from eagle3.draft import check_feature_layers
    from maverick.cli import UserError

    check_feature_layers((1, 2, 4), 4, "--feature-layers")
    for ids in ((4, 2, 1), (2, 2, 3)):
        with pytest.raises(UserError, match=r"--feature-layers \[.*\] must increase, each layer once"):
            check_feature_layers(ids, 4, "--feature-layers")


def test_draft_files_dtypes_duplicates_and_embeddings(tmp_path):
    """Weights of any dtype were cast in (an int8 fc, a float t2d of 0.5s); a tensor in two weight files
    loaded the later one's; a draft hidden size unlike the target's stopped deep in a matmul; a file's own
    embed_tokens of any shape was dropped without a word."""
    from eagle3.draft import check_draft_fits, embeddings_note
    from maverick.cli import UserError
    from maverick.model import Llama4

    d, path = make(tmp_path)
    sd = load_file(str(path / "model.safetensors"))
    for key, value, dtype in (
        ("fc.weight", sd["fc.weight"].to(torch.int8), "int8"),
        ("t2d", sd["t2d"].float() / 2, "float32"),
        ("d2t", sd["d2t"].float(), "float32"),
        ("lm_head.weight", sd["lm_head.weight"] > 0, "bool"),
    ):
        save_file(dict(sd, **{key: value}), str(path / "model.safetensors"))
        with pytest.raises(UserError, match=f"{path}: {key} is {dtype}, not"):
            load_draft(path)
    save_file(dict(sd, t2d=sd["t2d"].to(torch.uint8), d2t=sd["d2t"].int()), str(path / "model.safetensors"))
    assert torch.equal(load_draft(path).t2d, d.t2d)  # integer maps of 0/1 and offsets load
    save_file(sd, str(path / "model.safetensors"))
    save_file({"fc.weight": torch.zeros_like(sd["fc.weight"])}, str(path / "model-2.safetensors"))
    with pytest.raises(
        UserError, match=r"model.safetensors: tensor\(s\) \['fc.weight'\] stand in model-2.safetensors too"
    ):
        load_draft(path)
    (path / "model-2.safetensors").unlink()

    target = Llama4(get_config("tiny-dense"))
    cfg = json.loads((path / "config.json").read_text())
    with pytest.raises(UserError, match="hidden_size=32, but the target's embeddings .* are 64 wide"):
        check_draft_fits(DraftConfig.from_hf_dict(cfg | {"hidden_size": 32}), target.config)
    save_file(dict(sd, **{"embed_tokens.weight": torch.zeros(7, 3)}), str(path / "model.safetensors"))
    with pytest.raises(UserError, match=r"embed_tokens.weight is \[7, 3\], not \[vocab_size, hidden_size\]"):
        load_draft(path)
    own = target.model.embed_tokens.weight.detach()
    for embed, note in ((own.bfloat16(), False), (own + 0.5, True)):
        save_file(dict(sd, **{"embed_tokens.weight": embed.contiguous()}), str(path / "model.safetensors"))
        got = embeddings_note(load_draft(path), target.model.embed_tokens)
        assert (got is not None) == note
    assert "carry an embed_tokens.weight unlike the target's" in got
    save_file(sd, str(path / "model.safetensors"))
    assert embeddings_note(load_draft(path), target.model.embed_tokens) is None


def test_default_feature_layers_are_layer_order_for_every_depth():
    """The default taps (2, L//2, L-3) were (2, 2, 1) for a 4-layer target, which the option check (and the
    engines' layer-order concatenation) refuses; targets of 7 layers and more keep EAGLE-3's taps."""
    from eagle3.draft import check_feature_layers, default_feature_layers

    for L in range(1, 65):
        taps = default_feature_layers(L)
        check_feature_layers(taps, L, "--feature-layers")
        assert len(taps) == min(3, L + 1)
        if L >= 7:
            assert taps == (2, L // 2, L - 3)
    assert default_feature_layers(30) == (2, 15, 27) and default_feature_layers(4) == (1, 2, 3)


def test_llama3_scaling_without_its_context_length_reads_as_transformers_llama_config(tmp_path):
    """A draft's llama3 rope_scaling without original_max_position_embeddings was refused; the engines read the
    draft's config through transformers' LlamaConfig, which fills it with max_position_embeddings (2048
    when that is absent too): so do we, and the draft's rotary frequencies are the ones its config gives."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    save_draft(Eagle3Draft(DraftConfig.for_target(get_config("tiny-dense"), 512)), tmp_path / "d")
    cfg = tmp_path / "d" / "config.json"
    base = json.loads(cfg.read_text())
    base.pop("rope_parameters", None)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    for max_pos in (4096, None):
        d = base | {"rope_scaling": dict(scaling)}
        if max_pos is None:
            del d["max_position_embeddings"]
        cfg.write_text(json.dumps(d))
        draft = load_draft(tmp_path / "d")
        hf = LlamaConfig(**json.loads(json.dumps(d)))  # (it edits the dicts it is given)
        want = hf.rope_parameters["original_max_position_embeddings"]
        assert draft.config.rope_scaling["original_max_position_embeddings"] == want == (max_pos or 2048)
        hf_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
        assert torch.equal(draft.inv_freq, hf_freq.float())
