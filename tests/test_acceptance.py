"""eval.acceptance: teacher-forced run lengths give every greedy chain cycle's accepted count exactly, and
sampled chains' acceptance without bias."""

import json
from pathlib import Path

import pytest
import torch
from test_spec import make_draft, make_target

from eagle3.draft import load_draft
from eagle3.spec import SpecDecoder
from eagle3.tuner import FixedK
from maverick.gguf_model import load_gguf_model
from maverick.sampling import SamplingParams
from maverick.tokenizer import encode_chat, load_tokenizer
from train import acceptance as acceptance_mod
from train.acceptance import (
    answers_of,
    paired_difference,
    reach_of_runs,
    run_lengths,
    sampled_reach,
    sampled_reach_rows,
    summarize,
    target_detail,
    target_fields,
    target_probs,
    walk,
)

DRAFT = "eagle3/drafts/smollm2-135m-instruct"


def test_run_lengths_predict_each_cycle_of_a_decoding_run():
    """The real target and shipped draft in fp32: for each cycle of SpecDecoder with k = 3, the accepted
    count equals min(run[t], 3) at the cycle's start index t."""
    model, tok = load_gguf_model(dtype=torch.float32), load_tokenizer()
    draft = load_draft(DRAFT, dtype=torch.float32)
    k, steps, checked = 3, 4, 0
    for q in ["Write a short poem about the sea.", "List three uses of Python, one line each."]:
        prompt = encode_chat(tok, [{"role": "user", "content": q}])
        g = SpecDecoder(model, draft, max_len=256, policy=FixedK(k)).generate([prompt], 48)
        answer, accepted = g.tokens[0], g.stats["spec"].accepted
        assert answer == answers_of(model, [prompt], 48)[0][: len(answer)]
        run = run_lengths(model, draft, prompt, answer, steps)
        assert len(run) == len(answer) - steps  # indices P-1 .. P+len(answer)-2-steps
        j, cycles, tokens = 0, 0, 0  # j: the cycle's start index minus (P - 1)
        for a in accepted:
            if j < len(run):
                assert a == min(int(run[j]), k), (q, j, a, int(run[j]))
                checked += 1
                cycles, tokens = cycles + 1, tokens + a + 1
            j += a + 1
        assert walk(reach_of_runs(run, steps), k) == (cycles, tokens)  # the greedy walk is the run itself
    assert checked >= 40 and sum(accepted) > 0  # enough cycles, some accepting


def test_answers_are_batched_by_padded_prompt_tokens_and_returned_in_order(monkeypatch):
    """answers_of batches longest prompts first, within --batch-size rows and prefill_tokens padded prompt
    tokens (a long prompt alone), and returns each prompt's answer in place: the answers decoded one
    prompt at a time."""
    model = make_target()
    g = torch.Generator().manual_seed(0)
    lengths = [3, 40, 5, 21, 7, 20]
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    batches = []
    real = acceptance_mod.Decoder.generate

    def spy(self, chunk, *a, **kw):
        batches.append([len(p) for p in chunk])
        return real(self, chunk, *a, **kw)

    monkeypatch.setattr(acceptance_mod.Decoder, "generate", spy)
    got = answers_of(model, prompts, 6, batch_size=3, prefill_tokens=42)
    assert batches == [[40], [21, 20], [7, 5, 3]]
    batches.clear()
    assert got == [answers_of(model, [p], 6)[0] for p in prompts] and len(batches) == 6
    assert all(len(a) == 6 for a in got)  # no stop token in a random tiny model's 6 tokens


def test_summarize_counts_runs():
    s = summarize([reach_of_runs(torch.tensor([0, 1, 2, 5, 3, 0, 1, 4]), 5)], 5)
    assert s["positions"] == 8
    assert s["p_run_ge"] == [0.75, 0.5, 0.375, 0.25, 0.125]
    assert s["tau"][1] == 1.75 and s["tau"][3] == 1 + 0.75 + 0.5 + 0.375
    # decoding at k = 2 starts cycles at 0 (run 0: 1 token), 1 (run 1: 2), 3 (run 5: 3) and 6 (run 1: 2)
    assert s["tau_walked"][2] == 8 / 4 and s["tau"][2] == 2.25


