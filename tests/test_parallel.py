"""Tensor + expert parallel inference (maverick/parallel.py) against one process: 2 and 4 gloo processes on
CPU load a tiny MoE from sharded safetensors, each reading only its slices; fp32 logits match the single
process within 1e-5 relative (also with FP8 routed experts, converted after or before cutting); greedy decoding and speculative decoding (chain and tree, a tiny random
draft) emit the single process's tokens. The memory report for Maverick at 8 ranks is checked against
the parameter-count formula and the published totals.

One spawn per world size runs every multi-process check (process start dominates on this CPU); 4 ranks is
`slow`, as are the torchrun launches of maverick.generate and train.regenerate. The other commands that take
a sharded target (train.dump, eagle3.generate, eval.acceptance) are launched by torchrun on 2 ranks here.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from eagle3.draft import DraftConfig, Eagle3Draft
from eagle3.spec import SpecDecoder, TreeConfig
from eagle3.tuner import FixedK
from maverick.checkpoint import load_hf, save_hf
from maverick.cli import run_cli
from maverick.config import get_config
from maverick.fp8_experts import convert_experts_to_fp8
from maverick.generate import Decoder
from maverick.gguf_loader import default_gguf_path
from maverick.model import Llama4
from maverick.parallel import (
    Shard,
    all_sum,
    fp8_expert_layers,
    head_ranges,
    layout,
    load_hf_sharded,
    memory_report,
    params_per_rank_formula,
    shard_model,
)
from maverick.parallel import (
    main as parallel_main,
)

FEATURES = (1, 2, 3)
PROMPT_LEN = 70  # > 64: the prefill reduces by all_reduce, the decode steps by the ordered gather
NEW_TOKENS = 12


def _target() -> Llama4:
    torch.manual_seed(0)
    t = Llama4(get_config("tiny-moe"))
    t.init_weights(std=0.1)
    return t.eval()


def _draft(target_cfg) -> Eagle3Draft:
    dc = DraftConfig.for_target(target_cfg, draft_vocab_size=target_cfg.vocab_size, feature_layers=FEATURES)
    torch.manual_seed(1)
    d = Eagle3Draft(dc)
    d.init_weights(std=0.1)
    d.t2d.fill_(True)
    return d.eval()


@torch.no_grad()
def _run(model: Llama4, draft: Eagle3Draft, prompt: list[int]) -> dict:
    """Everything compared between one process and a parallel group: logits of a 70-token forward without a
    cache, of a cached prefill + 8 decode steps, greedy tokens of plain / chain / tree decoding."""
    seq = torch.tensor([prompt], device=model.device)
    out = {"logits": model(seq).logits}
    cache = model.new_cache(1, 256)
    cache.set_window(192)
    steps = [model(seq[:, :40], cache=cache).logits]
    for t in range(40, 48):
        steps.append(model(seq[:, t : t + 1], cache=cache).logits)
    out["cached_logits"] = torch.cat(steps, 1)
    out = {k: v.cpu() for k, v in out.items()}
    out["plain"] = Decoder(model, max_len=256).generate([prompt], NEW_TOKENS).tokens[0]
    chain = SpecDecoder(model, draft, max_len=256, policy=FixedK(3))
    out["chain"] = chain.generate([prompt], NEW_TOKENS).tokens[0]
    tree = SpecDecoder(model, draft, max_len=256, tree=TreeConfig(depth=3, top_k=2, total_tokens=6))
    out["tree"] = tree.generate([prompt], NEW_TOKENS).tokens[0]
    return out


@torch.no_grad()
def _fp8_logits(model: Llama4, prompt: list[int]) -> dict:
    """Logits with the routed experts in FP8 (converted in place: run last)."""
    convert_experts_to_fp8(model)
    return {"fp8_logits": model(torch.tensor([prompt], device=model.device)).logits.cpu()}


def _worker(rank: int, world: int, d: str, backend: str = "gloo") -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{d}/rendezvous", rank=rank, world_size=world)
    try:
        model, stats = load_hf_sharded(Path(d) / "ckpt", Shard(rank, world), torch.float32, device)
        draft = _draft(model.config).to(device)
        draft.load_state_dict(torch.load(Path(d) / "draft.pt"))
        shard = Shard(rank, world)
        # a row's sum over ranks has the same bits whatever the call's row count (measured: gloo's
        # all_reduce at 4 ranks changes ~half the elements' bits between sizes)
        x = torch.randn(1, 9, 5120, generator=torch.Generator().manual_seed(rank)).to(device)
        full_sum = all_sum(x.clone(), shard)
        out_sum = [torch.equal(all_sum(x[:, :t].clone(), shard), full_sum[:, :t]) for t in range(1, 9)]
        prompt = torch.load(Path(d) / "prompt.pt")
        out = _run(model, draft, prompt)
        out["sum_row_invariant"] = out_sum
        out["model_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        out |= _fp8_logits(model, prompt)
        # bf16: speculative decoding keeps plain decoding's bits with a parallel target (ordered sums)
        model, _ = load_hf_sharded(Path(d) / "ckpt", Shard(rank, world), torch.bfloat16, device)
        draft = draft.to(torch.bfloat16)
        # a row's logits: the same bits decoded one by one as in one 4-row call (a verify); the MoE's
        # routed outputs joined the partial sum of a rank that moved with the row count before
        with torch.no_grad():
            c1, c2 = model.new_cache(1, 256), model.new_cache(1, 256)
            for c in (c1, c2):
                c.set_window(192)
                model(torch.tensor([prompt[:-4]], device=device), cache=c)
            tail = torch.tensor([prompt[-4:]], device=device)
            steps = torch.cat([model(tail[:, t : t + 1], cache=c1).logits for t in range(4)], 1)
            call = model(tail, cache=c2).logits
        out["bf16_rows_invariant"] = [torch.equal(steps[0, t], call[0, t]) for t in range(4)]
        out["bf16_plain"] = Decoder(model, max_len=256).generate([prompt], NEW_TOKENS).tokens[0]
        chain = SpecDecoder(model, draft, max_len=256, policy=FixedK(3))
        out["bf16_chain"] = chain.generate([prompt], NEW_TOKENS).tokens[0]
        full = load_hf(Path(d) / "ckpt", torch.float32, str(device))  # FP8 first, then cut
        convert_experts_to_fp8(full)
        out["fp8_cut_logits"] = _fp8_logits(shard_model(full, Shard(rank, world)), prompt)["fp8_logits"]
        out["bytes_read"] = stats.bytes_read
        out["bytes_in_files"] = stats.bytes_in_files
        torch.save(out, Path(d) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    d = tmp_path_factory.mktemp("parallel")
    target = _target()
    save_hf(target, d / "ckpt", max_shard_bytes=300_000)  # several files
    assert len(list((d / "ckpt").glob("*.safetensors"))) > 2
    draft = _draft(target.config)
    torch.save(draft.state_dict(), d / "draft.pt")
    prompt = torch.randint(3, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3)).tolist()
    torch.save(prompt, d / "prompt.pt")
    ref = _run(target, draft, prompt)
    ref |= _fp8_logits(copy.deepcopy(target), prompt)
    ref["fp8_cut_logits"] = ref["fp8_logits"]
    # the routing spreads tokens over every rank's experts, or expert parallelism would be untested
    moe = target.model.layers[1].feed_forward
    seen = []
    hook = moe.register_forward_hook(lambda m, args, out: seen.append(m.route(args[0].reshape(-1, 64))[0]))
    with torch.no_grad():
        target(torch.tensor([prompt]))
    hook.remove()
    assert set(seen[0].tolist()) == {0, 1, 2, 3}
    return d, target, ref


def _spawn(d: Path, world: int, backend: str) -> list[dict]:
    mp.start_processes(_worker, args=(world, str(d), backend), nprocs=world, start_method="spawn")
    outs = [torch.load(d / f"rank{r}.pt") for r in range(world)]
    for r in range(world):
        (d / f"rank{r}.pt").unlink()
    return outs


def _check(single, world: int, backend: str = "gloo") -> list[dict]:
    d, target, ref = single
    outs = _spawn(d, world, backend)
    for out in outs:
        for key in ("logits", "cached_logits", "fp8_logits", "fp8_cut_logits"):
            rel = (out[key] - ref[key]).abs().max() / ref[key].abs().max()
            print(f"{world} ranks ({backend}): {key} max relative error {float(rel):.2e}")
            assert rel < 1e-5, (world, key, float(rel))
            assert not torch.equal(out[key], ref[key]) or world == 1  # the sums really ran in another order
        assert out["plain"] == ref["plain"], world
        assert out["chain"] == ref["chain"] == ref["plain"], world
        assert out["tree"] == ref["tree"] == ref["plain"], world
        assert out["bf16_chain"] == out["bf16_plain"], world
        assert all(out["bf16_rows_invariant"]), (world, out["bf16_rows_invariant"])
        assert all(out["sum_row_invariant"]), (world, out["sum_row_invariant"])
    # each rank read only its slices: 1/world of the sharded tensors plus the replicated ones (norms,
    # routers), and kv heads twice as often where 4 ranks share 2 of them
    cfg = target.config
    plan = layout(cfg, Shard(0, world))
    sd = target.state_dict()
    nbytes = {k: v.numel() * v.element_size() for k, v in sd.items()}
    total = sum(nbytes.values())
    replicated = sum(nbytes[k] for k, s in plan.items() if s is None)
    kv = sum(nbytes[k] for k in plan if k.endswith(("k_proj.weight", "v_proj.weight")))
    kv_extra = kv // cfg.num_key_value_heads - kv // world if world > cfg.num_key_value_heads else 0
    for out in outs:
        assert out["bytes_in_files"] == total
        assert out["bytes_read"] == (total - replicated) // world + replicated + kv_extra
        assert out["model_bytes"] == out["bytes_read"]
    print(
        f"{world} ranks: bytes read per rank {outs[0]['bytes_read']:,} of {total:,} ({replicated:,} replicated)"
    )
    return outs


def test_two_ranks_match_one_process(single):
    outs = _check(single, 2)
    assert outs[0]["bytes_read"] < 0.55 * outs[0]["bytes_in_files"]


@pytest.mark.slow
def test_four_ranks_match_one_process(single):
    """4 ranks over 2 kv heads: each kv head replicated on two ranks; one expert per rank."""
    _check(single, 4)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (nccl: one GPU per rank)")
def test_two_gpus_nccl_match_one_cpu_process(single):
    """The nccl path: the same checks against the one CPU process (fp32, TF32 off by default)."""
    _check(single, 2, "nccl")


def test_head_ranges_and_layout():
    mav = get_config("maverick-400b")
    assert head_ranges(mav, Shard(3, 8)) == ((15, 20), (3, 4))  # 5 query heads, their one kv head
    tiny = get_config("tiny-moe")  # 4 query heads, 2 kv heads
    assert [head_ranges(tiny, Shard(r, 4)) for r in range(4)] == [
        ((0, 1), (0, 1)),
        ((1, 2), (0, 1)),
        ((2, 3), (1, 2)),
        ((3, 4), (1, 2)),
    ]
    plan = layout(mav, Shard(2, 8))
    assert plan["model.layers.1.feed_forward.experts.gate_up_proj"] == (0, 32, 48)
    assert plan["model.layers.0.self_attn.o_proj.weight"] == (1, 1280, 1920)
    assert plan["model.layers.1.feed_forward.router.weight"] is None
    with pytest.raises(ValueError, match="num_attention_heads=4 does not split over 3 ranks"):
        layout(tiny, Shard(0, 3))


# published text parameter totals (REFERENCE.md)
TOTALS = {"maverick-400b": 400_711_848_960, "scout-109b": 107_769_861_120}


@pytest.mark.parametrize("name", ["maverick-400b", "scout-109b"])
def test_memory_report_at_eight_ranks(name):
    cfg = get_config(name)
    bf16, fp8 = memory_report(cfg, 8), memory_report(cfg, 8, fp8=True)
    n = bf16["params_per_rank"]
    assert n == params_per_rank_formula(cfg, 8) == fp8["params_per_rank"]
    # the 8 ranks hold the model once plus 7 more copies of what is replicated (norms, routers; with 8 kv
    # heads over 8 ranks no kv head is repeated)
    H, L, E = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_local_experts
    replicated = (2 * L + 1) * H + len(cfg.moe_layers) * E * H
    assert 8 * n - 7 * replicated == TOTALS[name]
    assert bf16["weight_bytes"] == 2 * n
    # FP8: the routed experts of the release's FP8 layers at one byte, plus an fp32 scale per output channel
    E8, I = E // 8, cfg.intermediate_size
    n_fp8 = len(fp8_expert_layers(cfg))
    assert fp8["weight_bytes"] == 2 * n - n_fp8 * (E8 * 3 * H * I - E8 * (2 * I + H) * 4)
    assert bf16["kv_cache_bytes"] == 2 * L * 1 * cfg.head_dim * 8192 * 2
    if name == "maverick-400b":  # 50.1e9 parameters, 93.3 GiB in bf16: over an H100's 80 GB, under an H200
        assert n == 50_103_178_240
        assert 93 * 2**30 < bf16["weight_bytes"] < 94 * 2**30
        assert 50 * 2**30 < fp8["weight_bytes"] < 51 * 2**30
        assert fp8_expert_layers(cfg) == list(range(1, 46, 2))


def test_report_cli(capsys):
    parallel_main(["--report", "--configs", "maverick-400b"])
    assert "50,103,178,240" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        run_cli(parallel_main, ["--configs", "tiny-moe", "--world", "3"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: num_attention_heads=4 does not split over 3 ranks"
    ]


@pytest.mark.slow
def test_torchrun_generate_two_ranks(tmp_path):
    """`torchrun --nproc-per-node 2 -m maverick.generate --target DIR` prints the one-process tokens' text."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(get_config("tiny-moe"), vocab_size=49152)  # the GGUF tokenizer's vocabulary
    t = Llama4(cfg)
    t.init_weights(std=0.1)
    save_hf(t, tmp_path / "ckpt")
    common = ["-m", "maverick.generate", "--target", str(tmp_path / "ckpt"), "--prompt", "Hello there"]
    common += ["--tokenizer", str(default_gguf_path())]
    common += ["--max-new-tokens", "8", "--dtype", "fp32"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = subprocess.run([sys.executable, *common], capture_output=True, text=True, timeout=300, env=env)
    assert one.returncode == 0, one.stderr
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            "29517",
            *common,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert two.returncode == 0, two.stderr
    text = lambda s: s.strip().rsplit("\n", 1)  # noqa: E731  (streamed text, JSON stats)
    assert text(two.stdout)[0] == text(one.stdout)[0]
    assert '"ranks": 2' in two.stdout


def test_sharded_load_reads_slices_in_process(tmp_path):
    """Loading needs no process group: every rank of 4 gets exactly its slice of every tensor, and the
    slices of the 4 ranks put back together are the whole checkpoint."""
    target = _target()
    save_hf(target, tmp_path / "ckpt", max_shard_bytes=300_000)
    sd = target.state_dict()
    got = [load_hf_sharded(tmp_path / "ckpt", Shard(r, 4))[0].state_dict() for r in range(4)]
    plan = layout(target.config, Shard(0, 4))
    for key, s in plan.items():
        if s is None:
            assert all(torch.equal(g[key], sd[key]) for g in got), key
        elif key.endswith(("k_proj.weight", "v_proj.weight")):  # 2 kv heads over 4 ranks: pairs share one
            assert torch.equal(torch.cat([got[0][key], got[2][key]], s[0]), sd[key]), key
            assert torch.equal(got[0][key], got[1][key]) and torch.equal(got[2][key], got[3][key]), key
        else:
            assert torch.equal(torch.cat([g[key] for g in got], s[0]), sd[key]), key


def test_sharded_load_errors_name_the_key(tmp_path):
    from safetensors.torch import load_file, save_file

    from maverick.checkpoint import CheckpointError

    target = _target()
    save_hf(target, tmp_path / "ckpt")
    f = tmp_path / "ckpt" / "model-00001-of-00001.safetensors"
    sd = load_file(str(f))
    key = "model.layers.1.feed_forward.experts.down_proj"
    save_file({**sd, key: sd[key][:3]}, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"'{key}' has shape \\(3, 96, 64\\), expected \\(4, 96, 64\\)"):
        load_hf_sharded(tmp_path / "ckpt", Shard(0, 2))
    save_file({k: v for k, v in sd.items() if k != key}, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"missing key\\(s\\) \\['{key}'\\]"):
        load_hf_sharded(tmp_path / "ckpt", Shard(0, 2))


def _wide_vocab_moe(path: Path) -> None:
    """The tiny MoE with the GGUF tokenizer's vocabulary (49,152), saved as an HF directory."""
    torch.manual_seed(0)
    t = Llama4(dataclasses.replace(get_config("tiny-moe"), vocab_size=49152))
    t.init_weights(std=0.1)
    save_hf(t, path)


def _chats(path: Path) -> None:
    """Three conversations of one or two turns, as JSONL chats."""
    import json

    chats = [[("Hi", "Hello there! How can I help?"), ("What is 2+2?", "4.")],
             [("Name a colour.", "Blue, like the sky on a clear day.")],
             [("Say hello in French.", "Bonjour!"), ("And in German?", "Hallo!")]]  # fmt: skip
    rows = [{"id": f"c{i}", "messages": [{"role": r, "content": x} for u, a in c for r, x in (("user", u), ("assistant", a))]}
            for i, c in enumerate(chats)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _one_process_and_two_ranks(args: list[str], port: int, out) -> dict[str, subprocess.CompletedProcess]:
    """`python -m ...` with `args` in one process ("one") and under torchrun on 2 gloo ranks ("two"), each
    with its output arguments `out(name)`; both must succeed."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = {}
    for name, launch in (("one", []), ("two", ["-m", "torch.distributed.run", "--nproc-per-node", "2",
                                               "--master-port", str(port)])):  # fmt: skip
        r = subprocess.run([sys.executable, *launch, *args, *out(name)], capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = r
    return runs


def test_torchrun_dump_two_ranks_equals_one_process(tmp_path):
    """`torchrun --nproc-per-node 2 -m train.dump --target DIR`: the tiny MoE target sharded over 2 gloo
    ranks (each reads its slices) dumps what one process dumps: the same ids, masks and full-vocabulary
    argmax (gathered from the ranks' vocabulary halves), the same draft vocabulary, and features and final
    hidden states within one bf16 step of rounding (the ranks' partial sums add in another order), written
    by rank 0 alone."""
    import json

    from train.dump import DumpDataset

    _wide_vocab_moe(tmp_path / "ckpt")
    _chats(tmp_path / "chats.jsonl")
    common = ["-m", "train.dump", "--target", str(tmp_path / "ckpt"), "--tokenizer", str(default_gguf_path()),
              "--data", str(tmp_path / "chats.jsonl"), "--heldout-fraction", "0", "--target-dtype", "fp32",
              "--shard-size", "2", "--draft-vocab-size", "256", "--no-progress", "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    ran = _one_process_and_two_ranks(common, 29519, lambda name: ["--out", str(tmp_path / name)])
    runs = {name: json.loads(r.stdout.strip().splitlines()[-1]) for name, r in ran.items()}
    assert runs["two"]["ranks"] == 2 and runs["two"]["samples"] == runs["one"]["samples"] == 3
    a, b = DumpDataset(tmp_path / "one"), DumpDataset(tmp_path / "two")
    assert all(torch.equal(x, y) for x, y in zip(a.vocab(), b.vocab()))
    for i in range(len(a)):
        x, y = a[i], b[i]
        for key in ("input_ids", "loss_mask", "target_argmax"):
            assert torch.equal(x[key], y[key]), (i, key)
        for key in ("features", "hidden"):  # seen: a bf16 rounding flipped in 0.1% of the elements
            assert torch.allclose(x[key].float(), y[key].float(), rtol=2**-7, atol=1e-4), (i, key)


@pytest.mark.slow
def test_torchrun_regenerate_two_ranks_equals_one_process(tmp_path):
    """`torchrun --nproc-per-node 2 -m train.regenerate --target DIR`: the sharded tiny MoE answers every
    user turn as one process does (the same JSONL, written once, by rank 0); a rerun finds everything done."""
    import json

    _wide_vocab_moe(tmp_path / "ckpt")
    _chats(tmp_path / "chats.jsonl")
    common = ["-m", "train.regenerate", "--target", str(tmp_path / "ckpt"), "--tokenizer", str(default_gguf_path()),
              "--data", str(tmp_path / "chats.jsonl"), "--dtype", "fp32", "--max-new-tokens", "12",
              "--batch-size", "2", "--max-seconds", "600", "--device", "cpu"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    two = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29521"]
    stats = {}
    for name, launch in (("one", []), ("two", two), ("again", two)):
        out = tmp_path / ("two" if name == "again" else name) / "chats.jsonl"
        r = subprocess.run([sys.executable, *launch, *common, "--out", str(out)],
                           capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        stats[name] = json.loads(r.stdout.strip().splitlines()[-1])
    assert stats["two"]["ranks"] == 2 and stats["one"]["conversations"] == stats["two"]["conversations"] == 3
    assert stats["again"]["conversations"] == 0
    one, got = ((tmp_path / d / "chats.jsonl").read_text().splitlines() for d in ("one", "two"))
    assert len(one) == 3 and sorted(one) == sorted(got)
    assert sum(m["role"] == "assistant" for line in one for m in json.loads(line)["messages"]) >= 3


def test_torchrun_eagle3_generate_two_ranks(tmp_path):
    """`torchrun --nproc-per-node 2 -m eagle3.generate --check`: speculative decoding with the sharded tiny MoE
    and a draft on every rank emits plain decoding's tokens, with the tuned draft length and prompt lookup and
    with tuned trees (the tuners' choices rank 0's: ranks that drafted by their own clocks would issue
    different collectives and wait forever)."""
    import json

    from eagle3.draft import save_draft

    _wide_vocab_moe(tmp_path / "ckpt")
    save_draft(_draft(load_hf(tmp_path / "ckpt").config), tmp_path / "draft")
    common = ["-m", "eagle3.generate", "--target", str(tmp_path / "ckpt"), "--draft", str(tmp_path / "draft"),
              "--tokenizer", str(default_gguf_path()),
              "--prompt", "Hello there, hello there, hello there", "--max-new-tokens", "24", "--dtype", "fp32", "--check"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for port, shape in ((29523, ["--lookup"]), (29525, ["--tree", "1,1,1", "--tree", "2,2,3"])):
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                            str(port), *common, *shape], capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        printed = [line for line in r.stdout.splitlines() if line.startswith('{"draft"')]
        assert len(printed) == 1  # by rank 0 alone
        result = json.loads(printed[0])
        assert result["ranks"] == 2 and result["identical_to_plain"] and result["new_tokens"] == 24
        assert result["shape"] == ("tuned" if shape == ["--lookup"] else "tuned tree of 1,1,1 | 2,2,3")


def test_torchrun_acceptance_two_ranks_equals_one_process(tmp_path):
    """`torchrun --nproc-per-node 2 -m eval.acceptance --target DIR`: the sharded tiny MoE's sampled answers
    and the drafts' acceptance of sampled chains (the target's probabilities over the ranks' gathered head
    rows) are one process's, for two drafts compared, printed and written once. (Greedy, random drafts
    accept nothing here: sampled chains give numbers to compare.)"""
    import json

    from eagle3.draft import save_draft

    _wide_vocab_moe(tmp_path / "ckpt")
    cfg = load_hf(tmp_path / "ckpt").config
    save_draft(_draft(cfg), tmp_path / "a")
    torch.manual_seed(1)
    save_draft(_draft(cfg), tmp_path / "b")
    prompts = ["Hello there, hello there, hello", "Count: one two three four", "Name a colour."]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    common = ["-m", "eval.acceptance", "--target", str(tmp_path / "ckpt"), "--tokenizer", str(default_gguf_path()),
              "--draft", str(tmp_path / "a"), "--draft", str(tmp_path / "b"), "--bench", "jsonl", "--prompts",
              str(tmp_path / "p.jsonl"), "--max-new-tokens", "20", "--steps", "3", "--dtype", "fp32", "--temperature", "1"]  # fmt: skip
    ran = _one_process_and_two_ranks(common, 29527, lambda name: ["--out", str(tmp_path / f"{name}.json")])
    assert all(
        r.stdout.count("paired over the same answers") == 1 for r in ran.values()
    )  # rank 0 alone prints
    got = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ran}
    one, two = got["one"], got["two"]
    assert one["answer_tokens"] == two["answer_tokens"] == 60
    for path in (str(tmp_path / "a"), str(tmp_path / "b")):
        a, b = one["drafts"][path], two["drafts"][path]
        assert a["positions"] == b["positions"] == 51 and a["p_run_ge"][0] > 0.1
        assert a["p_run_ge"] == pytest.approx(b["p_run_ge"], abs=1e-6)


def test_torchrun_bench_two_ranks_equals_one_process(tmp_path):
    """`torchrun --nproc-per-node 2 -m eval.bench --target DIR`: plain decoding and the tuned chain with prompt
    lookup on the sharded tiny MoE emit one process's tokens (0 mismatches within the run, the same outputs as
    a one-process run), rank 0 writes the report and prints once; HF's rows and the engines' variants are
    refused under torchrun."""
    import json
    from types import SimpleNamespace

    from eagle3.draft import save_draft
    from eval.bench import check_sharded_methods
    from maverick.cli import UserError

    _wide_vocab_moe(tmp_path / "ckpt")
    save_draft(_draft(load_hf(tmp_path / "ckpt").config), tmp_path / "draft")
    prompts = ["Hello there, hello there, hello", "Count: one two three four", "Name a colour."]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    common = ["-m", "eval.bench", "--target", str(tmp_path / "ckpt"), "--tokenizer", str(default_gguf_path()),
              "--draft", str(tmp_path / "draft"), "--bench", "jsonl", "--prompts", str(tmp_path / "p.jsonl"),
              "--turns", "1", "--methods", "ours-plain,eagle3-tuned+lookup", "--max-new-tokens", "24", "--dtype", "fp32"]  # fmt: skip
    ran = _one_process_and_two_ranks(
        common, 29529, lambda name: ["--out", str(tmp_path / name)]
    )  # exit 0: no mismatches
    assert all(r.stdout.count("report (every column)") == 1 for r in ran.values())  # rank 0 alone reports
    outputs = {}
    for name in ran:
        lines = (tmp_path / name / "records.jsonl").read_text().splitlines()[1:]
        outputs[name] = {(x["method"], x["prompt_id"]): x["output_ids"] for line in lines for x in json.loads(line)["records"]}  # fmt: skip
    assert len(outputs["one"]) == 6 and outputs["one"] == outputs["two"]
    assert json.loads((tmp_path / "two" / "report.json").read_text())["config"]["ranks"] == 2
    args = SimpleNamespace(fp8="none", compile_draft=False)
    with pytest.raises(UserError, match="drop hf-generate, ours-plain\\+q4"):
        check_sharded_methods(args, ["ours-plain", "hf-generate", "ours-plain+q4"])
    with pytest.raises(UserError, match="--fp8 and --compile-draft"):
        check_sharded_methods(SimpleNamespace(fp8="target", compile_draft=False), ["ours-plain"])
