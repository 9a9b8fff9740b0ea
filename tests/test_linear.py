"""maverick.linear: the packed-weight path gives F.linear's bits, row by row whatever the row count, and
follows weight updates; gradients and other dtypes take F.linear."""

import copy

import pytest
import torch
import torch.nn.functional as F

from maverick.fp8_convert import convert_to_fp8_weight_only
from maverick.fp8_weight_only import Float8WeightOnlyLinear
from maverick.linear import (
    PACKED_MAX_ROWS,
    Linear,
    fused_linear,
    in_row_chunks,
    invariant_rows,
    linear,
    packed_linear,
    packed_weight,
    packing_supported,
    use_packed,
)

pytestmark = pytest.mark.skipif(not packing_supported(), reason="no oneDNN bf16 on this CPU")

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (8192, 576)]


@pytest.mark.parametrize("out_f,in_f", SHAPES)
def test_packed_equals_f_linear_and_is_row_count_invariant(out_f, in_f):
    g = torch.Generator().manual_seed(out_f + in_f)
    w = torch.randn(out_f, in_f, generator=g).bfloat16()
    x = torch.randn(PACKED_MAX_ROWS, in_f, generator=g).bfloat16()
    with torch.no_grad():
        assert use_packed(x, w)
        for m in (1, 2, 5, 9, 25, 32):  # where F.linear is itself row-count invariant
            torch.testing.assert_close(linear(x[:m], w), F.linear(x[:m], w), rtol=0, atol=0)
        # the raw kernel keeps each row's bits for the row counts probed for this shape (1..64 on a Xeon
        # with AMX, 2..64 for [576, 1536] on AMD EPYC Zen 4, a single row padded to 2) ...
        raw = lambda z: packed_linear(z, packed_weight(w), None)  # noqa: E731
        lo, hi = invariant_rows(raw, "test", (out_f, in_f), torch.bfloat16)
        assert 1 <= lo <= hi, (lo, hi)
        ref = in_row_chunks(raw, x, lo, lo)  # each row in a call of lo rows
        for m in range(lo, hi + 1):
            torch.testing.assert_close(raw(x[:m]), ref[:m], rtol=0, atol=0)
        # ... and a layer pads shorter calls and splits longer ones, so each row keeps those bits at every
        # row count from 1 to 64
        layer = Linear(in_f, out_f, bias=False).bfloat16()
        layer.weight.copy_(w)
        for m in range(1, PACKED_MAX_ROWS + 1):
            torch.testing.assert_close(layer(x[:m]), ref[:m], rtol=0, atol=0)


def test_bias_batch_dims_and_noncontiguous_input():
    lin = Linear(96, 80, bias=True).bfloat16()
    x = torch.randn(2, 3, 96).bfloat16()
    xt = torch.randn(96, 4).bfloat16().t()
    with torch.no_grad():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=0, atol=0)
        torch.testing.assert_close(lin(xt), F.linear(xt, lin.weight, lin.bias), rtol=0, atol=0)


def test_follows_weight_writes():
    lin = Linear(64, 32, bias=False).bfloat16()
    x = torch.randn(3, 64).bfloat16()
    with torch.no_grad():
        before = lin(x)
        lin.weight.mul_(2)  # in place: same storage, new version
        torch.testing.assert_close(lin(x), 2 * before, rtol=0, atol=0)
        lin.load_state_dict({"weight": torch.randn(32, 64).bfloat16()})
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=0, atol=0)
        lin.weight = torch.nn.Parameter(torch.randn(32, 64).bfloat16())  # a new tensor
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=0, atol=0)


def test_gradients_and_other_dtypes_take_f_linear():
    lin = Linear(64, 32).bfloat16()
    ref = torch.nn.Linear(64, 32).bfloat16()
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(4, 64).bfloat16()
    assert not use_packed(x, lin.weight)  # grad enabled, weight requires grad
    lin(x).float().square().sum().backward()
    ref(x).float().square().sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=0, atol=0)
    with torch.no_grad():
        assert not use_packed(x.float(), lin.weight)  # mixed dtypes
        assert use_packed(x.float(), lin.weight.float()) == torch.backends.mkldnn.is_available()  # fp32 packs
        assert not use_packed(x.half(), lin.weight.half())
        assert not use_packed(torch.randn(PACKED_MAX_ROWS + 1, 64).bfloat16(), lin.weight)


