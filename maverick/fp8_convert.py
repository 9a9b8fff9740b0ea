"""Apply FP8 to a built model: swap nn.Linear modules in place, and switch FP8 off for evaluation.

FP8 is a converter applied after the model is built (and after weights are loaded), never part of
the model file. Only modules whose type is exactly nn.Linear or ``maverick.linear.Linear`` (nn.Linear with
a packed-weight fast path) are candidates (another subclass may have its own forward);
``module_filter(fqn, module) -> bool`` then decides. The default keeps in high
precision what FP8 hurts or cannot run:
- ``lm_head`` (logits feed a softmax over 202k tokens; small errors move the argmax),
- routers / MoE gates (``router`` in the name, or a module named exactly ``gate``: top-1 routing
  flips on tiny logit changes; ``gate_proj`` of a SwiGLU is NOT a router and is converted),
- embeddings and norms (``embed`` / ``norm`` in the name, should any be an nn.Linear),
- any linear whose in or out features are not multiples of 16 (``_scaled_mm`` alignment).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import nn

from maverick.fp8_linear import Float8Linear
from maverick.fp8_recipe import Fp8Recipe
from maverick.fp8_weight_only import Float8WeightOnlyLinear
from maverick.linear import Linear

ModuleFilter = Callable[[str, nn.Module], bool]
_PLAIN_LINEARS = (nn.Linear, Linear)


def default_fp8_filter(fqn: str, module: nn.Module) -> bool:
    """True when the nn.Linear at ``fqn`` should run in FP8 (see module docstring)."""
    name = fqn.lower()
    last = name.rsplit(".", 1)[-1]
    if any(word in name for word in ("lm_head", "router", "embed", "norm")) or last in ("gate", "gates"):
        return False
    if not isinstance(module, nn.Linear):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def _swap_linears(
    model: nn.Module, make: Callable[[nn.Linear], nn.Module], module_filter: ModuleFilter | None
) -> nn.Module:
    keep = module_filter if module_filter is not None else default_fp8_filter
    if type(model) in _PLAIN_LINEARS:
        return make(model) if keep("", model) else model
    targets = [
        (fqn, module)
        for fqn, module in model.named_modules()
        if type(module) in _PLAIN_LINEARS and keep(fqn, module)
    ]
    for fqn, module in targets:
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(module))
    return model


def convert_to_fp8(
    model: nn.Module, recipe: Fp8Recipe | None = None, module_filter: ModuleFilter | None = None
) -> nn.Module:
    """Swap the selected nn.Linear modules for Float8Linear (sharing their weights), in place.

    Returns ``model`` (or the new module when ``model`` itself is a selected nn.Linear).
    With a delayed recipe, call ``sync_float8_amax_and_scale_history(model)`` once per step.
    """
    recipe = recipe if recipe is not None else Fp8Recipe()
    return _swap_linears(model, lambda lin: Float8Linear.from_float(lin, recipe), module_filter)


def convert_to_fp8_weight_only(
    model: nn.Module, module_filter: ModuleFilter | None = None, backend: str = "auto"
) -> nn.Module:
    """Swap the selected nn.Linear modules for Float8WeightOnlyLinear (quantised copies), in place."""
    return _swap_linears(model, lambda lin: Float8WeightOnlyLinear.from_float(lin, backend), module_filter)


@contextlib.contextmanager
def fp8_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run every Float8Linear in ``model`` as plain ``F.linear`` (bit-identical to nn.Linear)
    inside the block, e.g. for a high-precision evaluation; restores the previous flags after.
    (Weight-only layers have no high-precision weight left and are unaffected.)"""
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    previous = [m.fp8_enabled for m in layers]
    for m in layers:
        m.fp8_enabled = False
    try:
        yield model
    finally:
        for m, flag in zip(layers, previous):
            m.fp8_enabled = flag
