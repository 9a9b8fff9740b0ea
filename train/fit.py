"""Train an EAGLE-3 draft head with the training-time test (TTT) on target hidden-state dumps or online.

One step:
  1. the global batch (`batch_size` samples x processes x `grad_accum`) comes from a seeded, length-
     grouped order that depends only on (seed, epoch), so a resumed run reads exactly the batches an
     uninterrupted one would, whatever the number of processes;
  2. target logits over the draft vocab are rebuilt from the stored final hidden state and the target's
     lm_head rows of the draft vocab (fp32); positions whose stored full-vocab argmax lies outside the
     draft vocab are masked (as `train.ttt.target_draft_logits` defines them, without the 49152-wide head);
  3. the draft is unrolled `ttt_steps` times (train/ttt.py); step i's soft cross-entropy is weighted
     `decay**i`;
  4. AdamW (0.9, 0.95), linear warmup + cosine, gradient clipping at 0.5.

NOTE on the loss normaliser: each unroll step's loss is the sum over valid positions divided by the
number of valid positions in the WHOLE global batch (all processes, all micro-batches), counted before
the forward. `ttt_loss` divides by the local count instead, which makes the update depend on how the
batch is split: two processes averaging their own means differ from one process over the union.
With the global count, 1 process x 4 samples, 2 x 2 and 1 x 2 x (2 accumulation steps) give the same
update (tests/test_fit.py checks it). `ttt_step_sums` reuses `ttt_unroll` and checks itself against
`ttt_loss` in the tests.

Runs on 1 CPU, 1 GPU or many processes through `accelerate` (`accelerate launch` or `torchrun`: DDP;
FSDP2 through an accelerate config with `fsdp_version: 2`, which shards the draft's parameters and
optimizer state: checkpoints gather them, so they are the same files whatever the run's layout, and a run
may resume under another). The draft's embeddings are the target's, frozen and not saved.

Outputs in --out: `train_log.jsonl` (a line per logged step), `checkpoints/step-NNNNNNN/` (the draft in
the EAGLE-3 format + `training_state.pt` with optimizer, scheduler, step, RNG and data position,
written to a temporary name and renamed), `draft/` (the final draft), `curve.png`, tracker logs.
`--resume` continues from the latest checkpoint and ends bit-identical to an uninterrupted run. An --out
that holds an earlier run (a log, checkpoints or a draft) is refused unless `--resume` or `--overwrite`
(which deletes them first): two runs never mix in one directory.

Guards against silent corruption: dump shards are checked against the manifest's sha256 before training
(`--no-verify-dumps` skips the full read), and a step whose loss or gradient norm is not finite stops the
run before the optimizer applies it, with an error naming the step and the last good checkpoint.

Shape legend: B batch, T tokens, H hidden, V target vocab, V' draft vocab, S unroll steps.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle3.draft import NORM_VARIANTS, DraftConfig, Eagle3Draft, load_draft, read_safetensors, save_draft
from eagle3.vocab import grow_draft_vocab
from maverick.cli import (
    ArgumentParser,
    UserError,
    add_threads_option,
    check_output_dir,
    nonnegative_float,
    nonnegative_int,
    output_dir,
    positive_float,
    positive_int,
    read_json_object,
    run_cli,
    share,
)
from maverick.config import Llama4Config
from maverick.files import atomic_dir, atomic_path, atomic_write
from maverick.fp8 import fp8_disabled
from maverick.target import TARGET_DTYPES, default_target_path, load_target_tables, target_identity
from train.dump import DumpDataset
from train.online import OnlineDataset
from train.samples import add_data_args, chat_samples, draft_vocab_from
from train.ttt import TTTBatch, ttt_unroll

log = logging.getLogger(__name__)

STATE_FILE = "training_state.pt"
LOG_FILE = "train_log.jsonl"
# settings a resumed run must share with the run it continues (the rest may change: logging, stops)
RESUME_KEYS = ("steps", "batch_size", "grad_accum", "lr", "warmup", "min_lr_ratio", "weight_decay",
               "grad_clip", "ttt_steps", "decay", "seed", "bf16", "group_by_length", "max_length", "fp8",
               "eagle31")  # fmt: skip


@dataclass
class FitConfig:
    out: str
    dumps: str | None = None  # dump directory (train/dump.py); or online=True
    online: bool = False
    target: str | None = None  # .gguf / HF dir; default: the dumps' target
    steps: int = 1000
    batch_size: int = 4  # samples per process per micro-batch
    grad_accum: int = 1
    lr: float = 1e-4
    warmup: int = 50
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    ttt_steps: int = 7
    decay: float = 0.8
    seed: int = 0
    bf16: bool = True  # bf16 autocast (CPU and GPU); fp32 master weights
    group_by_length: bool = True
    max_length: int | None = None  # cut samples to this many tokens for training
    checkpoint_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 2
    log_every: int = 1
    tracker: str = "wandb"  # none | tensorboard | wandb (offline)
    resume: str | None = None  # "auto" (latest in out/checkpoints) or a checkpoint directory
    stop_after: int | None = None  # stop (with a checkpoint) after this step, for time-boxed sessions
    eval_dumps: str | None = None
    eval_every: int = 0
    fp8: bool = False
    init_std: float = 0.02
    init_draft: str | None = None  # start from this draft (same target and features; its vocabulary)
    new_vocab: bool = False  # with init_draft: the data's vocabulary instead (shared tokens' rows carried)
    eagle31: bool = False  # EAGLE-3.1's norms: one on each aux-layer feature before fc, one on the output
    progress: bool = True
    cpu: bool = False  # train on the CPU even when a GPU is present
    # online mode (no dumps): data and target options as in train/dump.py
    draft_vocab_size: int = 8192
    target_dtype: str = "bf16"
    online_args: dict | None = None
    overwrite: bool = False  # --out may hold an earlier run: delete it first (else refuse unless resume)
    verify_dumps: bool = True  # sha256 of every dump shard against its manifest before training

    def resume_view(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in RESUME_KEYS}


class TrainData(Protocol):
    """What the loop needs from a data source (train.dump.DumpDataset, train.online.OnlineDataset)."""

    lengths: list[int]
    feature_layers: tuple[int, ...]

    def __len__(self) -> int: ...

    def fetch(self, indices: Sequence[int]) -> list[dict[str, Tensor]]: ...


# ----------------------------------------------------------------------------------------------------
# Data order


def epoch_batches(
    lengths: Sequence[int], global_batch: int, seed: int, epoch: int, group_by_length: bool = True
) -> list[list[int]]:
    """The global batches of one epoch, a pure function of (lengths, global_batch, seed, epoch).

    Samples are shuffled; with `group_by_length`, windows of 16 batches are sorted by length first
    (less padding) and the batch order is shuffled again. The last incomplete batch is dropped.
    """
    n = len(lengths)
    if n < global_batch:
        raise UserError(
            f"{n} samples cannot fill one global batch of {global_batch} (--batch-size x --grad-accum x "
            "processes): give more samples or a smaller batch"
        )
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(n, generator=g).tolist()
    if group_by_length:
        window = global_batch * 16
        order = [
            i for w in range(0, n, window) for i in sorted(order[w : w + window], key=lambda i: -lengths[i])
        ]
    batches = [order[b : b + global_batch] for b in range(0, n - global_batch + 1, global_batch)]
    if group_by_length:
        batches = [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]
    return batches


def data_fingerprint(lengths: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(lengths, dtype=np.int64).tobytes()).hexdigest()[:16]


def identity_diff(a: dict[str, Any] | None, b: dict[str, Any] | None, skip: Sequence[str] = ()) -> list[str]:
    """The entries of two data identities (train.dump.data_identity) that differ, as "key A, B" (fingerprints
    cut to 12 characters); an entry either side lacks (None: a dump written before it was recorded, an
    in-memory target) is not compared, nor is anything when a side has no identity (a checkpoint saved before
    it was recorded, a test's data wrapper)."""
    if a is None or b is None:
        return []

    def show(k, v):
        return [x[:12] if isinstance(x, str) else x for x in v] if k == "samples" else v

    return [f"{k} {show(k, a[k])!r}, {show(k, b[k])!r}" for k in a
            if k not in skip and a[k] is not None and b.get(k) is not None and a[k] != b[k]]  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# Batches and the loss


def collate(
    samples: Sequence[dict[str, Tensor]], lm_rows: Tensor, t2d: Tensor, max_length: int | None = None
) -> TTTBatch:
    """Right-pad samples into a TTTBatch. lm_rows [V', H] fp32: the target's lm_head rows of the draft
    vocab; target logits = hidden @ lm_rows.T (fp32), in-vocab = t2d[stored argmax]."""
    lengths = [min(len(s["input_ids"]), max_length or 1 << 30) for s in samples]
    B, T = len(samples), max(lengths)
    F3 = samples[0]["features"].shape[-1]
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    feats = torch.zeros(B, T, F3, dtype=samples[0]["features"].dtype)
    hidden = torch.zeros(B, T, lm_rows.shape[1], dtype=torch.float32)
    argmax = torch.zeros(B, T, dtype=torch.long)
    for b, (s, L) in enumerate(zip(samples, lengths)):
        ids[b, :L] = s["input_ids"][:L].long()
        mask[b, :L] = s["loss_mask"][:L].long()
        valid[b, :L] = True
        feats[b, :L] = s["features"][:L]
        hidden[b, :L] = s["hidden"][:L].float()
        argmax[b, :L] = s["target_argmax"][:L].long()
    dev = lm_rows.device
    logits = hidden.to(dev) @ lm_rows.T  # [B, T, V']
    in_vocab = t2d[argmax.to(dev)] & valid.to(dev)
    return TTTBatch(ids.to(dev), mask.to(dev), feats.to(dev), logits, in_vocab, valid.to(dev))


def step_counts(batch: TTTBatch, steps: int) -> Tensor:
    """[S] valid positions per unroll step (as ttt_loss counts them), known before the forward."""
    T = batch.input_ids.shape[1]
    counts = torch.zeros(steps, dtype=torch.long, device=batch.input_ids.device)
    for i in range(min(steps, T - 1)):
        valid = batch.loss_mask[:, 2 + i :].bool() & batch.target_in_vocab[:, 1 + i : T - 1]
        counts[i] = valid.sum()
    return counts


def ttt_step_sums(
    draft: Eagle3Draft, embed: Callable[[Tensor], Tensor], batch: TTTBatch, steps: int
) -> tuple[Tensor, Tensor]:
    """Per unroll step: (sum of soft cross-entropies over valid positions [S], top-1 agreements [S]).
    Same positions and targets as train.ttt.ttt_loss, left unnormalised (see the module NOTE). Only the
    valid positions go through the draft's lm_head and the loss (prompt tokens and padding do not)."""
    target_p = F.softmax(batch.target_logits.float(), dim=-1)  # [B, T, V']
    target_top = batch.target_logits.max(-1).indices  # [B, T] (first maximum, as argmax; 2x faster on CPU)
    T = target_top.shape[1]
    ce_sums, correct = [], []
    zero = batch.target_logits.new_zeros(())
    unroll = ttt_unroll(
        draft, embed, batch.input_ids, batch.features, steps, batch.attention_valid, hidden=True
    )
    for i, h in unroll:
        n = T - 2 - i  # indices t < n have a token x_{t+2+i} to predict; slices instead of ttt_loss's pads
        valid = batch.loss_mask[:, 2 + i :].bool() & batch.target_in_vocab[:, 1 + i : T - 1]  # [B, n]
        if n <= 0 or not bool(valid.any()):
            ce_sums.append(
                zero + 0 * draft.logits(h[:, :1]).sum()
            )  # keeps every parameter in the graph (DDP)
            correct.append(zero)
            continue
        rows = valid.nonzero(as_tuple=True)
        lg = draft.logits(h[:, :n][rows])  # [N, V'] at the valid positions only
        ce_sums.append(soft_cross_entropy(lg, target_p[:, 1 + i : 1 + i + n][rows]).sum())
        correct.append((lg.max(-1).indices == target_top[:, 1 + i : 1 + i + n][rows]).sum().detach().float())
    while len(ce_sums) < steps:  # sequences shorter than the unroll
        ce_sums.append(zero)
        correct.append(zero)
    return torch.stack(ce_sums), torch.stack(correct)


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: Tensor, p: Tensor) -> Tensor:
        zf = z.float()
        lse = torch.logsumexp(zf, dim=-1)
        ctx.save_for_backward(z, p, lse)
        return lse - (p * zf).sum(-1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        z, p, lse = ctx.saved_tensors
        dz = (torch.exp(z.float() - lse[:, None]) - p) * grad[:, None]
        return dz.to(z.dtype), None


def soft_cross_entropy(logits: Tensor, target_p: Tensor) -> Tensor:
    """Per row -(target_p * log_softmax(logits)).sum(-1) for target rows that sum to 1, as
    logsumexp(z) - (p * z).sum(-1) with gradient softmax(z) - p: in fp32 whatever the logits' dtype, and
    without materialising log_softmax and its backward over [N, V'] (the largest tensors of a step)."""
    return _SoftCrossEntropy.apply(logits, target_p.float())


class TTTObjective(nn.Module):
    """The draft plus its frozen embeddings; forward = per-step sums. This is the module DDP/FSDP wrap,
    so gradient synchronisation hooks on a real forward. The embedding table is a plain attribute, not
    a parameter or buffer: it is never trained, broadcast or saved."""

    def __init__(self, draft: Eagle3Draft, embed_weight: Tensor, steps: int):
        super().__init__()
        self.draft = draft
        self.embed_weight = embed_weight
        self.steps = steps

    def embed(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.embed_weight)

    def forward(self, input_ids, loss_mask, features, target_logits, target_in_vocab, attention_valid):
        batch = TTTBatch(input_ids, loss_mask, features, target_logits, target_in_vocab, attention_valid)
        return ttt_step_sums(self.draft, self.embed, batch, self.steps)


class WarmupCosine:
    """lr multiplier: linear warmup over `warmup` steps, then cosine down to `min_ratio` at `total`.
    A callable object (not a lambda) so LambdaLR's state_dict carries its settings."""

    def __init__(self, warmup: int, total: int, min_ratio: float):
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------------------------------
# Checkpoints


def _rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        # numpy's state as plain values + a tensor, so torch.load(weights_only=True) accepts it
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },  # fmt: skip
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    v, keys, gauss = state["python"]
    random.setstate((v, tuple(keys), gauss))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def is_fsdp(acc) -> bool:
    """Whether accelerate shards the model (an FSDP accelerate config)."""
    from accelerate.utils import DistributedType

    return acc.distributed_type == DistributedType.FSDP


