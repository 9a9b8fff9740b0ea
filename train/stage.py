"""One draft stage in one time-budgeted command: regenerate, train on every answer so far, score, write it all.

    python -m train.stage --minutes 10 --init-draft eagle3/drafts/smollm2-135m-instruct --out runs/stage7 \\
        --data .stage/data.jsonl.xz [--target <gguf or HF dir>]
    python -m train.stage --minutes 10 --init-draft runs/stage7 --out runs/stage8 --data .stage/data.jsonl.xz

On whatever device it finds (the GPU when there is one), within --minutes of wall clock from its start:

1. regenerate (`train.fastgen`, until --regen-share of the budget is spent): the target answers, greedily and
   turn after turn, the training conversations of --data (`python -m train.stage_data` makes it: ShareGPT's
   training split as token ids) that no earlier stage answered; answers stream to `answers.jsonl.xz`;
2. train (`train.fastfit`, until the budget less --score-share): from --init-draft (or a fresh draft), on
   every answer so far: this stage's, the earlier stages' (`answers*.jsonl.xz` beside --init-draft, and
   records of --data that carry answers, e.g. the stage-6 regeneration), cut to --max-length tokens;
   with --eagle-3.1 the draft gets EAGLE-3.1's norms (an EAGLE-3 --init-draft is carried over into one);
   with --grow-vocab N the --init-draft's vocabulary grows to N tokens (the answers' most frequent join it);
3. score: teacher-forced greedy chain acceptance (`eval.acceptance`) of the initial and the new draft on
   the target's greedy answers to the held-out conversations of --data (first turns, never trained on),
   and the new draft's difference from the initial one with a 95% bootstrap interval (`new_less_init`).

Writes into --out: `draft/` (config.json + bf16 model.safetensors: the EAGLE-3 format), `train_log.jsonl`,
`curve.png`, `answers.jsonl.xz`, `stage.json` (data, steps, device, minutes, tokens/s of regeneration and
training, scores). Everything is written under a temporary name and renamed; the training state lives in
`train_state.pt` while the stage runs and is removed at its end (the rest stays well under 64 MiB; the
answers stop growing at --max-answers-mib).

Resuming: rerunning with the same --out continues where it stopped. A finished phase is recorded in
stage.json and not run again; an interrupted regeneration keeps every conversation it wrote (a cut-off last
write is dropped) and answers only the others; an interrupted training continues from its last
`train_state.pt` (saved every --checkpoint-seconds) for the rest of its time. A next stage takes
`--init-draft <this --out>`: its draft, and its answers as earlier answers. The stage after that reads only
its init's answers and --data's: fold every stage's answers into --data (`train.stage_data --answers`); a
stage whose earlier answers are fewer than its init draft trained on says so (`draft/training.json`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import random
import signal
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from eagle3.draft import NORM_VARIANTS, DraftConfig, Eagle3Draft, load_draft, save_draft
from eagle3.draft import draft_dir as find_draft_dir
from eagle3.vocab import count_tokens
from maverick.cli import (
    ArgumentParser,
    UserError,
    add_threads_option,
    device,
    nonnegative_float,
    nonnegative_int,
    output_dir,
    positive_float,
    positive_int,
    read_json_object,
    run_cli,
    share,
)
from maverick.files import atomic_path, atomic_write, remove_leftovers
from maverick.model import Llama4
from maverick.target import default_target_path, load_target
from train import answers as answer_file
from train.acceptance import paired_difference, reach_of_runs, run_lengths, summarize, target_fields
from train.dump import default_feature_layers
from train.fastfit import Buckets, TimeSchedule, bucket_batches, dense_step_sums, target_batch, weighted_loss
from train.fastgen import Conversation, FastGenerator
from train.fit import EAGLE31, _append_jsonl, _truncate_log, grow_vocab, init_from_draft, plot_curves
from train.profiling import StepProfiler
from train.profiling import describe as describe_profile
from train.samples import draft_vocab_from, samples_fingerprint

ANSWERS = "answers.jsonl.xz"
STATE = "stage.json"
TRAIN_STATE = "train_state.pt"
LOG = "train_log.jsonl"
# steps before --profile-steps records: the CUDA graphs' first replays, the first buckets' compilation
PROFILE_SKIP = 20


@contextlib.contextmanager
def ctrl_c_after_step():
    """Within it, a first Ctrl-C (SIGINT) is noted in the list it yields instead of raised, so that a loop ends
    its step and saves before stopping; a second one raises at once. Off the main thread, where no handler can
    be set, a Ctrl-C raises as usual and nothing is noted."""
    stop: list[int] = []

    def on_int(signum, frame) -> None:
        if stop:
            raise KeyboardInterrupt
        stop.append(signum)
        print("Ctrl-C: saving after this step (a second one stops at once)", flush=True)

    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    old = signal.signal(signal.SIGINT, on_int)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, old)


class StageError(UserError):
    """A user-caused problem (paths, data): printed as one `error:` line, exit status 2 (maverick/cli.py)."""


def draft_dir(path: Path) -> Path:
    """A draft directory, or a stage's --out holding one in draft/ (a StageError: it stops the stage)."""
    try:
        return find_draft_dir(path)
    except FileNotFoundError as exc:
        raise StageError(str(exc)) from None


