"""train.fastgen: continuous batching gives each conversation the tokens of plain decoding on its own, turn
after turn; the CUDA graph replays give the eager step's tokens; answer files survive a cut-off write."""

import json
import lzma

import pytest
import torch

from maverick.config import get_config
from maverick.generate import Decoder
from maverick.kv_cache import KVCache
from maverick.model import Llama4
from train import answers
from train.fastgen import Conversation, FastGenerator

STOP = list(range(5, 512, 13))  # ~8% of the vocabulary: answers end at varied lengths, rows get refilled


def tiny_model(dtype=torch.float32, device="cpu") -> Llama4:
    torch.manual_seed(0)
    model = Llama4(get_config("tiny-dense"))
    # tied embeddings with small weights repeat one token forever; larger ones give varied answers
    model.init_weights(std=0.15, generator=torch.Generator().manual_seed(1))
    return model.to(device=device, dtype=dtype).eval()


def conversations(n: int, seed: int = 0) -> list[Conversation]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        turns = int(torch.randint(1, 4, (1,), generator=g))
        prompts = [torch.randint(8, 512, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(turns)]  # fmt: skip
        out.append(Conversation(f"c{i}", prompts))
    return out


def reference(model, conv: Conversation, max_new: int, max_len: int) -> dict:
    """Plain decoding, one conversation at a time: turn k's prompt is everything before it."""
    dec = Decoder(model, max_len=max_len, exact=False)
    ctx, rec = [], {"id": conv.id, "prompts": [], "answers": []}
    for p in conv.prompts:
        if len(ctx) + len(p) + max_new > max_len:
            break
        ctx = ctx + p
        ans = dec.generate([ctx], max_new, stop_ids=STOP).tokens[0]
        rec["prompts"].append(p)
        rec["answers"].append(ans)
        ctx = ctx + ans
        if ans[-1] not in STOP:
            break
    return rec


def generate(model, convs, **kw) -> tuple[dict, object]:
    got = {}
    gen = FastGenerator(model, stop_ids=STOP, **kw)
    stats = gen.run(convs, lambda a: got.__setitem__(a.id, a.record()))
    return got, stats


@pytest.mark.parametrize("prefill_rows", [None, 4])  # the CPU's 2 rows a forward; 4 padded together
def test_continuous_batching_equals_plain_decoding_per_conversation(prefill_rows):
    model = tiny_model()
    convs = conversations(14)
    got, stats = generate(
        model, convs, batch_size=4, max_len=96, max_new_tokens=12, slot_bucket=32, refill_min=2,
        prefill_rows=prefill_rows,
    )  # fmt: skip
    want = {c.id: reference(model, c, 12, 96) for c in convs}
    assert got == want
    # the test exercises what it claims: refills, early stops, several turns, some cut by max_new
    ans = [a for r in want.values() for a in r["answers"]]
    assert any(a[-1] in STOP for a in ans) and any(len(a) == 12 and a[-1] not in STOP for a in ans)
    assert any(len(r["answers"]) > 1 for r in want.values())
    assert stats.conversations == 14 and stats.turns == len(ans) and stats.new_tokens == sum(map(len, ans))


def test_prompts_too_long_are_skipped_and_turns_stop_at_max_len():
    model = tiny_model()
    long = Conversation("long", [list(range(8, 100))])
    multi = Conversation("multi", [list(range(8, 40)), list(range(8, 40)), list(range(8, 40))])
    got, stats = generate(model, [long, multi], batch_size=2, max_len=96, max_new_tokens=12)
    assert stats.skipped == 1 and "long" not in got
    assert got["multi"] == reference(model, multi, 12, 96)
    assert sum(map(len, got["multi"]["prompts"])) + sum(map(len, got["multi"]["answers"])) <= 96


def test_deadline_drops_running_conversations():
    model = tiny_model()
    got, stats = generate(model, conversations(6), batch_size=2, max_len=96, max_new_tokens=12)
    gen = FastGenerator(model, batch_size=2, max_len=96, max_new_tokens=12, stop_ids=STOP)
    seen = []
    s = gen.run(conversations(6), seen.append, deadline=0.0)
    assert seen == [] and s.conversations == 0


def test_prefix_view_shares_the_cache_and_keeps_every_attribute():
    cache = KVCache(2, 3, 16, 2, 4)
    cache.exact, cache.note = False, "an attribute KVCache.__init__ does not know"
    view = cache.prefix_view(8)
    assert view.k.shape[3] == 8 and cache.k.shape[3] == 16 and (view.max_len, cache.max_len) == (8, 16)
    assert view.lengths is cache.lengths and view.k.data_ptr() == cache.k.data_ptr()
    assert not view.exact and view.note == cache.note and not view.slice_to_bound and cache.slice_to_bound
    new = torch.ones(3, 2, 1, 4)
    view.write(0, new, new, view.kv_len(1))
    view.advance(1)
    assert cache.k[0, :, :, 0].eq(1).all() and cache.lengths.tolist() == [1, 1, 1]


def test_decode_step_has_no_host_read():
    """A CUDA graph captures only device work: a host read (.item(), .tolist(), a branch on a tensor) inside
    the step would fail the capture on the GPU, and the stage would decode eagerly at a fraction of the speed.
    Checked here on the CPU: dynamo traces each bucket's step as one graph (fullgraph=True breaks on a host
    read). The control: the same step with a host read in it does not trace."""
    import torch._dynamo

    gen = FastGenerator(tiny_model(), batch_size=4, max_len=256, max_new_tokens=8, stop_ids=STOP)
    with torch.no_grad():
        for n in gen._buckets:
            torch._dynamo.reset()
            torch.compile(gen._step, fullgraph=True, backend="eager")(gen._views[n])

        def with_host_read(view):
            gen._step(view)
            if gen.tok.sum().item() > 0:
                gen.tok.add_(0)

        torch._dynamo.reset()
        with pytest.raises(Exception, match="(?i)data-dependent|graph break"):
            torch.compile(with_host_read, fullgraph=True, backend="eager")(gen._views[gen._buckets[0]])
    torch._dynamo.reset()


def test_answer_file_appends_streams_and_drops_a_cut_off_write(tmp_path):
    path = tmp_path / "answers.jsonl.xz"
    recs = [{"id": f"a{i}", "prompts": [[1, 2]], "answers": [[3, i]]} for i in range(5)]
    answers.append(path, recs[:2])
    answers.append(path, recs[2:4])
    assert answers.read_records(path) == recs[:4]
    good = path.read_bytes()
    blob = lzma.compress(b'{"id": "a4"}\n', format=lzma.FORMAT_XZ)
    path.write_bytes(good + blob[: len(blob) // 2])  # a write killed half-way
    assert answers.read_records(path) == recs[:4]
    assert answers.repair(path) == (recs[:4], len(blob) // 2) and path.read_bytes() == good
    answers.append(path, recs[4:])
    assert answers.read_records(path) == recs
    assert answers.sample(recs[0]) == {"input_ids": [1, 2, 3, 0], "loss_mask": [0, 0, 1, 1]}


def test_answer_file_damaged_stream_is_an_error_never_a_cut(tmp_path):
    """A damaged byte in the first of three streams read as no records, and `repair` (every train.stage
    rerun) cut the file to 0 bytes, deleting the two whole streams after it. Only running out of data is a
    cut-off write; a damaged stream, even the last, is an error naming its byte, and the file stays as is."""
    from maverick.cli import UserError

    path = tmp_path / "answers.jsonl.xz"
    recs = [{"id": f"a{i}", "prompts": [[1, 2]], "answers": [[3, i] * 20]} for i in range(6)]
    n1 = answers.append(path, recs[:2])
    n2 = answers.append(path, recs[2:4])
    answers.append(path, recs[4:])
    good = path.read_bytes()
    # a byte inside the first stream's data; the block header size of the second and of the last (the
    # decoder then waits for bytes that never come, as after a cut); a byte of the last stream's index
    damaged = ((n1 // 2, 0), (n1 + 12, n1), (n1 + n2 + 12, n1 + n2), (len(good) - 20, n1 + n2))
    for byte, stream_at in damaged:
        bad = bytearray(good)
        bad[byte] ^= 0x80
        path.write_bytes(bytes(bad))
        for read in (answers.read_records, answers.repair):
            with pytest.raises(UserError, match=f"{path}: the xz stream at byte {stream_at} is damaged"):
                read(path)
            assert path.read_bytes() == bad
    path.write_bytes(good[:3])  # a first write cut off inside the xz magic is a cut, not a foreign file
    assert answers.repair(path) == ([], 3) and path.read_bytes() == b""


def test_answer_file_cut_write_followed_by_zero_bytes_is_a_cut(tmp_path):
    """A power loss can leave an append's blocks unwritten: the file's length covers the write, the bytes
    read as zeros. That read as a damaged stream (an error, every rerun of the stage stopped) where it is a
    cut-off write: the whole streams before it are the records, `repair` cuts the rest off."""
    path = tmp_path / "answers.jsonl.xz"
    recs = [{"id": f"a{i}", "prompts": [[1, 2]], "answers": [[3, i]]} for i in range(5)]
    answers.append(path, recs[:2])
    answers.append(path, recs[2:4])
    good = path.read_bytes()
    blob = lzma.compress(json.dumps(recs[4]).encode() + b"\n", format=lzma.FORMAT_XZ)
    for tail in (blob[: len(blob) // 2] + bytes(4096), bytes(len(blob)), blob[:3] + bytes(9)):
        path.write_bytes(good + tail)
        assert answers.read_records(path) == recs[:4]
        assert answers.repair(path) == (recs[:4], len(tail)) and path.read_bytes() == good
        answers.append(path, recs[4:])
        assert answers.read_records(path) == recs
    path.write_bytes(good + bytes(8))  # zeros after whole streams: cut off too (an append writes none)
    assert answers.repair(path) == (recs[:4], 8) and path.read_bytes() == good
    path.write_bytes(bytes(len(blob)))  # a first write lost whole
    assert answers.read_records(path) == [] and answers.repair(path) == ([], len(blob))
    assert path.read_bytes() == b""


def test_answer_file_kind_is_its_content_and_a_whole_last_line_counts(tmp_path):
    """`write` writes xz whatever the name, and a name not ending in .xz was read as plain JSONL: no records.
    A plain file's last line without a newline was dropped even when whole; only a cut-off one is."""
    recs = [{"id": f"a{i}", "prompts": [[1, 2]], "answers": [[3, i]]} for i in range(3)]
    answers.write(tmp_path / "c.jsonl", recs)
    assert answers.read_records(tmp_path / "c.jsonl") == recs
    plain = tmp_path / "p.jsonl"
    plain.write_text("\n".join(json.dumps(r) for r in recs))
    assert answers.read_records(plain) == recs
    plain.write_text("".join(json.dumps(r) + "\n" for r in recs[:2]) + json.dumps(recs[2])[:-5])
    assert answers.read_records(plain) == recs[:2]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replays_equal_the_eager_step():
    model = tiny_model(torch.bfloat16, "cuda")
    convs = conversations(40, seed=3)
    kw = dict(batch_size=8, max_len=128, max_new_tokens=16, slot_bucket=32, refill_min=2)
    graph, gs = generate(model, convs, graphs=True, **kw)
    eager, es = generate(model, convs, graphs=False, **kw)
    assert graph == eager and gs.new_tokens == es.new_tokens > 0
    # and plain decoding of each conversation on the GPU gives the same tokens (fp32: no near-ties flip)
    model32 = tiny_model(torch.float32, "cuda")
    got, _ = generate(model32, convs[:10], graphs=True, **kw)
    assert got == {c.id: reference(model32, c, 16, 128) for c in convs[:10]}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_triton_decode_attention_reads_each_rows_keys_only():
    from maverick.decode_attention import grouped_decode_attention, kernel_ok, triton_decode_attention

    assert kernel_ok("cuda:0", torch.bfloat16, 9, 3, 64)
    g = torch.Generator(device="cuda").manual_seed(0)
    B, S = 64, 700
    q = torch.randn(B, 9, 1, 64, device="cuda", generator=g).bfloat16()
    kc, vc = (torch.randn(B, 3, S + 100, 64, device="cuda", generator=g).bfloat16() for _ in range(2))
    n = torch.randint(1, S + 1, (B,), device="cuda", generator=g)
    mask = (torch.arange(S, device="cuda")[None] < n[:, None])[:, None, None]
    want = grouped_decode_attention(q, kc[:, :, :S], vc[:, :, :S], mask).float()
    beyond = (torch.arange(S + 100, device="cuda")[None] >= n[:, None])[:, None, :, None]
    kc.masked_fill_(beyond, float("nan"))  # slots past a row's keys are never read
    vc.masked_fill_(beyond, float("nan"))
    got = triton_decode_attention(q, kc, vc, n).float()
    assert (got - want).abs().max() < 2e-2