def gathered(t: Tensor) -> Tensor:
    """A tensor whole: an FSDP2 parameter (or its optimizer state) is a DTensor holding this process's
    shard, gathered here. A collective under FSDP: every process calls it, on the same tensors in the
    same order."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state(module: nn.Module) -> dict[str, Tensor]:
    """module.state_dict() with every sharded entry gathered (a collective under FSDP)."""
    return {k: gathered(v) for k, v in module.state_dict().items()}


def plain_draft_state(draft: nn.Module, state: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """The draft's state (or `state`, a full_state of it) in the released format: parameters + d2t/t2d,
    without FP8 scaling buffers."""
    with torch.device("meta"):
        keys = set(Eagle3Draft(draft.config).state_dict())
    return {k: v for k, v in (draft.state_dict() if state is None else state).items() if k in keys}


def save_draft_plain(
    draft: Eagle3Draft,
    path: Path,
    extra_files: dict[str, str] | None = None,
    state: dict[str, Tensor] | None = None,
) -> None:
    """save_draft of the draft's plain weights (an FP8-converted draft saves as a normal one); `state`: its
    full_state, gathered beforehand where the draft is sharded."""
    sd = plain_draft_state(draft, state)
    if state is not None or len(sd) != len(draft.state_dict()):
        with torch.device("meta"):
            plain = Eagle3Draft(draft.config)
        plain.load_state_dict({k: v.detach().cpu() for k, v in sd.items()}, strict=True, assign=True)
        draft = plain
    save_draft(draft, path, extra_files)


def save_checkpoint(
    out: Path,
    step: int,
    draft: Eagle3Draft,
    state: dict[str, Any],
    keep: int,
    weights: dict[str, Tensor] | None = None,
) -> Path:
    """checkpoints/step-NNNNNNN/{draft/, training_state.pt}: written under a temporary name, renamed.
    `weights`: the draft's full_state where it is sharded."""
    root = out / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:07d}"
    with atomic_dir(final, tmp_prefix=f".step-{step:07d}.tmp") as tmp:
        save_draft_plain(draft, tmp / "draft", state=weights)
        torch.save(state, tmp / STATE_FILE)
    done = sorted(p for p in root.glob("step-*") if (p / STATE_FILE).is_file())
    for old in done[: max(0, len(done) - keep)]:
        shutil.rmtree(old)
    return final


