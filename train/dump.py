"""Hidden-state dumps: run the target once per training sample and store what the draft trains on.

Per sample (all positions of the sample, padding never stored):
    input_ids      int32  [T]
    loss_mask      uint8  [T]      1 on assistant tokens
    features       bf16   [T, 3H]  hidden states ENTERING the three feature layers (low, mid, high)
    hidden         bf16   [T, H]   the target's final normed hidden state
    target_argmax  int32  [T]      the target's full-vocab argmax at each position

Why these and not the target logits: the draft scores a reduced vocabulary (8192 of 49152 for
SmolLM2), and `train/fit.py` rebuilds the target logits over exactly those ids from `hidden` with the
target's lm_head rows (576 x 8192 multiply-adds per token instead of 49152-wide logits on disk). The
full-vocab argmax is the one thing those rows cannot give back: whether the target's top token lies
outside the draft vocab, which masks the position out of the loss. bf16 halves the bytes; the features
come out of a bf16 target anyway.

Layout on disk (a directory):
    manifest.json                what was dumped, from what, and every finished shard (size, sha256)
    vocab.safetensors            the draft vocabulary maps d2t [V'], t2d [V] (eagle3/vocab.py)
    shard-00000.safetensors ...  `shard_size` consecutive samples each, concatenated along tokens, with
                                 `offsets` [n+1] (sample k is tokens offsets[k]:offsets[k+1]) and
                                 `sample_index` [n] (its index in the dumped sample list)
Shards are written under a temporary name and renamed; the manifest (also renamed into place) is
updated after each one, so an interrupted dump restarts where it stopped: finished shards whose size
matches the manifest are skipped, temporary files are deleted. A run with different settings
(target, layers, dtype, data) into the same directory is refused instead of mixing dumps, and so is
a directory that holds other files and no manifest (a draft's, a user's folder).

Target forwards are batched: the samples of a shard are sorted by length and grouped under a token
budget, right-padded (causal attention: padding on the right cannot change earlier positions). Under
torchrun the target runs tensor + expert parallel (maverick/parallel.py: each rank reads its slices of an
HF directory), every rank runs every forward, and rank 0 writes.
On CPUs with AMX a bf16 target is 3-4x faster than fp32 (see `python -m train.dump --help`).

Shape legend: B batch, T tokens, N tokens of a shard, H target hidden, V target vocab, V' draft vocab.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import re
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from eagle3.draft import check_feature_layers, default_feature_layers
from maverick.cli import (
    ArgumentParser,
    UserError,
    add_threads_option,
    check_output_dir,
    device,
    int_list,
    output_dir,
    positive_int,
    read_json_object,
    run_cli,
)
from maverick.config import Llama4Config
from maverick.files import LEFTOVER, atomic_path, atomic_write, remove_leftovers
from maverick.model import Llama4
from maverick.target import TARGET_DTYPES, TARGET_HELP, default_target_path, target_identity
from train.samples import add_data_args, chat_samples, draft_vocab_from

log = logging.getLogger(__name__)

FORMAT = "eagle3-hidden-state-dump"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
VOCAB_FILE = "vocab.safetensors"
FIELDS = ("input_ids", "loss_mask", "features", "hidden", "target_argmax")
STORE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# safetensors dtype codes of the stored fields (checked when a shard is opened)
_ST_DTYPES = {"input_ids": ("I32",), "loss_mask": ("U8",), "target_argmax": ("I32",), "offsets": ("I64",),
              "sample_index": ("I64",), "features": ("BF16", "F16"), "hidden": ("BF16", "F16")}  # fmt: skip


class DumpError(UserError):
    """A dump directory or shard that cannot be used; the message names the file."""


# ----------------------------------------------------------------------------------------------------
# The target


@torch.no_grad()
def run_target(
    model: Llama4,
    samples: Sequence[Mapping[str, Any]],
    feature_layers: Sequence[int],
    store_dtype: torch.dtype = torch.bfloat16,
    head_rows: int = 1024,
) -> list[dict[str, Tensor]]:
    """One batched target forward over right-padded samples -> the stored fields of each sample.

    The argmax is the one of fp32 logits (`full_vocab_argmax`), `head_rows` positions at a time so the
    [rows, V] logits stay small.
    """
    lengths = [len(s["input_ids"]) for s in samples]
    if min(lengths) < 1:
        raise ValueError("run_target: empty sample")
    B, T = len(samples), max(lengths)
    tokens = torch.zeros(B, T, dtype=torch.long, device=model.device)  # [B, T], right padding = token 0
    for b, s in enumerate(samples):
        tokens[b, : lengths[b]] = torch.as_tensor(s["input_ids"], dtype=torch.long)
    out = model(tokens, feature_layers=tuple(feature_layers), logits=None)
    if out.features is None or out.features.shape[-1] != len(feature_layers) * model.config.hidden_size:
        raise RuntimeError(f"the target returned no features for layers {tuple(feature_layers)}")
    results = []
    for b, s in enumerate(samples):
        L = lengths[b]
        hidden = out.hidden[b, :L]  # [L, H]
        argmax = torch.cat([target_argmax(model, h) for h in hidden.split(head_rows)])
        results.append(
            {
                "input_ids": torch.as_tensor(s["input_ids"], dtype=torch.int32).cpu(),
                "loss_mask": torch.as_tensor(s["loss_mask"]).to(torch.uint8).cpu(),
                "features": out.features[b, :L].to(store_dtype).cpu(),
                "hidden": hidden.to(store_dtype).cpu(),
                "target_argmax": argmax.to(torch.int32).cpu(),
            }
        )
    return results


def target_argmax(model: Llama4, hidden: Tensor) -> Tensor:
    """The target's full-vocabulary argmax of hidden [N, H] (`full_vocab_argmax`). A tensor parallel
    target (maverick/parallel.py) holds vocabulary rows vocab_start .. of the head on each rank: each rank
    takes the best of its rows and the fp32 score that chose it (`full_vocab_best`: the same bits as one
    process's for that row), and every rank picks the same winner from the gathered pairs (the lowest id on
    a tie, as argmax does)."""
    head = model.lm_head.weight
    shard = getattr(model, "shard", None)
    if shard is None:
        return full_vocab_argmax(hidden, head)
    local, logit = full_vocab_best(hidden, head)  # [N] ids of this rank's rows, the scores that chose them
    pairs = torch.stack([logit.double(), (local + model.model.embed_tokens.vocab_start).double()])  # [2, N]
    gathered = [torch.empty_like(pairs) for _ in range(shard.world)]
    dist.all_gather(gathered, pairs, group=shard.group)
    logits, ids = torch.stack(gathered, 1)  # [W, N] each, ranks in vocabulary order
    return ids.gather(0, logits.argmax(0, keepdim=True))[0].long()


def full_vocab_argmax(hidden: Tensor, head: Tensor, candidates: int = 8) -> Tensor:
    """argmax over fp32 logits hidden [N, H] @ head [V, H].T -> [N] (int64).

    NOTE: with a bf16 target the fp32 head costs as much as 40% of the dump (576 x 49152 fp32
    multiply-adds per token). Instead the head runs in the model's dtype to pick `candidates` ids per
    position and only those are rescored in fp32: bf16 logits are off by ~0.4% of their size, far less
    than the gap to the 8th best, so the result equals the fp32 argmax (tests check it).
    """
    return full_vocab_best(hidden, head, candidates)[0]


def full_vocab_best(hidden: Tensor, head: Tensor, candidates: int = 8) -> tuple[Tensor, Tensor]:
    """(`full_vocab_argmax`'s ids [N], the fp32 scores it chose them by [N]). The head's GEMM (in its dtype)
    picks `candidates` ids per position; each is rescored on its own, an fp32 dot product of one shape
    whatever the head's row count, and the best kept (the lowest id on a tie, as argmax). So a sharded head's
    ranks and one process score a row by the same bits: a GEMM's bits depend on the head's rows, and its
    near-ties resolved otherwise on a rank's half (constructed: 1,505 of 4,096 rows). (Exact ties past the
    candidates, e.g. more than `candidates` identical head rows, are not seen.) A NaN score counts as -inf,
    so a NaN hidden row still gets a vocabulary id (its loss is NaN anyway) rather than an id past the end.
    """
    k = min(candidates, head.shape[0])
    cand = (hidden.to(head.dtype) @ head.T).topk(k, dim=-1).indices  # [N, k]
    exact = torch.einsum("nh,nkh->nk", hidden.float(), head[cand].float())  # [N, k] fp32
    exact = exact.nan_to_num(nan=-torch.inf)  # (a NaN is never == best: the min below was int64's max)
    best = exact.max(-1, keepdim=True).values  # [N, 1]
    ids = torch.where(exact == best, cand, torch.iinfo(cand.dtype).max).min(-1).values  # lowest id on a tie
    return ids, best[:, 0]


def plan_batches(lengths: Sequence[int], batch_tokens: int, max_batch: int = 64) -> list[list[int]]:
    """Group sample indices for batched forwards: longest first, each group's padded size
    (members x longest) within `batch_tokens` (a single longer sample still gets its own batch)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if (
            batches
            and len(batches[-1]) < max_batch
            and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens
        ):
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