def test_target_detail_matches_the_target_logits_at_each_cycle_start():
    """in_vocab / target_p of position j (cycle start index P-1+j) are about x_{P+1+j}, the cycle's first
    draft token: the draft's t2d of it and the target's softmax probability of it (from a plain forward)."""
    model, tok = load_gguf_model(dtype=torch.float32), load_tokenizer()
    draft = load_draft(DRAFT, dtype=torch.float32)
    prompt = encode_chat(tok, [{"role": "user", "content": "Name the planets of the solar system."}])
    answer = answers_of(model, [prompt], 40)[0]
    steps = 3
    f = target_fields(model, prompt, answer, draft.config.feature_layers)
    d = target_detail(draft, prompt, answer, steps, f, target_probs(model, prompt, answer, steps, f))
    run = run_lengths(model, draft, prompt, answer, steps, f)
    assert d["in_vocab"].shape == d["target_p"].shape == run.shape
    ids = prompt + answer
    with torch.no_grad():
        probs = model(torch.tensor([ids])).logits[0].float().softmax(-1)  # row t: the next token x_{t+1}
    P = len(prompt)
    for j in range(len(run)):
        y = ids[P + 1 + j]  # the greedy answer's token = the target's choice
        assert bool(d["in_vocab"][j]) == bool(draft.t2d[y])
        assert abs(float(d["target_p"][j]) - float(probs[P + j, y])) < 1e-4
        if not draft.t2d[y]:
            assert run[j] == 0  # a token outside the draft vocabulary is never drafted
    # the sampled chains' measure at temperature 0 (one-hot distributions) is the greedy count
    greedy = reach_of_runs(run, steps)
    assert greedy[:, 0].sum() >= 5
    assert torch.equal(sampled_reach(model, draft, prompt, answer, steps, SamplingParams(0.0), f), greedy)


def test_summarize_reports_the_vocabulary_ceiling_and_confident_positions():
    runs = torch.tensor([0, 1, 2, 0, 3, 0])
    detail = {
        "in_vocab": torch.tensor([False, True, True, True, True, False]),
        "target_p": torch.tensor([0.95, 0.99, 0.5, 0.92, 0.3, 0.1]),
    }
    s = summarize([reach_of_runs(runs, 3)], 3, detail)
    assert s["in_vocab"] == round(4 / 6, 4)
    assert s["confident"] == 0.5  # 0.95, 0.99, 0.92
    assert s["p_run_ge_1_confident"] == round(1 / 3, 4)  # runs 0, 1, 0 there


def test_cli_keeps_the_targets_answers_and_reads_them_back(tmp_path, monkeypatch, capsys):
    """eval.acceptance generates the target's answers once per (target, prompts, settings): a second
    comparison reads them from the cache and scores the drafts exactly as the first; --fresh-answers and a
    damaged file generate them again."""
    from eval import acceptance

    monkeypatch.setattr(acceptance, "ANSWERS_DIR", tmp_path / "answers")
    generated = []
    real = acceptance.answers_of

    def counted(*a, **kw):
        generated.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(acceptance, "answers_of", counted)
    draft = "eagle3/drafts/smollm2-135m-instruct"
    argv = ["--draft", draft, "--n", "2", "--max-new-tokens", "12", "--steps", "3"]
    first = acceptance.main(argv)
    second = acceptance.main(argv)
    assert len(generated) == 1 and first["answers_cached"] is None
    cache = tmp_path / "answers" / Path(second["answers_cached"]).name
    assert second["drafts"] == first["drafts"] and cache.exists()
    out = tmp_path / "acceptance.json"  # a rerun over its own --out replaces it (another file is refused:
    shipped = acceptance.main([*argv[2:], "--out", str(out)])  # tests/test_cli_errors.py)
    assert acceptance.is_results(out)
    assert list(shipped["drafts"].values()) == list(first["drafts"].values()) and len(generated) == 1
    assert f"read from {cache}" in capsys.readouterr().out
    assert acceptance.main([*argv, "--fresh-answers"])["answers_cached"] is None and len(generated) == 2
    other = acceptance.main([*argv[:-2], "--steps", "4", "--out", str(out)])  # --steps: the same answers
    assert json.loads(out.read_text())["config"]["steps"] == 4
    assert other["answers_cached"] == str(cache) and len(generated) == 2
    longer = acceptance.main([*argv[:4], "--max-new-tokens", "13", "--steps", "3"])  # a new key
    assert longer["answers_cached"] is None and len(generated) == 3
    cache.write_text("[[1, 2], ")  # damaged: generated again, and the file mended
    assert acceptance.main(argv)["drafts"] == first["drafts"] and len(generated) == 4
    assert acceptance.read_answers(cache, 2) is not None
    # sampled answers are kept apart from the greedy ones and from other seeds, and read back per seed
    hot = [*argv, "--temperature", "1"]
    a, b = acceptance.main(hot), acceptance.main(hot)
    assert a["answers_cached"] is None and b["answers_cached"] not in (None, str(cache))
    assert a["drafts"] == b["drafts"] and len(generated) == 5
    assert acceptance.main([*hot, "--seed", "1"])["answers_cached"] is None and len(generated) == 6


