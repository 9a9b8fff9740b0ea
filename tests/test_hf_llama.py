"""HF LlamaForCausalLM checkpoints as our dense Llama-4-family model (maverick/hf_llama.py through
maverick/checkpoint.py): parity with transformers on random tiny configs, a control without the q/k
permutation, sharded and bf16 files, the round trip back to the HF layout, and errors naming the field
or key of what is not supported."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from maverick import hf_llama
from maverick.checkpoint import build_model, load_hf, read_state_dict, save_hf
from maverick.generate import Decoder
from maverick.target import load_target, load_target_tables

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}  # fmt: skip
VARIANTS = {
    "tied-gqa-llama3": dict(tie_word_embeddings=True, num_key_value_heads=2, rope_scaling=LLAMA3),
    "untied-gqa-llama3": dict(tie_word_embeddings=False, num_key_value_heads=2, rope_scaling=LLAMA3),
    "untied-mha-default": dict(tie_word_embeddings=False, num_key_value_heads=4, rope_theta=10000.0),
}


def hf_config(**kw) -> LlamaConfig:
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)  # fmt: skip
    return LlamaConfig(**(base | kw))


def make_hf(path, seed=0, dtype=torch.float32, **kw) -> LlamaForCausalLM:
    """A random HF Llama saved with save_pretrained (std 0.1 so logits spread and greedy tokens vary)."""
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(hf_config(**copy.deepcopy(kw))).eval()  # (LlamaConfig edits rope_scaling dicts)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.1)
    hf.to(dtype).save_pretrained(path)
    return hf


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def greedy_hf(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_greedy_tokens_match_hf(variant, tmp_path):
    hf = make_hf(tmp_path, **VARIANTS[variant])
    ours = load_hf(tmp_path)
    cfg = ours.config
    assert not cfg.moe_layers and all(cfg.no_rope_layers) and cfg.attention_chunk_size is None
    assert cfg.tie_word_embeddings == VARIANTS[variant]["tie_word_embeddings"]
    # positions past original_max_position_embeddings (32): llama3 scaling changes the long wavelengths
    x = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = hf(x).logits, ours(x).logits
    assert rel_err(got, ref) < 1e-5
    prompt = x[0, :12].tolist()
    want = greedy_hf(hf, prompt, 32)
    assert len(set(want)) >= 3  # a sequence that can disagree, not one repeated token
    assert Decoder(ours, max_len=64).generate([prompt], max_new_tokens=32).tokens[0] == want


def test_without_qk_permutation_parity_breaks(tmp_path):
    """Control: HF's rotate-half q/k rows used as they are stored must break parity."""
    hf = make_hf(tmp_path, **VARIANTS["untied-gqa-llama3"])
    cfg = hf_llama.config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    sd, _ = read_state_dict(tmp_path)
    renamed = {k.replace(".mlp.", ".feed_forward."): v for k, v in sd.items()}  # no permutation
    wrong = build_model(cfg, renamed)
    x = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_err(wrong(x).logits, hf(x).logits) > 1e-2


def test_permutation_is_llama_cpp_order_and_invertible():
    """Per head, HF row i -> our row 2i and HF row i + D/2 -> our row 2i+1."""
    w = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(16, 3)  # 2 heads, D 8, H 3
    ours = hf_llama.to_interleaved(w, 2)
    for h in range(2):
        for i in range(4):
            assert torch.equal(ours[h * 8 + 2 * i], w[h * 8 + i])
            assert torch.equal(ours[h * 8 + 2 * i + 1], w[h * 8 + 4 + i])
    assert torch.equal(hf_llama.to_half_split(ours, 2), w)