# ----------------------------------------------------------------------------------------------------
# Writing


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise DumpError(f"{path}: no manifest; not a dump directory (make one with python -m train.dump)")
    manifest = read_json_object(path, DumpError)
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise DumpError(
            f"{path}: format {manifest.get('format')!r} version {manifest.get('version')!r}, "
            f"expected {FORMAT!r} version {FORMAT_VERSION}"
        )
    return manifest


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


# what a run writes before its first manifest (and the partial files of each, manifest.json's too)
DUMP_FILE = re.compile("|".join(map(re.escape, (VOCAB_FILE, MANIFEST))) + r"|shard-\d{5}\.safetensors")


def check_out(out: Path) -> None:
    """--out may be a new or empty directory, a dump's (its manifest: a rerun resumes it, or says which
    setting differs), or what a first run stopped before its first manifest left (the vocabulary, shards,
    partial files). A directory holding anything else (a draft beside eagle3/drafts' shipped one, a user's
    folder) is a DumpError naming it, before any work: the shards and manifest went in beside its files."""
    check_output_dir(out)
    if not out.is_dir():
        return
    if (out / MANIFEST).exists():
        read_manifest(out)  # another program's manifest.json is refused here, before the data is read
        return
    other = [p.name for p in out.iterdir() if not DUMP_FILE.fullmatch(LEFTOVER.split(p.name)[0])]
    if other:
        raise DumpError(
            f"{out}: holds {', '.join(sorted(other)[:3])}{', ...' if len(other) > 3 else ''} and no {MANIFEST}, "
            "so it is not a dump directory; give --out a new or empty directory, or a dump's to resume it"
        )


