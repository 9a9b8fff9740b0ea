"""What bounds a loop's step: torch.profiler over a few steps in the middle of a run, summarised small enough
for stage.json (a lent GPU's minutes should bring back the speed, or what holds it down).

    prof = StepProfiler(skip=20, active=8, device=torch.device("cuda"))
    for ...:
        step()
        prof.step()        # after each step: the profiler records steps skip+1 .. skip+active
    prof.stop()
    prof.summary()         # None if the loop ended before the recorded steps

The summary's two numbers per step say which side bounds it: `device_ms` (the kernels' own time, summed) and
`wall_ms` (the step as the host saw it, between two `step()` calls). Device time well under wall time: the
host (Python, launches, syncs) bounds the loop; close to it: the GPU does. On a CPU `device_ms` is absent
and the ops' own CPU time tells where the step goes. The top ops follow, by their own (self) time: on CUDA
the kernels by device time (`ops`) and the host's ops by CPU time (`host_ops`); `ProfilerStep*` there is
the step's host time outside every op (Python between the ops). `wall_ms` counts
whatever ran between two `step()` calls (a prefill between two decode steps too), under the profiler: its
own cost per op is in it (on a CPU a SmolLM2 decode step takes ~2.5x as long profiled), so compare the
shares within a profile, not its wall time with an unprofiled run's.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, schedule


class StepProfiler:
    def __init__(self, skip: int, active: int, device: torch.device, top: int = 15):
        """Record steps skip+1 .. skip+active (the `skip` first ones run unrecorded: compilation, capture,
        warm-up); active == 0: off (every call is a no-op). A profiler that fails (no CUPTI, say) turns
        itself off and says why in `summary()`: it never stops the loop it watches."""
        if skip < 1:
            raise ValueError(f"StepProfiler: skip must be >= 1 (the first step starts the clock), got {skip}")
        self.active, self.top, self._skip = active, top, skip
        self.cuda = device.type == "cuda"
        self._prof = None
        self._steps = 0
        self._marks: list[float] = []  # perf_counter at the recorded steps' boundaries
        self._done = False
        self.error: str | None = None
        if active > 0:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            # warmup=1: the step before the recorded ones runs under the profiler, unrecorded (its start-up)
            self._guard(lambda: self._start(acts))

    def _start(self, acts) -> None:
        self._prof = profile(
            activities=acts, schedule=schedule(wait=self._skip - 1, warmup=1, active=self.active)
        )
        self._prof.start()

    def _guard(self, fn) -> None:
        try:
            fn()
        except Exception as exc:  # a failed profiler must not cost the run
            self.error = f"{type(exc).__name__}: {exc}"
            self._done = True

    def step(self) -> None:
        """Call after each step of the loop."""
        if self._prof is None or self._done:
            return
        self._steps += 1
        if self._steps >= self._skip and len(self._marks) <= self.active:
            if self.cuda:
                torch.cuda.synchronize()  # the step's kernels done: wall time is the step's, not its launch's
            self._marks.append(time.perf_counter())
        self._guard(self._prof.step)
        if self._steps >= self._skip + self.active:
            self.stop()

    @property
    def done(self) -> bool:
        """The recorded steps are over (or the profiler failed, or is off): later steps are not watched."""
        return self._done or self._prof is None

    def stop(self) -> None:
        if self._prof is not None and not self._done:
            self._done = True
            self._guard(self._prof.stop)

    def summary(self) -> dict[str, Any] | None:
        """{"steps", "wall_ms", "cpu_ms", "device_ms" (CUDA), "ops": [{"name", "calls", "self_cpu_ms",
        "self_device_ms"}]}, per recorded step; None if the loop ended before the recorded steps, {"error"}
        if the profiler failed."""
        self.stop()
        out: dict[str, Any] | None = None

        def read() -> None:
            nonlocal out
            out = self._read()

        if self.error is None:
            self._guard(read)
        return {"error": self.error} if self.error is not None else out

    def _read(self) -> dict[str, Any] | None:
        n = len(self._marks) - 1  # recorded steps
        if self._prof is None or n < self.active:
            return None
        events = self._prof.key_averages()
        out: dict[str, Any] = {
            "steps": n,
            "wall_ms": round((self._marks[-1] - self._marks[0]) * 1e3 / n, 3),
            "cpu_ms": round(sum(e.self_cpu_time_total for e in events) / 1e3 / n, 3),
        }
        host = [e for e in events if e.device_type == DeviceType.CPU]
        if not self.cuda:
            out["ops"] = self._ops(sorted(host, key=lambda e: e.self_cpu_time_total, reverse=True), n)
            return out
        # kineto lists a kernel twice (as its own CUDA event and in its launching op's self device time) and
        # the step's span on the GPU as an annotation: the device's time is its kernels' alone, as torch's
        # own table sums it; with graph replays no aten op holds the kernels, so they are what is ranked
        kernels = [
            e
            for e in events
            if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)
        ]
        out["device_ms"] = round(sum(_device_us(e) for e in kernels) / 1e3 / n, 3)
        out["ops"] = self._ops(sorted(kernels, key=_device_us, reverse=True), n)
        out["host_ops"] = self._ops(sorted(host, key=lambda e: e.self_cpu_time_total, reverse=True), n)
        return out

    def _ops(self, events, n: int) -> list[dict[str, Any]]:
        return [
            {"name": e.key, "calls": e.count // n if e.count >= n else e.count,
             "self_cpu_ms": round(e.self_cpu_time_total / 1e3 / n, 4)}
            | ({"self_device_ms": round(_device_us(e) / 1e3 / n, 4)} if self.cuda else {})
            for e in events[: self.top]
        ]  # fmt: skip


def _device_us(e) -> float:
    """An event's own device time in microseconds (the attribute's name changed across torch versions)."""
    return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) or 0.0)


def describe(name: str, s: dict[str, Any] | None, unit: str = "step") -> str:
    """One line for a log: the times per recorded step (or cycle: `unit`) and the top 5 ops."""
    if s is None:
        return f"{name} profile: the phase ended before the recorded steps"
    if "error" in s:
        return f"{name} profile failed (the run went on without it): {s['error']}"
    dev = f", device {s['device_ms']:.2f} ms" if "device_ms" in s else ""
    key = "self_device_ms" if "device_ms" in s else "self_cpu_ms"
    top = "; ".join(f"{o['name']} {o[key]:.2f}" for o in s["ops"][:5])
    host = "; ".join(f"{o['name']} {o['self_cpu_ms']:.2f}" for o in s.get("host_ops", [])[:5])
    return f"{name} profile over {s['steps']} {unit}s, per {unit}: wall {s['wall_ms']:.2f} ms{dev}, " + (
        f"top kernels (ms): {top}; top host ops (ms): {host}" if host else f"top ops (ms): {top}"
    )
