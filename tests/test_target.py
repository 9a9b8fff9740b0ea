"""Targets from one path (maverick/target.py): a GGUF file or an HF LlamaForCausalLM directory, end to end.

A tiny random Llama saved as transformers saves it (plus SmolLM2's tokenizer files) goes through
regeneration, a hidden-state dump, a few training steps and speculative decoding with the trained draft,
greedy-identical to plain decoding; the other CLIs that take a target (maverick.generate, eval.acceptance,
eval.bench with its transformers rows) run on the same directory. The real SmolLM2-135M-Instruct written as
an HF directory by transformers loads to the same weights and logits bits as our GGUF-loaded model.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3.draft import load_draft
from eagle3.spec import SpecDecoder
from maverick.generate import Decoder
from maverick.gguf_loader import default_gguf_path
from maverick.target import (
    load_hf_reference,
    load_target,
    load_target_tables,
    load_target_tokenizer,
    target_identity,
)
from maverick.tokenizer import encode_chat, load_tokenizer
from train.dump import DumpDataset

QUESTIONS = ["What is 2+2?", "Name a colour.", "Say hi.", "Capital of France?", "Count to 3.",
             "Why is the sky blue?", "Write a haiku.", "What is Python?", "Spell cat.", "Name a fruit."]  # fmt: skip
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A random 4-layer Llama (GQA, llama3 RoPE scaling, untied head) on SmolLM2's 49152-token vocabulary,
    saved by transformers with SmolLM2's tokenizer files beside it."""
    path = tmp_path_factory.mktemp("llama")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0, rope_scaling=dict(LLAMA3),
                      max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg)
    with torch.no_grad():  # a peaked next-token distribution, so greedy answers are not noise
        hf.lm_head.weight.normal_(0, 0.5)
    hf.save_pretrained(path)
    load_tokenizer().save_pretrained(path)
    return path


def test_load_target_dispatches_and_refuses(llama_dir, tmp_path):
    ours = load_target(llama_dir, torch.float32)
    assert ours.config.vocab_size == 49152 and ours.config.rope_scaling["rope_type"] == "llama3"
    assert target_identity(llama_dir)["kind"] == "hf"
    # what a draft needs of its target, read alone, as the loaded model holds it rounded to the dtype
    embed, head, cfg = load_target_tables(llama_dir, torch.bfloat16)
    assert cfg == ours.config and embed.dtype == head.dtype == torch.float32
    assert torch.equal(embed, ours.model.embed_tokens.weight.bfloat16().float())
    assert torch.equal(head, ours.lm_head.weight.bfloat16().float()) and not torch.equal(head, embed)
    with pytest.raises(ValueError, match="q4 packs a GGUF file's Q4/Q8 weights; an HF directory has none"):
        load_target(llama_dir, q4=True)
    with pytest.raises(FileNotFoundError, match="nope.*a .gguf file or an HF directory"):
        load_target(tmp_path / "nope")
    # the directory's tokenizer files render chats as the GGUF's tokenizer does
    msgs = [{"role": "user", "content": "Explain RoPE in one sentence."}]
    assert encode_chat(load_target_tokenizer(llama_dir), msgs) == encode_chat(load_target_tokenizer(), msgs)
    x = torch.tensor([encode_chat(load_target_tokenizer(llama_dir), msgs)])
    with torch.no_grad():
        ref = load_hf_reference(llama_dir)(x).logits
        assert float((ours(x).logits - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.fixture(scope="module")
def trained(llama_dir, tmp_path_factory):
    """regenerate -> dump -> fit on the HF directory, through the CLIs' main functions."""
    from train import dump, fit, regenerate

    root = tmp_path_factory.mktemp("e2e")
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": q}]}) + "\n"
                             for i, q in enumerate(QUESTIONS)))  # fmt: skip
    regen = root / "regen.jsonl"
    regenerate.main(["--out", str(regen), "--data", str(chats), "--target", str(llama_dir), "--turns", "1",
                     "--max-new-tokens", "12", "--max-prompt-tokens", "128", "--batch-size", "4",
                     "--dtype", "fp32", "--device", "cpu", "--max-samples", "10"])  # fmt: skip
    dumps = root / "dumps"
    summary = dump.main(["--out", str(dumps), "--target", str(llama_dir), "--target-dtype", "fp32",
                         "--data", str(regen), "--heldout-fraction", "0.2", "--shard-size", "4",
                         "--draft-vocab-size", "256", "--feature-layers", "1,2,3", "--device", "cpu",
                         "--cache-dir", str(root / "cache"), "--no-progress"])  # fmt: skip
    out = root / "fit"
    fitted = fit.main(["--dumps", str(dumps), "--out", str(out), "--steps", "4", "--batch-size", "2",
                       "--warmup", "1", "--lr", "1e-3", "--ttt-steps", "3", "--precision", "fp32",
                       "--tracker", "none", "--no-progress", "--cpu"])  # fmt: skip
    return {
        "regen": regen,
        "dumps": dumps,
        "dump": summary,
        "fit": fitted,
        "draft": out / "draft",
        "root": root,
    }


