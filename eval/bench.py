"""The main job: speed and quality of every decoding method, side by side, in one run.

    python -m eval.bench                       # MT-bench, SmolLM2-135M-Instruct + the shipped draft
    python -m eval.bench --preset quick        # 3 questions, 7 methods: 2-3 minutes on 2 cores
    python -m eval.bench --preset engine       # eager vs compiled, bf16 vs 4-bit, llama.cpp if installed
    python -m eval.bench --bench humaneval --n 20 --methods ours-plain,eagle3-tuned

Methods run alternately prompt by prompt (the order rotates each prompt) so machine drift cancels out;
each answers both turns of a prompt, the second conditioned on its own first answer. Every method of
ours must produce exactly the tokens of our plain greedy decoding (a mismatch is printed in red and makes
the exit status 1); HF's methods are a different implementation, so their differences are shown only.
At temperature > 0 outputs differ by design; instead each method of ours passes a distribution check of
the first token a speculative cycle emits against the target's exact marginal (eval/distcheck.py).
Methods named <method>+fp8 run on an FP8 copy of the target (checked against ours-plain+fp8), and
<method>+q4 on the target with its GGUF linears kept packed (bf16: the Q4 linears in torch's int4 kernel,
maverick/q4.py; fp32: every quantised linear as one-byte codes, the same weights, maverick/codes.py;
checked against ours-plain+q4).
Methods named <method>-compiled (ours-plain-compiled, eagle3-tuned+lookup-compiled, ...) run the target's
steps on the compiled engine (maverick/compiled.py, compiled once before the prompts; checked against
ours-plain-compiled) and, on CPU, the draft's steps as a compiled graph too (eagle3/compiled_draft.py).
llama.cpp and llama.cpp-prompt-lookup run llama.cpp on the same GGUF file and prompt ids, 2 threads, when
llama-cpp-python is installed (eval/llama_cpp.py; pip install -e '.[llamacpp]').
Methods named eagle3-...+lookup draft by prompt lookup where the text repeats itself and with the EAGLE-3
draft elsewhere (eagle3/lookup.py); eagle3-...+lookup+store also copy from a datastore of the target's own
answers (eagle3/datastore.py, --datastore) where the sequence itself has no match. eagle3-tree drafts the
tree of --tree-depth/--tree-top-k/--tree-tokens each cycle; eagle3-tree-tuned one of --tree-candidates, picked
cycle by cycle by its measured tokens per second (eagle3/tuner.py: DraftLengthTuner.choose_tree).

Prompts longer than --max-prompt-tokens are refused before any model runs (naming the prompt and turn;
a later turn counts the earlier answers at --max-new-tokens each): a benchmark run on prompts cut
without a word is not that benchmark. `--long-prompts truncate` keeps the last --max-prompt-tokens
tokens instead (the start of the chat, system prompt included, is lost) and the report counts the
cut turns (config.truncated_turns).

Nothing finished is lost: each prompt's records (every method, every turn) are appended to
<out>/records.jsonl as the prompt finishes. Ctrl-C writes the report of the finished prompts; `--resume`
(the same command and --out) continues an interrupted or killed run from the first unfinished prompt,
and with a larger --n extends a finished one. The settings must be those of the run it continues
(refused otherwise, naming them); each prompt's methods ran in one process, side by side, so the ratios
stay paired. Sampled runs draw from a generator seeded per prompt (--seed + the prompt's index), so a
resumed run samples what an uninterrupted one would have; the tuners start afresh (config.tuner* covers
the prompts this process ran).

Output: the config first, a progress bar, then a compact table (accept@1-3); report.json (all records),
report.md (every column) and plots in --out. `--preset quick` (make bench) runs 3 questions and the
methods that tell the story in 2-3 minutes on 2 cores; `--preset full` (the default; make bench-full) all
default methods on 10; `--preset engine` (make bench-engine) the engines side by side on 3, llama.cpp's
rows included when llama-cpp-python is installed (compiling the two engines takes ~9 minutes the first
time on 2 cores; the 4-bit engine's graphs load from the cache after that).

Under torchrun our eager methods (ours-plain, eagle3-*, with +lookup / +store) run on the target tensor +
expert parallel (maverick/parallel.py; each rank reads its slices of an HF directory); every rank runs
every method on every prompt, the tuners' choices are rank 0's (SpecDecoder wraps them in
eagle3.tuner.RankAgreed), and rank 0 writes and reports:

    torchrun --nproc-per-node 8 -m eval.bench --target DIR --draft DRAFT --methods ours-plain,eagle3-tuned+lookup
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from eagle3.datastore import Datastore, beside_draft
from eagle3.draft import DEFAULT_DRAFT, load_draft
from eagle3.generate import tree_specs
from eagle3.lookup import LookupConfig
from eagle3.spec import SpecDecoder, TreeConfig, spare_slots
from eagle3.tuner import DraftLengthTuner, FixedK
from eval.distcheck import DistCheck, check_method
from eval.llama_cpp import LlamaCpp, check_sampling, is_llama_cpp, require
from eval.prompts import BENCHMARKS, answer_text, chat_ids, check_prompts_option, load_benchmark
from eval.report import BOLD_RED, REPORT_FILES, RESET, RunRecord, print_table, summarise, write_report
from eval.summary import COMPILED_SUFFIX, FP8_SUFFIX, Q4_COMPILED_SUFFIX, Q4_SUFFIX, variant
from maverick.cli import (
    INTERRUPTED_STATUS,
    ArgumentParser,
    UserError,
    add_threads_option,
    nonnegative_int,
    output_dir,
    positive_int,
    run_cli,
)
from maverick.files import atomic_write, fingerprint
from maverick.generate import Decoder
from maverick.parallel import device_for, init_from_env, load_model, rank0_prints
from maverick.sampling import SamplingParams, add_sampling_options
from maverick.target import TARGET_HELP, load_hf_reference, load_target, load_target_tokenizer
from maverick.tokenizer import default_gguf_path, encode_chat

ALL_METHODS = [
    "hf-generate",
    "hf-prompt-lookup",
    "ours-plain",
    "eagle3-k3",
    "eagle3-k4",
    "eagle3-k5",
    "eagle3-tuned",
    "eagle3-tuned+lookup",
    "eagle3-tuned+lookup+store",
    "eagle3-tree",
    "eagle3-tree+lookup",
    "eagle3-tree-tuned+lookup",
    "ours-plain+q4",
    "eagle3-tuned+lookup+q4",
]
# --preset: the methods that tell the story on a few questions, or every default method on ten. quick took
# 2-3 minutes on 2 cores (3 questions x 2 turns x 128 tokens x 7 methods: ~800 tokens per method at the
# tok/s of docs/results.md, plus loading); full is today's 20-minute run. Flags given explicitly win.
QUICK_METHODS = [
    "hf-generate",
    "ours-plain",
    "eagle3-tuned",
    "eagle3-tuned+lookup",
    "eagle3-tree+lookup",
    "ours-plain+q4",
    "eagle3-tuned+lookup+q4",
]
# engine: eager against compiled, bf16 against 4-bit, and llama.cpp on the same file when
# llama-cpp-python is installed (the pip extra `llamacpp`; without it those rows are left out, with a note)
ENGINE_METHODS = [
    "ours-plain",
    "ours-plain-compiled",
    "ours-plain+q4",
    "ours-plain+q4-compiled",
    "eagle3-tuned+lookup",
    "eagle3-tuned+lookup-compiled",
    "eagle3-tuned+lookup+q4",
    "eagle3-tuned+lookup+q4-compiled",
]
LLAMA_CPP_METHODS = ["llama.cpp", "llama.cpp-prompt-lookup"]
PRESETS = {
    "quick": {"n": 3, "methods": ",".join(QUICK_METHODS)},
    "full": {"n": 10, "methods": ",".join(ALL_METHODS)},
    "engine": {"n": 3, "methods": ",".join(ENGINE_METHODS + LLAMA_CPP_METHODS)},
}
PROGRESS_FILE = "records.jsonl"  # in --out: a header with the settings, then a line per finished prompt
# settings a resumed run may change: where and how it reports, and how many prompts it runs (a benchmark's
# first --n: a larger --n extends a run); every other setting must be the run's own
RESUME_FREE = ("out", "overwrite", "resume", "n", "preset", "dist_samples", "dist_prompts")
LOOKUP_SUFFIX = "+lookup"
STORE_SUFFIX = "+store"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def reset_peak_memory(device: torch.device | str = "cpu") -> None:
    """Start a new peak for `peak_memory_mb` on the device the models run on: a CUDA device's allocator, or
    on the CPU the process's resident high-water mark (Linux: writing 5 to /proc/self/clear_refs). By the
    models' device, not by whether CUDA is present: a CPU run on a GPU machine read the idle allocator (0)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_memory_mb(device: torch.device | str = "cpu") -> float:
    """The process's peak memory since `reset_peak_memory` (CUDA: allocated; CPU: resident, VmHWM). Every
    model the run holds is in it: a method's own share is the difference from ours-plain's."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return _status_mb("VmHWM")


def _status_mb(field: str) -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class _FirstToken:
    """An HF streamer that timestamps the first generated token (HF first `put`s the prompt)."""

    def __init__(self):
        self.calls, self.t = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.t is None:
            self.t = time.perf_counter()

    def end(self):
        pass


def tree_config(args) -> TreeConfig:
    """The tree of --tree-*, cut for sampling (TreeConfig.for_sampling)."""
    tree = TreeConfig(args.tree_depth, args.tree_top_k, args.tree_tokens)
    return tree.for_sampling(sampling_params(args))


def tree_candidates(args) -> list[TreeConfig]:
    """eagle3-tree-tuned's trees: --tree-candidates, each cut for sampling (the cuts may coincide: once each)."""
    sampling = sampling_params(args)
    return list(dict.fromkeys(t.for_sampling(sampling) for t in args.tree_candidates))