def earlier_answers(init: Path | None, data: list[dict]) -> list[dict]:
    """Answered records of earlier stages: --data's records with answers, then `answers*.jsonl.xz` beside
    --init-draft (a stage's --out), later files winning for the same id."""
    recs = {r["id"]: r for r in data if "answers" in r}
    if init is not None:
        for f in sorted(init.glob("answers*.jsonl.xz")):
            recs |= {r["id"]: r for r in answer_file.read_records(f)}
    return list(recs.values())


def init_answered(init: Path | None) -> int:
    """How many answered conversations a stage's draft trained on (its training.json; 0 if unknown)."""
    if init is None:
        return 0
    try:
        info = json.loads((draft_dir(init) / "training.json").read_text())
    except (OSError, ValueError, StageError):
        return 0
    n = info.get("answered_conversations", 0) if isinstance(info, dict) else 0
    return n if isinstance(n, int) else 0


def load_data(paths: Sequence[str]) -> list[dict]:
    out = []
    for p in paths:
        if not Path(p).is_file():
            raise StageError(f"{p}: no such data file (make one with python -m train.stage_data)")
        recs = answer_file.read_records(p)
        bad = next((r for r in recs if not isinstance(r.get("prompts"), list)), None)
        if bad is not None:
            raise StageError(
                f"{p}: record {bad.get('id')!r} has no token-id 'prompts' (train.stage_data makes them)"
            )
        out += recs
    return out


