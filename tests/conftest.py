"""Fixtures shared by several test modules."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own load of the SmolLM2 GGUF file (its GGUF loader: numpy dequantisation, q/k rows
    un-permuted to rotate_half), fp32, eval: the reference of test_gguf, test_gguf_model and test_target,
    loaded once (~13 s on 2 cores). Shared: read it, never change it."""
    transformers = pytest.importorskip("transformers")
    from maverick.gguf_loader import default_gguf_path

    try:
        path = default_gguf_path()
    except (FileNotFoundError, ModuleNotFoundError) as e:
        pytest.skip(str(e))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = transformers.LlamaForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()
