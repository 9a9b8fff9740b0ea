"""Routed MoE experts in FP8: per-output-channel E4M3 for our fused layout, and Meta's release layout.

Our layout (as HF Llama 4), shape legend E experts, H hidden, I expert intermediate:
    feed_forward.experts.gate_up_proj  [E, H, 2I]  laid out [in, out]; gate = [..., :I], up = [..., I:]
    feed_forward.experts.down_proj     [E, I, H]   laid out [in, out]
Quantised, each output channel (last dim) gets one float32 scale, a DEquantisation multiplier
(w ~ q * scale, scale = amax / 448, the compressed-tensors convention): gate_up_scale [E, 2I],
down_scale [E, H]. Reducing over the input dim (dim 1) is what makes the scale per output channel.

Meta's ``Llama-4-Maverick-17B-128E-Instruct-FP8`` (compressed-tensors, "float-quantized"): routed
experts stored UNFUSED per expert in nn.Linear layout [out, in],
    {prefix}.experts.{e}.gate_proj.weight  float8_e4m3fn [I, H]   .weight_scale float32 [I, 1]
    {prefix}.experts.{e}.up_proj.weight    float8_e4m3fn [I, H]   .weight_scale float32 [I, 1]
    {prefix}.experts.{e}.down_proj.weight  float8_e4m3fn [H, I]   .weight_scale float32 [H, 1]
with prefix ``language_model.model.layers.{i}.feed_forward`` (weights static per channel,
activations dynamic per token; shared expert, dense FFN, attention, router stay bf16).
``fuse_compressed_tensors_experts`` maps that onto our fused tensors: a transpose and a concat
of the FP8 bytes, and the scales concatenated the same way, so no value is re-quantised.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from maverick.fp8_cast import quantize_current
from maverick.fp8_recipe import E4M3


class Fp8Experts(NamedTuple):
    """Fused FP8 expert weights; unpacks as (gate_up, gate_up_scale, down, down_scale)."""

    gate_up: torch.Tensor  # float8_e4m3fn [E, H, 2I]
    gate_up_scale: torch.Tensor  # float32 [E, 2I]
    down: torch.Tensor  # float8_e4m3fn [E, I, H]
    down_scale: torch.Tensor  # float32 [E, H]

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, H, 2I], down [E, I, H]) in ``dtype``."""
        return dequantize_experts_fp8(*self, dtype=dtype)