def _shard_tensors(per_sample: Sequence[Mapping[str, Tensor]], first: int) -> dict[str, Tensor]:
    lengths = torch.tensor([len(s["input_ids"]) for s in per_sample], dtype=torch.int64)
    offsets = torch.zeros(len(per_sample) + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    out = {f: torch.cat([s[f] for s in per_sample]).contiguous() for f in FIELDS}
    out["offsets"] = offsets
    out["sample_index"] = torch.arange(first, first + len(per_sample), dtype=torch.int64)
    return out


@dataclass
class DumpSettings:
    """What must be identical for shards to belong to one dump (compared on resume)."""

    target: dict[str, Any]  # target_identity(...) (+ "dtype" of the forward), or a name for in-memory targets
    feature_layers: tuple[int, ...]
    dtype: str  # stored float dtype: "bf16" | "fp16"
    max_length: int | None
    shard_size: int
    data: dict[str, Any]  # {"source", "split", "num_samples", "fingerprint"}

    def as_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "feature_layers": list(self.feature_layers),
            "dtype": self.dtype,
            "max_length": self.max_length,
            "shard_size": self.shard_size,
            "data": self.data,
        }


def write_dumps(
    model: Llama4,
    samples: Sequence[Mapping[str, Any]],
    out_dir: str | os.PathLike,
    settings: DumpSettings,
    batch_tokens: int = 4096,
    vocab: tuple[Tensor, Tensor] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Dump `samples` (dicts with input_ids, loss_mask) through `model` into `out_dir`; resumable.

    Returns the final manifest. `vocab` (d2t, t2d) is saved as vocab.safetensors when given. A tensor
    parallel target (maverick/parallel.py, under torchrun) runs its forwards on every rank, which all read
    the same manifest first; rank 0 alone writes (the others return the manifest as it was).
    """
    out = Path(out_dir)
    shard = getattr(model, "shard", None)
    writer = shard is None or shard.rank == 0
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    store_dtype = STORE_DTYPES[settings.dtype]
    n = len(samples)
    if n == 0:
        raise ValueError("write_dumps: no samples")
    num_shards = math.ceil(n / settings.shard_size)
    header = {"format": FORMAT, "version": FORMAT_VERSION, **settings.as_json(), "num_shards": num_shards}
    manifest_path = out / MANIFEST
    shards: dict[int, dict[str, Any]] = {}
    if manifest_path.exists():
        old = read_manifest(out)
        diff = [k for k in header if k not in ("num_shards",) and old.get(k) != header[k]]
        if diff:
            k = diff[0]
            raise DumpError(
                f"{manifest_path}: this directory holds a dump made with different settings "
                f"({k}: {old.get(k)!r} there, {header[k]!r} now); use another --out or delete it"
            )
        for entry in old.get("shards", []):
            f = out / entry["file"]
            if f.is_file() and f.stat().st_size == entry["bytes"]:
                shards[entry["index"]] = entry
            else:
                log.warning("%s: missing or wrong size; dumping it again", f)
    if writer:  # a dump of these settings (or a new one) goes on here: an interrupted run's partial files go
        for tmp in remove_leftovers(out):
            log.info("deleted partial file %s", tmp)
    if shard is not None:  # every rank has read the manifest before rank 0 writes
        dist.barrier(group=shard.group)
    if vocab is not None and writer:
        save_vocab(out, *vocab)

    def manifest() -> dict[str, Any]:
        done = [shards[k] for k in sorted(shards)]
        tokens = sum(e["tokens"] for e in done)
        nbytes = sum(e["bytes"] for e in done)
        m = dict(header)
        m["shards"] = done
        m["complete"] = len(done) == num_shards
        m["samples"] = sum(e["samples"] for e in done)
        m["tokens"] = tokens
        m["bytes"] = nbytes
        m["bytes_per_token"] = round(nbytes / tokens, 3) if tokens else None
        if (out / VOCAB_FILE).exists():
            m["vocab_file"] = VOCAB_FILE
        return m

    todo = [k for k in range(num_shards) if k not in shards]
    if len(todo) < num_shards:
        log.info("resuming: %d of %d shards already done", num_shards - len(todo), num_shards)
    total_tokens = sum(
        len(samples[i]["input_ids"]) for k in todo for i in _shard_range(k, settings.shard_size, n)
    )
    bar = _progress(total_tokens, progress and writer, "dump")
    t0, done_tokens = time.perf_counter(), 0
    for k in todo:
        idx = list(_shard_range(k, settings.shard_size, n))
        chunk = [samples[i] for i in idx]
        per_sample: list[dict[str, Tensor] | None] = [None] * len(chunk)
        for group in plan_batches([len(s["input_ids"]) for s in chunk], batch_tokens):
            for j, fields in zip(
                group, run_target(model, [chunk[j] for j in group], settings.feature_layers, store_dtype)
            ):
                per_sample[j] = fields
            ntok = sum(len(chunk[j]["input_ids"]) for j in group)
            done_tokens += ntok
            if bar is not None:
                bar.update(ntok)
                bar.set_postfix(tok_s=f"{done_tokens / (time.perf_counter() - t0):.0f}", shard=k)
        if not writer:
            continue
        tensors = _shard_tensors(per_sample, idx[0])
        final = out / shard_name(k)
        with atomic_path(final) as tmp:
            save_file(tensors, str(tmp), metadata={"format": FORMAT, "version": str(FORMAT_VERSION)})
        shards[k] = {
            "index": k,
            "file": final.name,
            "first_sample": idx[0],
            "samples": len(idx),
            "tokens": int(tensors["offsets"][-1]),
            "bytes": final.stat().st_size,
            "sha256": file_sha256(final),
        }
        atomic_write(manifest_path, json.dumps(manifest(), indent=2) + "\n")
    if bar is not None:
        bar.close()
    m = manifest()
    if writer:
        atomic_write(manifest_path, json.dumps(m, indent=2) + "\n")
    elapsed = time.perf_counter() - t0
    m["_run"] = {
        "seconds": elapsed,
        "tokens": done_tokens,
        "tokens_per_s": done_tokens / elapsed if elapsed else None,
    }
    return m


def _shard_range(k: int, shard_size: int, n: int) -> range:
    return range(k * shard_size, min(n, (k + 1) * shard_size))


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="tok", desc=desc, dynamic_ncols=True)


def save_vocab(directory: str | os.PathLike, d2t: Tensor, t2d: Tensor) -> None:
    path = Path(directory) / VOCAB_FILE
    with atomic_path(path) as tmp:
        save_file({"d2t": d2t.long().contiguous(), "t2d": t2d.bool().contiguous()}, str(tmp))


def load_vocab(directory: str | os.PathLike) -> tuple[Tensor, Tensor]:
    """(d2t int64 [V'], t2d bool [V]) saved beside the dumps, validated."""
    from eagle3.vocab import validate_vocab_maps

    path = Path(directory) / VOCAB_FILE
    if not path.is_file():
        raise DumpError(f"{path}: no draft vocabulary beside the dumps")
    try:
        with safe_open(str(path), framework="pt") as f:
            d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    except Exception as exc:
        raise DumpError(f"{path}: cannot read the draft vocabulary ({exc})") from exc
    try:
        validate_vocab_maps(d2t, t2d, t2d.numel())
    except ValueError as exc:
        raise DumpError(f"{path}: {exc}") from exc
    return d2t, t2d


# ----------------------------------------------------------------------------------------------------
# Reading


def _read_header(path: Path) -> dict[str, Any]:
    """Parse and check a safetensors header against the file size: a truncated or overwritten shard
    fails here with its name instead of deep inside a training step."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise DumpError(f"{path}: truncated ({size} bytes, not even a safetensors header)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > 100_000_000:
            raise DumpError(f"{path}: corrupt or truncated (header length {n} > file size {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DumpError(f"{path}: corrupt safetensors header ({exc})") from exc
    header.pop("__metadata__", None)
    end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if 8 + n + end != size:
        raise DumpError(
            f"{path}: truncated or corrupt: the header describes {8 + n + end} bytes, the file has {size}"
        )
    for name, codes in _ST_DTYPES.items():
        if name not in header:
            raise DumpError(f"{path}: missing tensor {name!r}")
        if header[name]["dtype"] not in codes:
            raise DumpError(f"{path}: tensor {name!r} has dtype {header[name]['dtype']}, expected {codes}")
    return header


class _Shard:
    """One shard file, opened lazily (and again after a fork: mmap handles are per process)."""

    def __init__(self, path: Path, entry: Mapping[str, Any], verify: bool):
        self.path = path
        if not path.is_file():
            raise DumpError(f"{path}: shard listed in the manifest is missing")
        if path.stat().st_size != entry["bytes"]:
            raise DumpError(
                f"{path}: truncated or corrupt: {path.stat().st_size} bytes, the manifest says {entry['bytes']}"
            )
        header = _read_header(path)
        if verify and file_sha256(path) != entry.get("sha256"):
            raise DumpError(f"{path}: sha256 differs from the manifest (corrupt shard)")
        self.first = int(entry["first_sample"])
        self.n = int(entry["samples"])
        self.tokens = int(entry["tokens"])
        shapes = {k: v["shape"] for k, v in header.items()}
        if shapes["offsets"] != [self.n + 1] or shapes["input_ids"] != [self.tokens]:
            raise DumpError(
                f"{path}: shapes disagree with the manifest ({self.n} samples, {self.tokens} tokens): "
                f"offsets {shapes['offsets']}, input_ids {shapes['input_ids']}"
            )
        self._pid = None
        self._file = None
        self.offsets = self._open().get_tensor("offsets")  # [n+1]
        if int(self.offsets[-1]) != self.tokens or bool((self.offsets[1:] <= self.offsets[:-1]).any()):
            raise DumpError(
                f"{path}: offsets are inconsistent (last {int(self.offsets[-1])}, tokens {self.tokens})"
            )

    def _open(self):
        if self._file is None or self._pid != os.getpid():
            try:
                self._file = safe_open(str(self.path), framework="pt")
            except Exception as exc:
                raise DumpError(f"{self.path}: cannot open shard ({exc})") from exc
            self._pid = os.getpid()
        return self._file

    def sample(self, k: int) -> dict[str, Tensor]:
        a, b = int(self.offsets[k]), int(self.offsets[k + 1])
        f = self._open()
        try:
            return {name: f.get_slice(name)[a:b] for name in FIELDS}
        except Exception as exc:
            raise DumpError(f"{self.path}: cannot read sample {k} ({exc})") from exc

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_file"] = None
        return state


# what must agree between dump directories read as one dataset (the target and what was stored of it)
_SAME_TARGET = ("size", "dtype", "hidden_size", "num_hidden_layers", "vocab_size")


def _check_same_dump(first: Path, a: Mapping[str, Any], other: Path, b: Mapping[str, Any]) -> None:
    ta, tb = a.get("target", {}), b.get("target", {})
    for key in _SAME_TARGET:
        if ta.get(key) != tb.get(key):
            raise DumpError(
                f"{other / MANIFEST}: target.{key} is {tb.get(key)!r} but {ta.get(key)!r} in {first / MANIFEST}; "
                "dumps read together must come from the same target"
            )
    for key in ("feature_layers", "dtype"):
        if a.get(key) != b.get(key):
            raise DumpError(
                f"{other / MANIFEST}: {key} is {b.get(key)!r} but {a.get(key)!r} in {first / MANIFEST}"
            )


def target_record(path: str | os.PathLike, dtype: str, cfg: Llama4Config) -> dict[str, Any]:
    """The manifest's "target": its identity (path, size), the forward's dtype and the shapes it fixes."""
    return target_identity(path) | {"dtype": dtype, "hidden_size": cfg.hidden_size,
                                    "num_hidden_layers": cfg.num_hidden_layers, "vocab_size": cfg.vocab_size}  # fmt: skip


def data_identity(
    fingerprints: Sequence[str | None],
    target: Mapping[str, Any],
    feature_layers: Sequence[int],
    dtype: str | None,
) -> dict[str, Any]:
    """What train.fit's --resume compares to know it reads the data a run started on (and --eval-dumps, but
    for "samples", to know they score the training data's kind): the samples' fingerprints (one per dump
    directory), the target as `_check_same_dump` compares it, the feature layers and the stored dtype."""
    return {"samples": list(fingerprints), **{f"target.{k}": target.get(k) for k in _SAME_TARGET},
            "feature_layers": list(feature_layers), "dtype": dtype}  # fmt: skip


def check_manifest_totals(directory: Path, m: Mapping[str, Any]) -> None:
    """The manifest's totals (samples, tokens, bytes, shard count) must be those of its shard list, and a
    complete dump's shards must cover its samples in order: an edited or mixed-up manifest is refused."""
    path = directory / MANIFEST
    shards = m.get("shards", [])
    for key in ("samples", "tokens", "bytes"):
        listed = sum(int(e.get(key, 0)) for e in shards)
        if key in m and m[key] != listed:
            raise DumpError(f"{path}: {key} is {m[key]} but its shard list sums to {listed}")
    if not m.get("complete"):
        return
    if len(shards) != m.get("num_shards"):
        raise DumpError(
            f"{path}: complete with num_shards {m.get('num_shards')} but {len(shards)} shards listed"
        )
    first = 0
    for e in shards:
        if e.get("first_sample") != first:
            raise DumpError(
                f"{path}: shard {e.get('file')} starts at sample {e.get('first_sample')}, expected {first}"
            )
        first += int(e["samples"])
    n = (m.get("data") or {}).get("num_samples")
    if n is not None and n != first:
        raise DumpError(f"{path}: data.num_samples is {n} but the shards hold {first} samples")


class DumpDataset:
    """Map-style dataset over a dump directory: item i is sample i as a dict of the stored fields
    (memory-mapped; only the rows of that sample are read).

    Several directories (a list, or one string "a,b") read as one dataset, samples in the order given:
    e.g. the target's own answers plus original ShareGPT text. They must come from the same target
    with the same feature layers and stored dtype; the draft vocabulary and the manifest are the first
    one's (the stored full-vocab argmax and final hidden state serve any vocabulary).

    Refuses an incomplete dump unless `allow_partial` (then only finished shards are visible, and
    item i is the i-th visible sample). `verify` checks every shard's sha256 (reads everything once).
    """

    def __init__(
        self, directory: str | os.PathLike | Sequence[str | os.PathLike], allow_partial: bool = False,
        verify: bool = False,
    ):  # fmt: skip
        if isinstance(directory, str) and "," in directory:
            directory = [d for d in directory.split(",") if d]
        dirs = [Path(d) for d in directory] if isinstance(directory, (list, tuple)) else [Path(directory)]
        if not dirs:
            raise DumpError("no dump directory given")
        self.directory, self.directories = dirs[0], dirs
        self.manifest = read_manifest(self.directory)
        self.shards, fingerprints = [], []
        for d in dirs:
            md = read_manifest(d)
            fingerprints.append((md.get("data") or {}).get("fingerprint"))
            check_manifest_totals(d, md)
            _check_same_dump(self.directory, self.manifest, d, md)
            if not md.get("complete") and not allow_partial:
                raise DumpError(
                    f"{d / MANIFEST}: the dump is incomplete ({len(md.get('shards', []))} of "
                    f"{md['num_shards']} shards); rerun the same python -m train.dump command to finish it"
                )
            self.shards += [_Shard(d / e["file"], e, verify) for e in md.get("shards", [])]
        if not self.shards:
            raise DumpError(f"{', '.join(map(str, dirs))}: no finished shards")
        starts = [0]
        for s in self.shards:
            starts.append(starts[-1] + s.n)
        self._starts = starts
        self.lengths: list[int] = [int(x) for s in self.shards for x in (s.offsets[1:] - s.offsets[:-1])]
        self.feature_layers = tuple(self.manifest["feature_layers"])
        m = self.manifest
        self.identity = data_identity(fingerprints, m.get("target", {}), self.feature_layers, m.get("dtype"))

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(
                f"sample {i} out of range for {len(self)} samples in {', '.join(map(str, self.directories))}"
            )
        i %= len(self)
        lo, hi = 0, len(self.shards) - 1
        while lo < hi:  # the shard holding sample i
            mid = (lo + hi + 1) // 2
            if self._starts[mid] <= i:
                lo = mid
            else:
                hi = mid - 1
        return self.shards[lo].sample(i - self._starts[lo])

    def fetch(self, indices: Sequence[int]) -> list[dict[str, Tensor]]:
        return [self[i] for i in indices]

    def vocab(self) -> tuple[Tensor, Tensor]:
        return load_vocab(self.directory)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)


# ----------------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m train.dump",
        description="Run the target over chat data and store EAGLE-3 training inputs (features, final "
        "hidden states, argmax) as resumable safetensors shards, plus the draft vocabulary.",
    )
    p.add_argument(
        "--out", required=True, type=output_dir, help="dump directory (rerun the same command to resume)"
    )
    p.add_argument("--target", "--gguf", dest="target", default=None, help=TARGET_HELP)
    p.add_argument("--target-dtype", default="bf16", choices=sorted(TARGET_DTYPES),
                   help="dtype of the target forward (bf16: 3-4x faster on AMX CPUs)")  # fmt: skip
    p.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the target runs (under torchrun: each rank's GPU, or the CPU)")  # fmt: skip
    p.add_argument("--dtype", default="bf16", choices=sorted(STORE_DTYPES), help="stored features / hidden")
    p.add_argument(
        "--feature-layers", type=int_list, default=None, help="comma-separated (default 2,L//2,L-3)"
    )
    p.add_argument("--shard-size", type=positive_int, default=256, help="samples per shard")
    p.add_argument("--batch-tokens", type=positive_int, default=4096, help="padded tokens per target forward")
    p.add_argument("--draft-vocab-size", type=positive_int, default=8192)
    add_threads_option(p)
    p.add_argument("--no-progress", action="store_true")
    add_data_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    check_out(Path(args.out))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    from maverick.parallel import init_from_env, load_model

    target_path = Path(args.target) if args.target else default_target_path()
    tokenizer_path = args.tokenizer or str(target_path)
    shard = init_from_env()  # torchrun: the target tensor + expert parallel over the ranks
    rank0 = shard is None or shard.rank == 0  # the rank that writes
    if rank0:
        print(json.dumps({"config": vars(args)}), flush=True)
    samples, train_split, data = chat_samples(args, tokenizer_path)
    model = load_model(shard, TARGET_DTYPES[args.target_dtype], target_path, device=args.device)
    cfg = model.config
    layers = (
        tuple(args.feature_layers) if args.feature_layers else default_feature_layers(cfg.num_hidden_layers)
    )
    check_feature_layers(layers, cfg.num_hidden_layers, "--feature-layers")
    d2t, t2d, coverage = draft_vocab_from(train_split, cfg.vocab_size, args.draft_vocab_size)
    target = target_record(target_path, args.target_dtype, cfg)
    settings = DumpSettings(target, layers, args.dtype, args.max_length, args.shard_size, data)
    m = write_dumps(model, samples, args.out, settings, args.batch_tokens, (d2t, t2d), not args.no_progress)
    if not rank0:
        return {}
    summary = {
        "out": str(Path(args.out).resolve()),
        "ranks": shard.world if shard else 1,
        "complete": m["complete"],
        "samples": m["samples"],
        "tokens": m["tokens"],
        "shards": len(m["shards"]),
        "bytes": m["bytes"],
        "bytes_per_token": m["bytes_per_token"],
        "dump_tokens_per_s": round(m["_run"]["tokens_per_s"] or 0.0, 1),
        "draft_vocab_size": int(d2t.numel()),
        "draft_vocab_coverage": round(coverage, 4),
    }
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    run_cli(main, resume="the same command continues from the shards it finished")