RUN_FILES = (LOG_FILE, "checkpoints", "draft", "curve.png")  # what a run leaves in --out


def check_out(cfg: FitConfig) -> list[str]:
    """The earlier run's files in --out that this run would replace (`overwrite`); an --out holding a run
    is refused unless resuming or `overwrite`. Touches nothing, so the CLI checks it before reading data."""
    out = Path(cfg.out)
    check_output_dir(out)  # the CLI's --out type checks it too; train() callers come here
    held = [n for n in RUN_FILES if (out / n).is_file() or (out / n).is_dir() and any((out / n).iterdir())]
    if held and not cfg.resume and not cfg.overwrite:
        raise UserError(
            f"--out {out} holds an earlier run ({', '.join(held)}): pass --resume to continue it, "
            "--overwrite to delete it and start again, or choose another --out"
        )
    return [] if cfg.resume else held


def prepare_out(cfg: FitConfig) -> None:
    """Create --out (`check_out` first); with `overwrite` the earlier run's files are deleted, by the main
    process."""
    out = Path(cfg.out)
    held = check_out(cfg)
    if held and int(os.environ.get("RANK", "0")) == 0:
        for n in held:
            shutil.rmtree(out / n) if (out / n).is_dir() else (out / n).unlink()
    out.mkdir(parents=True, exist_ok=True)


class NonFiniteStep(UserError):
    """A step whose loss or gradient norm is not finite (diverged, or corrupt data)."""


def find_checkpoint(out: Path, resume: str) -> Path | None:
    """resume="auto": the latest complete checkpoint under out/checkpoints (None if there is none)."""
    if resume != "auto":
        p = Path(resume)
        if not (p / STATE_FILE).is_file() or not (p / "draft" / "model.safetensors").is_file():
            raise FileNotFoundError(f"{p}: not a checkpoint (needs {STATE_FILE} and draft/model.safetensors)")
        return p
    root = out / "checkpoints"
    for tmp in root.glob(".step-*.tmp*"):  # left by a run killed while saving
        shutil.rmtree(tmp, ignore_errors=True)
    done = sorted(p for p in root.glob("step-*") if (p / STATE_FILE).is_file())
    return done[-1] if done else None


# ----------------------------------------------------------------------------------------------------
# Training