class Stage:
    def __init__(self, args: argparse.Namespace, t0: float):
        self.args, self.t0 = args, t0
        self.budget = args.minutes * 60.0
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        remove_leftovers(self.out)  # a killed run's half-written files (a training state: ~110 MiB)
        self.state: dict[str, Any] = (
            json.loads((self.out / STATE).read_text()) if (self.out / STATE).is_file() else {}
        )
        self.state.setdefault("phases", {})
        self.state.setdefault("runs", 0)
        self.state["runs"] += 1
        self.minutes_before = self.state.get("minutes", 0)  # earlier runs', interrupted ones included
        self.saved = json.loads(json.dumps(self.state))  # the state as last saved (save_minutes)
        try:
            self._load(args)
        except BaseException:
            self.save_minutes()  # the budget's clock ran from t0: a Ctrl-C or a failure while loading counts
            raise

    def _load(self, args: argparse.Namespace) -> None:
        self.device = torch.device(args.device)
        self.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
        self.init = Path(args.init_draft) if args.init_draft else None
        self.data = load_data(args.data)
        self.earlier = earlier_answers(self.init, self.data)
        missing = init_answered(self.init) - len(self.earlier)
        if missing > 0:  # e.g. a third stage given only the second's answers: the first's would be redone
            print(f"warning: the --init-draft trained on {missing} more answered conversations than this stage "
                  "has: fold the earlier stages' answers into --data (python -m train.stage_data --answers "
                  "<each stage's answers.jsonl.xz>) so that they are trained on and not answered again", flush=True)  # fmt: skip
        self.here: list[dict] | None = None  # the records of --out's answers file, once regeneration has them
        t = time.perf_counter()
        target = Path(args.target) if args.target else default_target_path()
        self.model: Llama4 = load_target(target, self.dtype, str(self.device)).eval()
        self.state["target"] = str(target)
        self.state["load_seconds"] = round(time.perf_counter() - t, 1)
        eos = self.model.config.eos_ids
        self.eos = list(eos) if isinstance(eos, list | tuple) else [eos]

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def minutes(self) -> float:
        return round(self.minutes_before + (time.perf_counter() - self.t0) / 60, 4)

    def save_state(self) -> None:
        self.state["minutes"] = self.minutes()  # so far, at every save
        self.saved = json.loads(json.dumps(self.state))
        atomic_write(self.out / STATE, json.dumps(self.state, indent=1) + "\n")

    def save_minutes(self) -> None:
        """An interrupted or failed run's minutes, into the state as last saved (its phases as they were)."""
        atomic_write(self.out / STATE, json.dumps({**self.saved, "minutes": self.minutes()}, indent=1) + "\n")

    # ---- 1. regeneration ----
    def regenerate(self) -> None:
        a, path = self.args, self.out / ANSWERS
        here, dropped = answer_file.repair(path)  # written by an interrupted earlier run of this stage
        done = {r["id"] for r in here} | {r["id"] for r in self.earlier if "more" not in r}
        todo = [r for r in self.data if r.get("split") != "heldout" and ("answers" not in r or r.get("more"))]
        random.Random(a.seed).shuffle(todo)  # any prefix answered samples every length
        # shuffled before the answered ones leave, so that a rerun goes on down the same order (filtered first,
        # a rerun's shuffle of what was left answered other conversations than an uninterrupted run)
        todo = [r for r in todo if r["id"] not in done]
        # an answered chat with later user turns continues after its answers: its first prompt is all of it
        cont = {r["id"]: r for r in todo if "answers" in r}
        if a.max_conversations is not None:
            todo = todo[: max(0, a.max_conversations - len(here))]
        deadline = self.t0 + a.regen_share * self.budget
        cap = a.max_answers_mib * 2**20
        pending: list[dict] = []
        new: list[dict] = []  # what this run wrote
        last_flush = [time.perf_counter()]

        # compressing a flush takes ~1 s of CPU: a writer thread does it (lzma releases the GIL) while the
        # decoding goes on; one worker keeps the streams in order
        writer = ThreadPoolExecutor(max_workers=1)
        writes = []

        def flush() -> None:
            writes.append(writer.submit(answer_file.append, path, list(pending)))
            new.extend(pending)
            pending.clear()
            last_flush[0] = time.perf_counter()
            self.save_minutes()  # a run killed outright (SIGKILL) still counts its minutes up to here

        def on_done(ans) -> None:
            rec = ans.record()
            old = cont.get(rec["id"])
            if old is not None:  # the earlier turns, then the new ones
                rec = {"id": old["id"], "prompts": old["prompts"] + old["more"][: len(rec["answers"])],
                       "answers": old["answers"] + rec["answers"]}  # fmt: skip
            pending.append(rec)
            if len(pending) >= a.flush_every or time.perf_counter() - last_flush[0] > 30:
                flush()

        def stop() -> bool:
            return path.exists() and path.stat().st_size >= cap

        gen = FastGenerator(
            self.model,
            a.batch_size,
            a.max_len,
            a.max_new_tokens,
            self.eos,
            graphs=None if a.graphs else False,
        )
        convs = (Conversation(r["id"], _continued(r) if r["id"] in cont else r["prompts"]) for r in todo)
        prof = StepProfiler(PROFILE_SKIP, a.profile_steps, self.device)
        try:
            stats = gen.run(convs, on_done, deadline=deadline, stop=stop, on_step=prof.step)
        finally:  # a failure or Ctrl-C (the device script's hang guard) keeps every finished conversation
            if pending:
                flush()
            writer.shutdown(wait=True)
        profiled = prof.summary()
        if a.profile_steps:
            print(describe_profile("regeneration", profiled, "decode step"), flush=True)
        for w in writes:
            w.result()  # a failed write is an error, not a silent loss
        self.here = here + new  # the file's records now: the training need not decompress it again
        graphs, graph_error, capture = gen.graphs, gen.graph_error, gen.capture_seconds
        del gen  # its cache and graphs: the training's memory
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.state["phases"]["regen"] = {
            "conversations": len(new),
            "conversations_earlier_runs": len(here),
            "turns": stats.turns,
            "new_tokens": stats.new_tokens,
            "prefill_tokens": stats.prefill_tokens,
            "decode_steps": stats.steps,
            "seconds": round(stats.seconds, 1),
            "new_tokens_per_s": round(stats.tokens_per_s, 1),
            "skipped_too_long": stats.skipped,
            "left": len(todo) - len(new) - stats.skipped,
            "batch_size": a.batch_size,
            "cuda_graphs": graphs,
            "cuda_graph_error": graph_error,
            "capture_seconds": round(capture, 1),
            "cut_off_bytes_dropped": dropped,
        }
        if a.profile_steps:
            self.state["phases"]["regen"]["profile"] = profiled
        self.save_state()

    # ---- 2. training ----
    def samples(self) -> list[dict]:
        # read here only when this run did not regenerate (done in an earlier run, or failed)
        here = self.here if self.here is not None else answer_file.read_records(self.out / ANSWERS)
        recs = {r["id"]: r for r in self.earlier} | {r["id"]: r for r in here}
        return [answer_file.sample(r) for r in recs.values()]

    def build_draft(self, samples: list[dict]) -> Eagle3Draft:
        a = self.args
        seeded = torch.Generator().manual_seed(a.seed)
        if self.init is not None:
            src = load_draft(draft_dir(self.init), dtype=torch.float32, device=str(self.device))
            if a.grow_vocab:
                src = self.grow(src, samples)
            if not a.eagle31 or all(getattr(src.config, k) for k in EAGLE31):
                return src
            # an EAGLE-3 draft carried into an EAGLE-3.1 one: its weights, fc_norm at its features' scale
            draft = Eagle3Draft(dataclasses.replace(src.config, **EAGLE31))
            draft.init_weights(std=0.02, generator=seeded)
            draft.set_vocab(src.d2t.cpu(), src.t2d.cpu())

            def features() -> list[torch.Tensor]:  # the target's, on 16 training samples
                ids = [torch.as_tensor(s["input_ids"][:512], device=self.device)[None] for s in samples[:16]]
                with torch.no_grad():
                    return [
                        self.model(x, feature_layers=src.config.feature_layers, logits=None).features
                        for x in ids
                    ]

            init_from_draft(draft, str(draft_dir(self.init)), features, src)
            return draft.to(self.device)
        cfg = self.model.config
        flat = [
            {"input_ids": torch.as_tensor(s["input_ids"]), "loss_mask": torch.as_tensor(s["loss_mask"])}
            for s in samples
        ]
        d2t, t2d, _ = draft_vocab_from(flat, cfg.vocab_size, self.args.draft_vocab_size)
        dcfg = DraftConfig.for_target(cfg, draft_vocab_size=int(d2t.numel()),
                                      feature_layers=default_feature_layers(cfg.num_hidden_layers),
                                      **(EAGLE31 if a.eagle31 else {}))  # fmt: skip
        draft = Eagle3Draft(dcfg)
        draft.init_weights(std=0.02, generator=seeded)
        draft.set_vocab(d2t, t2d)
        return draft.to(self.device)

    def grow(self, src: Eagle3Draft, samples: list[dict]) -> Eagle3Draft:
        """--grow-vocab (its size checked in `main`): the init draft with the answers' most frequent tokens
        added (train.fit.grow_vocab)."""
        return grow_vocab(src, count_tokens(samples, src.config.vocab_size), self.args.grow_vocab)

    def train(self) -> None:
        a = self.args
        samples = self.samples()
        if not samples:
            raise StageError(
                "no answers to train on: regeneration wrote none and no earlier answers were given"
            )
        dev = self.device
        draft = self.build_draft(samples).train()
        embed_w = self.model.model.embed_tokens.weight.detach()
        embed = lambda ids: F.embedding(ids, embed_w)  # noqa: E731
        opt = torch.optim.AdamW(draft.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0, eps=1e-8,
                                fused=dev.type == "cuda")  # fmt: skip
        sched = TimeSchedule(a.warmup)
        buckets = Buckets(a.token_budget, a.bucket, a.max_length)
        lengths = [len(s["input_ids"]) for s in samples]
        layers = draft.config.feature_layers
        step, epoch, pos, spent, tokens = 0, 0, 0, 0.0, 0
        tokens0 = 0
        fingerprint = samples_fingerprint(samples)
        ck = self.out / TRAIN_STATE
        if ck.is_file():
            st = torch.load(ck, map_location=dev, weights_only=True)
            if set(st["draft"]) != set(draft.state_dict()):
                raise StageError(
                    f"{ck}: its draft has the tensors {sorted(set(st['draft']) ^ set(draft.state_dict()))} "
                    f"where this run's has not, or the reverse: resume with the first run's --eagle-3.1"
                )
            if st["draft"]["d2t"].shape != draft.d2t.shape:
                raise StageError(
                    f"{ck}: its draft has {st['draft']['d2t'].numel()} tokens, this run's "
                    f"{draft.config.draft_vocab_size}: resume with the first run's --grow-vocab"
                )
            # the vocabulary and the samples too: another --init-draft, or a fresh draft's vocabulary counted on
            # other data, of the same size, trained against the first run's target rows without a word; other
            # samples would put the saved epoch position in another batch list
            if not torch.equal(st["draft"]["d2t"].cpu(), draft.d2t.cpu()):
                raise StageError(
                    f"{ck}: its draft vocabulary is not this run's: resume with the first run's --init-draft and "
                    f"data, or delete {ck} to train from the start"
                )
            if st.get("samples", fingerprint) != fingerprint:  # (a state saved before it was recorded: none)
                raise StageError(
                    f"{ck}: trained on other samples than this run's ({len(samples)}): resume with the first "
                    f"run's data, or delete {ck} to train from the start"
                )
            draft.load_state_dict(st["draft"])
            opt.load_state_dict(st["optimizer"])
            step, epoch, pos, spent, tokens = st["step"], st["epoch"], st["pos"], st["seconds"], st["tokens"]
            tokens0 = tokens
            print(f"resumed training at step {step} ({spent:.0f} s done)", flush=True)
        # the target rows of the loaded vocabulary (a checkpoint's, when one was loaded above)
        lm_rows = self.model.lm_head.weight.detach()[draft.draft_to_target_ids].float()
        t2d = draft.t2d.to(dev)
        budget = spent + max(
            0.0, self.left() - a.score_share * self.budget
        )  # this run's training seconds + earlier
        log_path = self.out / LOG
        if step == 0:
            log_path.unlink(missing_ok=True)
        else:
            _truncate_log(log_path, step)  # keep the records up to the checkpoint
        fn = lambda b: dense_step_sums(draft, embed, b, a.ttt_steps)  # noqa: E731
        if a.compile:
            fn = torch.compile(fn, dynamic=False)
        autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.precision == "bf16")
        batches = bucket_batches(lengths, buckets, a.seed, epoch)
        start_step, t_run, t_ck = step, time.perf_counter(), time.perf_counter()
        sums = torch.zeros(3, a.ttt_steps, device=dev)
        n_log, tok_log, t_log = 0, 0, time.perf_counter()
        prof = StepProfiler(PROFILE_SKIP, a.profile_steps, dev)

        def save_ck() -> None:
            st = {"draft": draft.state_dict(), "optimizer": opt.state_dict(), "step": step, "epoch": epoch,
                  "pos": pos, "seconds": spent + time.perf_counter() - t_run, "tokens": tokens,
                  "samples": fingerprint}  # fmt: skip
            with atomic_path(ck) as tmp:
                torch.save(st, tmp)
            self.save_minutes()

        def save_bf16_draft(info: dict[str, Any]) -> None:
            """The shipped format: bf16 weights (the fp32 master copy only lives in train_state.pt), written
            from a copy (save_draft writes it from the CPU)."""
            bf16 = copy.deepcopy(draft).to(torch.bfloat16)
            save_draft(bf16, self.out / "draft", {"training.json": json.dumps(info, indent=1)})

        def write_log() -> None:
            nonlocal n_log, tok_log, t_log
            dt = time.perf_counter() - t_log
            c = sums[2].clamp(min=1)
            loss_i, acc_i = (sums[0] / c).tolist(), (sums[1] / c).tolist()
            rec = {"step": step, "epoch": epoch, "loss": sum(a.decay**i * v for i, v in enumerate(loss_i)),
                   "loss_i": [round(v, 5) for v in loss_i], "acc_i": [round(v, 5) for v in acc_i],
                   "count_i": sums[2].tolist(), "lr": lr, "grad_norm": float(gn), "tokens": tokens,
                   "tokens_per_s": round(tok_log / dt, 1), "seconds": round(spent + time.perf_counter() - t_run, 1)}  # fmt: skip
            _append_jsonl(log_path, rec)
            print(
                f"step {step} loss {rec['loss']:.3f} acc0 {acc_i[0]:.3f} tok/s {rec['tokens_per_s']:.0f}",
                flush=True,
            )
            sums.zero_()
            n_log, tok_log, t_log = 0, 0, time.perf_counter()

        # a Ctrl-C (the device script's hang guard sends one) ends the step under way; then the state and the
        # draft are saved before it goes on up: a rerun resumes from this step, not from the last
        # --checkpoint-seconds save, and a machine gone cold still returns a draft (train_state.pt stays there)
        with ctrl_c_after_step() as stop:
            while (spent + time.perf_counter() - t_run < budget and (a.max_steps is None or step < a.max_steps)
                   and not stop):  # fmt: skip
                if pos >= len(batches):
                    epoch, pos = epoch + 1, 0
                    batches = bucket_batches(lengths, buckets, a.seed, epoch)
                T, ix = batches[pos]
                b = target_batch(
                    self.model, [samples[i] for i in ix], T, buckets.rows(T), layers, lm_rows, t2d
                )
                with autocast:
                    ce, correct, counts = fn(b)
                    loss = weighted_loss(ce, counts, a.decay)
                loss.backward()
                gn = torch.nn.utils.clip_grad_norm_(draft.parameters(), a.grad_clip)
                # with --max-steps the schedule follows the steps, so that runs repeat; else the time spent
                done = (
                    step / a.max_steps
                    if a.max_steps
                    else (spent + time.perf_counter() - t_run) / max(budget, 1e-9)
                )
                lr = a.lr * sched(step, done)
                for g in opt.param_groups:
                    g["lr"] = lr
                opt.step()
                opt.zero_grad(set_to_none=True)
                prof.step()
                n_tok = sum(min(T, lengths[i]) for i in ix)
                tokens += n_tok
                tok_log += n_tok
                step, pos, n_log = step + 1, pos + 1, n_log + 1
                sums += torch.stack((ce.detach().float(), correct, counts))
                if step % a.log_every == 0 or step == a.max_steps:
                    write_log()
                if time.perf_counter() - t_ck > a.checkpoint_seconds:
                    save_ck()
                    t_ck = time.perf_counter()
        if n_log:  # the steps since the last record (the budget or a Ctrl-C ended the run between two)
            write_log()
        if stop:
            save_ck()
            save_bf16_draft({"stage": str(self.out), "steps": step, "tokens": tokens, "interrupted": True})
            print(f"saved the training state and the draft at step {step}", flush=True)
            raise KeyboardInterrupt
        seconds = spent + time.perf_counter() - t_run
        ran = time.perf_counter() - t_run
        profiled = prof.summary()
        if a.profile_steps:
            print(describe_profile("training", profiled), flush=True)
        save_bf16_draft(
            {"stage": str(self.out), "steps": step, "tokens": tokens, "answered_conversations": len(samples)}
        )
        if log_path.exists():
            recs = [json.loads(x) for x in log_path.read_text().splitlines() if x.strip()]
            if recs:
                plot_curves(recs, self.out / "curve.png")
        self.state["phases"]["train"] = {
            "samples": len(samples),
            "sample_tokens": sum(min(n, buckets.length(n)) for n in lengths),
            "answer_tokens": sum(sum(s["loss_mask"]) for s in samples),
            "steps": step,
            "steps_this_run": step - start_step,
            "epochs": round(tokens / max(1, sum(lengths)), 3),
            "tokens": tokens,
            "seconds": round(seconds, 1),
            "tokens_per_s": round((tokens - tokens0) / max(ran, 1e-9), 1),  # this run's, compile included
            "init_draft": str(draft_dir(self.init)) if self.init else None,
            "norm_variants": [k for k in NORM_VARIANTS if getattr(draft.config, k)],  # [] : EAGLE-3
            "draft_vocab_size": draft.config.draft_vocab_size,
            "lr": a.lr, "token_budget": a.token_budget, "bucket": a.bucket, "max_length": a.max_length,
            "ttt_steps": a.ttt_steps, "precision": a.precision, "compile": a.compile,
        }  # fmt: skip
        if a.profile_steps:
            self.state["phases"]["train"]["profile"] = profiled
        self.save_state()
        ck.unlink(missing_ok=True)

    # ---- 3. score ----
    def score(self) -> None:
        a = self.args
        held = [r for r in self.data if r.get("split") == "heldout"][: a.heldout]
        if not held:
            self.state["phases"]["score"] = {"heldout": 0, "note": "no held-out records in --data"}
            self.save_state()
            return
        got: dict[str, list[int]] = {}
        gen = FastGenerator(self.model, min(len(held), a.batch_size), a.max_len, a.score_new_tokens, self.eos,
                            graphs=None if a.graphs else False)  # fmt: skip
        gen.run(
            (Conversation(r["id"], r["prompts"][:1]) for r in held),
            lambda x: got.__setitem__(x.id, x.answers[0]),
        )
        pairs = [
            (r["prompts"][0], got[r["id"]])
            for r in held
            if r["id"] in got and len(got[r["id"]]) > a.ttt_steps
        ]
        drafts = {"new": draft_dir(self.out)}
        if self.init is not None:
            drafts = {"init": draft_dir(self.init)} | drafts
        result: dict[str, Any] = {
            "heldout": len(pairs),
            "answer_tokens": sum(len(x) for _, x in pairs),
            "drafts": {},
        }
        fields: dict[tuple, list] = {}
        steps = min(5, a.ttt_steps)
        reaches: dict[str, list[torch.Tensor]] = {}
        for name, path in drafts.items():
            draft = load_draft(path, dtype=self.dtype, device=str(self.device))
            layers = tuple(draft.config.feature_layers)
            if layers not in fields:
                fields[layers] = [target_fields(self.model, p, x, layers) for p, x in pairs]
            reach = [
                reach_of_runs(run_lengths(self.model, draft, p, x, steps, f), steps)
                for (p, x), f in zip(pairs, fields[layers])
            ]
            result["drafts"][name] = {"path": str(path)} | summarize(reach, steps)
            reaches[name] = reach
        if len(reaches) == 2 and pairs:  # did the stage help: the difference, with its 95% interval
            result["new_less_init"] = paired_difference(
                reaches["init"], reaches["new"], range(len(pairs)), steps
            )
        self.state["phases"]["score"] = result
        self.save_state()

    def run(self) -> dict:
        a = self.args
        self.state["config"] = {k: v for k, v in vars(a).items()}
        self.state["device"] = (
            torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        )
        try:
            self.run_phases()
        except BaseException:  # Ctrl-C (the device script's limit), a failed training: its minutes count
            self.save_minutes()
            raise
        self.state["out_bytes"] = sum(f.stat().st_size for f in self.out.rglob("*") if f.is_file())
        self.save_state()
        return self.state

    def run_phases(self) -> None:
        a, ph = self.args, self.state["phases"]
        for name, fn in (("regen", self.regenerate), ("train", self.train), ("score", self.score)):
            if name in ph:
                print(f"{name}: done in an earlier run", flush=True)
                continue
            t = time.perf_counter()
            try:
                fn()
            except StageError:
                raise
            except Exception as exc:  # a failed phase must not take the later ones with it
                import traceback

                traceback.print_exc()
                if name == "train":  # nothing to score without a new draft
                    raise
                # regeneration: train on what was written and the earlier answers; a rerun does not retry
                ph[name] = {"error": f"{type(exc).__name__}: {exc}"}
                self.save_state()
            print(f"{name}: {json.dumps(ph[name])} ({time.perf_counter() - t:.0f} s)", flush=True)
            if a.stop_after == name:
                break


