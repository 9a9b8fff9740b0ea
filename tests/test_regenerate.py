"""train.regenerate on the real target: the target's own greedy answers, appended batch by batch, resumable,
and stopped cleanly by a time budget."""

import json

import torch

from maverick.generate import Decoder
from maverick.gguf_model import load_gguf_model
from maverick.tokenizer import encode_chat, load_tokenizer
from train.data import load_chats
from train.regenerate import regenerate

CONVS = [
    {"id": f"q{i}", "messages": [{"role": "user", "content": q}]}
    for i, q in enumerate(["What is 2+2?", "Name a colour.", "Say hi.", "What is the capital of France?"])
]


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_regenerate_answers_resumes_and_stops_on_time(tmp_path):
    out = tmp_path / "chats.jsonl"
    kw = dict(turns=1, max_new_tokens=6, max_prompt_tokens=64, batch_size=2, dtype=torch.float32)
    stats = regenerate(CONVS, out, max_seconds=0, **kw)  # the budget is spent after the first batch
    assert (stats["conversations"], stats["left"]) == (2, 2)
    first = records(out)
    assert len(first) == 2

    # a write cut off mid-line: the partial record is dropped and its conversation answered again
    out.write_text(out.read_text() + '{"id": "q9", "mess')
    stats = regenerate(CONVS, out, **kw)
    assert (stats["conversations"], stats["left"]) == (2, 0)
    got = {r["id"]: r["messages"] for r in records(out)}
    assert sorted(got) == ["q0", "q1", "q2", "q3"] and records(out)[:2] == first
    assert regenerate(CONVS, out, **kw)["conversations"] == 0  # nothing left to do

    # each answer is the target's greedy continuation of the chat prompt (one row at a time here)
    model, tok = load_gguf_model(dtype=torch.float32), load_tokenizer()
    dec = Decoder(model, max_len=80, exact=False)
    for c in CONVS:
        user, answer = got[c["id"]]
        assert user == c["messages"][0] and answer["role"] == "assistant"
        ids = dec.generate([encode_chat(tok, [user])], 6, stop_ids=model.config.eos_ids).tokens[0]
        assert answer["content"] == tok.decode(ids, skip_special_tokens=True)
        # an answer cut at the budget says so (train.stage_data neither closes nor continues it)
        assert answer.get("cut", False) is (ids[-1] not in model.config.eos_ids)
    assert sum(m.get("cut", False) for _, m in got.values()) >= 2  # 6 tokens cut most answers
    assert [c["messages"] for c in load_chats(out)] == [r["messages"] for r in records(out)]


def test_a_first_prompt_past_the_limit_is_said_and_not_tried_again(tmp_path):
    """A conversation whose first prompt exceeds --max-prompt-tokens vanished without a word (counted as done,
    nothing written, nothing skipped) and every rerun tried it again."""
    out = tmp_path / "chats.jsonl"
    convs = [CONVS[0], {"id": "long", "messages": [{"role": "user", "content": "word " * 60}]}]
    kw = dict(turns=1, max_new_tokens=4, max_prompt_tokens=40, batch_size=2, dtype=torch.float32)
    stats = regenerate(convs, out, **kw)
    assert (stats["conversations"], stats["too_long"], stats["empty_answers"]) == (2, 1, 0)
    assert [r["id"] for r in records(out)] == ["q0"]
    skipped = records(tmp_path / "chats.skipped.jsonl")
    assert [s["id"] for s in skipped] == ["long"] and "> --max-prompt-tokens 40" in skipped[0]["reason"]
    assert regenerate(convs, out, **kw)["conversations"] == 0  # not tried again