def _append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _truncate_log(path: Path, step: int, every: int | None = None) -> None:
    """Keep the records of steps <= step (a resumed run logs the later ones again); with `every` (the log
    interval), not a record at `step` itself off that grid (logged only because the run stopped there). A
    last line cut off by a kill is dropped."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append((json.loads(line)["step"], line))
        except (json.JSONDecodeError, KeyError, TypeError):
            if i < len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not a log record") from None
            log.warning("%s: dropped a last line cut off mid-write", path)
    kept = [line for n, line in records if n < step or (n == step and (every is None or n % every == 0))]
    atomic_write(path, "".join(line + "\n" for line in kept))


def _make_accelerator(cfg: FitConfig):
    from accelerate import Accelerator

    log_with = None if cfg.tracker == "none" else cfg.tracker
    if cfg.tracker == "wandb":  # never touch the network
        if os.environ.get("WANDB_MODE") != "disabled":
            os.environ["WANDB_MODE"] = "offline"
        os.environ.setdefault("WANDB_DIR", cfg.out)
        os.environ.setdefault("WANDB_SILENT", "true")
    elif cfg.tracker not in ("none", "tensorboard"):
        raise ValueError(f"--tracker must be none, tensorboard or wandb, got {cfg.tracker!r}")
    return Accelerator(
        mixed_precision="bf16" if cfg.bf16 else "no",
        log_with=log_with,
        project_dir=cfg.out,
        step_scheduler_with_optimizer=False,
        # without a GPU, accelerate only recognises torchrun's processes as MULTI_CPU (gloo) with cpu=True
        cpu=cfg.cpu or not torch.cuda.is_available(),
    )


def build_draft(
    target_cfg: Llama4Config,
    d2t: Tensor,
    t2d: Tensor,
    feature_layers,
    cfg: FitConfig,
    data: TrainData | None = None,
) -> Eagle3Draft:
    variants = dict(EAGLE31) if cfg.eagle31 else {}
    src = load_draft(cfg.init_draft) if cfg.init_draft else None
    if src is not None:  # its norm variants stay (--eagle-3.1 may add to them)
        variants |= {k: True for k in NORM_VARIANTS if getattr(src.config, k)}
    if src is not None and not cfg.new_vocab:  # a continued draft keeps its vocabulary, as in train.stage
        d2t, t2d = src.d2t.cpu(), src.t2d.cpu()
        log.info("%s: its draft vocabulary (%d tokens) is kept", cfg.init_draft, d2t.numel())
    # a continued draft keeps the positions and norms it was trained with (train.stage does too): an outside
    # draft's rope_theta or eps may differ from the target's (SpecForge's Llama-3 configs leave rope_theta out)
    kept = {k: getattr(src.config, k) for k in INIT_KEEPS} if src is not None else {}
    if differ := [k for k in INIT_KEEPS if src is not None and kept[k] != getattr(target_cfg, k)]:
        log.info("%s: its %s kept (the target's differ)", cfg.init_draft, ", ".join(differ))
    dcfg = DraftConfig.for_target(
        target_cfg, draft_vocab_size=int(d2t.numel()), feature_layers=feature_layers, **variants, **kept
    )
    draft = Eagle3Draft(dcfg)
    draft.init_weights(std=cfg.init_std, generator=torch.Generator().manual_seed(cfg.seed))
    draft.set_vocab(d2t, t2d)
    if src is not None:
        first = (
            (lambda: [s["features"] for s in data.fetch(range(min(16, len(data))))])
            if data is not None
            else None
        )
        init_from_draft(draft, cfg.init_draft, first, src)
    if cfg.fp8:
        from maverick.fp8 import Fp8Recipe, convert_to_fp8, default_fp8_filter

        # lm_head stays high precision (its logits feed the softmax); the rest as the default filter says
        convert_to_fp8(draft, Fp8Recipe(), lambda fqn, m: fqn != "lm_head" and default_fp8_filter(fqn, m))
    return draft


# the DraftConfig fields an --init-draft keeps over the target's (for_target's defaults)
INIT_KEEPS = ("rope_theta", "rope_scaling", "rms_norm_eps", "max_position_embeddings")
EAGLE31 = {"fc_norm": True, "norm_output": True}  # the DraftConfig fields of EAGLE-3.1's two norms


def init_from_draft(
    draft: Eagle3Draft,
    path: str,
    features: Callable[[], Sequence[Tensor]] | None = None,
    src: Eagle3Draft | None = None,
) -> None:
    """Copy the weights of a saved draft (continued training on more data). Its shapes and features must be
    the ones this run builds; its vocabulary may differ, in size too (`--new-vocab`): lm_head rows of tokens in
    both vocabularies are carried over, the others keep their fresh initialisation. Its norm variants may differ
    too (an EAGLE-3 draft carried into an EAGLE-3.1 one): norms that only this draft has keep their fresh
    weights (1), except a new fc_norm, which `scale_fc_norms` sets from `features()` (some training samples'
    target features) when given; norms that only the saved one has are dropped, and the log names both.
    src: the draft at `path`, when the caller has loaded it already."""
    src = load_draft(path) if src is None else src
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "vocab_size", "target_hidden_size", "feature_layers"):  # fmt: skip
        mine, theirs = getattr(draft.config, name), getattr(src.config, name)
        if mine != theirs:
            raise UserError(f"{path}: draft config {name}={theirs!r}, this run needs {mine!r}")
    dev = draft.d2t.device
    state = {k: v.to(dev) for k, v in src.state_dict().items() if k not in ("d2t", "t2d", "lm_head.weight")}
    mine = set(draft.state_dict()) - {"d2t", "t2d", "lm_head.weight"}
    fresh, dropped = sorted(mine - set(state)), sorted(set(state) - mine)
    if fresh or dropped:
        log.info("%s: its norm variants differ from this draft's: fresh %s; dropped %s",
                 path, fresh, dropped)  # fmt: skip
    draft.load_state_dict({k: v for k, v in state.items() if k in mine}, strict=False)
    with torch.no_grad():
        shared = carry_head_rows(src, draft)
    log.info("%s: weights carried over; lm_head rows shared by both vocabularies: %d of %d",
                path, int(shared.sum()), draft.config.draft_vocab_size)  # fmt: skip
    if features is not None and any(k.startswith("fc_norm.") for k in fresh):
        scale_fc_norms(draft, features())


def carry_head_rows(src: Eagle3Draft, draft: Eagle3Draft) -> Tensor:
    """Copy src's lm_head row of each target token that both drafts have into draft's row of that token,
    matched by target id (a draft's ids need not be in target-id order). Returns [draft vocab] bool: the
    rows copied; the others are left as they are."""
    src_row = torch.full((draft.config.vocab_size,), -1, dtype=torch.long)  # target id -> row of src
    src_row[src.draft_to_target_ids.cpu()] = torch.arange(src.config.draft_vocab_size)
    rows = src_row[draft.draft_to_target_ids.cpu()]  # [V'] row of src for each of our draft ids, or -1
    shared = rows >= 0
    w = draft.lm_head.weight
    w[shared.to(w.device)] = src.lm_head.weight[rows[shared].to(src.lm_head.weight.device)].to(w)
    return shared


def grow_vocab(src: Eagle3Draft, counts: Tensor, draft_vocab_size: int) -> Eagle3Draft:
    """`src` with a larger draft vocabulary: every token it had, then the most frequent others of `counts`
    [V] (assistant tokens of the training data) up to draft_vocab_size (eagle3.vocab.grow_draft_vocab).
    Every weight is src's; the new tokens' lm_head rows start at zero, so their logits start at 0 and the
    draft proposes one only where all its old logits are negative, until training moves them."""
    d2t, t2d = grow_draft_vocab(src.t2d.cpu(), counts.cpu(), draft_vocab_size)
    draft = Eagle3Draft(dataclasses.replace(src.config, draft_vocab_size=draft_vocab_size))
    draft = draft.to(device=src.d2t.device, dtype=src.lm_head.weight.dtype)
    state = {k: v for k, v in src.state_dict().items() if k not in ("d2t", "t2d", "lm_head.weight")}
    draft.load_state_dict(state, strict=False)
    draft.set_vocab(d2t, t2d)
    with torch.no_grad():
        draft.lm_head.weight.zero_()
        carry_head_rows(src, draft)
    log.info("draft vocabulary grown from %d to %d tokens (new lm_head rows at zero)",
             src.config.draft_vocab_size, draft_vocab_size)  # fmt: skip
    return draft


def scale_fc_norms(draft: Eagle3Draft, features: Sequence[Tensor]) -> None:
    """A carried draft's new fc_norm (its fc learnt the raw features): each aux layer's norm weight starts at
    the median RMS of that layer's features over these samples [.., n*H_target], so fc sees inputs at the
    scale it was trained on. The median, not the mean: an attention sink's features (SmolLM2: RMS ~1,000
    at the first position against a median of ~20 in the mid layer) are what the norm is there to tame.
    Measured on SmolLM2 with the shipped draft: see docs/results.md (2026-12-06, EAGLE-3.1)."""
    x = torch.cat([f.reshape(-1, f.shape[-1]).float().cpu() for f in features])
    with torch.no_grad():
        for norm, part in zip(draft.fc_norm, x.chunk(len(draft.fc_norm), -1)):
            norm.weight.fill_(float(part.pow(2).mean(-1).sqrt().median()))


def train(
    cfg: FitConfig,
    data: TrainData,
    vocab: tuple[Tensor, Tensor],
    embed_weight: Tensor,
    lm_head_weight: Tensor,
    target_cfg: Llama4Config,
    eval_data: TrainData | None = None,
    step_callback: Callable[[int, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The training loop (see the module docstring). Returns the summary that the CLI prints.

    `step_callback(step, record)` runs after every optimizer step (e.g. to watch progress; an exception
    there stops the run like a crash would, without a checkpoint)."""
    if eval_data is not None:
        check_eval_data(data, eval_data)
    if cfg.warmup >= cfg.steps:  # the README's 20-step try with the default 50 trained at 4e-5 of 1e-4, acc 0
        reached = cfg.lr * cfg.steps / max(cfg.warmup, 1)  # WarmupCosine at the last step
        log.warning("--warmup %d >= --steps %d: the learning rate never leaves its warmup (it reaches %.2g of "
                    "--lr %g); give a shorter --warmup", cfg.warmup, cfg.steps, reached, cfg.lr)  # fmt: skip
    prepare_out(cfg)
    acc = _make_accelerator(cfg)
    try:
        return _train(
            acc, cfg, data, vocab, embed_weight, lm_head_weight, target_cfg, eval_data, step_callback
        )
    finally:
        acc.end_training()  # trackers, and the process group (gloo aborts at exit without it)
        # accelerate keeps its state in process-wide singletons: drop them so that another train() in
        # this process (tests, notebooks) may choose other settings
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def check_eval_data(data: TrainData, eval_data: TrainData) -> None:
    """Held-out dumps must be what the training data is (as dump directories read together: the same target,
    feature layers and stored dtype): others were scored, a number that means nothing, every --eval-every."""
    diff = identity_diff(
        getattr(eval_data, "identity", None), getattr(data, "identity", None), skip=("samples",)
    )
    if diff:
        where = ",".join(map(str, getattr(eval_data, "directories", []))) or "the held-out data"
        raise UserError(
            f"--eval-dumps {where}: not dumps of the training data's target and features ({'; '.join(diff)}: "
            "held-out, training); dump them with the training data's --target, --target-dtype, --feature-layers "
            "and --dtype"
        )