def method_parts(name: str) -> tuple[str, bool, bool]:
    """A speculative method's name (without a variant suffix) as (base, lookup, store): base is
    eagle3-tuned, eagle3-tree, eagle3-tree-tuned or eagle3-k<N>; a UserError naming the known methods
    otherwise."""
    store = name.endswith(STORE_SUFFIX)
    name = name.removesuffix(STORE_SUFFIX)
    if store and not name.endswith(LOOKUP_SUFFIX):
        raise UserError(f"'{STORE_SUFFIX}' extends prompt lookup: name the method <method>+lookup+store")
    lookup = name.endswith(LOOKUP_SUFFIX)
    name = name.removesuffix(LOOKUP_SUFFIX)
    if name not in ("eagle3-tuned", "eagle3-tree", "eagle3-tree-tuned") and not (
        name.startswith("eagle3-k") and name.removeprefix("eagle3-k").isdigit()
    ):
        raise UserError(
            f"unknown method {name!r}; known: {', '.join(ALL_METHODS)} (eagle3 chains also with '{LOOKUP_SUFFIX}' or '{LOOKUP_SUFFIX}{STORE_SUFFIX}', "
            f"any method of ours with '{FP8_SUFFIX}', '{Q4_SUFFIX}', '{COMPILED_SUFFIX}' or '{Q4_COMPILED_SUFFIX}')"
        )
    return name, lookup, store