def test_deepcopy_and_fp8_conversion_after_packed_calls():
    model = torch.nn.Sequential(Linear(64, 64, bias=False), Linear(64, 16, bias=False)).bfloat16()
    x = torch.randn(2, 64).bfloat16()
    with torch.no_grad():
        y = model(x)
        twin = copy.deepcopy(model)  # the packed copies live outside the module
        torch.testing.assert_close(twin(x), y, rtol=0, atol=0)
        convert_to_fp8_weight_only(twin, module_filter=lambda fqn, m: True)
        assert all(isinstance(m, Float8WeightOnlyLinear) for m in twin)
        w = twin[0].dequantized_weight(torch.bfloat16)
        torch.testing.assert_close(twin[0](x), F.linear(x, w), rtol=0, atol=0)


def split(y, layers):
    return list(y.split([layer.out_features for layer in layers], dim=-1))


def test_fused_linear_equals_separate_layers():
    """q/k/v (576 -> 576, 192, 192) and gate/up (576 -> 1536, 1536) as one packed matmul: every output has
    the bits of its own layer, for every row count up to PACKED_MAX_ROWS; gradients take separate layers."""
    torch.manual_seed(0)
    for outs in ((576, 192, 192), (1536, 1536)):
        layers = [Linear(576, o, bias=False).bfloat16() for o in outs]
        x = torch.randn(PACKED_MAX_ROWS, 576).bfloat16()
        with torch.no_grad():
            for m in (1, 3, 9, 33, PACKED_MAX_ROWS):
                fused = split(fused_linear(x[:m], layers), layers)
                assert [y.shape[-1] for y in fused] == list(outs)
                for y, layer in zip(fused, layers):
                    torch.testing.assert_close(y, layer(x[:m]), rtol=0, atol=0)
            layers[0].weight.add_(1)  # written: the fused copy follows
            torch.testing.assert_close(
                split(fused_linear(x, layers), layers)[0], layers[0](x), rtol=0, atol=0
            )
        grads = fused_linear(x[:2], layers)
        assert grads.requires_grad


def test_fused_linear_remembers_its_choice_and_follows_changes():
    """The kernel chosen for a group of layers is remembered: later calls give the same bits, and a weight
    written in place or replaced, other layers led by the same first one, or a call that wants gradients
    each take the full path again."""
    torch.manual_seed(2)
    layers = (Linear(64, 32, bias=False).bfloat16(), Linear(64, 16, bias=False).bfloat16())
    other = Linear(64, 16, bias=False).bfloat16()
    x = torch.randn(3, 64).bfloat16()

    def ref(group):
        return torch.cat([F.linear(x, m.weight) for m in group], -1)

    with torch.no_grad():
        first = fused_linear(x, layers)
        assert layers[0]._plans  # remembered
        torch.testing.assert_close(fused_linear(x, layers), first, rtol=0, atol=0)
        torch.testing.assert_close(fused_linear(x, list(layers)), first, rtol=0, atol=0)
        torch.testing.assert_close(
            fused_linear(x, (layers[0], other)), ref((layers[0], other)), rtol=0, atol=0
        )
        layers[1].weight.mul_(2)
        torch.testing.assert_close(fused_linear(x, layers), ref(layers), rtol=0, atol=0)
        layers[0].weight = torch.nn.Parameter(torch.randn(32, 64).bfloat16())
        torch.testing.assert_close(fused_linear(x, layers), ref(layers), rtol=0, atol=0)
        layers[0].weight.data = torch.zeros(32, 64).bfloat16()  # new storage, same tensor and version
        torch.testing.assert_close(fused_linear(x, layers), ref(layers), rtol=0, atol=0)
    y = fused_linear(x, layers)  # grad enabled: F.linear, with gradients
    y.float().sum().backward()
    assert layers[0].weight.grad is not None and layers[1].weight.grad is not None


def test_fused_linear_leaves_fp8_layers_to_themselves():
    layers = [Linear(64, 32, bias=False).bfloat16(), Linear(64, 16, bias=False).bfloat16()]
    layers[1] = Float8WeightOnlyLinear.from_float(layers[1])
    x = torch.randn(2, 64).bfloat16()
    with torch.no_grad():
        a, b = split(fused_linear(x, layers), layers)
        torch.testing.assert_close(a, layers[0](x), rtol=0, atol=0)
        torch.testing.assert_close(b, layers[1](x), rtol=0, atol=0)


def test_fused_linear_is_the_concatenation():
    """fused_linear: the packed one-matmul path and the fallback (fp32 here) both equal cat of the layers."""
    torch.manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        layers = [Linear(64, o, bias=False).to(dtype) for o in (32, 16, 16)]
        x = torch.randn(3, 64).to(dtype)
        with torch.no_grad():
            ref = torch.cat([layer(x) for layer in layers], dim=-1)
            torch.testing.assert_close(fused_linear(x, layers), ref, rtol=0, atol=0)


def test_packed_copies_die_with_their_weights():
    import gc

    from maverick import linear as L

    layer = Linear(64, 32, bias=False).bfloat16()
    with torch.no_grad():
        layer(torch.randn(2, 64).bfloat16())
    slot = (id(layer.weight), 1)
    assert slot in L._packs
    del layer
    gc.collect()
    assert slot not in L._packs