def _continued(rec: dict) -> list[list[int]]:
    """The prompts that continue an answered record with its later user turns ("more")."""
    flat = answer_file.sample(rec)["input_ids"]
    return [flat + rec["more"][0]] + rec["more"][1:]


def build_parser() -> argparse.ArgumentParser:
    cuda = torch.cuda.is_available()
    p = ArgumentParser(prog="python -m train.stage", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument(
        "--minutes", type=positive_float, required=True, help="wall-clock budget of the whole stage"
    )
    p.add_argument("--out", required=True, type=output_dir)
    p.add_argument("--init-draft", default=None, help="a draft directory or an earlier stage's --out")
    p.add_argument(
        "--target",
        "--gguf",
        dest="target",
        default=None,
        help=".gguf or HF directory (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--data", action="append", required=True, help="id records from python -m train.stage_data"
    )
    p.add_argument("--device", type=device, default="cuda" if cuda else "cpu")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="the target's dtype")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    add_threads_option(p)
    p.add_argument("--stop-after", choices=("regen", "train", "score"), default=None)
    p.add_argument("--profile-steps", type=nonnegative_int, default=0,
                   help=f"profile this many decode steps and training steps (after the first {PROFILE_SKIP} of "
                   "each) with torch.profiler: per-step wall, device and top-op times into stage.json (0: off)")  # fmt: skip
    g = p.add_argument_group("regeneration")
    g.add_argument(
        "--regen-share", type=share, default=0.45, help="regenerate until this share of the budget"
    )
    # 768 rows x 1536 slots: a 27 GB cache for SmolLM2 (23 KB per token)
    g.add_argument(
        "--batch-size", type=positive_int, default=768 if cuda else 16, help="cache rows decoding at once"
    )
    g.add_argument(
        "--max-len", type=positive_int, default=1536, help="cache slots per row (context of a conversation)"
    )
    g.add_argument("--max-new-tokens", type=positive_int, default=384)
    g.add_argument(
        "--max-conversations", type=nonnegative_int, default=None, help="answer at most this many in all"
    )
    g.add_argument(
        "--max-answers-mib",
        type=positive_float,
        default=40.0,
        help="stop regenerating at this file size (the write under way may pass it by one --flush-every's answers)",
    )
    g.add_argument("--flush-every", type=positive_int, default=256, help="conversations per compressed write")
    g.add_argument("--no-graphs", dest="graphs", action="store_false", help="eager decode steps on CUDA")
    t = p.add_argument_group("training")
    t.add_argument("--lr", type=positive_float, default=2e-4)
    t.add_argument("--warmup", type=nonnegative_int, default=20)
    t.add_argument("--ttt-steps", type=positive_int, default=5)
    t.add_argument("--decay", type=nonnegative_float, default=0.8)
    t.add_argument("--grad-clip", type=positive_float, default=0.5)
    # the TTT attention keeps [rows, heads, T, T] fp32 scores per unroll step for the backward: ~1.8 GB per
    # step at 32k tokens in buckets of 1536, so the budget is tokens, not rows
    t.add_argument(
        "--token-budget", type=positive_int, default=32768 if cuda else 2048, help="tokens per batch"
    )
    t.add_argument("--bucket", type=positive_int, default=256)
    t.add_argument("--max-length", type=positive_int, default=1536, help="tokens per training sample")
    t.add_argument("--precision", choices=("bf16", "fp32"), default="bf16" if cuda else "fp32")
    t.add_argument("--compile", action="store_true", help="torch.compile the TTT step (one graph per bucket)")
    t.add_argument("--max-steps", type=nonnegative_int, default=None,
                   help="stop after N steps; the LR's cosine then runs over the steps, not the time budget, "
                   "so that two runs repeat")  # fmt: skip
    t.add_argument("--log-every", type=positive_int, default=10)
    t.add_argument("--checkpoint-seconds", type=nonnegative_float, default=60.0)
    t.add_argument(
        "--draft-vocab-size", type=positive_int, default=8192, help="a fresh draft's (no --init-draft)"
    )
    t.add_argument("--grow-vocab", type=positive_int, default=None, metavar="N",
                   help="with --init-draft: grow its vocabulary to N tokens, adding the answers' most frequent "
                   "(new lm_head rows start at zero)")  # fmt: skip
    t.add_argument("--eagle-3.1", dest="eagle31", action="store_true",
                   help="EAGLE-3.1's norms (each aux-layer feature before fc, the output); an --init-draft "
                   "without them is carried over, fc_norm starting at its features' scale")  # fmt: skip
    s = p.add_argument_group("scoring")
    s.add_argument("--score-share", type=share, default=0.08, help="budget share kept for scoring")
    s.add_argument("--heldout", type=nonnegative_int, default=64, help="held-out conversations scored")
    s.add_argument("--score-new-tokens", type=positive_int, default=128)
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    t0 = time.perf_counter()
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.init_draft:
        init = draft_dir(Path(args.init_draft))
        if args.grow_vocab:  # before any regeneration: a bad size would otherwise stop the stage at training
            c = DraftConfig.from_hf_dict(read_json_object(init / "config.json"), str(init / "config.json"))
            if not c.draft_vocab_size <= args.grow_vocab <= c.vocab_size:
                raise StageError(
                    f"--grow-vocab {args.grow_vocab}: the init draft has {c.draft_vocab_size} tokens and the "
                    f"target {c.vocab_size}; give a size between"
                )
    elif args.grow_vocab:
        raise StageError(
            "--grow-vocab grows an --init-draft's vocabulary (a fresh draft: --draft-vocab-size)"
        )
    stage = Stage(args, t0)
    print(json.dumps({"config": {k: v for k, v in vars(args).items()}, "device": str(stage.device),
                      "earlier_answers": len(stage.earlier), "data_records": len(stage.data)}), flush=True)  # fmt: skip
    state = stage.run()
    print(json.dumps({k: v for k, v in state.items() if k != "config"}), flush=True)
    return state


if __name__ == "__main__":
    run_cli(main, resume="the same command (the same --out) continues where it stopped")