def without_missing_llama_cpp(methods: list[str]) -> list[str]:
    """The engine preset runs without the optional llama.cpp extra: its rows are left out, with a note."""
    try:
        for m in filter(is_llama_cpp, methods):
            require(m)
    except UserError as e:
        print(f"note: no llama.cpp rows: {e}", file=sys.stderr)
        return [m for m in methods if not is_llama_cpp(m)]
    return methods


def check_method_names(methods: list[str]) -> None:
    """Every --methods name is known, checked before any model loads."""
    for m in methods:
        base = m.removesuffix(variant(m))
        if base not in ("ours-plain", "hf-generate", "hf-prompt-lookup") and not is_llama_cpp(base):
            method_parts(base)


def with_references(methods: list[str], temperature: float) -> list[str]:
    """Greedy runs check each method of ours token by token against plain decoding on its own numerics
    (ours-plain, ours-plain+q4, ...): a reference not asked for is added in front, with a note (before, such
    a method was compared with nothing, or a +q4 one with bf16 decoding, whose differences never count)."""
    if temperature > 0:
        return methods
    ours = [m for m in methods if m.startswith(("ours-", "eagle3-"))]
    added = [r for r in dict.fromkeys("ours-plain" + variant(m) for m in ours) if r not in methods]
    if added:
        print(
            f"added {', '.join(added)}: the plain decoding the methods are checked against", file=sys.stderr
        )
    return added + methods


def check_datastore_option(args, methods: list[str]) -> None:
    """The datastore of the `+store` methods exists, and a --datastore given is read by one of them."""
    store = [m for m in methods if m.removesuffix(variant(m)).endswith(STORE_SUFFIX)]
    if args.datastore and not store:
        raise UserError(
            "--datastore is read by methods named <method>+lookup+store only; none of --methods is"
        )
    path = datastore_path(args)
    if store and not path.is_file():
        raise UserError(f"{path}: no datastore for {store[0]} (build one with python -m train.datastore)")


def build_decoder(name: str, target, draft, max_len: int, args) -> Decoder | SpecDecoder:
    """Our decoder for a method name (without a "+fp8" / "+q4" / "-compiled" suffix)."""
    if name == "ours-plain":
        return Decoder(target, max_len=max_len)
    name, lookup_on, store = method_parts(name)
    datastore = Datastore.load(datastore_path(args)) if store else None
    copy_tokens = getattr(args, "lookup_tokens", 10)
    # a streak below the base length is off
    streak = max(copy_tokens, getattr(args, "lookup_streak_tokens", 20))
    tune = not getattr(args, "lookup_fixed", False)
    lookup = LookupConfig(max_tokens=copy_tokens, streak_tokens=streak, tune=tune) if lookup_on else None
    fixed_k = name.removeprefix("eagle3-k")
    if draft is None:
        raise UserError(f"method {name} needs a draft (--draft)")
    policy, tree = None, None
    if name == "eagle3-tuned":
        policy = DraftLengthTuner(choices=range(1, 9))
    elif name == "eagle3-tree":
        tree = tree_config(args)
    elif name == "eagle3-tree-tuned":  # the tuner picks a tree each cycle (and tunes prompt-lookup copies)
        tree = tree_candidates(args)
        policy = DraftLengthTuner(choices=range(1, 9), tree_configs=tree)
    else:
        policy = FixedK(int(fixed_k))
    return SpecDecoder(
        target,
        draft,
        max_len=max_len,
        policy=policy,
        tree=tree,
        compile_draft=args.compile_draft or getattr(target, "compiled", False),  # -compiled: the draft too
        lookup=lookup,
        datastore=datastore,
    )


def datastore_path(args) -> Path:
    """--datastore, or the one shipped beside the draft directory (<draft>.datastore.safetensors)."""
    path = getattr(args, "datastore", None)
    return Path(path) if path else beside_draft(getattr(args, "draft", DEFAULT_DRAFT))


