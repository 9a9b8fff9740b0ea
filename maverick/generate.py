"""Plain autoregressive decoding on the static cache: the baseline every speedup is measured against.

    python -m maverick.generate --prompt "Write a haiku about CPUs" --chat

(The same prompt decoded speculatively with an EAGLE-3 draft: `python -m eagle3.generate`.)

Prompts of different lengths share one batch: they are right-padded for the prefill, then each row's
cache length is set to its own prompt length, so every row continues from its own position (no left
padding, no position shifts).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from maverick.cli import ArgumentParser, UserError, add_threads_option, positive_int, run_cli, write_stdout
from maverick.compiled import for_engine
from maverick.kv_cache import KVCache
from maverick.model import Llama4
from maverick.sampling import SamplingParams, add_sampling_options, logits_to_probs, sample


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per row (up to and including a stop token)
    prompt_lengths: list[int]
    seconds: float
    ttft: float  # time to the first new token (prefill + first sample)
    stats: dict = field(default_factory=dict)

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def pick(logits: Tensor, sampling: SamplingParams | None, generator: torch.Generator | None) -> Tensor:
    """logits [B, V] -> next tokens [B]."""
    if sampling is None or sampling.temperature == 0:
        return logits.argmax(dim=-1)
    return sample(logits_to_probs(logits.float(), sampling), generator)


def prefill(model: Llama4, cache: KVCache, prompts: Sequence[Sequence[int]], **kw) -> tuple[Tensor, object]:
    """Write the prompts into an empty cache; return the logits of each row's last prompt token [B, V]
    and the model output (for features)."""
    B = len(prompts)
    if B != cache.batch_size:
        raise ValueError(f"{B} prompts for a cache of batch size {cache.batch_size}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    lens = torch.tensor([len(p) for p in prompts], device=model.device)
    T = int(lens.max())
    tokens = torch.zeros(B, T, dtype=torch.long, device=model.device)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.as_tensor(p, device=model.device)
    cache.reset()
    # a compiled engine prefills eagerly, so that a prompt's bits do not depend on its batch-mates' lengths
    forward = getattr(model, "prefill", model)
    out = forward(tokens, cache=cache, logits=(lens - 1)[:, None], **kw)
    cache.truncate(lens)
    return out.logits[:, 0], out


def check_lengths(
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    context: int,
    what: str = "prompt",
    vocab_size: int | None = None,
) -> None:
    """Before any work: a negative count is a bug of the caller's; a prompt that, with its new tokens,
    runs past the target's context (max_position_embeddings) is the user's, named with its length, and so
    is a token id outside the target's vocabulary (ids from another tokenizer), named with the id."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    for b, p in enumerate(prompts):
        row = f" {b}" if len(prompts) > 1 else ""
        if not len(p):
            raise UserError(f"{what}{row} is empty: a prompt needs at least one token")
        if vocab_size is not None:
            lo, hi = min(p), max(p)
            if lo < 0 or hi >= vocab_size:
                raise UserError(
                    f"{what}{row} holds token id {lo if lo < 0 else hi}, outside the target's vocabulary of "
                    f"{vocab_size} (ids 0..{vocab_size - 1}): ids of another tokenizer?"
                )
        if len(p) + max_new_tokens > context:
            raise UserError(
                f"{what}{row} is {len(p)} tokens; with {max_new_tokens} new tokens that runs past the "
                f"target's context of {context} tokens (max_position_embeddings): shorten it or lower "
                "--max-new-tokens"
            )


