"""llama.cpp as a peer row in eval.bench: the same GGUF file, prompt token ids (our chat template), token
budget and stop tokens, through llama-cpp-python, an optional extra:

    pip install llama-cpp-python        # or: pip install -e '.[llamacpp]'   (compiles llama.cpp, ~15 min on 2 cores)

Methods: `llama.cpp` (plain decoding) and `llama.cpp-prompt-lookup` (the binding's
LlamaPromptLookupDecoding, where the installed version has it). llama.cpp decodes the file's own
quantised weights with its own kernels, so its tokens may differ from ours: like HF's rows, its mismatches
are shown, not failures. The time of a call includes the whole prompt's processing, as ours does (the
binding's reuse of the previous call's matching prefix is switched off). Sampled rows: llama.cpp scales by
the temperature after top-p, ours (and HF) before, so a temperature other than 1 with top-p < 1 is refused.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from maverick.cli import UserError

PREFIX = "llama.cpp"
METHODS = (PREFIX, PREFIX + "-prompt-lookup")
INSTALL = "pip install llama-cpp-python (or pip install -e '.[llamacpp]')"


class LlamaCppMissing(UserError):
    """llama-cpp-python (or the part of it a method needs) is not installed: a user error, not a bug."""


def is_llama_cpp(method: str) -> bool:
    return method.startswith(PREFIX)


def require(method: str):
    """What `method` needs from llama-cpp-python (the module it uses), or LlamaCppMissing saying how to
    install it; cheap, so eval.bench checks before it loads anything."""
    if method not in METHODS:
        raise UserError(f"unknown llama.cpp method {method!r}; known: {', '.join(METHODS)}")
    try:
        import llama_cpp
    except ImportError as e:
        raise LlamaCppMissing(
            f"method {method} needs llama-cpp-python, which is not installed: {INSTALL}"
        ) from e
    if not method.endswith("-prompt-lookup"):
        return llama_cpp
    try:
        from llama_cpp import llama_speculative
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # noqa: F401
    except ImportError as e:
        raise LlamaCppMissing(
            f"method {method}: this llama-cpp-python ({getattr(llama_cpp, '__version__', '?')}) has no "
            "LlamaPromptLookupDecoding; upgrade it (pip install -U llama-cpp-python)"
        ) from e
    return llama_speculative


def check_sampling(sampling, method: str = PREFIX) -> None:
    """A UserError where llama.cpp would sample another distribution than ours: its chain cuts by top-p
    before it scales by the temperature (top-k and min-p 0 commute with the scaling)."""
    if sampling is None or sampling.temperature in (0, 1) or sampling.top_p >= 1:
        return
    raise UserError(
        f"method {method}: llama.cpp applies --top-p {sampling.top_p} before --temperature "
        f"{sampling.temperature}, ours after, so its samples would come from another distribution; give "
        "--top-p 1 or --temperature 1 (or leave out the llama.cpp rows)"
    )


class LlamaCpp:
    """One llama.cpp model for one method: `run(ids, max_new_tokens, sampling)` -> (new ids, stats)."""

    def __init__(
        self,
        method: str,
        gguf: str,
        n_ctx: int,
        eos: Sequence[int],
        threads: int = 2,
        lookup_tokens: int = 10,
    ):
        kw = {}
        if method.endswith("-prompt-lookup"):
            kw["draft_model"] = require(method).LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens)
        else:
            require(method)
        import llama_cpp

        self.method, self.eos = method, set(eos)
        self.llm = llama_cpp.Llama(
            model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False, **kw
        )

    def run(self, ids: list[int], max_new_tokens: int, sampling) -> tuple[list[int], dict]:
        """Greedy (temperature 0) or sampled with the same temperature / top-k / top-p; no repetition
        penalty, no min-p (llama.cpp's defaults would change the distribution)."""
        check_sampling(sampling, self.method)
        greedy = sampling is None or sampling.temperature == 0
        kw = dict(temp=0.0, top_k=1, top_p=1.0) if greedy else dict(
            temp=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p
        )  # fmt: skip
        new: list[int] = []
        t0 = time.perf_counter()
        first = None
        self.llm.reset()  # generate(reset=True) still reuses the previous call's matching prefix
        for t in self.llm.generate(ids, reset=True, min_p=0.0, repeat_penalty=1.0, **kw):
            if first is None:
                first = time.perf_counter()
            new.append(int(t))
            if new[-1] in self.eos or len(new) >= max_new_tokens:
                break
        dt = time.perf_counter() - t0
        return new, {"seconds": dt, "ttft": (first or time.perf_counter()) - t0}
