"""torchrun entry point for tests/test_fit.py: `train.fit` under accelerate's FSDP2, on CPU processes.

accelerate shards a model only on accelerators: on CPU processes an FSDP config falls back to DDP. FSDP2
itself (`fully_shard`, DTensor parameters) runs on gloo, so this turns accelerate's FSDP2 on for the CPU
processes torchrun starts (`FSDP_VERSION=1`: FSDP1's config instead); what an FSDP run does on GPUs
(sharded parameters and optimizer state, gathered checkpoints, held-out forwards in step) then runs here.
It prints how many parameters are sharded."""

import os

import train.fit as fit
from maverick.cli import run_cli

_make_accelerator, _load_optimizer = fit._make_accelerator, fit._Run.load_optimizer


def make_fsdp_accelerator(cfg):
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    acc = _make_accelerator(cfg)
    acc.state.distributed_type = DistributedType.FSDP
    plugin = FullyShardedDataParallelPlugin(fsdp_version=int(os.environ.get("FSDP_VERSION", "2")))
    if acc.state.mixed_precision != "no":  # as accelerate does for an FSDP config (bf16: bf16 compute)
        plugin.set_mixed_precision(acc.state.mixed_precision)
    acc.state.fsdp_plugin = plugin
    return acc


def load_optimizer(run):  # called right after accelerate.prepare
    from torch.distributed.tensor import DTensor

    sharded = sum(isinstance(p, DTensor) for p in run.objective.parameters())
    run.acc.print(f"sharded parameters: {sharded} of {len(list(run.objective.parameters()))}")
    _load_optimizer(run)


fit._make_accelerator, fit._Run.load_optimizer = make_fsdp_accelerator, load_optimizer

if __name__ == "__main__":
    run_cli(fit.main)
