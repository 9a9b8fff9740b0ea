"""Online training data: the dump fields computed from the target on the fly, no disk.

`OnlineDataset` has the interface of `train.dump.DumpDataset` (len, `lengths`, `feature_layers`, item
i -> the dict of stored fields, `fetch(indices)`), and produces the same values in the same dtypes:
it calls the same `run_target`, so `python -m train.fit --online` trains on exactly what a dump of the
same samples would hold (up to batch-composition rounding of the target's matmuls). `fetch` runs one
batched target forward per call, which is what the training loop asks for per micro-batch.

Why map-style and not an iterator over a stream: the loop's data order is a pure function of
(seed, epoch, step), so resuming and splitting across processes need random access, not a cursor.
The price is the target's compute on every epoch; dumps pay it once.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from maverick.model import Llama4
from maverick.target import TARGET_DTYPES, load_target
from train.dump import (
    STORE_DTYPES,
    data_identity,
    default_feature_layers,
    plan_batches,
    run_target,
    target_record,
)
from train.samples import samples_fingerprint


class OnlineDataset:
    def __init__(
        self,
        model: Llama4,
        samples: Sequence[Mapping[str, Any]],
        feature_layers: Sequence[int] | None = None,
        store_dtype: torch.dtype = torch.bfloat16,
        batch_tokens: int = 4096,
        target: Mapping[str, Any] | None = None,
    ):
        """target: the manifest record of the model (train.dump.target_record) where it was loaded from a
        path; it enters `identity`, which train.fit compares on --resume."""
        if not samples:
            raise ValueError("OnlineDataset: no samples")
        self.model = model.eval()
        self.samples = list(samples)
        L = model.config.num_hidden_layers
        self.feature_layers = (
            tuple(feature_layers) if feature_layers is not None else default_feature_layers(L)
        )
        self.store_dtype = store_dtype
        self.batch_tokens = batch_tokens
        self.lengths = [len(s["input_ids"]) for s in self.samples]
        # the target's tables in fp32 (after rounding to the forward's dtype), for fit.py
        self.embed_weight = model.model.embed_tokens.weight.detach().float()
        self.lm_head_weight = model.lm_head.weight.detach().float()
        # the stored dtype's name as a dump's manifest has it (fp32, which dumps do not store: torch's name)
        stored = next((k for k, v in STORE_DTYPES.items() if v == store_dtype), str(store_dtype))
        self.identity = data_identity(
            [samples_fingerprint(self.samples)], target or {}, self.feature_layers, stored
        )

    @classmethod
    def from_path(
        cls,
        path: str | os.PathLike,
        samples: Sequence[Mapping[str, Any]],
        dtype: torch.dtype = torch.bfloat16,
        feature_layers: Sequence[int] | None = None,
        device: str = "cpu",
    ) -> OnlineDataset:
        """Load the target (.gguf or HF dir) and run it in `dtype` on `device`."""
        model = load_target(path, dtype, device)
        name = next(k for k, v in TARGET_DTYPES.items() if v == dtype)
        return cls(model, samples, feature_layers, target=target_record(path, name, model.config))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return self.fetch([i])[0]

    def fetch(self, indices: Sequence[int]) -> list[dict[str, Tensor]]:
        chosen = [self.samples[i] for i in indices]
        out: list[dict[str, Tensor] | None] = [None] * len(chosen)
        for group in plan_batches([len(s["input_ids"]) for s in chosen], self.batch_tokens):
            fields = run_target(self.model, [chosen[j] for j in group], self.feature_layers, self.store_dtype)
            for j, f in zip(group, fields):
                out[j] = f
        return out