def test_regenerate_dump_fit_on_hf_directory(llama_dir, trained):
    records = [json.loads(line) for line in trained["regen"].read_text().splitlines()]
    assert len(records) >= 8
    # each answer is transformers' greedy continuation of the same directory under its own chat template
    tok, hf = load_target_tokenizer(llama_dir), load_hf_reference(llama_dir)
    for r in records[:3]:
        ids = encode_chat(tok, r["messages"][:1])
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=2)
        assert r["messages"][1]["content"] == tok.decode(
            out[0, len(ids) :].tolist(), skip_special_tokens=True
        )
    ds = DumpDataset(trained["dumps"])
    assert trained["dump"]["complete"] and ds.manifest["target"]["kind"] == "hf"
    assert ds.manifest["target"]["path"] == str(llama_dir.resolve())
    s = ds[0]
    with torch.no_grad():  # the stored argmax is the directory's model's, as transformers computes it
        ref = hf(s["input_ids"].long()[None]).logits[0]
    assert torch.equal(s["target_argmax"].long(), ref.argmax(-1))
    log = [json.loads(x) for x in (trained["root"] / "fit" / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 4 and all(torch.isfinite(torch.tensor(r["loss"])) for r in log)


def test_speculative_decoding_with_the_trained_draft_is_greedy_identical(llama_dir, trained):
    target = load_target(llama_dir, torch.float32)
    draft = load_draft(trained["draft"], dtype=torch.float32)
    assert draft.config.target_hidden_size == 64 and tuple(draft.config.feature_layers) == (1, 2, 3)
    tok = load_target_tokenizer(llama_dir)
    for q in QUESTIONS[:3]:
        ids = encode_chat(tok, [{"role": "user", "content": q}])
        plain = Decoder(target, max_len=len(ids) + 48).generate([ids], 32).tokens[0]
        spec = SpecDecoder(target, draft, max_len=len(ids) + 48).generate([ids], 32)
        assert spec.tokens[0] == plain and len(plain) == 32


def test_generate_acceptance_and_bench_take_the_directory(llama_dir, trained, tmp_path, capsys):
    from eval import acceptance, bench
    from maverick import generate

    generate.main(["--target", str(llama_dir), "--prompt", "Say hi.", "--chat", "--max-new-tokens", "6",
                   "--dtype", "fp32"])  # fmt: skip
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["new_tokens"] == 6
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in QUESTIONS[:2]))
    res = acceptance.main(["--target", str(llama_dir), "--draft", str(trained["draft"]), "--bench", "jsonl",
                           "--prompts", str(prompts), "--n", "2", "--max-new-tokens", "8", "--steps", "3",
                           "--dtype", "fp32"])  # fmt: skip
    assert res is not None
    rc = bench.main(["--gguf", str(llama_dir), "--draft", str(trained["draft"]), "--bench", "jsonl",
                     "--prompts", str(prompts), "--n", "2", "--turns", "1", "--max-new-tokens", "12",
                     "--methods", "hf-generate,ours-plain,eagle3-k3", "--dtype", "fp32",
                     "--out", str(tmp_path / "bench")])  # fmt: skip
    report = json.loads((tmp_path / "bench" / "report.json").read_text())
    assert rc == 0 and report["config"]["gguf"] == str(llama_dir)
    outputs = {}
    for r in report["records"]:
        outputs.setdefault(r["method"], []).append(r["output_ids"])
    assert len(outputs["eagle3-k3"]) == 2 and all(len(o) == 12 for o in outputs["eagle3-k3"])
    assert outputs["hf-generate"] == outputs["ours-plain"] == outputs["eagle3-k3"]


