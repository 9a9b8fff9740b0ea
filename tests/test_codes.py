"""maverick.codes: fp32 decoding on the GGUF's one-byte codes. The packs give the file's weights bit for bit
(Q4_0, Q4_1, Q8_0); the compiled kernel equals x @ W^T to fp32 rounding and gives every row the same bits
whatever the row count (1..64); layers fall back to the dense weight when it is written, for gradients and
for many rows; on the real SmolLM2 file every quantised matrix (the tied head too) gets a pack and greedy
speculative decoding on the packed model emits exactly its plain decoding's tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from eagle3.draft import load_draft
from eagle3.lookup import LookupConfig
from eagle3.spec import SpecDecoder
from eagle3.tuner import DraftLengthTuner, FixedK
from maverick.codes import CODES_MAX_ROWS, CodePack, attach_codes, codes_matmul
from maverick.generate import Decoder
from maverick.gguf_loader import codes_parts, dequantize
from maverick.gguf_model import load_gguf_model
from maverick.linear import Linear, fused_linear
from maverick.q4 import live_pack
from maverick.tokenizer import encode_chat, load_tokenizer

DRAFT = "eagle3/drafts/smollm2-135m-instruct"


def gguf_bytes(qtype: Q, N: int, K: int, seed: int) -> np.ndarray:
    """Random GGUF blocks of a [N, K] matrix: Q8_0 fp16 d + 32 int8; Q4_0 fp16 d + 16 bytes of nibbles
    (low: elements 0..15, high: 16..31); Q4_1 fp16 d, fp16 m + 16 bytes."""
    g = np.random.default_rng(seed)
    nb = N * K // 32
    d = g.uniform(0.001, 0.05, (nb, 1)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q8_0:
        return np.concatenate([d, g.integers(-128, 128, (nb, 32)).astype(np.int8).view(np.uint8)], 1).ravel()
    c = g.integers(0, 16, (nb, 32)).astype(np.uint8)
    qs = c[:, :16] | (c[:, 16:] << 4)
    if qtype == Q.Q4_0:
        return np.concatenate([d, qs], 1).ravel()
    m = g.normal(0, 0.1, (nb, 1)).astype(np.float16).view(np.uint8)
    return np.concatenate([d, m, qs], 1).ravel()


def packed_layer(qtype: Q, N: int, K: int, seed: int) -> Linear:
    raw = gguf_bytes(qtype, N, K, seed)
    layer = Linear(K, N, bias=False)
    with torch.no_grad():
        layer.weight.copy_(dequantize(raw, qtype, (N, K)).view(N, K))
    attach_codes(layer, *codes_parts(raw, qtype, (N, K)))
    return layer


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_packs_give_the_file_weights_bit_for_bit(qtype):
    raw = gguf_bytes(qtype, 48, 96, 1)
    codes, scale, offset = codes_parts(raw, qtype, (48, 96))
    assert codes.dtype == torch.uint8
    w = dequantize(raw, qtype, (48, 96)).view(48, 96)
    assert torch.equal(CodePack(codes, scale, offset).dense(), w)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_kernel_is_the_product_and_row_count_invariant(qtype):
    """Against x @ W^T in float64: within 1e-5 of the largest output. Each row: the same bits alone and
    within 2..64 rows (what keeps greedy verification bit-exact)."""
    layer = packed_layer(qtype, 320, 576, 2)
    x = torch.randn(CODES_MAX_ROWS, 576)
    with torch.no_grad():
        ref = x.double() @ layer.weight.double().T
        alone = torch.cat([layer(x[i : i + 1]) for i in range(CODES_MAX_ROWS)])
        err = float((alone.double() - ref).abs().max() / ref.abs().max())
        assert err < 1e-5, err
        for R in (2, 3, 4, 5, 8, 11, 17, 64):
            assert torch.equal(layer(x[:R]), alone[:R]), R
        assert torch.equal(codes_matmul(x[:6].view(2, 3, 576), layer.codes), alone[:6].view(2, 3, 320))


def test_grouped_layers_and_fallbacks():
    """q/k/v side by side give each layer's own bits; a written weight, gradients and more than 64 rows take
    the dense weight."""
    layers = [packed_layer(Q.Q4_1, n, 128, 3 + i) for i, n in enumerate((64, 32, 32))]
    x = torch.randn(4, 128)
    with torch.no_grad():
        assert torch.equal(fused_linear(x, layers), torch.cat([m(x) for m in layers], -1))
        assert len(layers[0].codes.groups) == 1
        big = torch.randn(CODES_MAX_ROWS + 1, 128)
        torch.testing.assert_close(layers[0](big), big @ layers[0].weight.T, rtol=0, atol=0)
        layers[0].weight.mul_(2)
        assert live_pack(layers[0], "codes") is None
        # the written dense weight (fp32 few-row calls run row-count safe: their bits are not one 4-row call's)
        torch.testing.assert_close(layers[0](x), x @ layers[0].weight.T)
    y = layers[1](x.requires_grad_())
    y.sum().backward()
    torch.testing.assert_close(x.grad, layers[1].weight.sum(0).expand(4, -1))


def test_bad_packs_are_refused():
    with pytest.raises(ValueError, match="must be uint8"):
        CodePack(torch.zeros(16, 64, dtype=torch.int32), torch.ones(16, 2), torch.zeros(16, 2))
    with pytest.raises(ValueError, match=r"scale/offset must be \[16, 2\]"):
        CodePack(torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 3), torch.zeros(16, 3))
    with pytest.raises(ValueError, match="not F16"):
        codes_parts(np.zeros(64, np.uint8), Q.F16, (1, 32))
    with pytest.raises(ValueError, match="bias-free fp32"):
        attach_codes(Linear(64, 16).bfloat16(), torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 2), torch.zeros(16, 2))  # fmt: skip
    layer = Linear(64, 16, bias=False)  # random weights: not what these codes say
    with pytest.raises(ValueError, match="do not give the layer's weight"):
        attach_codes(layer, torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 2), torch.zeros(16, 2))


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(), load_gguf_model(dtype=torch.float32, q4=True)


def test_real_target_packs_every_quantised_matrix(smollm2):
    _, m = smollm2
    packed = [n for n, mod in m.named_modules() if getattr(mod, "codes", None) is not None]
    assert len(packed) == 7 * m.config.num_hidden_layers + 1  # q k v o gate up down, and the Q8_0 head
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert torch.equal(m.lm_head.codes.dense(), m.lm_head.weight)


@pytest.mark.parametrize("how", ["k3", "tuned+lookup"])
def test_speculative_decoding_on_codes_is_lossless(smollm2, how):
    tok, target = smollm2
    draft = load_draft(DRAFT, dtype=torch.float32)
    ids = encode_chat(tok, [{"role": "user", "content": "List five facts about the moon, one per line."}])
    with torch.no_grad():
        ref = Decoder(target, max_len=512).generate([ids], 48, None, []).tokens[0]
        policy, lookup = (FixedK(3), None) if how == "k3" else (DraftLengthTuner(), LookupConfig())
        out = (
            SpecDecoder(target, draft, max_len=512, policy=policy, lookup=lookup)
            .generate([ids], 48)
            .tokens[0]
        )
    assert out == ref