def test_probed_windows_are_kept_for_later_processes(tmp_path, monkeypatch):
    """A window probed once is saved (WINDOWS_FILE) and read back by a later process (here: the in-process
    table emptied) without probing; a damaged file is probed again and rewritten; the key names the thread
    count."""
    import json

    import maverick.linear as lin

    monkeypatch.setattr(lin, "WINDOWS_FILE", tmp_path / "windows.json")
    monkeypatch.setattr(lin, "_row_windows", {})
    calls = []
    probe = lin.in_row_chunks
    monkeypatch.setattr(lin, "in_row_chunks", lambda *a: calls.append(1) or probe(*a))
    w = torch.randn(192, 576, generator=torch.Generator().manual_seed(3)).bfloat16()
    args = (lambda z: packed_linear(z, packed_weight(w), None), "saved", (192, 576), torch.bfloat16)
    first = invariant_rows(*args)
    probed = len(calls)
    assert probed >= 64
    key = lin._windows_key(*args[1:])
    assert json.loads(lin.WINDOWS_FILE.read_text()) == {key: list(first)}
    lin._row_windows.clear()
    assert invariant_rows(*args) == first and len(calls) == probed  # read back, not probed
    lin.WINDOWS_FILE.write_text('{"cut')
    lin._row_windows.clear()
    assert invariant_rows(*args) == first and len(calls) == 2 * probed
    assert json.loads(lin.WINDOWS_FILE.read_text()) == {key: list(first)}
    lin.WINDOWS_FILE.write_text(json.dumps({key: [0, 99]}))  # not a window: probed again
    lin._row_windows.clear()
    assert invariant_rows(*args) == first and len(calls) == 3 * probed
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert lin._windows_key(*args[1:]) != key
        # in memory too: the window of another thread count was kept (fp32 GEMMs here: [4, 64] at one
        # thread, [2, 3] at two; a 9-row call at two threads then gave 1 of 9 rows other bits)
        invariant_rows(*args)
        assert len(calls) > 3 * probed
    finally:
        torch.set_num_threads(threads)


def _rows_as_alone(layer, x) -> list[int]:
    """The call sizes m (1..64) whose rows differ from the same rows called one at a time."""
    with torch.no_grad():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
        return [m for m in range(1, len(x) + 1) if not torch.equal(layer(x[:m]), alone[:m])]


def test_layers_with_a_bias_and_fp8_weight_only_keep_each_rows_bits(tmp_path, monkeypatch):
    """Layers with a bias and FP8 weight-only layers (bf16 on the CPU) called the packed kernel unprobed: on
    AMD EPYC a [576, 1536] weight's one-row calls take another kernel, and 59 of 63 call sizes gave rows
    other bits than one-row calls (SmolLM2 +fp8: logits up to 0.85 apart at 37 of 41 positions)."""
    import maverick.linear as lin

    monkeypatch.setattr(lin, "WINDOWS_FILE", tmp_path / "windows.json")
    monkeypatch.setattr(lin, "_row_windows", {})
    g = torch.Generator().manual_seed(0)
    dense = Linear(1536, 576, bias=False).bfloat16()
    biased = Linear(1536, 576, bias=True).bfloat16()
    with torch.no_grad():
        dense.weight.copy_(torch.randn(576, 1536, generator=g))
        biased.weight.copy_(dense.weight)
        biased.bias.copy_(torch.randn(576, generator=g))
    fp8 = Float8WeightOnlyLinear.from_float(dense, backend="dequant")
    x = torch.randn(PACKED_MAX_ROWS, 1536, generator=g).bfloat16()
    assert _rows_as_alone(biased, x) == []
    assert _rows_as_alone(fp8, x) == []


def test_the_probe_sees_differences_that_one_input_hides(tmp_path, monkeypatch):
    """The probe's one N(0, 1) input showed no row count differing on this [192, 1152] weight (AMD EPYC),
    where other inputs gave rows of 9 to 59 of 63 call sizes other bits than one-row calls."""
    import maverick.linear as lin

    monkeypatch.setattr(lin, "WINDOWS_FILE", tmp_path / "windows.json")
    monkeypatch.setattr(lin, "_row_windows", {})
    torch.manual_seed(0)
    torch.randn(576, 1536), torch.randn(576, 1152)  # the third draw is the weight
    layer = Linear(1152, 192, bias=False).bfloat16()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(192, 1152))
    for seed in range(6):
        x = torch.randn(PACKED_MAX_ROWS, 1152, generator=torch.Generator().manual_seed(seed)).bfloat16()
        assert _rows_as_alone(layer, x) == [], seed