def test_sharded_bf16_checkpoint_and_round_trip(tmp_path):
    make_hf(tmp_path / "hf", dtype=torch.bfloat16, **VARIANTS["untied-gqa-llama3"])
    # read back rather than kept: `.to(bf16)` also rounds HF's inv_freq buffer, a fresh load keeps it fp32
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    ours = load_hf(tmp_path / "sharded", dtype=torch.bfloat16)
    single = load_hf(tmp_path / "hf", dtype=torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    for k, v in single.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k
    x = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert rel_err(ours(x).logits.float(), hf(x).logits.float()) < 2e-2  # bf16 rounding
    # back to the HF layout: the same tensors under the same keys, a config transformers reads
    save_hf(ours, tmp_path / "back", max_shard_bytes=60_000, layout="llama")
    orig = {
        k: v for f in sorted((tmp_path / "sharded").glob("*.safetensors")) for k, v in load_file(f).items()
    }
    back = {k: v for f in sorted((tmp_path / "back").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert sorted(back) == sorted(orig)
    for k in orig:
        assert back[k].dtype == orig[k].dtype and torch.equal(back[k], orig[k]), k
    again = LlamaForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.bfloat16).eval()
    assert again.config.rope_parameters["rope_type"] == "llama3"
    with torch.no_grad():
        assert torch.equal(again(x).logits, hf(x).logits)
    assert load_hf(tmp_path / "back").config == load_hf(tmp_path / "hf").config


def test_tied_round_trip_leaves_the_head_out(tmp_path):
    make_hf(tmp_path / "hf", **VARIANTS["tied-gqa-llama3"])
    ours = load_target(tmp_path / "hf", dtype=torch.float32)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    save_hf(ours, tmp_path / "back", layout="llama")
    back = {k: v for f in (tmp_path / "back").glob("*.safetensors") for k, v in load_file(f).items()}
    orig = load_file(tmp_path / "hf" / "model.safetensors")
    assert "lm_head.weight" not in back and sorted(back) == sorted(orig)
    assert all(torch.equal(back[k], orig[k]) for k in orig)
    embed, head, _ = load_target_tables(tmp_path / "back")  # a tied head is the embedding
    assert head is embed and torch.equal(embed, orig["model.embed_tokens.weight"])


def test_llama4_model_is_refused_in_the_llama_layout(tmp_path):
    from maverick.config import get_config
    from maverick.model import Llama4

    with pytest.raises(ValueError, match="not a plain Llama.*moe_layers"):
        save_hf(Llama4(get_config("tiny-moe")), tmp_path / "x", layout="llama")


def _edit_config(src, dst, **changes):
    dst.mkdir()
    d = json.loads((src / "config.json").read_text()) | changes
    (dst / "config.json").write_text(json.dumps(d))
    (dst / "model.safetensors").symlink_to(src / "model.safetensors")


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(attention_bias=True), "attention_bias=true is not supported"),
        (dict(mlp_bias=True), "mlp_bias=true is not supported"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (
            dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
            "rope_parameters.rope_type is 'yarn'",
        ),  # fmt: skip
        (
            dict(rope_parameters={"rope_type": "llama3", "factor": 4.0, "rope_theta": 1e4}),
            "lacks rope_parameters.low_freq_factor",
        ),  # fmt: skip
        (
            dict(architectures=["LlamaForSequenceClassification"]),
            r"architectures=\['LlamaForSequenceClassification'\]",
        ),
        (
            dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
            r"architectures=\['Qwen2ForCausalLM'\]",
        ),
    ],
)
def test_unsupported_config_fields_are_named(tmp_path, changes, message):
    make_hf(tmp_path / "hf")
    _edit_config(tmp_path / "hf", tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message) as e:
        load_hf(tmp_path / "bad")
    assert "config.json" in str(e.value)


def test_old_style_rope_scaling_config_loads(tmp_path):
    """config.json as transformers 4.x wrote it (Llama 3.1): rope_theta + rope_scaling with `type`."""
    hf = make_hf(tmp_path / "hf", **VARIANTS["untied-gqa-llama3"])
    d = json.loads((tmp_path / "hf" / "config.json").read_text())
    rp = d.pop("rope_parameters")
    d["rope_theta"] = rp.pop("rope_theta")
    d["rope_scaling"] = {"type" if k == "rope_type" else k: v for k, v in rp.items()}
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(d))
    (tmp_path / "old" / "model.safetensors").symlink_to(tmp_path / "hf" / "model.safetensors")
    assert load_hf(tmp_path / "old").config == load_hf(tmp_path / "hf").config
    assert load_hf(tmp_path / "old").config.rope_scaling == dict(LLAMA3)
    x = torch.randint(0, 256, (1, 50))
    with torch.no_grad():
        assert rel_err(load_hf(tmp_path / "old")(x).logits, hf(x).logits) < 1e-5


def _edit_weights(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    sd = load_file(src / "model.safetensors")
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda sd: sd.__setitem__("model.layers.0.self_attn.q_proj.bias", torch.zeros(64)),
            r"'model.layers.0.self_attn.q_proj.bias': biases are not supported \(config attention_bias\)",
        ),  # fmt: skip
        (
            lambda sd: sd.__setitem__("model.layers.1.mlp.up_proj.bias", torch.zeros(96)),
            r"'model.layers.1.mlp.up_proj.bias'.*mlp_bias",
        ),  # fmt: skip
        (
            lambda sd: sd.__setitem__("model.bogus.weight", torch.zeros(2)),
            r"unexpected key.*model.bogus.weight",
        ),
        (
            lambda sd: sd.pop("model.layers.2.mlp.down_proj.weight"),
            r"missing key.*model.layers.2.feed_forward.down_proj.weight",
        ),  # fmt: skip
        (lambda sd: sd.pop("lm_head.weight"), r"missing key.*lm_head.weight"),
        (
            lambda sd: sd.__setitem__("model.layers.0.mlp.gate_proj.weight", torch.zeros(96, 3)),
            r"model.layers.0.feed_forward.gate_proj.weight.*shape \(96, 3\), expected \(96, 64\)",
        ),  # fmt: skip
        (
            lambda sd: sd.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(33, 64)),
            r"'model.layers.0.self_attn.k_proj.weight' has shape \(33, 64\)",
        ),  # fmt: skip
    ],
)
def test_bad_keys_and_shapes_are_named(tmp_path, edit, message):
    make_hf(tmp_path / "hf")
    _edit_weights(tmp_path / "hf", tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=message):
        load_hf(tmp_path / "bad")