class Runner:
    """One object per method: `run(prompt_ids, max_new_tokens) -> (ids, stats)`. A method name ending in
    "+fp8" / "+q4" runs the same method on that variant of the target (given as `target`)."""

    def __init__(self, name, args, target, draft, hf, eos):
        name = name.removesuffix(variant(name))
        self.name, self.eos, self.hf = name, eos, hf
        self.sampling = sampling_params(args)
        max_len = bench_max_len(args)
        self.llama = None
        if is_llama_cpp(name):
            gguf = args.gguf  # main resolved the default
            self.llama = LlamaCpp(
                name, gguf, max_len, eos, args.threads or 2, getattr(args, "lookup_tokens", 10)
            )
        self.dec = (
            None
            if name.startswith("hf-") or self.llama
            else build_decoder(name, target, draft, max_len, args)
        )

    @torch.no_grad()
    def run(self, ids: list[int], max_new_tokens: int, generator: torch.Generator) -> tuple[list[int], dict]:
        if self.name.startswith("hf-"):
            return self._run_hf(ids, max_new_tokens)
        if self.llama is not None:
            return self.llama.run(ids, max_new_tokens, self.sampling)
        if self.name == "ours-plain":
            g = self.dec.generate([ids], max_new_tokens, self.sampling, self.eos, generator)
            return g.tokens[0], {"seconds": g.seconds, "ttft": g.ttft}
        g = self.dec.generate([ids], max_new_tokens, self.sampling, self.eos, generator)
        s = g.stats["spec"]
        stats = {"seconds": g.seconds, "ttft": g.ttft, "cycles": s.cycles, "accepted": s.accepted}
        stats |= {"draft_lengths": s.draft_lengths, "cut": s.cut, "draft_seconds": s.draft_seconds}
        stats["verify_seconds"], stats["target_cut"] = s.verify_seconds, s.target_cut
        stats["lookup_cycles"], stats["store_cycles"] = s.lookup_cycles, s.store_cycles
        return g.tokens[0], stats

    def _run_hf(self, ids, max_new_tokens):
        x = torch.tensor([ids])
        kw = dict(max_new_tokens=max_new_tokens, eos_token_id=self.eos, pad_token_id=self.eos[0])
        if self.sampling.greedy:
            kw["do_sample"] = False
        else:
            kw |= dict(
                do_sample=True, temperature=self.sampling.temperature, top_k=self.sampling.top_k or None
            )
            kw["top_p"] = self.sampling.top_p
        if self.name == "hf-prompt-lookup":
            kw["prompt_lookup_num_tokens"] = 10
        streamer = _FirstToken()
        t0 = time.perf_counter()
        out = self.hf.generate(x, streamer=streamer, **kw)
        dt = time.perf_counter() - t0
        new = out[0, len(ids) :].tolist()
        return new, {"seconds": dt, "ttft": (streamer.t or time.perf_counter()) - t0}


def bench_max_len(args) -> int:
    """The cache length every decoder of a run gets: two turns of the longest prompt and answer, and room for
    a cycle's drafts (a wide tree's frontiers may need more than 128 slots)."""
    trees = [tree_config(args), *tree_candidates(args)]
    return args.max_prompt_tokens * 2 + args.max_new_tokens * 2 + spare_slots(trees)


def compiled_engine(target, draft, args):
    """The compiled engine the -compiled methods share, compiled now (seconds printed apart from TTFT)."""
    from maverick.compiled import CompiledTarget

    feats = draft.config.feature_layers if draft is not None else ()
    engine = CompiledTarget(target, bench_max_len(args), feats)
    secs = engine.compile()
    loaded = sum(engine.loaded.values())  # buckets whose AOT package came from disk
    print(
        json.dumps({"compile_s": round(sum(secs.values()), 1), "rows": list(secs), "loaded": loaded}),
        flush=True,
    )
    return engine


def check_prompt_lengths(args, tok, prompts) -> None:
    """--long-prompts error: every turn of every prompt must fit --max-prompt-tokens, checked before any
    model runs; a later turn counts each earlier answer at its most, --max-new-tokens."""
    if args.long_prompts != "error":
        return
    for prompt in prompts:
        for turn in range(min(args.turns, len(prompt["turns"]))):
            n = len(chat_ids(tok, prompt, turn, [""] * turn)) + turn * args.max_new_tokens
            if n > args.max_prompt_tokens:
                answers = f" with {turn} answer(s) of up to {args.max_new_tokens} tokens" if turn else ""
                raise UserError(
                    f"--bench {args.bench}: prompt {prompt['id']} turn {turn + 1} is {n} tokens{answers}, over "
                    f"--max-prompt-tokens {args.max_prompt_tokens}: raise it, lower --turns, or pass "
                    "--long-prompts truncate (keeps the last --max-prompt-tokens tokens; the report counts them)"
                )


def fit_prompt(ids: list[int], args, where: str, cut: list[str]) -> list[int]:
    """A prompt within --max-prompt-tokens: as is, cut to its last tokens (--long-prompts truncate;
    `where` is appended to `cut`), or refused."""
    if len(ids) <= args.max_prompt_tokens:
        return ids
    if args.long_prompts != "truncate":
        raise UserError(f"{where}: {len(ids)} tokens, over --max-prompt-tokens {args.max_prompt_tokens}")
    cut.append(where)
    return ids[-args.max_prompt_tokens :]


