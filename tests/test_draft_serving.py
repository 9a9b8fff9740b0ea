"""The shipped draft directory as the serving engines read it: vLLM's weight-name mapping over every
*.safetensors file, and the aux-layer ids of both engines' conventions against our hidden-state capture.

vLLM's mapping below restates what vllm/model_executor/models/llama_eagle3.py (commit 00bd149) does in
`Eagle3LlamaForCausalLM.load_weights` and `LlamaModel.load_weights`: `t2d` skipped, `d2t` ->
`draft_id_to_target_id`, every other name but `lm_head.*` prefixed `model.`, then `midlayer.` ->
`layers.0.`, q/k/v -> the fused `qkv_proj`, gate/up -> `gate_up_proj`; a name that is no parameter is a
KeyError there. Its aux-layer capture appends the residual stream ENTERING layer idx (hidden_states +
residual before `layer(...)`); SGLang (python/sglang/srt/models/llama.py, commit 0023954:
`set_eagle3_layers_to_capture` captures layers `val + 1` of the nested ids, with the same loop) reads
the nested ids as layer outputs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from eagle3.datastore import Datastore, beside_draft
from eagle3.draft import DraftConfig, Eagle3Draft, feature_layers_from_hf, load_draft, save_draft
from maverick.cli import UserError
from maverick.config import get_config
from maverick.model import Llama4
from train.dump import run_target

SHIPPED = Path(__file__).resolve().parent.parent / "eagle3" / "drafts" / "smollm2-135m-instruct"


def vllm_param_name(name: str) -> str | None:
    """A checkpoint tensor name -> vLLM's Eagle3LlamaForCausalLM parameter (None: skipped by vLLM)."""
    if "t2d" in name:
        return None
    if "d2t" in name:
        return name.replace("d2t", "draft_id_to_target_id")
    if "lm_head" not in name:
        name = "model." + name
    name = name.replace("midlayer.", "layers.0.")
    for shard, fused in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                         (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")):  # fmt: skip
        if shard in name:
            return name.replace(shard, fused)
    return name


def vllm_params(cfg: dict) -> dict[str, tuple[int, ...]]:
    """vLLM's parameters of a one-layer Eagle3 Llama draft and their (fused) shapes, from config.json."""
    H, nq, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg.get("head_dim", H // nq)
    I, Vd = cfg["intermediate_size"], cfg.get("draft_vocab_size") or cfg["vocab_size"]
    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": (cfg["vocab_size"], H),  # optional: vLLM shares the target's
        f"{p}self_attn.qkv_proj.weight": ((nq + 2 * nkv) * D, 2 * H),  # the first layer reads [embeds, h]
        f"{p}self_attn.o_proj.weight": (H, nq * D),
        f"{p}mlp.gate_up_proj.weight": (2 * I, H),
        f"{p}mlp.down_proj.weight": (H, I),
        f"{p}input_layernorm.weight": (H,),
        f"{p}hidden_norm.weight": (H,),
        f"{p}post_attention_layernorm.weight": (H,),
        "model.fc.weight": (H, 3 * cfg.get("target_hidden_size", H)),
        "model.norm.weight": (H,),
        "lm_head.weight": (Vd, H),
        "draft_id_to_target_id": (Vd,),
    }


def load_like_vllm(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every *.safetensors file of the directory through vLLM's mapping -> {param: loaded shape}; an
    unknown name raises KeyError as vLLM's params_dict lookup does."""
    cfg = json.loads((directory / "config.json").read_text())
    params = vllm_params(cfg)
    loaded: dict[str, list[int]] = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                name = vllm_param_name(k)
                if name is None:
                    continue
                if name not in params:
                    raise KeyError(f"{f.name}: {k} -> {name}")
                rows = sf.get_slice(k).get_shape()
                if name in loaded and name.endswith(("qkv_proj.weight", "gate_up_proj.weight")):
                    loaded[name][0] += rows[0]  # shards stack on the output dim
                else:
                    loaded[name] = list(rows)
    return {k: tuple(v) for k, v in loaded.items()}


def test_shipped_draft_directory_loads_as_vllm_loads_it():
    cfg = json.loads((SHIPPED / "config.json").read_text())
    assert sorted(p.name for p in SHIPPED.glob("*.safetensors")) == ["model.safetensors"]
    loaded = load_like_vllm(SHIPPED)
    params = vllm_params(cfg)
    assert set(loaded) == set(params) - {"model.embed_tokens.weight"}  # all but the shared embeddings
    assert loaded == {k: params[k] for k in loaded}  # and every fused shape is what vLLM allocates
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # vLLM: states entering layers
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]  # SGLang: outputs
    assert beside_draft(SHIPPED).is_file()  # the datastore ships beside the directory


def test_a_file_beside_the_weights_stops_vllm_and_us(tmp_path):
    """The control: the old layout (the datastore inside the draft directory) is what vLLM refuses."""
    d = tmp_path / "draft"
    shutil.copytree(SHIPPED, d, ignore=shutil.ignore_patterns("*.png", "*.jsonl*", "*.md"))
    Datastore([[1, 2, 3, 4]]).save(d / "datastore.safetensors")
    with pytest.raises(KeyError, match="tokens"):
        load_like_vllm(d)
    with pytest.raises(UserError, match=r"datastore\.safetensors: tensor\(s\) \['tokens'\].*beside"):
        load_draft(d)


def _tiny_target() -> Llama4:
    torch.manual_seed(0)
    t = Llama4(get_config("tiny-dense"))
    t.init_weights(std=0.1)
    return t.eval()


def test_aux_layer_ids_of_both_conventions_name_the_trained_features(tmp_path):
    """Round trip: save a draft, read its config.json's two id lists, capture the target's states the way
    each engine does (vLLM: the input of layer i; SGLang: the output of layer i) and compare with the
    features our dumps train on (train.dump.run_target)."""
    target = _tiny_target()
    L = target.config.num_hidden_layers
    layers = (1, 2, L)  # includes the state after the last layer (vLLM: id L, SGLang: output of L-1)
    dc = DraftConfig.for_target(
        target.config, draft_vocab_size=target.config.vocab_size, feature_layers=layers
    )
    d = Eagle3Draft(dc)
    d.init_weights()
    d.t2d.fill_(True)
    save_draft(d, tmp_path / "draft")
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    vllm_ids, sglang_ids = (
        cfg["eagle_aux_hidden_state_layer_ids"],
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
    )

    entering, leaving = {}, {}
    hooks = []
    for i, layer in enumerate(target.model.layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: entering.__setitem__(i, a[0].clone())))
        hooks.append(layer.register_forward_hook(lambda m, a, out, i=i: leaving.__setitem__(i, out.clone())))
    ids = torch.randint(0, target.config.vocab_size, (11,), generator=torch.Generator().manual_seed(2))
    sample = {"input_ids": ids, "loss_mask": torch.ones(11, dtype=torch.bool)}
    trained = run_target(
        target, [sample], load_draft(tmp_path / "draft").config.feature_layers, torch.float32
    )
    for h in hooks:
        h.remove()
    trained = trained[0]["features"]  # [T, 3H]: what train.fit reads from the dumps

    after_last = leaving[L - 1]
    vllm = torch.cat([entering[i] if i < L else after_last for i in vllm_ids], -1)[0]
    sglang = torch.cat([leaving[i] for i in sglang_ids], -1)[0]
    assert torch.equal(vllm, trained) and torch.equal(sglang, trained)
    # the control: reading the nested ids with vLLM's convention shifts every feature by one layer
    shifted = torch.cat([entering[i] for i in sglang_ids], -1)[0]
    assert not torch.allclose(shifted, trained)


def test_config_reads_either_convention_and_refuses_a_disagreement():
    assert feature_layers_from_hf({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}}) == (
        2,
        15,
        27,
    )
    assert feature_layers_from_hf({"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}) == (2, 15, 27)
    both = {
        "eagle_aux_hidden_state_layer_ids": [2, 15, 27],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]},
    }
    assert feature_layers_from_hf(both) == (2, 15, 27)
    both["eagle_aux_hidden_state_layer_ids"] = [1, 14, 26]  # a vLLM user who copied SGLang's ids
    with pytest.raises(UserError, match=r"cfg.json: .*\[1, 14, 26\].*name different states"):
        feature_layers_from_hf(both, "cfg.json")
    with pytest.raises(UserError, match="no eagle_aux_hidden_state_layer_ids"):
        feature_layers_from_hf({}, "cfg.json")
    with pytest.raises(UserError, match="list of integers"):
        feature_layers_from_hf({"eagle_aux_hidden_state_layer_ids": "2,15,27"}, "cfg.json")