def test_smollm2_as_hf_directory_equals_the_gguf_model(tmp_path, hf_smollm2):
    """transformers writes SmolLM2-135M-Instruct as an HF directory from the GGUF (dequantised to fp32);
    loaded through the HF path it holds the same tensors as our GGUF load (q/k permuted back by us after
    transformers un-permuted them), so the fp32 logits are the same bits. (19 s of CPU, 56 s wall on the
    shared 2-core machine: mostly transformers' GGUF dequantisation and ours.)"""
    path = default_gguf_path()
    hf = hf_smollm2  # transformers' load of the GGUF (tests/conftest.py)
    # a GGUF-loaded transformers model refuses save_pretrained (flagged quantised): copy it into a plain one
    with torch.device("meta"):
        plain = LlamaForCausalLM(copy.deepcopy(hf.config))
    plain.load_state_dict(hf.state_dict(), assign=True)
    plain.tie_weights()
    del plain.config.quantization_config
    plain.save_pretrained(tmp_path)
    load_tokenizer(path).save_pretrained(tmp_path)
    from_dir, from_gguf = load_target(tmp_path, torch.float32), load_target(path, torch.float32)
    a, b = from_dir.state_dict(), from_gguf.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    msgs = [{"role": "user", "content": "Why is the sky blue?"}]
    ids = encode_chat(load_target_tokenizer(tmp_path), msgs)
    assert ids == encode_chat(load_target_tokenizer(path), msgs)
    with torch.no_grad():
        assert torch.equal(from_dir(torch.tensor([ids])).logits, from_gguf(torch.tensor([ids])).logits)


def test_hf_reference_of_a_gguf_is_saved_and_read_back(tmp_path, monkeypatch, hf_smollm2):
    """load_hf_reference reads a GGUF through transformers once and saves what it read (HF_DIR); a later
    call loads the saved copy: the same tensors bit for bit, tied head included, the same config and logits.
    A damaged copy is read from the GGUF again. (transformers' GGUF read is the session's fixture here.)"""
    from transformers import AutoModelForCausalLM

    import maverick.target as target

    monkeypatch.setattr(target, "HF_DIR", tmp_path)
    real, reads = AutoModelForCausalLM.from_pretrained, []

    def spy(name, *a, **kw):
        reads.append("gguf" if "gguf_file" in kw else "saved")
        return hf_smollm2 if "gguf_file" in kw else real(name, *a, **kw)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    assert load_hf_reference(None) is hf_smollm2
    (saved,) = tmp_path.iterdir()  # one copy, no temporary left
    again = load_hf_reference(None)
    assert reads == ["gguf", "saved"] and again is not hf_smollm2
    a, b = again.state_dict(), hf_smollm2.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()  # still tied
    skip = {
        "quantization_config",
        "_name_or_path",
        "architectures",
    }  # the GGUF's; the saved copy names its own
    want = {k: v for k, v in hf_smollm2.config.to_dict().items() if k not in skip}
    assert {k: v for k, v in again.config.to_dict().items() if k in want} == want
    x = torch.tensor([[1, 9690, 28, 2683, 314, 260, 6284, 2829, 47, 2]])
    with torch.no_grad():
        assert torch.equal(again(x).logits, hf_smollm2(x).logits)
    (saved / "model.safetensors").write_bytes(b"cut")
    assert load_hf_reference(None) is hf_smollm2 and reads[-2:] == ["saved", "gguf"]
    assert (saved / "model.safetensors").stat().st_size > 500_000_000


def test_the_hf_copy_is_keyed_by_its_own_format(monkeypatch, tmp_path):
    """The saved HF copies of a GGUF are named by HF_FORMAT, not the tokenizer's saved format (a tokenizer
    format bump made a new 514 MB model copy)."""
    import maverick.target as target
    import maverick.tokenizer as tokenizer

    seen = []

    class Stop(Exception):
        pass

    def spy(root, p, fmt=None):
        seen.append(fmt)
        raise Stop

    monkeypatch.setattr(target, "saved_copy_dir", spy)
    monkeypatch.setattr(tokenizer, "SAVED_FORMAT", 99)
    with pytest.raises(Stop):
        target._hf_from_gguf(tmp_path / "x.gguf", {})
    assert seen == [target.HF_FORMAT] and target.HF_FORMAT != 99


def test_a_missing_tokenizer_source_is_named_as_one(tmp_path):
    """`--tokenizer /nope/tok` was reported as "target checkpoint not found"."""
    from maverick.target import load_target_tokenizer

    with pytest.raises(FileNotFoundError, match=r"tokenizer source not found: .*nope.tok"):
        load_target_tokenizer(tmp_path / "nope" / "tok")
