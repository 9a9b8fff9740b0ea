"""HF checkpoints in and out: sharded safetensors + `model.safetensors.index.json` + `config.json`.

Loading builds the model on the meta device, memory-maps the tensors and assigns them: every key must be
used and every shape must match, or the error names the key. Keys of Llama4ForCausalLM are ours as they
are; Llama4ForConditionalGeneration nests them under `language_model.` and adds vision keys, which are
skipped and counted. LlamaForCausalLM directories (config.json `architectures` / `model_type`) go through
maverick/hf_llama.py's key map and q/k permutation into a dense config; `save_hf(..., layout="llama")`
writes that layout back. Only safetensors files are read (never pickles, never remote code).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from maverick import hf_llama
from maverick.cli import UserError, read_json_object
from maverick.config import Llama4Config
from maverick.files import atomic_dir
from maverick.model import Llama4, rope_inv_freq

log = logging.getLogger(__name__)

VISION_PREFIXES = (
    "vision_model.",
    "multi_modal_projector.",
    "model.vision_model.",
    "model.multi_modal_projector.",
)
TEXT_PREFIXES = ("language_model.", "model.language_model.")


class CheckpointError(UserError):
    pass


def _read_json(f: Path) -> dict:
    """The JSON object of a checkpoint's config.json or index; errors name the file."""
    if not f.is_file():
        raise FileNotFoundError(f"no {f.name} at {f}")
    return read_json_object(f, CheckpointError)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = _read_json(index)["weight_map"]
        except KeyError:
            raise CheckpointError(f"{index}: not a valid safetensors index (no 'weight_map')") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must be an object of tensor name -> file name")
        files = sorted({path / f for f in weight_map.values()})
    elif (path / "model.safetensors").exists():
        files = [path / "model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"{f} is listed in the index but missing")
    return files


def _text_key(key: str) -> str | None:
    """Map a checkpoint key to ours; None for keys to skip (vision tower)."""
    if key.startswith(VISION_PREFIXES):
        return None
    for p in TEXT_PREFIXES:
        if key.startswith(p):
            key = key[len(p) :]
            # Llama4ForConditionalGeneration in HF v5 saves `model.language_model.layers...` for the text
            # model and `lm_head` at the top level; older files use `language_model.model.layers...`.
            return key if key.startswith(("model.", "lm_head.")) else "model." + key
    return key


def read_state_dict(
    path: str | os.PathLike, only: Iterable[str] | None = None
) -> tuple[dict[str, torch.Tensor], int]:
    """All text tensors of a checkpoint directory (memory-mapped), and the number of skipped vision keys.
    only: read just these (our names, e.g. the embedding and head), leaving the other tensors unread."""
    path = Path(path)
    only = None if only is None else set(only)
    out: dict[str, torch.Tensor] = {}
    skipped = 0
    for f in _safetensors_files(path):
        try:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    ours = _text_key(key)
                    if ours is None:
                        skipped += 1
                        continue
                    if ours in out:
                        raise CheckpointError(
                            f"{f}: key {key!r} maps to {ours!r}, which another key already gave"
                        )
                    if only is None or ours in only:
                        out[ours] = sf.get_tensor(key)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{f}: cannot read safetensors file ({e})") from e
    if skipped:
        log.info("skipped %d vision keys in %s", skipped, path)
    return _fuse_fp8_experts(out, str(path)), skipped


_FP8_EXPERT = re.compile(r"^(model\.layers\.\d+\.feed_forward)\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def _fuse_fp8_experts(sd: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Meta's FP8 release keeps routed experts per expert in FP8 with per-channel scales (compressed-
    tensors). Fuse each such layer into our layout, kept in FP8: `experts.gate_up_proj` [E, H, 2I]
    float8 + `experts.gate_up_scale` [E, 2I], `experts.down_proj` [E, I, H] + `experts.down_scale`."""
    from maverick.fp8_experts import fuse_compressed_tensors_experts

    layers: dict[str, set[int]] = {}
    for k in sd:
        m = _FP8_EXPERT.match(k)
        if m:
            layers.setdefault(m.group(1), set()).add(int(m.group(2)))
    for prefix, experts in layers.items():
        try:
            fused = fuse_compressed_tensors_experts(sd, prefix, max(experts) + 1)
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"{source}: {e}") from None
        for k in [k for k in sd if k.startswith(prefix + ".experts.")]:
            del sd[k]
        sd[prefix + ".experts.gate_up_proj"], sd[prefix + ".experts.gate_up_scale"] = (
            fused.gate_up,
            fused.gate_up_scale,
        )
        sd[prefix + ".experts.down_proj"], sd[prefix + ".experts.down_scale"] = fused.down, fused.down_scale
    return sd


def check_state_dict(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], source: str) -> None:
    """Every expected key present, no other key, every shape equal; errors name the key."""
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing:
        raise CheckpointError(f"{source}: missing key(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        raise CheckpointError(f"{source}: unexpected key(s) {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    for k, meta in expected.items():
        if tuple(got[k].shape) != tuple(meta.shape):
            raise CheckpointError(
                f"{source}: key {k!r} has shape {tuple(got[k].shape)}, expected {tuple(meta.shape)}"
            )


def build_model(
    cfg: Llama4Config,
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    source: str = "checkpoint",
) -> Llama4:
    """Build on meta, check every key and shape, assign. `source` names the file in errors."""
    with torch.device("meta"):
        model = Llama4(cfg)
        _use_fp8_experts_where_stored(model, state_dict, dtype)
    expected = dict(model.state_dict())
    tied = cfg.tie_word_embeddings
    if tied:
        check_tied_head(state_dict, source)
        expected.pop("lm_head.weight", None)
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    check_state_dict(expected, state_dict, source)
    tensors = {
        k: v.to(device) if _is_fp8_slot(k, expected) else v.to(device=device, dtype=dtype)
        for k, v in state_dict.items()
    }
    if tied:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    model.load_state_dict(tensors, strict=True, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg).to(device)
    return model.eval()


FP8_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2}


def _is_fp8_slot(key: str, expected: dict[str, torch.Tensor]) -> bool:
    """Buffers of FP8 experts keep their stored dtype (FP8 weights, fp32 scales)."""
    return expected[key].dtype in FP8_DTYPES or key.endswith("_scale")


def _use_fp8_experts_where_stored(
    model: Llama4, state_dict: dict[str, torch.Tensor], dtype: torch.dtype
) -> None:
    from maverick.fp8_experts import Float8Experts, Fp8Experts

    for name, module in model.named_modules():
        key = f"{name}.experts.gate_up_proj"
        if hasattr(module, "experts") and key in state_dict and state_dict[key].dtype in FP8_DTYPES:
            e = module.experts
            E, H, I2 = e.gate_up_proj.shape
            meta = Fp8Experts(
                torch.empty(E, H, I2, dtype=torch.float8_e4m3fn),
                torch.empty(E, I2),
                torch.empty(E, I2 // 2, H, dtype=torch.float8_e4m3fn),
                torch.empty(E, H),
            )
            module.experts = Float8Experts(meta, dtype=dtype)


def _check_llama4(d: dict, source: str) -> None:
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    if any(not a.startswith("Llama4") for a in archs) or model_type not in (None, "llama4", "llama4_text"):
        raise CheckpointError(
            f"{source}: architectures={archs} model_type={model_type!r} is not supported; supported: "
            "Llama4ForCausalLM, Llama4ForConditionalGeneration, LlamaForCausalLM"
        )


def hf_model_config(path: str | os.PathLike) -> tuple[Llama4Config, bool]:
    """(our config, whether the directory holds the LlamaForCausalLM layout) from its config.json."""
    f = Path(path) / "config.json"
    d, source = _read_json(f), str(f)
    if hf_llama.is_llama(d):
        return hf_llama.config_from_hf(d, source), True
    _check_llama4(d, source)
    try:
        return Llama4Config.from_hf_dict(d, hf_defaults=True), False
    except ValueError as exc:  # a field of the wrong type or value (Llama4Config's checks)
        raise CheckpointError(f"{source}: {exc}") from None


def load_hf(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Llama4:
    """Load an HF Llama4ForCausalLM / Llama4ForConditionalGeneration or LlamaForCausalLM directory."""
    path = Path(path)
    cfg, llama = hf_model_config(path)
    sd, _ = read_state_dict(path)
    if llama:
        sd = hf_llama.from_hf(sd, cfg, str(path))
    return build_model(cfg, sd, dtype, device, source=str(path))


EMBED_KEY, HEAD_KEY = "model.embed_tokens.weight", "lm_head.weight"


def check_tied_head(state_dict: dict[str, torch.Tensor], source: str) -> None:
    """A tied checkpoint that stores an lm_head unlike its embeddings: transformers keeps the stored head, we tie
    the embeddings; refused (as the Llama loader refuses it), naming both keys."""
    head, embed = state_dict.get("lm_head.weight"), state_dict.get("model.embed_tokens.weight")
    if head is not None and embed is not None and head is not embed and not torch.equal(head, embed):
        raise CheckpointError(
            f"{source}: tie_word_embeddings=true but key 'lm_head.weight' differs from 'model.embed_tokens.weight'"
        )


def load_hf_tables(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor, Llama4Config]:
    """(embedding [V, H], lm_head [V, H], config) of a checkpoint directory, as stored, reading only those
    two tensors: what a draft needs of its target (an 8B target in fp32 would be 32 GB for 2 tables).
    A tied head is the embedding. Both keys are the same in the Llama and Llama 4 layouts."""
    path = Path(path)
    cfg, _ = hf_model_config(path)
    sd, _ = read_state_dict(path, only=(EMBED_KEY, HEAD_KEY))
    want = {EMBED_KEY: (cfg.vocab_size, cfg.hidden_size)}
    if not cfg.tie_word_embeddings:
        want[HEAD_KEY] = want[EMBED_KEY]
    for key, shape in want.items():
        if key not in sd:
            raise CheckpointError(f"{path}: missing key(s) [{key!r}]")
        if tuple(sd[key].shape) != shape:
            raise CheckpointError(f"{path}: key {key!r} has shape {tuple(sd[key].shape)}, expected {shape}")
    if cfg.tie_word_embeddings:
        check_tied_head(sd, str(path))
    return sd[EMBED_KEY], sd[EMBED_KEY] if cfg.tie_word_embeddings else sd[HEAD_KEY], cfg


def save_hf(
    model: Llama4, path: str | os.PathLike, max_shard_bytes: int = 2 * 1024**3, layout: str = "llama4"
) -> None:
    """Write sharded safetensors + index + config.json into `path`, atomically (temp dir, then rename).

    layout: "llama4" (Llama4ForCausalLM keys, our config.json) or "llama" (LlamaForCausalLM keys, q/k rows
    back in HF's half-split order, a LlamaConfig; only for plain Llama configs, see hf_llama.check_plain).
    """
    if layout not in ("llama4", "llama"):
        raise ValueError(f"layout must be 'llama4' or 'llama', not {layout!r}")
    path = Path(path)
    cfg = model.config
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    if layout == "llama":
        sd = hf_llama.to_hf(sd, cfg)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(sd):
        nbytes = sd[k].numel() * sd[k].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = sd[k]
        size += nbytes
    with atomic_dir(path) as tmp:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        weight_map = {}
        for name, shard in zip(names, shards):
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(v.numel() * v.element_size() for v in sd.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if layout == "llama":
            llama_cfg = hf_llama.hf_config(cfg, model.dtype)
            (tmp / "config.json").write_text(json.dumps(llama_cfg, indent=2, sort_keys=True))
        else:
            cfg.save_json(tmp / "config.json")


def count_parameters(cfg: Llama4Config) -> tuple[int, int]:
    """(total, active per token) parameters, counted on the meta device. Active counts the shared
    expert plus top-k routed experts per MoE layer, embeddings and lm_head."""
    with torch.device("meta"):
        model = Llama4(cfg)
    total = 0
    inactive = 0
    for name, p in _unique_params(model.named_parameters(remove_duplicate=True)):
        total += p.numel()
        if ".experts." in name:
            inactive += p.numel() * (cfg.num_local_experts - cfg.num_experts_per_tok) // cfg.num_local_experts
    return total, total - inactive


def _unique_params(named: Iterable[tuple[str, torch.nn.Parameter]]):
    seen = set()
    for name, p in named:
        if id(p) not in seen:
            seen.add(id(p))
            yield name, p