def quantize_experts_fp8(gate_up: torch.Tensor, down: torch.Tensor) -> Fp8Experts:
    """gate_up [E, H, 2I], down [E, I, H] -> E4M3 copies + per-output-channel scales [E, 2I], [E, H]."""
    if gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(
            f"quantize_experts_fp8: need gate_up [E, H, 2I] and down [E, I, H], "
            f"got {tuple(gate_up.shape)} and {tuple(down.shape)}"
        )
    E, H, I2 = gate_up.shape
    if down.shape != (E, I2 // 2, H) or I2 % 2:
        raise ValueError(
            f"quantize_experts_fp8: down must be [E, I, H] = [{E}, {I2 // 2}, {H}] to match gate_up "
            f"{tuple(gate_up.shape)}, got {tuple(down.shape)}"
        )
    gu_q, gu_s = quantize_current(gate_up, E4M3, margin=0, dim=1)  # [E, H, 2I], [E, 1, 2I]
    dn_q, dn_s = quantize_current(down, E4M3, margin=0, dim=1)  # [E, I, H], [E, 1, H]
    return Fp8Experts(gu_q, gu_s.squeeze(1), dn_q, dn_s.squeeze(1))


def dequantize_experts_fp8(
    gate_up_fp8: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down_fp8: torch.Tensor,
    down_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``quantize_experts_fp8``: (gate_up [E, H, 2I], down [E, I, H]) in ``dtype``."""
    gate_up = gate_up_fp8.float() * gate_up_scale.float().unsqueeze(1)  # [E, H, 2I] * [E, 1, 2I]
    down = down_fp8.float() * down_scale.float().unsqueeze(1)  # [E, I, H] * [E, 1, H]
    return gate_up.to(dtype), down.to(dtype)


_PROJS = ("gate_proj", "up_proj", "down_proj")


def _scale_vector(scale: torch.Tensor, rows: int, key: str) -> torch.Tensor:
    """Accept [out, 1] (compressed-tensors channel strategy) or [out]; return float32 [out]."""
    if scale.shape not in ((rows, 1), (rows,)):
        raise ValueError(
            f"{key}: expected a per-output-channel scale of shape [{rows}, 1], got {tuple(scale.shape)}"
        )
    return scale.reshape(rows).float()


def fuse_compressed_tensors_experts(
    state_dict: Mapping[str, torch.Tensor], prefix: str, num_experts: int
) -> Fp8Experts:
    """Read one MoE layer's per-expert FP8 weights (Meta's release layout, module docstring) and
    return our fused ``Fp8Experts``; ``.dequantize(torch.bfloat16)`` gives bf16 tensors.

    ``state_dict`` is any mapping (a dict, or a lazy safetensors reader) and ``prefix`` the
    ``feed_forward`` module path, e.g. ``language_model.model.layers.1.feed_forward``.
    Raises KeyError naming every missing key, ValueError naming the key of a wrong dtype or shape.
    """
    prefix = prefix.rstrip(".")
    keys = {
        (e, proj, kind): f"{prefix}.experts.{e}.{proj}.{kind}"
        for e in range(num_experts)
        for proj in _PROJS
        for kind in ("weight", "weight_scale")
    }
    missing = [k for k in keys.values() if k not in state_dict]
    if missing:
        shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} missing in all)" if len(missing) > 8 else "")
        raise KeyError(f"fuse_compressed_tensors_experts: missing {shown}")

    weights: dict[str, list[torch.Tensor]] = {p: [] for p in _PROJS}  # uint8 views of [out, in]
    scales: dict[str, list[torch.Tensor]] = {p: [] for p in _PROJS}  # float32 [out]
    expected_shape: dict[str, tuple[int, ...]] = {}
    for e in range(num_experts):
        for proj in _PROJS:
            wkey, skey = keys[(e, proj, "weight")], keys[(e, proj, "weight_scale")]
            w = state_dict[wkey]
            if w.dtype != E4M3:
                raise ValueError(f"{wkey}: expected dtype {E4M3}, got {w.dtype}")
            if w.dim() != 2:
                raise ValueError(f"{wkey}: expected a 2-D [out, in] weight, got {tuple(w.shape)}")
            if expected_shape.setdefault(proj, tuple(w.shape)) != tuple(w.shape):
                raise ValueError(
                    f"{wkey}: shape {tuple(w.shape)} differs from expert 0's {expected_shape[proj]}"
                )
            weights[proj].append(w.view(torch.uint8))
            scales[proj].append(_scale_vector(state_dict[skey], w.shape[0], skey))

    I, H = expected_shape["gate_proj"]
    if expected_shape["up_proj"] != (I, H) or expected_shape["down_proj"] != (H, I):
        raise ValueError(
            f"{prefix}.experts: expected gate_proj/up_proj [I, H] and down_proj [H, I], got "
            f"{expected_shape['gate_proj']}, {expected_shape['up_proj']}, {expected_shape['down_proj']}"
        )
    # FP8 bytes move as uint8: transposes and concats are exact and need no float8 kernels.
    gate = torch.stack(weights["gate_proj"]).transpose(1, 2)  # [E, H, I]
    up = torch.stack(weights["up_proj"]).transpose(1, 2)  # [E, H, I]
    gate_up = torch.cat([gate, up], dim=2).contiguous().view(E4M3)  # [E, H, 2I]
    down = torch.stack(weights["down_proj"]).transpose(1, 2).contiguous().view(E4M3)  # [E, I, H]
    gate_up_scale = torch.cat(
        [torch.stack(scales["gate_proj"]), torch.stack(scales["up_proj"])], dim=1
    )  # [E, 2I]
    down_scale = torch.stack(scales["down_proj"])  # [E, H]
    return Fp8Experts(gate_up, gate_up_scale, down, down_scale)


class Float8Experts(torch.nn.Module):
    """Drop-in for `maverick.model.Experts` holding FP8 weights with per-output-channel scales
    (weight-only: activations stay in the model dtype). Each expert's weight is dequantised when it
    runs, which is the exact emulation of an FP8 weight x high-precision activation GEMM."""

    def __init__(self, fp8: Fp8Experts, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.dtype = dtype
        self.register_buffer("gate_up_proj", fp8.gate_up)
        self.register_buffer("gate_up_scale", fp8.gate_up_scale)
        self.register_buffer("down_proj", fp8.down)
        self.register_buffer("down_scale", fp8.down_scale)

    @classmethod
    def from_experts(cls, experts: torch.nn.Module) -> Float8Experts:
        w = experts.gate_up_proj
        return cls(quantize_experts_fp8(w.detach(), experts.down_proj.detach()), dtype=w.dtype)

    def expert(self, e: int, x_ND: torch.Tensor) -> torch.Tensor:
        gate_up = (self.gate_up_proj[e].float() * self.gate_up_scale[e]).to(x_ND.dtype)  # [H, 2I]
        down = (self.down_proj[e].float() * self.down_scale[e]).to(x_ND.dtype)  # [I, H]
        gate_NI, up_NI = (x_ND @ gate_up).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate_NI) * up_NI) @ down

    def grouped(self, x_sorted_ND: torch.Tensor, counts_E: list[int]) -> torch.Tensor:
        outs = [self.expert(e, xs) for e, xs in enumerate(x_sorted_ND.split(counts_E)) if xs.shape[0]]
        return torch.cat(outs) if outs else x_sorted_ND.new_zeros(x_sorted_ND.shape)


def convert_experts_to_fp8(model: torch.nn.Module) -> int:
    """Swap every routed-expert block (`*.experts` holding gate_up_proj/down_proj) for Float8Experts: the
    kind of layer Meta's FP8 release quantizes (attention, shared experts, dense FFN, router, embeddings stay
    high precision). Every MoE layer's, the first and last included, which the release keeps in bf16
    (`parallel.fp8_expert_layers`). Returns the number of blocks converted."""
    from maverick.model import Experts

    n = 0
    for module in list(model.modules()):
        if hasattr(module, "experts") and isinstance(module.experts, Experts):
            module.experts = Float8Experts.from_experts(module.experts)
            n += 1
    return n
