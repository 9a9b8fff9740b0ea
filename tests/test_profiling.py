"""train.profiling on CUDA events: the device time of one kernel counted once (kineto lists it as its own
event, inside its launching op's self device time, and under the step's GPU annotation), the kernels ranked
apart from the host's ops. Built as torch.autograd.profiler builds kineto's events, so it runs on a CPU."""

from __future__ import annotations

import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList, FunctionEvent

from train.profiling import StepProfiler, describe


def kineto_like_events() -> EventList:
    """One step: aten::mm (20 us on the host) launches a 100 us kernel; the step's annotation on both sides."""
    mm = FunctionEvent(id=1, name="aten::mm", thread=1, start_us=0, end_us=20, use_device="cuda", stack=[])
    mm.append_kernel("sm90_gemm", 0, 100.0)
    kernel = FunctionEvent(id=1, name="sm90_gemm", thread=7, start_us=30, end_us=130, use_device="cuda",
                           stack=[], device_type=DeviceType.CUDA)  # fmt: skip
    step_host = FunctionEvent(id=2, name="ProfilerStep#1", thread=1, start_us=0, end_us=140, use_device="cuda",
                              stack=[], is_user_annotation=True)  # fmt: skip
    step_gpu = FunctionEvent(id=2, name="ProfilerStep#1", thread=7, start_us=30, end_us=130, use_device="cuda",
                             stack=[], device_type=DeviceType.CUDA, is_user_annotation=True)  # fmt: skip
    step_host.append_cpu_child(mm)
    mm.set_cpu_parent(step_host)
    events = EventList([step_host, mm, kernel, step_gpu], use_device="cuda")
    events._tree_built = True
    return events


def test_a_kernel_is_counted_once_and_ranked_apart_from_the_host_ops():
    events = kineto_like_events()

    class Recorded:
        def key_averages(self):
            return events.key_averages()

    prof = StepProfiler(skip=1, active=1, device=torch.device("cpu"))  # no profiler started on a CPU ...
    prof.cuda, prof._prof, prof._marks = True, Recorded(), [0.0, 0.001]  # ... the CUDA run's state
    s = prof._read()
    assert s["device_ms"] == 0.1  # read 0.3: the kernel, its op's share of it and the GPU annotation
    assert [(o["name"], o["self_device_ms"]) for o in s["ops"]] == [("sm90_gemm", 0.1)]
    assert [o["name"] for o in s["host_ops"]] == ["ProfilerStep#1", "aten::mm"]
    assert s["host_ops"][1]["self_cpu_ms"] == 0.02
    line = describe("decode", s)
    assert "device 0.10 ms" in line and "top kernels (ms): sm90_gemm 0.10; top host ops (ms):" in line