def test_kept_answers_are_keyed_by_an_hf_directorys_files(tmp_path):
    """Weights rewritten in place (the same size: a fine-tune saved over the old one) change a file's mtime
    but not its directory's: the kept answers of the old weights are not read for the new ones. A GGUF file
    is keyed by its own mtime."""
    import os

    from eval.acceptance import answers_path

    d = tmp_path / "target"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"A" * 1000)
    before = answers_path(d, "bf16", 128, [[1, 2, 3]])
    assert answers_path(d, "bf16", 128, [[1, 2, 3]]) == before
    with open(d / "model.safetensors", "r+b") as f:
        f.write(b"B" * 1000)
    st = (d / "model.safetensors").stat()
    os.utime(d / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert answers_path(d, "bf16", 128, [[1, 2, 3]]) != before
    later = answers_path(d, "bf16", 128, [[1, 2, 3]])
    (d / "README.md").write_text("notes")  # not the target's: its answers stay
    assert answers_path(d, "bf16", 128, [[1, 2, 3]]) == later


def test_cli_scores_second_turns_after_the_targets_own_first_answers(tmp_path, monkeypatch):
    """--turns 2: each second turn is asked after the target's first answer (its text in the chat, as
    eval.bench asks it); both turns pooled, and each on its own."""
    from eval import acceptance
    from eval.prompts import answer_text, chat_ids, load_benchmark

    monkeypatch.setattr(acceptance, "ANSWERS_DIR", tmp_path / "answers")
    asked = []
    real = acceptance.answers_of

    def recorded(model, prompts, *a, **kw):
        answers = real(model, prompts, *a, **kw)
        asked.append((prompts, answers))
        return answers

    monkeypatch.setattr(acceptance, "answers_of", recorded)
    copy = tmp_path / "same-draft"
    copy.symlink_to(Path(DRAFT).resolve())
    argv = ["--draft", DRAFT, "--n", "2", "--max-new-tokens", "12", "--steps", "3", "--turns", "2"]
    r = acceptance.main([*argv, "--draft", str(copy)])
    (first, answers), (second, _) = asked
    tok = load_tokenizer()
    bench = load_benchmark("mtbench", 2)
    eos = [2]  # SmolLM2's <|im_end|>, the target config's eos_ids
    assert first == [chat_ids(tok, p, 0, []) for p in bench]
    assert second == [chat_ids(tok, p, 1, [answer_text(tok, a, eos)]) for p, a in zip(bench, answers)]
    s = r["drafts"][DRAFT]
    assert [t["turn"] for t in r["turns"]] == [1, 2] and set(s["turns"]) == {1, 2}
    assert s["turns"][1]["positions"] + s["turns"][2]["positions"] == s["positions"] > 0
    assert acceptance.main(argv)["drafts"][DRAFT] == s  # both turns' answers read back
    same = r["drafts"][str(copy)]["against_first"]  # one draft twice: no difference, 2 prompts resampled
    assert same["tau"] == 0 and same["tau_ci95"] == [0, 0] and same["clusters"] == 2


# Sampled chains: N SpecDecoder runs (k = 3) against the estimator over N answers sampled from the target.
# First cycles: both are means of [0, 1] values, so by Hoeffding each is within sqrt(ln(2/delta) / 2N) =
# 0.036 of P(run >= i) at delta = 1e-3, N = 3000: the two within 0.071. Cycles started in the first
# N_POS positions (the walk): within 5 standard errors of the difference of the two means (the samples'
# own spreads, ~0.1 cycle).
N_MC, K_MC, N_POS, MC_BOUND = 3000, 3, 8, 0.071


def _cycles_started(accepted_rows: list[list[int]], rows: int, max_new: int, n: int) -> list[int]:
    """Per row of a batched SpecDecoder run, the cycles that started at answer positions 0..n-1 (position j:
    the cycle after the first j + 1 answer tokens). accepted_rows lists, per cycle, the rows still running."""
    pos, cycles = [0] * rows, [0] * rows
    for acc in accepted_rows:
        live = [r for r in range(rows) if pos[r] + 1 < max_new]
        assert len(live) == len(acc)
        for r, a in zip(live, acc):
            cycles[r] += pos[r] < n
            pos[r] += a + 1
    return cycles


@pytest.mark.parametrize("sampling", [SamplingParams(1.0), SamplingParams(0.8, top_k=6, top_p=0.9)])
def test_sampled_reach_predicts_sampled_decoding(sampling, monkeypatch):
    """A tiny target and a random draft that keep ~70% / 42% / 25% of their tokens at temperature 1: the
    mean of `sampled_reach` at the first cycle's start over answers the target samples equals the share of
    SpecDecoder runs whose first cycle keeps >= i tokens, and `walk` over those answers the number of
    cycles decoding starts in the first 8 positions; a wrong rule (the chance that the draft proposes
    the emitted token, q(x), instead of min(p, q) / p) misses by far more than the bound."""
    t = make_target(std=0.1, seed=5, vocab_size=16, eos_token_id=None)
    d = make_draft(t, std=0.1, seed=6)
    prompt, L = [3, 7, 1, 9, 4], N_POS + K_MC  # answers of L tokens score N_POS positions
    g = SpecDecoder(t, d, max_len=32, policy=FixedK(K_MC)).generate(
        [prompt] * N_MC, L + 1, sampling=sampling, generator=torch.Generator().manual_seed(0)
    )
    acc = g.stats["spec"].accepted_rows
    first = torch.tensor(acc[0])  # every row's first cycle
    decoded = torch.stack([(first >= i).float().mean() for i in range(1, K_MC + 1)])
    cycles = torch.tensor(_cycles_started(acc, N_MC, L + 1, N_POS), dtype=torch.float)
    answers = answers_of(t, [prompt] * N_MC, L, batch_size=N_MC, sampling=sampling, seed=1)
    reach = sampled_reach_rows(t, d, prompt, answers, K_MC, sampling)  # [N, positions, K]
    assert reach.shape == (N_MC, N_POS, K_MC)
    estimated = reach[:, 0].mean(0)
    assert decoded[0] > 0.3 and decoded[1] > 0.05  # the chains keep tokens past the first
    assert (estimated - decoded).abs().max() < MC_BOUND, (decoded, estimated)
    walked = torch.tensor([walk(r, K_MC)[0] for r in reach])
    bound = 5 * (cycles.var() / N_MC + walked.var() / N_MC).sqrt()
    assert abs(walked.mean() - cycles.mean()) < bound, (cycles.mean(), walked.mean(), bound)
    assert bound < 0.2 and cycles.mean() < N_POS - 1  # a tight check, of runs that skip positions
    for a in answers[:3]:  # one answer at a time gives the batch's numbers
        assert torch.allclose(
            sampled_reach(t, d, prompt, a, K_MC, sampling), reach[answers.index(a)], atol=1e-5
        )
    assert sampled_reach(t, d, prompt, answers[0][:K_MC], K_MC, sampling).shape == (0, K_MC)  # no position

    monkeypatch.setattr(acceptance_mod, "kept", lambda q, p: q)
    wrong = sampled_reach_rows(t, d, prompt, answers, K_MC, sampling)
    assert (wrong[:, 0].mean(0) - decoded).abs().max() > MC_BOUND
    assert abs(torch.tensor([walk(r, K_MC)[0] for r in wrong]).mean() - cycles.mean()) > bound


def test_paired_difference_is_the_difference_with_a_bootstrap_interval_over_prompts():
    g = torch.Generator().manual_seed(0)
    a = [(torch.rand(10, 3, generator=g) < 0.4).float().cumprod(1) for _ in range(200)]
    same = paired_difference(a, a, list(range(200)), 3)
    assert same["tau"] == 0 and same["tau_ci95"] == [0, 0] and same["tau_walked_ci95"] == [0, 0]
    better = [torch.ones_like(r) for r in a]  # every draft token kept
    d = paired_difference(a, better, list(range(200)), 3)
    tau_a = 1 + torch.cat(a).sum(1).mean().item()
    assert abs(d["tau"] - (4 - tau_a)) < 1e-3 and d["tau_ci95"][0] > 0 and d["tau_walked"] > 0

    # independent drafts of one quality: the interval holds 0, and its half-width is 1.96 standard errors
    # of the difference of two means of 2,000 Bernoulli(0.4) positions: 1.96 * sqrt(2 * 0.24 / 2000) = 0.030
    b = [(torch.rand(10, 1, generator=g) < 0.4).float() for _ in range(200)]
    c = [(torch.rand(10, 1, generator=g) < 0.4).float() for _ in range(200)]
    d = paired_difference(b, c, list(range(200)), 1)
    lo, hi = d["tau_ci95"]
    assert lo < 0 < hi and 0.024 < (hi - lo) / 2 < 0.037, d
    # two answers of one prompt move together: the same answers twice per prompt are no more evidence
    twice = paired_difference(b + b, c + c, list(range(200)) * 2, 1)
    apart = paired_difference(b + b, c + c, list(range(400)), 1)
    width = lambda r: r["tau_ci95"][1] - r["tau_ci95"][0]  # noqa: E731
    assert abs(width(twice) / width(d) - 1) < 0.15 and abs(width(d) / width(apart) - 2**0.5) < 0.2


def test_the_table_marks_a_draft_path_cut_to_its_end():
    from eval.acceptance import _tail

    assert _tail("runs/stage7/out/draft") == "runs/stage7/out/draft"
    long = "/home/someone/experiments/2026-12/stage-seven/out/draft"
    shown = _tail(long)
    assert len(shown) == 48 and shown[0] == "\u2026" and long.endswith(shown[1:])