def main(argv=None) -> int:
    ap = ArgumentParser(
        prog="python -m eval.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--bench", choices=BENCHMARKS, default="mtbench")
    ap.add_argument("--prompts", default=None, help="JSONL of prompts for --bench jsonl")
    ap.add_argument("--n", type=positive_int, default=10, help="number of prompts (default 10)")
    ap.add_argument("--turns", type=positive_int, default=2, help="turns per prompt (MT-bench has 2)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=128)
    ap.add_argument("--max-prompt-tokens", type=positive_int, default=1024)
    ap.add_argument("--long-prompts", choices=("error", "truncate"), default="error",
                    help="a prompt over --max-prompt-tokens: refuse the run before it starts (default), or "
                         "keep its last --max-prompt-tokens tokens and count it in the report")  # fmt: skip
    ap.add_argument("--methods", default=",".join(ALL_METHODS))
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    add_sampling_options(ap)
    ap.add_argument("--target", "--gguf", dest="gguf", default=None,
                    help=TARGET_HELP + "; under torchrun each rank reads only its slices of an HF directory")  # fmt: skip
    ap.add_argument("--tokenizer", default=None,
                    help="GGUF file or HF directory with the tokenizer (default: the target's own)")  # fmt: skip
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT), help="EAGLE-3 draft directory")
    ap.add_argument("--datastore", default=None,
                    help="datastore for methods named <method>+lookup+store (default: <draft dir>.datastore.safetensors "
                         "beside the draft directory; build one with python -m train.datastore)")  # fmt: skip
    # the tree that did best with prompt lookup on this 2-core CPU (of 3/3/8, 3/4/12, 4/3/10, 4/4/14, 5/2/10,
    # 5/6/24: MT-bench, 3 questions); GPUs, where verifying more nodes costs next to nothing, take bigger ones
    ap.add_argument("--tree-depth", type=positive_int, default=3)
    ap.add_argument("--tree-top-k", type=positive_int, default=4)
    ap.add_argument("--tree-tokens", type=positive_int, default=12)
    ap.add_argument("--tree-candidates", type=tree_specs, default=tree_specs("2,2,3;3,2,7;3,4,12"),
                    metavar="D,K,T;...", help="the trees eagle3-tree-tuned picks among by measured tokens/s "
                    "(depth, children per node, draft nodes verified; default: 2,2,3;3,2,7;3,4,12)")  # fmt: skip
    ap.add_argument(
        "--lookup-tokens", type=positive_int, default=10, help="tokens a prompt-lookup copy drafts at most"
    )
    ap.add_argument("--lookup-streak-tokens", type=positive_int, default=20,
                    help="... after a copy accepted in full (LookupConfig.streak_tokens; 10 = off)")  # fmt: skip
    ap.add_argument("--lookup-fixed", action="store_true",
                    help="copies always draft the cap (--lookup-tokens / --lookup-streak-tokens), not the length "
                         "the tuned methods' verify cost pays for (LookupConfig.tune)")  # fmt: skip
    ap.add_argument(
        "--compile-draft",
        action="store_true",
        help="the draft's steps compiled (CPU: eagle3/compiled_draft.py)",
    )
    ap.add_argument("--fp8", choices=["none", "target", "draft", "both"], default="none",
                    help="FP8 weight-only layers (emulated on CPU) for the target and/or the draft of every "
                         "method; to compare FP8 with bf16 in one run, add methods named <method>+fp8 "
                         "(e.g. ours-plain+fp8,eagle3-tuned+fp8): they use an FP8 copy of the target")  # fmt: skip
    ap.add_argument("--dist-samples", type=nonnegative_int, default=500,
                    help="temperature > 0: rows per method in the distribution check of the first speculative "
                         "token (0: skip; see eval/distcheck.py)")  # fmt: skip
    ap.add_argument("--dist-prompts", type=positive_int, default=2, help="prompts in the distribution check")
    add_threads_option(ap)
    ap.add_argument(
        "--out", type=output_dir, default=None, help="report directory (default results/bench-<time>)"
    )
    again = ap.add_mutually_exclusive_group()
    again.add_argument("--overwrite", action="store_true",
                       help="start again in an --out that holds an earlier run (its records are deleted)")  # fmt: skip
    again.add_argument("--resume", action="store_true",
                       help=f"continue the run in --out from its {PROGRESS_FILE} (the same settings; a larger --n "
                            "extends it)")  # fmt: skip
    ap.add_argument("--preset", choices=list(PRESETS), default="full",
                    help="quick: 3 questions, 7 methods (make bench, 2-3 min on 2 cores); full: the defaults above "
                         "(make bench-full, ~20 min); engine: eager vs compiled engines and llama.cpp "
                         "(make bench-engine); explicit --n / --methods override it")  # fmt: skip
    ap.set_defaults(**PRESETS[ap.parse_known_args(argv)[0].preset])
    args = ap.parse_args(argv)
    shard = init_from_env()  # torchrun: the target tensor + expert parallel over the ranks
    with rank0_prints(shard):  # rank 0 prints, shows progress and writes
        return bench(args, shard)


def check_sharded_methods(args, methods: list[str]) -> None:
    """Under torchrun only our eager methods run on the sharded target: HF's and llama.cpp's rows, the FP8,
    4-bit and compiled variants and the compiled draft run in one process."""
    other = [m for m in methods if m.startswith("hf-") or is_llama_cpp(m) or variant(m)]
    if other:
        raise UserError(f"under torchrun eval.bench runs our eager methods only; drop {', '.join(other)}")
    if args.fp8 != "none" or args.compile_draft:
        raise UserError("under torchrun drop --fp8 and --compile-draft (they run in one process)")


