"""Our model on the real SmolLM2-135M-Instruct GGUF weights vs transformers' LlamaForCausalLM on the same file,
in fp32: dense, and on the file's one-byte codes (`q4=True`, maverick/codes.py)."""

from __future__ import annotations

import pytest
import torch

from maverick.generate import Decoder
from maverick.gguf_model import load_gguf_model
from maverick.tokenizer import default_gguf_path, encode_chat, load_tokenizer


@pytest.fixture(scope="module")
def models(hf_smollm2):
    path = default_gguf_path()
    hf = hf_smollm2
    ours = {"dense": load_gguf_model(path, dtype=torch.float32), "codes": load_gguf_model(path, q4=True)}
    return hf, ours, load_tokenizer(path)


@pytest.mark.parametrize("weights", ["dense", "codes"])
def test_logits_match_hf_on_real_prompt(models, weights):
    hf, ours, tok = models
    ours = ours[weights]
    ids = encode_chat(tok, [{"role": "user", "content": "Explain why the sky is blue in two sentences."}])
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = hf(x).logits
        got = ours(x).logits
    rel = float((got - ref).abs().max() / ref.abs().max())
    assert rel < 1e-4, rel


@pytest.mark.parametrize("weights", ["dense", "codes"])
def test_64_greedy_tokens_identical(models, weights):
    hf, ours, tok = models
    ours = ours[weights]
    ids = encode_chat(tok, [{"role": "user", "content": "Write a short story about a lighthouse keeper."}])
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
    got = Decoder(ours, max_len=len(ids) + 80).generate([ids], max_new_tokens=64).tokens[0]
    assert got == ref[0, len(ids) :].tolist()
