"""FP8 for Maverick: Transformer-Engine-style training layers, weight-only inference, FP8 experts.

The recipe in one paragraph. FP8 has two formats: E4M3 (max 448, 3 mantissa bits) for the forward
tensors and E5M2 (max 57344, 2 mantissa bits) for gradients, whose range matters more than their
precision ("hybrid"). An FP8 value only means something with a scale: the high-precision tensor is
multiplied by ``scale = (fp8_max / amax) / 2**margin`` and saturated into FP8, the GEMM accumulates
in fp32 and multiplies by both operands' ``1 / scale``. Where the amax comes from is the recipe:
delayed scaling (TE's default) takes it from a history of earlier steps so the cast needs no
reduction first; current scaling takes this tensor's amax now; row-wise takes one amax per row
(per token, per output channel). Layers that FP8 hurts (lm_head, routers) or that ``_scaled_mm``
cannot run (dims not multiples of 16) stay in high precision.

Usage (training)::

    model = convert_to_fp8(model, Fp8Recipe(scaling="delayed"))
    for batch in data:
        loss(model(batch)).backward(); opt.step(); opt.zero_grad()
        sync_float8_amax_and_scale_history(model)          # delayed scaling only
    with fp8_disabled(model):                             # high-precision evaluation
        evaluate(model)

Usage (inference): ``convert_to_fp8_weight_only(model)``; routed experts via
``quantize_experts_fp8`` or, from Meta's FP8 checkpoint, ``fuse_compressed_tensors_experts``.

Where things live: recipe ``fp8_recipe``, scales and casts ``fp8_cast``, the GEMM backend
(``_scaled_mm`` on CUDA sm_89+, exact emulation elsewhere) ``fp8_gemm``, the layer ``fp8_linear``,
swapping and the off switch ``fp8_convert``, weight-only ``fp8_weight_only``, experts
``fp8_experts``. Timings at Maverick shapes: ``python -m eval.bench_fp8_gemm`` (CUDA).
"""

from maverick.fp8_cast import (
    cast_to_fp8,
    dequantize,
    quantize_current,
    record_amax_,
    scale_from_amax,
    sqnr,
    tensor_amax,
    update_delayed_scale_,
)
from maverick.fp8_convert import convert_to_fp8, convert_to_fp8_weight_only, default_fp8_filter, fp8_disabled
from maverick.fp8_experts import (
    Fp8Experts,
    dequantize_experts_fp8,
    fuse_compressed_tensors_experts,
    quantize_experts_fp8,
)
from maverick.fp8_gemm import emulated_mm, fp8_mm, resolve_backend, scaled_mm_supported
from maverick.fp8_linear import Float8Linear, sync_float8_amax_and_scale_history
from maverick.fp8_recipe import E4M3, E5M2, Fp8Recipe, fp8_max
from maverick.fp8_weight_only import Float8WeightOnlyLinear, quantize_weight_per_channel

__all__ = [
    "E4M3",
    "E5M2",
    "Float8Linear",
    "Float8WeightOnlyLinear",
    "Fp8Experts",
    "Fp8Recipe",
    "cast_to_fp8",
    "convert_to_fp8",
    "convert_to_fp8_weight_only",
    "default_fp8_filter",
    "dequantize",
    "dequantize_experts_fp8",
    "emulated_mm",
    "fp8_disabled",
    "fp8_max",
    "fp8_mm",
    "fuse_compressed_tensors_experts",
    "quantize_current",
    "quantize_experts_fp8",
    "quantize_weight_per_channel",
    "record_amax_",
    "resolve_backend",
    "scale_from_amax",
    "scaled_mm_supported",
    "sqnr",
    "sync_float8_amax_and_scale_history",
    "tensor_amax",
    "update_delayed_scale_",
]