def bench(args, shard) -> int:
    """The run main() parsed: every rank of a sharded target runs every method on every prompt (their
    collectives must match), rank 0 alone reads and writes --out (after every rank has read it) and reports."""
    rank0 = shard is None or shard.rank == 0
    if args.threads:
        torch.set_num_threads(args.threads)
    check_prompts_option(args.bench, args.prompts)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise UserError("--methods: no method given")
    check_method_names(methods)
    methods = with_references(methods, args.temperature)
    check_datastore_option(args, methods)
    if shard is not None:
        check_sharded_methods(args, methods)
    if args.preset == "engine" and args.methods == PRESETS["engine"]["methods"]:
        methods = without_missing_llama_cpp(methods)
    for m in filter(is_llama_cpp, methods):
        require(m)  # a UserError saying how to install llama-cpp-python, before any model loads
        check_sampling(sampling_params(args), m)
    dtype = DTYPES[args.dtype]
    gguf = args.gguf = args.gguf or str(default_gguf_path())
    if args.resume and not args.out:
        raise UserError("--resume continues the run in --out: give its --out")
    out_dir = Path(args.out or f"results/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    config = {k: v for k, v in vars(args).items()} | {"methods": methods, "gguf": gguf}
    config["tree_candidates"] = [asdict(t) for t in args.tree_candidates]  # as given (sampling cuts them)
    config |= {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": str(device_for(shard)),
    }
    config |= {"ranks": shard.world} if shard is not None else {}
    # the weights themselves, so that --resume does not mix two drafts (or targets) of one path in a report
    weights = {"target": gguf, "draft": args.draft, "datastore": args.datastore}
    config["weights"] = {k: fingerprint(v) for k, v in weights.items() if v and Path(v).expanduser().exists()}
    if any(m.startswith("eagle3-tree") and not m.startswith("eagle3-tree-tuned") for m in methods):
        config["tree"] = asdict(tree_config(args))
    if any(m.startswith("eagle3-tree-tuned") for m in methods):
        config["trees_tuned"] = [asdict(t) for t in tree_candidates(args)]
    progress = out_dir / PROGRESS_FILE
    earlier = []  # the progress file's lines of the prompts an earlier run finished
    if args.resume:
        earlier = read_progress(out_dir, config)
    else:  # on every rank: each refuses alike (nothing is deleted before the first prompt is written)
        check_out_dir(out_dir, args.overwrite)
    if shard is not None:  # every rank has read the progress file before rank 0 writes to it
        dist.barrier(group=shard.group)
    print(json.dumps(config), flush=True)

    tok = load_target_tokenizer(args.tokenizer or gguf)
    prompts = load_benchmark(args.bench, n=args.n, path=args.prompts)
    done = finished_prompts(earlier, prompts, progress)
    if done:
        config["resumed_prompts"] = len(done)
        print(
            f"resuming: {len(done)} of {len(prompts)} prompts finished in {progress}",
            flush=True,
        )
    check_prompt_lengths(args, tok, prompts)
    target = load_model(shard, dtype, gguf)
    context = target.config.max_position_embeddings
    if args.max_prompt_tokens + args.max_new_tokens > context:
        raise UserError(
            f"--max-prompt-tokens {args.max_prompt_tokens} + --max-new-tokens {args.max_new_tokens} run past the "
            f"target's context of {context} tokens"
        )
    eos = target.config.eos_ids
    draft = None
    if any(m.startswith("eagle3") for m in methods):
        draft = load_draft(args.draft, dtype=dtype, device=str(target.device))
    hf = None
    if any(m.startswith("hf-") for m in methods):
        hf = load_hf_reference(gguf, dtype)  # the same GGUF file or HF directory in transformers
    if args.fp8 != "none":
        from maverick.fp8 import convert_to_fp8_weight_only

        if args.fp8 in ("target", "both"):
            convert_to_fp8_weight_only(target)
        if args.fp8 in ("draft", "both") and draft is not None:
            convert_to_fp8_weight_only(draft)
    if any(m.startswith("hf-") and variant(m) for m in methods):
        raise UserError(f"'{FP8_SUFFIX}' and '{Q4_SUFFIX}' apply to our methods only, not HF's")
    targets = {"": target}  # by variant suffix
    if any(variant(m) == FP8_SUFFIX for m in methods):
        from maverick.fp8 import convert_to_fp8_weight_only

        targets[FP8_SUFFIX] = convert_to_fp8_weight_only(copy.deepcopy(target))
    if any(variant(m) in (Q4_SUFFIX, Q4_COMPILED_SUFFIX) for m in methods):
        targets[Q4_SUFFIX] = load_target(gguf, dtype=dtype, q4=True)
    if any(variant(m) == COMPILED_SUFFIX for m in methods):
        targets[COMPILED_SUFFIX] = compiled_engine(target, draft, args)
    if any(variant(m) == Q4_COMPILED_SUFFIX for m in methods):
        targets[Q4_COMPILED_SUFFIX] = compiled_engine(targets[Q4_SUFFIX], draft, args)
    runners = {m: Runner(m, args, targets[variant(m)], draft, hf, eos) for m in methods}

    gen = torch.Generator().manual_seed(args.seed)
    # warm-up: one short generation per method (allocations, lazy init, compile)
    warm = encode_chat(tok, [{"role": "user", "content": "Say hello."}])
    for r in tqdm(runners.values(), desc="warm-up", unit="method", file=sys.stderr, disable=not rank0):
        r.run(warm, 8, gen)

    records: list[RunRecord] = []
    cut: list[str] = []  # prompt turns cut to --max-prompt-tokens (--long-prompts truncate)
    bar = tqdm(
        total=len(prompts) * len(methods), desc="bench", unit="run", file=sys.stderr, disable=not rank0
    )
    try:  # a prompt's records join `records` (and the progress file) once every method has run it
        for i, prompt in enumerate(prompts):
            key = str(prompt["id"])
            if key in done:
                prompt_records, prompt_cut = done[key]
                bar.update(len(methods))
            else:
                prompt_cut = []
                prompt_records = run_prompt(
                    i, prompt, methods, runners, args, tok, eos, prompt_cut, bar, device_for(shard)
                )
                if rank0 and not args.resume and not records:  # the run's first prompt: the file starts here
                    start_progress(progress, config)
                if rank0:
                    append_progress(progress, key, prompt, prompt_records, prompt_cut)
            records.extend(prompt_records)
            cut.extend(prompt_cut)
    except KeyboardInterrupt:  # Ctrl-C: report the prompts every method finished, so nothing done is lost
        if not records:
            raise
        finished = len({r.prompt_id for r in records})
        config["interrupted_after_prompts"] = finished
        print(f"\ninterrupted: the report keeps the {finished} prompts every method finished; the same "
              "command with --resume continues the run", file=sys.stderr)  # fmt: skip
    bar.close()

    greedy = sampling_params(args).greedy  # sampled outputs differ by design: checked in distribution instead
    summaries = summarise(records, baseline="ours-plain", hf_baseline="hf-generate", compare_outputs=greedy)
    for m, r in runners.items():
        base = m.removesuffix(variant(m)).removesuffix(STORE_SUFFIX).removesuffix(LOOKUP_SUFFIX)
        if base == "eagle3-tuned":
            config["tuner" + m.removeprefix("eagle3-tuned")] = _jsonable(r.dec.policy.summary())
        elif base == "eagle3-tree-tuned":  # per tree: cycles, EMA tokens and seconds per cycle
            trees = r.dec.policy.summary()["tree"]
            config["tree_tuner" + m.removeprefix("eagle3-tree-tuned")] = {str(t): v for t, v in trees.items()}
    checks = []
    interrupted = "interrupted_after_prompts" in config
    if not greedy and args.dist_samples > 0 and not interrupted:
        checks = distribution_checks(args, methods, prompts, tok, targets, draft)
        config["distribution_check"] = [asdict(c) | {"passed": c.passed} for c in checks]
    config["truncated_turns"] = len(cut)
    paths = write_report(records, summaries, config, out_dir) if rank0 else {}
    n_prompts = config.get("interrupted_after_prompts", len(prompts))
    print(f"\ntarget {Path(gguf).name}, dtype {args.dtype}, {n_prompts} prompts x {args.turns} turns, "
          f"max_new_tokens {args.max_new_tokens}, temperature {args.temperature}")  # fmt: skip
    ok = print_table(summaries, compact=True)
    if cut:
        print(f"{len(cut)} prompt turns were cut to their last {args.max_prompt_tokens} tokens (--long-prompts "
              f"truncate), e.g. {cut[0]}")  # fmt: skip
    for c in checks:
        verdict = "ok" if c.passed else f"{BOLD_RED}FAIL{RESET}"
        print(f"distribution check {c.method} prompt {c.prompt_id}: TV of the 2nd token {c.tv:.3f} "
              f"(bound {c.bound:.3f}, {c.samples} samples, {c.buckets} buckets): {verdict}")  # fmt: skip
        ok = ok and c.passed
    if paths:  # rank 0's
        print(f"report (every column): {paths['json']}  {paths['markdown']}")
        print(f"plots: {paths['speedup']}  {paths['acceptance']}  {paths['draft_length']}")
    print(json.dumps({s.method: {"tok_s": round(s.tokens_per_s, 2), "tau": s.tau} for s in summaries}))
    if interrupted:
        return INTERRUPTED_STATUS
    return 0 if ok else 1


def run_prompt(i, prompt, methods, runners, args, tok, eos, cut, bar, device="cpu") -> list[RunRecord]:
    """Every method on the i-th prompt's turns (each turn after that method's own earlier answers), the methods
    in an order rotated by i; the prompt's RunRecords (one per method and turn). Sampling draws from a
    generator seeded with --seed + i, so a resumed run samples each prompt as an uninterrupted one would."""
    order = methods[i % len(methods) :] + methods[: i % len(methods)]
    gen = torch.Generator().manual_seed(args.seed + i)
    records = []
    for m in order:
        answers: list[str] = []
        for turn in range(min(args.turns, len(prompt["turns"]))):
            where = f"{m}: prompt {prompt['id']} turn {turn + 1}"
            ids = fit_prompt(chat_ids(tok, prompt, turn, answers), args, where, cut)
            reset_peak_memory(device)
            new, st = runners[m].run(ids, args.max_new_tokens, gen)
            answers.append(answer_text(tok, new, eos))
            records.append(
                RunRecord(
                    method=m,
                    prompt_id=str(prompt["id"]),
                    turn=turn,
                    new_tokens=len(new),
                    seconds=st["seconds"],
                    ttft=st["ttft"],
                    cycles=st.get("cycles", 0),
                    accepted=st.get("accepted", []),
                    draft_lengths=st.get("draft_lengths", []),
                    cut=st.get("cut", []),
                    target_cut=st.get("target_cut", 0),
                    draft_seconds=st.get("draft_seconds", 0.0),
                    verify_seconds=st.get("verify_seconds", 0.0),
                    lookup_cycles=st.get("lookup_cycles", 0),
                    store_cycles=st.get("store_cycles", 0),
                    peak_memory_mb=peak_memory_mb(device),
                    output_ids=new,
                    dtype=args.dtype,
                )
            )
        bar.update(1)
    return records


# ---- the progress file: nothing finished is lost, and --resume continues from it ----


def _settings(config: dict) -> dict:
    """The settings a resumed run must share with the run it continues (as JSON reads them back)."""
    return json.loads(json.dumps({k: v for k, v in config.items() if k not in RESUME_FREE}, default=str))


def _prompt_sha(prompt: dict) -> str:
    return hashlib.sha256(json.dumps(prompt, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """A new run: refuse an --out holding an earlier one unless --overwrite (its records go when this run's
    first prompt is written, so a run refused or stopped before then changes nothing)."""
    held = [p.name for p in (out_dir / PROGRESS_FILE, out_dir / "report.json") if p.exists()]
    if held and not overwrite:
        raise UserError(
            f"{out_dir} holds an earlier run ({', '.join(held)}): --resume continues it, --overwrite starts "
            "again, or give another --out"
        )
    # the report's other files, without a run's records: a user's report.md or plot would be replaced
    other = [n for n in REPORT_FILES if (out_dir / n).exists()]
    if other and not overwrite:
        raise UserError(
            f"{out_dir} holds {', '.join(other)}, which this run writes: --overwrite replaces it, or give "
            "another --out"
        )


def start_progress(path: Path, config: dict) -> None:
    """The progress file's header with this run's settings (temporary name, rename), replacing an earlier
    run's records and report (--overwrite)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / "report.json").unlink(missing_ok=True)
    atomic_write(path, json.dumps({"settings": _settings(config)}) + "\n")


def read_progress(out_dir: Path, config: dict) -> list[dict]:
    """--resume: the finished prompts' lines of out_dir's progress file, after checking its settings are this
    run's. A partial last line (a run killed mid-write) is cut off once every whole line has been read."""
    path = out_dir / PROGRESS_FILE
    if not path.exists():
        held = (
            " (its report.json was written by a version without one)"
            if (out_dir / "report.json").exists()
            else ""
        )
        raise UserError(f"--resume: {path} does not exist{held}; run without --resume to start")
    data = path.read_bytes()
    keep = data[: data.rfind(b"\n") + 1]
    lines = []
    for n, line in enumerate(keep.splitlines(), 1):
        try:
            lines.append(json.loads(line))
            ok = (
                "settings" in lines[-1]
                if n == 1
                else {"prompt_id", "prompt_sha", "records"} <= set(lines[-1])
            )
        except (ValueError, TypeError):
            ok = False
        if not ok:
            raise UserError(
                f"{path}: line {n} is not a line of eval.bench's progress file; give another --out"
            )
    if not lines:
        raise UserError(
            f"{path}: no settings line; run without --resume (and with --overwrite) to start again"
        )
    was, now = lines[0]["settings"], _settings(config)
    diff = {k: (was.get(k), now.get(k)) for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)}
    if diff:
        shown = "; ".join(f"{k}: {a!r} then, {b!r} now" for k, (a, b) in diff.items())
        raise UserError(f"{path}: cannot resume with different settings ({shown})")
    if len(keep) != len(data):
        atomic_write(path, keep)
    return lines[1:]


def finished_prompts(
    lines: list[dict], prompts: list[dict], path: Path
) -> dict[str, tuple[list[RunRecord], list[str]]]:
    """The records and cut turns of the finished prompts by prompt id, each checked to be one of this run's
    prompts (the same text: the progress file keeps a digest of each)."""
    shas = {str(p["id"]): _prompt_sha(p) for p in prompts}
    done = {}
    for line in lines:
        key = line["prompt_id"]
        if key not in shas:
            raise UserError(
                f"{path}: prompt {key} was run but is not among this run's {len(prompts)} prompts (a smaller "
                "--n, or another prompts file?)"
            )
        if line["prompt_sha"] != shas[key]:
            raise UserError(
                f"{path}: prompt {key} has another text than when it was run (the prompts file changed?)"
            )
        try:
            done[key] = [RunRecord.from_dict(r) for r in line["records"]], list(line.get("cut", []))
        except (ValueError, TypeError) as e:
            raise UserError(f"{path}: prompt {key}: {e}") from None
    return done


def append_progress(path: Path, key: str, prompt: dict, records: list[RunRecord], cut: list[str]) -> None:
    """One finished prompt's records (and its turns cut by --long-prompts truncate) as one line, flushed to
    disk before the next prompt starts."""
    line = {
        "prompt_id": key,
        "prompt_sha": _prompt_sha(prompt),
        "records": [asdict(r) for r in records],
        "cut": cut,
    }
    with path.open("a") as f:
        f.write(json.dumps(line, separators=(",", ":")) + "\n")
        f.flush()
        os.fsync(f.fileno())


def sampling_params(args) -> SamplingParams:
    return SamplingParams(args.temperature, args.top_k, args.top_p)


def distribution_checks(args, methods, prompts, tok, targets, draft) -> list[DistCheck]:
    """At temperature > 0: each of our methods against the exact marginal of its target (eval/distcheck.py),
    on the first turn of the first --dist-prompts prompts; fresh decoders sized for the check."""
    sampling = sampling_params(args)
    gen = torch.Generator().manual_seed(args.seed + 1)
    checks = []
    ours = [m for m in methods if not m.startswith("hf-") and not is_llama_cpp(m)]
    bar = tqdm(
        total=len(ours) * min(args.dist_prompts, len(prompts)), desc="distribution check", file=sys.stderr
    )
    for prompt in prompts[: args.dist_prompts]:
        ids = fit_prompt(chat_ids(tok, prompt, 0, []), args, f"prompt {prompt['id']}", [])
        for m in ours:
            base = m.removesuffix(variant(m))
            t = targets[variant(m)]
            dec = build_decoder(base, t, draft, len(ids) + 64, args)

            def generate(rows, n, dec=dec):
                return dec.generate(rows, n, sampling, (), gen).tokens

            batch_ok = not base.startswith("eagle3-tree")
            checks.append(check_method(m, str(prompt["id"]), generate, batch_ok, t, ids, sampling,
                                       samples=args.dist_samples))  # fmt: skip
            bar.update(1)
    bar.close()
    return checks


def _jsonable(x):
    return json.loads(
        json.dumps(x, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))
    )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_cli(main)
