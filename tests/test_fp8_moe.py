"""FP8 routed experts (weight-only, per output channel) in the model, and Meta's FP8 release layout."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from maverick.checkpoint import load_hf, save_hf
from maverick.config import get_config
from maverick.fp8 import sqnr
from maverick.fp8_experts import convert_experts_to_fp8, quantize_experts_fp8
from maverick.model import Llama4


def tiny_model():
    torch.manual_seed(0)
    m = Llama4(get_config("tiny-moe"))
    m.init_weights(std=0.1)
    return m.eval()


@torch.no_grad()
def test_fp8_experts_close_to_high_precision():
    m = tiny_model()
    x = torch.randint(0, 512, (2, 24))
    ref = m(x).logits
    assert convert_experts_to_fp8(m) == 2  # the two MoE layers of tiny-moe
    got = m(x).logits
    assert sqnr(ref, got) >= 25.0
    assert m.model.layers[1].feed_forward.experts.gate_up_proj.dtype == torch.float8_e4m3fn


@torch.no_grad()
def test_load_fp8_release_layout(tmp_path):
    """Per-expert FP8 keys with weight_scale (compressed-tensors) load into FP8 experts; logits equal the
    model whose experts were quantised the same way in memory."""
    m = tiny_model()
    save_hf(m, tmp_path / "bf16")
    sd = {}
    from safetensors import safe_open

    for f in (tmp_path / "bf16").glob("*.safetensors"):
        with safe_open(str(f), "pt") as r:
            sd |= {k: r.get_tensor(k) for k in r.keys()}
    for layer in (1, 3):
        p = f"model.layers.{layer}.feed_forward.experts"
        q = quantize_experts_fp8(sd.pop(f"{p}.gate_up_proj"), sd.pop(f"{p}.down_proj"))
        I = q.gate_up.shape[2] // 2
        for e in range(q.gate_up.shape[0]):
            sd[f"language_model.{p}.{e}.gate_proj.weight"] = q.gate_up[e, :, :I].T.contiguous()
            sd[f"language_model.{p}.{e}.gate_proj.weight_scale"] = q.gate_up_scale[e, :I, None].contiguous()
            sd[f"language_model.{p}.{e}.up_proj.weight"] = q.gate_up[e, :, I:].T.contiguous()
            sd[f"language_model.{p}.{e}.up_proj.weight_scale"] = q.gate_up_scale[e, I:, None].contiguous()
            sd[f"language_model.{p}.{e}.down_proj.weight"] = q.down[e].T.contiguous()
            sd[f"language_model.{p}.{e}.down_proj.weight_scale"] = q.down_scale[e, :, None].contiguous()
    sd = {(k if k.startswith("language_model.") else "language_model." + k): v for k, v in sd.items()}
    d = tmp_path / "fp8"
    d.mkdir()
    save_file(sd, str(d / "model.safetensors"))
    (d / "config.json").write_text((tmp_path / "bf16" / "config.json").read_text())
    loaded = load_hf(d)
    assert loaded.model.layers[1].feed_forward.experts.down_proj.dtype == torch.float8_e4m3fn
    convert_experts_to_fp8(m)
    x = torch.randint(0, 512, (1, 20))
    assert torch.equal(loaded(x).logits, m(x).logits)