def decode_window(prompts: Sequence[Sequence[int]], max_new_tokens: int, max_len: int) -> int:
    """The fixed key window of one generation: prompt + new tokens + 64 slots for drafted tokens, rounded
    up to 64. Plain and speculative decoding of the same request use the same window, which is what makes
    their logits bit-identical (model.exact_attention)."""
    need = max(len(p) for p in prompts) + max_new_tokens + 64
    return min(max_len, -(-need // 64) * 64)


def stop_set(stop_ids) -> set[int]:
    """The stop tokens as ints. A tensor's or an array's elements hash by identity, not value: a set of them
    never holds a token id, and a generation given them would run on to its budget."""
    if hasattr(stop_ids, "tolist"):  # a tensor or a numpy array, of any shape
        stop_ids = stop_ids.reshape(-1).tolist()
    return {int(t) for t in stop_ids}


class Decoder:
    """Holds a model, its static cache and the (optionally compiled) one-token step."""

    def __init__(
        self,
        model: Llama4,
        max_len: int = 2048,
        batch_size: int = 1,
        compile: bool = False,
        exact: bool = True,
        engine: str = "eager",
    ):
        """exact=False: the fused attention kernel over the keys in use instead of the fixed-window exact
        attention; several times faster for large batches, but its logits may differ from speculative
        decoding's in the last bit (fine for data generation, not for the bit-exact baseline).
        engine="compiled": every step on the compiled engine (maverick/compiled.py; `model` may already be
        one, shared with speculative decoders)."""
        self.model = model = for_engine(model, engine, max_len)
        self.max_len = max_len  # a compiled engine's caches hold more slots (whole blocks): not theirs
        self.exact, self.compiled_step = exact, compile
        self.cache = self._new_cache(batch_size, max_len)
        self.step = torch.compile(self._step, dynamic=False) if compile else self._step

    def _new_cache(self, batch_size: int, max_len: int) -> KVCache:
        cache = self.model.new_cache(batch_size, max_len, exact=self.exact)
        if self.compiled_step:  # fixed shapes: attend over the whole preallocated cache, every cache alike
            cache.slice_to_bound = False
        return cache

    def _step(self, tokens: Tensor) -> Tensor:
        return self.model(tokens[:, None], cache=self.cache, logits="all").logits[:, -1]

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 128,
        sampling: SamplingParams | None = None,
        stop_ids: Sequence[int] = (),
        generator: torch.Generator | None = None,
        on_tokens: Callable[[Tensor], None] | None = None,
        stop_check: Callable[[list[int]], bool] | None = None,
        drop_finished: bool = False,
    ) -> Generation:
        """Decode until every row hit a stop token / `stop_check` or max_new_tokens. drop_finished: remove
        finished rows from the batch (and the cache) as they end, for throughput jobs; `on_tokens` then
        sees only the live rows, and a compiled step recompiles for each new batch size."""
        B = len(prompts)
        c = self.model.config
        check_lengths(prompts, max_new_tokens, c.max_position_embeddings, vocab_size=c.vocab_size)
        if B != self.cache.batch_size:
            self.cache = self._new_cache(B, self.max_len)
        if max(len(p) for p in prompts) + max_new_tokens > self.max_len:
            raise ValueError(f"prompt + {max_new_tokens} new tokens exceed the cache ({self.max_len})")
        t0 = time.perf_counter()
        window = decode_window(prompts, max_new_tokens, self.cache.max_len) if self.exact else None
        self.cache.set_window(window)
        logits, _ = prefill(self.model, self.cache, prompts)
        out = [[] for _ in range(B)]
        done = [False] * B
        stop = stop_set(stop_ids)
        ttft = 0.0
        live = list(range(B))  # cache row j holds prompt live[j]
        for i in range(max_new_tokens):
            tok = pick(logits, sampling, generator)
            toks = tok.tolist()
            if i == 0:
                ttft = time.perf_counter() - t0
            for j, b in enumerate(live):
                if not done[b]:
                    out[b].append(toks[j])
                    done[b] = toks[j] in stop or (stop_check is not None and stop_check(out[b]))
            if on_tokens is not None:
                on_tokens(tok)
            if all(done) or i == max_new_tokens - 1:
                break
            n_done = sum(done[b] for b in live)
            if drop_finished and n_done * 4 >= len(live):  # copying the cache pays once a quarter is idle
                keep = [j for j, b in enumerate(live) if not done[b]]
                idx = torch.tensor(keep, device=tok.device)
                self.cache.select_rows(idx)
                live, tok = [live[j] for j in keep], tok[idx]
            logits = self.step(tok)
        if len(live) != B:  # a fresh full-size cache for the next call
            self.cache = self._new_cache(B, self.max_len)
        return Generation(out, [len(p) for p in prompts], time.perf_counter() - t0, ttft)


class TextStream:
    """Writes an answer to stdout as its tokens arrive: the tokens so far are decoded whole each time and only
    the new end of the text is written. A character whose bytes span tokens (an emoji, CJK: byte-level BPE)
    decodes to U+FFFD until its last byte arrives, so a trailing U+FFFD is held back until the next token
    (or `finish`): what is written is the final text."""

    def __init__(self, tokenizer, show: bool = True):
        self.tokenizer, self.show = tokenizer, show
        self.ids: list[int] = []
        self.text = ""  # the decoded text so far
        self.shown = ""  # what was written

    def add(self, ids: Sequence[int]) -> None:
        self.ids.extend(int(t) for t in ids)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        self._write(self.text.rstrip("\ufffd"))

    def finish(self) -> None:
        """Write what was held back (a U+FFFD the answer really ends with)."""
        self._write(self.text)

    def _write(self, upto: str) -> None:
        if not upto.startswith(self.shown) or len(upto) == len(self.shown):
            return  # nothing new (a decoded prefix never changes once its characters are whole)
        if self.show:
            write_stdout(upto[len(self.shown) :])  # a Ctrl-C's message starts its own line (maverick/cli.py)
        self.shown = upto


def main(argv: Sequence[str] | None = None) -> None:
    from maverick.parallel import init_from_env, load_model
    from maverick.target import TARGET_HELP, load_target_tokenizer
    from maverick.tokenizer import encode_chat

    ap = ArgumentParser(
        prog="python -m maverick.generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--target", "--gguf", "--hf", dest="target", default=None,
                    help=TARGET_HELP + "; under torchrun each rank reads only its slices of an HF directory")  # fmt: skip
    ap.add_argument("--tokenizer", default=None,
                    help="GGUF file or HF directory with the tokenizer (default: the target's own)")  # fmt: skip
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    ap.add_argument("--max-new-tokens", type=positive_int, default=256)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    add_sampling_options(ap)
    ap.add_argument("--compile", action="store_true", help="torch.compile the eager one-token step")
    ap.add_argument("--engine", choices=["eager", "compiled"], default="eager",
                    help="compiled: whole-model compiled graphs (maverick/compiled.py); with --q4 the int4 kernel inside them")  # fmt: skip
    ap.add_argument("--q4", action="store_true",
                    help="keep the GGUF's quantised linears packed (bf16: maverick/q4.py; fp32: maverick/codes.py): faster decoding")  # fmt: skip
    add_threads_option(ap)
    args = ap.parse_args(argv)
    shard = init_from_env()  # torchrun: tensor + expert parallel over the group (maverick/parallel.py)
    if shard is not None and (args.q4 or args.compile or args.engine == "compiled"):
        ap.error("--q4, --compile and --engine compiled run in one process only: drop them under torchrun")

    if args.q4 and args.compile:
        ap.error("--q4 with --compile would trace the dense weights: use --engine compiled with --q4")
    if args.q4 and args.engine == "compiled" and args.dtype != "bf16":
        ap.error("--q4 --engine compiled runs the int4 kernel on bf16: add --dtype bf16 or drop --q4")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = load_model(shard, dtype, args.target, q4=args.q4)
    tok = load_target_tokenizer(args.tokenizer or args.target)
    if args.chat:
        ids = encode_chat(tok, [{"role": "user", "content": args.prompt}])
    else:
        ids = tok.encode(args.prompt)
    check_lengths([ids], args.max_new_tokens, model.config.max_position_embeddings, "--prompt")
    dec = Decoder(model, max_len=len(ids) + args.max_new_tokens + 8, compile=args.compile, engine=args.engine)
    if args.engine == "compiled":
        secs = dec.model.compile()
        print(json.dumps({"compile_s": round(sum(secs.values()), 1), "buckets": list(secs)}), flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    stream = TextStream(tok, show=shard is None or shard.rank == 0)
    res = dec.generate(
        [ids], args.max_new_tokens, sampling, model.config.eos_ids, gen, on_tokens=lambda t: stream.add(t[:1])
    )
    stream.finish()
    n = res.new_tokens
    stats = {"new_tokens": n, "seconds": round(res.seconds, 3), "tokens_per_s": round(n / res.seconds, 2)}
    stats |= {
        "ttft_s": round(res.ttft, 3),
        "dtype": args.dtype,
        "compile": args.compile,
        "engine": args.engine,
    }
    stats["q4"] = args.q4
    if shard is None or shard.rank == 0:
        write_stdout("\n" + json.dumps(stats | {"ranks": shard.world if shard else 1}) + "\n")


if __name__ == "__main__":
    run_cli(main)