def test_derived_rotary_buffers_are_dropped_and_tied_head_checked(tmp_path):
    hf = make_hf(tmp_path / "hf", tie_word_embeddings=True)
    inv = "model.layers.0.self_attn.rotary_emb.inv_freq"
    _edit_weights(tmp_path / "hf", tmp_path / "old", lambda sd: sd.__setitem__(inv, torch.ones(8)))
    x = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        assert rel_err(load_hf(tmp_path / "old")(x).logits, hf(x).logits) < 1e-5

    def other_head(sd):
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"] + 1

    _edit_weights(tmp_path / "hf", tmp_path / "bad", other_head)
    with pytest.raises(ValueError, match="tie_word_embeddings=true but key 'lm_head.weight'"):
        load_hf(tmp_path / "bad")


def test_pickle_only_directory_is_refused(tmp_path):
    make_hf(tmp_path / "hf")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_hf(tmp_path / "bin")


def test_rope_scaling_wins_over_rope_parameters_as_in_transformers(tmp_path):
    """A config.json with both a default `rope_parameters` and a llama3 `rope_scaling`: transformers takes the
    rope_scaling (`rope_scaling or rope_parameters`), we took the default (logits 5.0 apart)."""
    hf = make_hf(tmp_path)
    cfg_file = tmp_path / "config.json"
    d = json.loads(cfg_file.read_text())
    assert d["rope_parameters"]["rope_type"] == "default"
    cfg_file.write_text(json.dumps(d | {"rope_scaling": LLAMA3}))
    ref = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert ref.config.rope_parameters["rope_type"] == "llama3"
    ours = load_hf(tmp_path)
    assert ours.config.rope_scaling["rope_type"] == "llama3"
    x = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_err(ours(x).logits, ref(x).logits) < 1e-5
    del hf


def test_a_tied_config_with_another_stored_head_is_refused(tmp_path):
    """tie_word_embeddings true with a stored lm_head unlike the embeddings (transformers keeps the head): refused
    by the model's loader and by the tables a draft trains against; a stored copy of the embeddings loads."""
    from maverick.checkpoint import CheckpointError, load_hf_tables

    make_hf(tmp_path, tie_word_embeddings=False)
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(json.dumps(json.loads(cfg_file.read_text()) | {"tie_word_embeddings": True}))
    for load in (load_hf, load_hf_tables):
        with pytest.raises(
            CheckpointError, match="tie_word_embeddings=true but key 'lm_head.weight' differs"
        ):
            load(tmp_path)
    (weights,) = tmp_path.glob("*.safetensors")
    sd = load_file(str(weights))
    save_file(sd | {"lm_head.weight": sd["model.embed_tokens.weight"].clone()}, str(weights))
    m = load_hf(tmp_path)
    assert m.lm_head.weight is m.model.embed_tokens.weight


def test_llama3_scaling_without_its_context_length_reads_as_in_transformers(tmp_path):
    """A llama3 rope_scaling without original_max_position_embeddings was refused; transformers reads it as
    max_position_embeddings (with a warning) and computes with it: so do we, logits within 1e-5 of HF's."""
    make_hf(tmp_path / "hf", **VARIANTS["untied-gqa-llama3"])
    d = json.loads((tmp_path / "hf" / "config.json").read_text())
    rp = d.pop("rope_parameters")
    del rp["original_max_position_embeddings"]
    _edit_config(tmp_path / "hf", tmp_path / "filled", rope_parameters=rp)
    ours = load_hf(tmp_path / "filled")
    assert ours.config.rope_scaling["original_max_position_embeddings"] == 256  # max_position_embeddings
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "filled").eval()
    x = torch.randint(0, 256, (1, 200))
    with torch.no_grad():
        assert rel_err(ours(x).logits, hf(x).logits) < 1e-5
        # the control: the context length of the file it came from (32) is another model
        assert rel_err(load_hf(tmp_path / "hf")(x).logits, hf(x).logits) > 1e-3
