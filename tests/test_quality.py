"""eval.quality: the divergence measures on known distributions, the teacher-forced positions, and the
command on the real SmolLM2 target, whose `codes` form computes the reference's values (the control)."""

from __future__ import annotations

import math

import pytest
import torch

from eval import quality
from tests.test_cli_errors import exit_status


def test_compare_on_known_distributions():
    p = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.6, 0.3]])
    q = torch.tensor([[0.25, 0.5, 0.25], [0.1, 0.6, 0.3]])
    out = quality.compare(p.log(), q.log(), [0, 2])
    kl0 = 0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(0.25 / 0.5)
    assert torch.allclose(out["kl"], torch.tensor([kl0, 0.0]), atol=1e-6)
    assert out["top1"].tolist() == [0.0, 1.0]
    assert torch.allclose(out["nll"], torch.tensor([-math.log(0.25), -math.log(0.3)]))
    assert torch.allclose(out["nll_ref"], torch.tensor([-math.log(0.5), -math.log(0.3)]))
    s = quality.summarize(out)
    assert s["positions"] == 2 and s["top1"] == 0.5 and s["kl_max"] == pytest.approx(kl0, abs=1e-6)
    assert s["ppl"] == pytest.approx(math.exp((-math.log(0.25) - math.log(0.3)) / 2), rel=1e-6)


def test_answer_positions_predict_the_answer_tokens(monkeypatch):
    """Teacher-forced, the bf16 target's distributions at the positions answer_logprobs returns pick its own
    greedy answer; one position off (the control) they do not."""
    from eval.acceptance import first_turns
    from eval.prompts import load_benchmark
    from maverick.target import load_target, load_target_tokenizer
    from train.acceptance import answers_of

    model, tok = load_target(dtype=torch.bfloat16), load_target_tokenizer()
    prompts = first_turns(tok, load_benchmark("mtbench", 2))
    answers = answers_of(model, prompts, 24)
    agree, shifted = [], []
    for p, a in zip(prompts, answers):
        lp = quality.answer_logprobs(model, p, a)
        assert lp.shape == (len(a), model.config.vocab_size)
        assert torch.allclose(lp.exp().sum(-1), torch.ones(len(a)), atol=1e-4)
        agree += (lp.argmax(-1) == torch.tensor(a)).tolist()
        shifted += (lp[1:].argmax(-1) == torch.tensor(a[:-1])).tolist()
    assert sum(agree) / len(agree) >= 0.95 and sum(shifted) / len(shifted) < 0.3


def test_the_command_measures_fp8_against_the_codes_control(tmp_path, monkeypatch, capsys):
    from eval import acceptance

    monkeypatch.setattr(acceptance, "ANSWERS_DIR", tmp_path / "answers")
    out = tmp_path / "q.json"
    res = quality.main(["--n", "2", "--max-new-tokens", "12", "--variants", "codes,fp8", "--out", str(out)])
    codes, fp8 = res["variants"]["codes"], res["variants"]["fp8"]
    assert codes["positions"] == fp8["positions"] == 24
    # codes hold the GGUF's values exactly: the reference's distributions, to float rounding
    assert codes["kl_max"] < 1e-6 and codes["top1"] == 1.0 and codes["ppl"] == pytest.approx(codes["ppl_ref"])
    assert fp8["kl_mean"] > 1e-4 and fp8["kl_mean"] > 100 * max(codes["kl_mean"], 1e-9)
    assert set(fp8["categories"]) == {"writing"} and out.exists()
    assert quality.is_results(out)  # a rerun replaces it (another file is refused: tests/test_cli_errors.py)
    table = capsys.readouterr().out
    assert "KL mean" in table and "\nfp8 " in table


def test_unknown_variants_are_one_line(capsys, tmp_path):
    code, err = exit_status(quality.main, ["--variants", "q4,int2"], capsys)
    assert code == 2 and "--variants: unknown 'int2'; choose from bf16, q4, fp8, codes" in err
    code, err = exit_status(quality.main, ["--variants", "bf16,codes", "--target", str(tmp_path)], capsys)
    assert code == 2 and f"--variants codes: {tmp_path} is an HF directory" in err