class _Run:
    """One training run's state, in named stages: `restore` (a checkpoint), `step` (one optimizer step
    -> its log record), `checkpoint`, `finish` (final draft, curve, summary)."""

    def __init__(self, acc, cfg: FitConfig, data: TrainData, vocab, embed_weight, lm_head_weight, target_cfg):
        self.acc, self.cfg, self.data = acc, cfg, data
        self.out = Path(cfg.out)
        self.log_path = self.out / LOG_FILE
        dev = acc.device
        self.draft = build_draft(target_cfg, vocab[0], vocab[1], data.feature_layers, cfg, data)
        self.objective = TTTObjective(self.draft, embed_weight.to(dev), cfg.ttt_steps).to(dev)
        self.optimizer = torch.optim.AdamW(
            self.draft.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay, eps=1e-8
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, WarmupCosine(cfg.warmup, cfg.steps, cfg.min_lr_ratio)
        )
        self.lm_rows = lm_head_weight[self.draft.draft_to_target_ids.cpu()].float().to(dev)  # [V', H]
        self.t2d = self.draft.t2d.to(dev)
        self.decay = torch.tensor([cfg.decay**i for i in range(cfg.ttt_steps)], device=dev)
        self.global_batch = cfg.batch_size * acc.num_processes * cfg.grad_accum
        self.per_epoch = len(epoch_batches(data.lengths, self.global_batch, cfg.seed, 0, cfg.group_by_length))
        self.fingerprint = data_fingerprint(data.lengths)
        # DumpDataset's or OnlineDataset's (train.dump.data_identity); a test's wrapper may have none
        self.identity = getattr(data, "identity", None)
        self._batches: tuple[int, list[list[int]]] = (-1, [])
        self.fp8_sync = None
        fsdp = is_fsdp(acc)
        if fsdp and not acc.is_fsdp2:
            raise UserError(
                "train.fit shards the draft with FSDP2 only: set fsdp_version: 2 in the accelerate config"
            )
        if fsdp and cfg.fp8:
            raise UserError("--fp8 is not supported under FSDP: train FP8 drafts under DDP (no FSDP config)")
        self.optimizer_state: dict[str, Any] | None = None  # a checkpoint's, loaded after accelerate.prepare
        if cfg.fp8:
            from maverick.fp8 import sync_float8_amax_and_scale_history

            self.fp8_sync = sync_float8_amax_and_scale_history

    # ---- checkpoints ----
    def restore(self, ck: Path) -> int:
        """Load a checkpoint (before `accelerate.prepare`); returns its step."""
        try:
            state = torch.load(ck / STATE_FILE, map_location="cpu", weights_only=True)
        except (RuntimeError, OSError, EOFError) as exc:  # cut short by a full disk or a copy
            raise UserError(f"{ck / STATE_FILE}: a truncated or corrupt checkpoint ({exc}); delete {ck} "
                            "to resume from the one before it") from None  # fmt: skip
        saved = state["config"]
        # a key newer than the checkpoint reads as its default (a run saved before `eagle31` existed had none)
        was = {k: saved.get(k, FitConfig.__dataclass_fields__[k].default) for k in RESUME_KEYS}
        diff = {k: (was[k], v) for k, v in self.cfg.resume_view().items() if was[k] != v}
        if diff:
            raise UserError(f"{ck / STATE_FILE}: cannot resume with different settings (saved, now): {diff}")
        if (
            state["data"]["fingerprint"] != self.fingerprint
            or state["data"]["world_batch"] != self.global_batch
        ):
            raise UserError(
                f"{ck / STATE_FILE}: the checkpoint was trained on other data or another global batch"
            )
        # the lengths alone let other data of the same samples through (another target, its dtype): a checkpoint
        # saved since "identity" was recorded names what differs (an older one has none: not compared)
        diff = identity_diff(state["data"].get("identity"), self.identity)
        if diff:
            raise UserError(
                f"{ck / STATE_FILE}: the checkpoint was trained on other data ({'; '.join(diff)}: saved, now); "
                "resume on the data the run was started with"
            )
        sd = read_safetensors(ck / "draft" / "model.safetensors")  # a corrupt one: a UserError naming it
        if not torch.equal(sd["d2t"], self.draft.d2t.cpu()):
            raise UserError(
                f"{ck}: its draft vocabulary is not this run's (an --init-draft run keeps the init draft's "
                "vocabulary unless --new-vocab; resume with the setting the run was started with)"
            )
        # the architecture too: an --init-draft's norm variants (norm_before_residual and norm_output have no
        # tensor) come from that draft, so a resume without it would build, and train, another draft
        cf = ck / "draft" / "config.json"
        saved_cfg = DraftConfig.from_hf_dict(read_json_object(cf), str(cf))
        differ = [f"{f.name}={getattr(saved_cfg, f.name)!r} there, {getattr(self.draft.config, f.name)!r} now"
                  for f in dataclasses.fields(DraftConfig)
                  if f.compare and getattr(saved_cfg, f.name) != getattr(self.draft.config, f.name)]  # fmt: skip
        if differ:
            raise UserError(
                f"{cf}: the checkpoint's draft is not the one this run builds ({'; '.join(differ)}); resume "
                "with the --init-draft (and --eagle-3.1) the run was started with"
            )
        try:
            self.draft.load_state_dict({**sd, **state.get("fp8_buffers", {})}, strict=True)
        except RuntimeError as exc:  # same config, other tensors: a checkpoint edited or mixed up by hand
            why = str(exc).strip().splitlines()[-1].strip()
            raise UserError(
                f"{ck / 'draft'}: its weights do not fit the draft of its config.json ({why})"
            ) from None
        self.optimizer_state = state["optimizer"]
        self.scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
        return int(state["step"])

    def load_optimizer(self) -> None:
        """The restored checkpoint's optimizer state, after `accelerate.prepare`: FSDP2 replaces the
        parameters by sharded ones (and a state loaded before would stay keyed to the old ones), so each
        full state tensor is cut to this process's shard of its parameter here."""
        if self.optimizer_state is None:
            return
        from torch.distributed.tensor import DTensor, distribute_tensor

        sd, self.optimizer_state = self.optimizer_state, None
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for i, st in sd["state"].items():
            p = params[i]
            if isinstance(p, DTensor):  # every process holds the whole tensor: no communication
                st.update({k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
                           for k, v in st.items() if k != "step"})  # fmt: skip
        self.optimizer.load_state_dict(sd)

    def state(self, step: int) -> dict[str, Any]:
        """The training state for a checkpoint, the same whether the run is sharded or not (a collective
        under FSDP: every process calls it)."""
        plain = plain_draft_state(self.draft)
        optimizer = self.optimizer.state_dict()
        optimizer["state"] = {
            i: {k: gathered(v) for k, v in st.items()} for i, st in optimizer["state"].items()
        }
        return {
            "step": step,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict(),
            "rng": _rng_state(),
            "data": {
                "epoch": step // self.per_epoch,
                "position": step % self.per_epoch,
                "seed": self.cfg.seed,
                "fingerprint": self.fingerprint,
                "world_batch": self.global_batch,
                **({"identity": self.identity} if self.identity is not None else {}),
            },  # fmt: skip
            "config": self.cfg.resume_view(),
            "fp8_buffers": {k: v for k, v in self.draft.state_dict().items() if k not in plain},
        }

    def checkpoint(self, step: int) -> None:
        state, weights = self.state(step), full_state(self.draft)  # gathered by every process under FSDP
        if self.acc.is_main_process:
            path = save_checkpoint(self.out, step, self.draft, state, self.cfg.keep_checkpoints, weights)
            self.acc.print(f"checkpoint {path}")
        self.acc.wait_for_everyone()

    # ---- one step ----
    def micro_batches(self, step: int) -> list[TTTBatch]:
        """This process's micro-batches of global batch `step` (a pure function of the step)."""
        cfg, world, rank = self.cfg, self.acc.num_processes, self.acc.process_index
        epoch, pos = divmod(step, self.per_epoch)
        if self._batches[0] != epoch:
            self._batches = (
                epoch,
                epoch_batches(self.data.lengths, self.global_batch, cfg.seed, epoch, cfg.group_by_length),
            )
        gb = self._batches[1][pos]
        bs = cfg.batch_size
        micro = [gb[(m * world + rank) * bs : (m * world + rank + 1) * bs] for m in range(cfg.grad_accum)]
        return [collate(self.data.fetch(ix), self.lm_rows, self.t2d, cfg.max_length) for ix in micro]

    def step(self, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        acc, cfg = self.acc, self.cfg
        mbs = self.micro_batches(step)
        counts = acc.reduce(sum(step_counts(b, cfg.ttt_steps) for b in mbs), reduction="sum")  # [S] global
        norm = self.decay / counts.clamp(min=1).float() * acc.num_processes  # DDP averages over processes
        sums = torch.zeros(2, cfg.ttt_steps, device=acc.device)  # (ce, correct) per unroll step
        for m, b in enumerate(mbs):
            args = (
                b.input_ids,
                b.loss_mask,
                b.features,
                b.target_logits,
                b.target_in_vocab,
                b.attention_valid,
            )
            sync = m == len(mbs) - 1  # all-reduce gradients once, on the last micro-batch
            with contextlib.nullcontext() if sync else acc.no_sync(self.objective):
                ce, correct = self.objective(*args)
                acc.backward((ce * norm).sum())
            sums += torch.stack((ce.detach().float(), correct))
        grad_norm = acc.clip_grad_norm_(self.objective.parameters(), cfg.grad_clip)
        sums = acc.reduce(sums, reduction="sum")  # the same on every process, so all stop together
        if not (torch.isfinite(sums[0]).all() and torch.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteStep(
                f"step {step + 1}: loss {(sums[0] / counts.clamp(min=1)).tolist()} (per unroll step), "
                f"gradient norm {float(grad_norm)}: not finite"
            )
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.fp8_sync is not None:
            self.fp8_sync(self.draft)

        n_tok = int(acc.reduce(sum(b.attention_valid.sum() for b in mbs), reduction="sum"))
        dt = time.perf_counter() - t0
        c = counts.clamp(min=1).float()
        loss_i, acc_i = (sums[0] / c).tolist(), (sums[1] / c).tolist()
        return {
            "step": step + 1,
            "loss": float(sum(cfg.decay**i * v for i, v in enumerate(loss_i))),
            "loss_i": [round(v, 5) for v in loss_i],
            "acc_i": [round(v, 5) for v in acc_i],
            "count_i": counts.tolist(),
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens": n_tok,
            "step_s": round(dt, 4),
            "tokens_per_s": round(n_tok / dt, 1),
            "epoch": step // self.per_epoch,
        }

    def log(self, record: dict[str, Any]) -> None:
        if not self.acc.is_main_process:
            return
        _append_jsonl(self.log_path, record)
        if self.cfg.tracker != "none":
            flat = {k: record[k] for k in ("loss", "lr", "grad_norm", "tokens_per_s")}
            for name in ("loss", "acc", "eval_loss", "eval_acc"):
                flat |= {f"{name}_{i}": v for i, v in enumerate(record.get(f"{name}_i", []))}
            self.acc.log(flat, step=record["step"])

    # ---- the end ----
    def finish(self, start: int, last: int, tokens: int, elapsed: float) -> dict[str, Any]:
        cfg = self.cfg
        summary: dict[str, Any] = {"out": str(self.out.resolve()), "step": last, "steps": cfg.steps,
                                   "processes": self.acc.num_processes}  # fmt: skip
        weights = full_state(self.draft) if last >= cfg.steps else None  # every process, under FSDP
        if not self.acc.is_main_process:
            return summary
        recs = (
            [json.loads(x) for x in self.log_path.read_text().splitlines()] if self.log_path.exists() else []
        )
        final = recs[-1] if recs else {}
        summary |= {
            "loss": final.get("loss"),
            "acc_i": final.get("acc_i"),
            "tokens_per_s": round(tokens / elapsed, 1) if elapsed > 0 else None,
            "step_s": round(elapsed / max(1, last - start), 4),
            "bf16": cfg.bf16,
        }
        if last >= cfg.steps:
            info = json.dumps({"config": dataclasses.asdict(cfg), "summary": summary}, indent=2)
            save_draft_plain(self.draft, self.out / "draft", {"training.json": info}, weights)
            summary["draft"] = str((self.out / "draft").resolve())
        if recs:
            plot_curves(recs, self.out / "curve.png")
        return summary


def _train(acc, cfg, data, vocab, embed_weight, lm_head_weight, target_cfg, eval_data, step_callback):
    run = _Run(acc, cfg, data, vocab, embed_weight, lm_head_weight, target_cfg)
    start = 0
    ck = find_checkpoint(run.out, cfg.resume) if cfg.resume else None
    if cfg.resume and ck is None:
        acc.print(f"no checkpoint under {run.out / 'checkpoints'}; starting from step 0")
    if ck is not None:
        start = run.restore(ck)
        acc.print(f"resumed from {ck} at step {start}")
        if acc.is_main_process:
            _truncate_log(run.log_path, start, cfg.log_every if start < cfg.steps else None)
    elif acc.is_main_process and run.log_path.exists():
        run.log_path.unlink()
    run.objective, run.optimizer = acc.prepare(run.objective, run.optimizer)
    run.load_optimizer()
    if cfg.tracker != "none":
        acc.init_trackers("eagle3-draft", config={k: (v if isinstance(v, int | float | str | bool) else str(v))
                                                  for k, v in dataclasses.asdict(cfg).items()})  # fmt: skip
    bar = None
    if cfg.progress and acc.is_main_process:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc="fit", dynamic_ncols=True)
    stop = min(cfg.steps, cfg.stop_after) if cfg.stop_after is not None else cfg.steps
    last, tokens, t_run = start, 0, time.perf_counter()
    for step in range(start, stop):
        try:
            record = run.step(step)
        except NonFiniteStep as exc:
            if bar is not None:
                bar.close()
            good = find_checkpoint(run.out, "auto")
            kept = f"the last good checkpoint is {good}" if good else "no checkpoint was written before it"
            raise NonFiniteStep(
                f"{exc}; stopped before applying it ({kept}; nothing was saved after it). Check the data "
                "(dumps: drop --no-verify-dumps) or lower --lr, then --resume"
            ) from exc
        last, tokens = step + 1, tokens + record["tokens"]
        if eval_data is not None and cfg.eval_every and (last % cfg.eval_every == 0 or last == cfg.steps):
            # FP8 drafts are scored in high precision (what is saved and served), and their delayed scaling
            # does not take the held-out activations' amaxes into the training scales
            with fp8_disabled(run.draft) if cfg.fp8 else contextlib.nullcontext():
                record |= evaluate(run.objective, eval_data, run.lm_rows, run.t2d, cfg, acc)
        if last % cfg.log_every == 0 or last == stop:
            run.log(record)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", acc0=f"{record['acc_i'][0]:.3f}",
                            tok_s=f"{record['tokens_per_s']:.0f}")  # fmt: skip
        if step_callback is not None:
            step_callback(last, record)
        if cfg.checkpoint_every and last % cfg.checkpoint_every == 0 and last < stop:
            run.checkpoint(last)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t_run
    if last > start or ck is None:
        run.checkpoint(last)
    summary = run.finish(start, last, tokens, elapsed)
    acc.wait_for_everyone()
    return summary


@torch.no_grad()
def evaluate(objective, data: TrainData, lm_rows: Tensor, t2d: Tensor, cfg: FitConfig, acc) -> dict[str, Any]:
    """Per-step loss and top-1 agreement on held-out dumps (each process takes every world-th batch)."""
    objective.eval()
    S = cfg.ttt_steps
    sums = torch.zeros(3, S, device=acc.device)
    order = sorted(range(len(data)), key=lambda i: -data.lengths[i])
    chunks = [order[i : i + cfg.batch_size] for i in range(0, len(order), cfg.batch_size)]
    mine = chunks[acc.process_index :: acc.num_processes]
    # under FSDP every forward gathers the weights with every process: all run the same number of forwards
    # (a process out of chunks runs the first one again and does not count it)
    rounds = -(-len(chunks) // acc.num_processes) if is_fsdp(acc) else len(mine)
    for r in range(rounds):
        ix = mine[r] if r < len(mine) else chunks[0]
        b = collate(data.fetch(ix), lm_rows, t2d, cfg.max_length)
        with acc.autocast():
            ce, correct = acc.unwrap_model(objective)(b.input_ids, b.loss_mask, b.features, b.target_logits,
                                                      b.target_in_vocab, b.attention_valid)  # fmt: skip
        if r < len(mine):
            sums += torch.stack((ce.float(), correct, step_counts(b, S).float()))
    sums = acc.reduce(sums, reduction="sum")
    objective.train()
    c = sums[2].clamp(min=1)
    loss_i, acc_i = (sums[0] / c).tolist(), (sums[1] / c).tolist()
    return {
        "eval_loss": float(sum(cfg.decay**i * v for i, v in enumerate(loss_i))),
        "eval_loss_i": [round(v, 5) for v in loss_i],
        "eval_acc_i": [round(v, 5) for v in acc_i],
    }


def plot_curves(records: Sequence[dict[str, Any]], path: Path) -> None:
    """curve.png: loss and top-1 agreement per unroll step against the step (atomic write). Drawn on an
    Agg canvas of its own, not through pyplot, as eval/plots.py draws: switching pyplot's backend would
    leave a notebook that trains here showing no later plot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = [r["step"] for r in records]
    S = len(records[0]["loss_i"])
    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    ax_l, ax_a = fig.subplots(1, 2)
    for i in range(S):
        ax_l.plot(steps, [r["loss_i"][i] for r in records], label=f"step {i}", lw=1)
        ax_a.plot(steps, [r["acc_i"][i] for r in records], label=f"step {i}", lw=1)
    if any("eval_acc_i" in r for r in records):
        ev = [r for r in records if "eval_acc_i" in r]
        ax_a.plot(
            [r["step"] for r in ev], [r["eval_acc_i"][0] for r in ev], "k--o", ms=3, label="held-out step 0"
        )
    ax_l.set(xlabel="optimizer step", ylabel="soft cross-entropy", title="loss per unroll step")
    ax_a.set(xlabel="optimizer step", ylabel="top-1 agreement", title="acc per unroll step", ylim=(0, 1))
    ax_a.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")


# ----------------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m train.fit",
        description="Train an EAGLE-3 draft head with the training-time test on hidden-state dumps "
        "(python -m train.dump) or online from the target. Multi-process: accelerate launch / torchrun.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--dumps",
        help="dump directory made by python -m train.dump; several: A,B (one dataset, A's draft vocabulary)",
    )
    src.add_argument("--online", action="store_true", help="run the target on the fly (data options below)")
    p.add_argument(
        "--out", required=True, type=output_dir, help="output directory (log, checkpoints, draft, curve.png)"
    )
    p.add_argument("--target", "--gguf", dest="target", default=None, help="target: a llama .gguf file or an HF checkpoint directory "
                   "(default: the one the dumps name; online: SmolLM2-135M-Instruct GGUF)")  # fmt: skip
    p.add_argument("--steps", type=positive_int, default=1000)
    p.add_argument("--batch-size", type=positive_int, default=4, help="samples per process per micro-batch")
    p.add_argument("--grad-accum", type=positive_int, default=1)
    p.add_argument("--lr", type=positive_float, default=1e-4)
    p.add_argument("--warmup", type=nonnegative_int, default=50, help="linear warmup steps, then cosine")
    p.add_argument("--min-lr-ratio", type=share, default=0.0)
    p.add_argument("--weight-decay", type=nonnegative_float, default=0.0)
    p.add_argument("--grad-clip", type=positive_float, default=0.5)
    p.add_argument("--ttt-steps", type=positive_int, default=7, help="training-time-test unroll steps")
    p.add_argument(
        "--decay", type=nonnegative_float, default=0.8, help="loss weight of unroll step i: decay**i"
    )
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="bf16 autocast or fp32")
    p.add_argument("--no-group-by-length", action="store_true")
    p.add_argument("--checkpoint-every", type=nonnegative_int, default=0)
    p.add_argument("--keep-checkpoints", type=positive_int, default=2)
    p.add_argument("--log-every", type=positive_int, default=1)
    p.add_argument("--tracker", choices=("none", "tensorboard", "wandb"), default="wandb",
                   help="wandb runs offline (never the network)")  # fmt: skip
    p.add_argument("--overwrite", action="store_true",
                   help="--out holds an earlier run: delete its log, checkpoints and draft first (else refused)")  # fmt: skip
    p.add_argument("--no-verify-dumps", action="store_true",
                   help="skip the sha256 check of every dump shard before training (reads all the dumps once)")  # fmt: skip
    p.add_argument("--resume", nargs="?", const="auto", default=None,
                   help="continue from the latest checkpoint in --out (or the given checkpoint directory)")  # fmt: skip
    p.add_argument(
        "--stop-after", type=positive_int, default=None, help="stop after this step (checkpointed)"
    )
    p.add_argument("--eval-dumps", default=None, help="held-out dumps scored every --eval-every steps")
    p.add_argument("--eval-every", type=positive_int, default=None, help="with --eval-dumps: score them every "
                   "N steps and at the end")  # fmt: skip
    p.add_argument(
        "--fp8", action="store_true", help="FP8 (maverick.fp8) for the draft's linears except lm_head"
    )
    p.add_argument("--init-std", type=positive_float, default=0.02)
    p.add_argument("--eagle-3.1", dest="eagle31", action="store_true",
                   help="EAGLE-3.1's norms (each aux-layer feature before fc, the output): a current vLLM "
                   "serves such a draft, SGLang does not (eagle3/draft.py NORM_VARIANTS)")  # fmt: skip
    p.add_argument("--init-draft", default=None,
                   help="start from this saved draft (same features; its vocabulary) instead of random weights")  # fmt: skip
    p.add_argument("--new-vocab", action="store_true",
                   help="with --init-draft: the data's draft vocabulary, not the init draft's (lm_head rows of "
                   "tokens in both are carried, the others start fresh)")  # fmt: skip
    add_threads_option(p)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--cpu", action="store_true", help="train on the CPU even when a GPU is present")
    g = p.add_argument_group("online mode")
    g.add_argument("--draft-vocab-size", type=positive_int, default=8192)
    g.add_argument("--target-dtype", default="bf16", choices=sorted(TARGET_DTYPES))
    add_data_args(p, max_length_default=None)  # --max-length: dumps are cut to it; online default 1024
    # the --online options default to None here, so that one given with --dumps is seen (and refused);
    # config_from_args gives them their defaults
    p.set_defaults(online_defaults={k: p.get_default(k) for k in ONLINE_ONLY}, **dict.fromkeys(ONLINE_ONLY))
    return p


# the data options of --online (FitConfig.online_args), and every option only --online reads (the dumps fix
# their data, target dtype and vocabulary)
ONLINE_DATA = ("data", "split", "max_samples", "max_conversations", "heldout_fraction", "split_seed",
               "cache_dir", "tokenizer")  # fmt: skip
ONLINE_ONLY = ("draft_vocab_size", "target_dtype", *ONLINE_DATA)


def check_options(args: argparse.Namespace) -> None:
    """Options that this combination would ignore, refused (a run that silently did without them)."""
    if args.new_vocab and not args.init_draft:
        raise UserError("--new-vocab replaces an --init-draft's vocabulary (a fresh draft has the data's)")
    if args.eval_every is not None and not args.eval_dumps:
        raise UserError("--eval-every scores --eval-dumps: give them, or drop --eval-every")
    if args.eval_dumps and args.eval_every is None:
        raise UserError("--eval-dumps are scored every --eval-every N steps: give it")
    given = ["--" + k.replace("_", "-") for k in ONLINE_ONLY if getattr(args, k) is not None]
    if args.dumps and given:
        raise UserError(f"{', '.join(given)}: --online options, not read with --dumps (a dump fixes its data, "
                        "target dtype and vocabulary: python -m train.dump takes them)")  # fmt: skip


def config_from_args(args: argparse.Namespace) -> FitConfig:
    check_options(args)
    args = argparse.Namespace(**vars(args) | {k: args.online_defaults[k] for k in ONLINE_ONLY
                                               if getattr(args, k) is None})  # fmt: skip
    return FitConfig(
        out=args.out, dumps=args.dumps, online=args.online, target=args.target, steps=args.steps,
        batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr, warmup=args.warmup,
        min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        ttt_steps=args.ttt_steps, decay=args.decay, seed=args.seed, bf16=args.precision == "bf16",
        group_by_length=not args.no_group_by_length, max_length=args.max_length if args.dumps else None,
        checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints, log_every=args.log_every,
        tracker=args.tracker, resume=args.resume, stop_after=args.stop_after, eval_dumps=args.eval_dumps,
        eval_every=args.eval_every or 0, fp8=args.fp8, init_std=args.init_std, init_draft=args.init_draft, new_vocab=args.new_vocab, eagle31=args.eagle31, progress=not args.no_progress, cpu=args.cpu,
        draft_vocab_size=args.draft_vocab_size, target_dtype=args.target_dtype,
        online_args={k: getattr(args, k) for k in ONLINE_DATA} | {"max_length": args.max_length or 1024} if args.online else None,
        overwrite=args.overwrite, verify_dumps=not args.no_verify_dumps,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = config_from_args(args)
    check_out(cfg)  # before the dumps' sha256 pass, which can take minutes
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"config": dataclasses.asdict(cfg)}), flush=True)
    if cfg.dumps and cfg.verify_dumps and int(os.environ.get("RANK", "0")) == 0:
        print(
            "checking every dump shard's sha256 against its manifest (--no-verify-dumps skips it)", flush=True
        )
    eval_data = DumpDataset(cfg.eval_dumps, verify=cfg.verify_dumps) if cfg.eval_dumps else None
    if cfg.dumps:
        data = DumpDataset(cfg.dumps, verify=cfg.verify_dumps)
        target = data.manifest["target"]
        target_path = cfg.target or target.get("path")
        dtype = TARGET_DTYPES.get(target.get("dtype", "fp32"), torch.float32)
        embed, head, tcfg = load_target_tables(target_path, dtype)
        if cfg.target is None and "size" in target:
            if target_identity(target_path)["size"] != target["size"]:
                raise UserError(
                    f"{target_path}: size differs from the one recorded in {data.directory}/manifest.json"
                )
        vocab = data.vocab()
    else:
        target_path = Path(cfg.target) if cfg.target else default_target_path()
        ns = argparse.Namespace(**cfg.online_args)
        samples, train_split, _ = chat_samples(ns, ns.tokenizer or str(target_path))
        gpu = torch.cuda.is_available() and not cfg.cpu
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if gpu else "cpu"  # accelerate's device
        data = OnlineDataset.from_path(target_path, samples, TARGET_DTYPES[cfg.target_dtype], device=device)
        embed, head, tcfg = data.embed_weight, data.lm_head_weight, data.model.config
        d2t, t2d, _ = draft_vocab_from(train_split, tcfg.vocab_size, cfg.draft_vocab_size)
        vocab = (d2t, t2d)
    summary = train(cfg, data, vocab, embed, head, tcfg, eval_data=eval_data)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    run_cli(
        main,
        resume="with --checkpoint-every, the same command with --resume continues from the last checkpoint",
    )
