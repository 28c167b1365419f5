"""CUDA kernel and NCCL events as compute and communication (report/device_events.py,
runtime/profile.py's device path), on synthetic event lists: no process, no GPU."""
from __future__ import annotations

import pytest
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

from autohybrid.report.device_events import classify_device_events, comm_op
from autohybrid.runtime.profile import activities_for, device_events, timeline_from_events

NCCL_AR = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"


def test_exposed_is_comm_not_covered_by_other_streams():
    """NCCL kernel 10–50 on stream 20; compute on stream 7 covers 0–30 and 40–45; a
    compute kernel on the NCCL stream itself (45–60) hides nothing; copies hide nothing."""
    split = classify_device_events([
        (GEMM, "cuda", 7, 0.0, 30.0),
        ("void at::native::vectorized_elementwise_kernel<4>", "cuda", 7, 40.0, 45.0),
        (NCCL_AR, "cuda", 20, 10.0, 50.0),
        ("triton_red_fused_add_native_layer_norm_0", "cuda", 20, 50.0, 60.0),
        ("Memcpy DtoD (Device -> Device)", "cuda", 9, 30.0, 40.0),
        ("nccl:all_reduce", "cpu", 1, 8.0, 9.0),
        ("aten::mm", "cpu", 1, 0.0, 1.0),
    ])
    assert [c[0] for c in split.communication] == [NCCL_AR]
    assert len(split.compute) == 3 and len(split.copies) == 1
    assert split.issues == [("nccl:all_reduce", 8.0, 9.0)]
    assert split.exposed == [(30.0, 40.0), (45.0, 50.0)]
    assert split.exposed_total == pytest.approx(15.0)
    assert split.comm_total == pytest.approx(40.0)


def test_fully_hidden_and_fully_exposed():
    hidden = classify_device_events([(GEMM, "cuda", 7, 0.0, 100.0),
                                     (NCCL_AR, "cuda", 20, 10.0, 50.0)])
    assert hidden.exposed == [] and hidden.exposed_total == 0.0
    # two back-to-back collectives with nothing beside them: all exposed, counted once
    alone = classify_device_events([
        (NCCL_AR, "cuda", 20, 0.0, 10.0),
        ("ncclDevKernel_AllGather_RING_LL", "cuda", 21, 5.0, 20.0),
        (GEMM, "cuda", 20, 20.0, 30.0)])
    assert alone.exposed == [(0.0, 20.0)]
    with pytest.raises(ValueError, match="ends"):
        classify_device_events([(GEMM, "cuda", 1, 5.0, 1.0)])


def test_comm_op_names():
    assert comm_op(NCCL_AR) == "all_reduce"
    assert comm_op("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL") == "reduce_scatter"
    assert comm_op("ncclKernel_AllGather_RING_LL_Sum_int8_t") == "all_gather"
    assert comm_op("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == "send_recv"
    assert comm_op("nccl:all_reduce") == "all_reduce"


class _Ev:
    def __init__(self, name, start, end, thread=1, device=DeviceType.CPU, stream=None,
                 annotation=False):
        self.name, self.thread, self.device_type = name, thread, device
        self.device_resource_id = stream
        self.is_user_annotation = annotation
        self.time_range = type("R", (), {"start": start, "end": end})()


def test_timeline_from_cuda_events():
    """A CUDA step: the host enqueues 0–20 (step range 0–25), kernels run 5–70 on the
    device; the gradient all-reduce kernel (stream 30) 40–70 overlaps the last compute
    kernel (stream 7) until 55: 15 µs exposed. The step span reaches the last kernel."""
    cuda = DeviceType.CUDA
    events = [
        _Ev("ah::step0", 0, 25),
        _Ev("aten::mm", 1, 3),
        _Ev("autograd::engine::evaluate_function: MmBackward0", 4, 10),
        _Ev("c10d::allreduce_", 11, 12),
        _Ev("nccl:all_reduce", 11, 12),
        _Ev("ah::step0", 0, 70, device=cuda, stream=7, annotation=True),
        _Ev(GEMM, 5, 20, device=cuda, stream=7),
        _Ev(GEMM, 22, 55, device=cuda, stream=7),
        _Ev(NCCL_AR, 40, 70, device=cuda, stream=30),
        _Ev("Memset (Device)", 2, 3, device=cuda, stream=7),
    ]
    assert [d[0] for d in device_events(events)] == [GEMM, GEMM, NCCL_AR, "Memset (Device)"]
    timeline = timeline_from_events(events, rank=0, trace_start_s=0.0)
    step = timeline.intervals(0, "step", 0)[0]
    assert round(step.end_s * 1e6) == 70 and step.args["device"] == "cuda"
    comm = timeline.intervals(0, "communication")
    assert [(c.name, c.args["stream"]) for c in comm] == [("all_reduce", 30)]
    s = timeline.summary(0, 0)
    assert s.exposed_comm_s * 1e6 == pytest.approx(15.0)
    assert s.comm_s * 1e6 == pytest.approx(30.0)
    assert s.compute_s * 1e6 == pytest.approx(15.0 + 33.0)


def test_profiler_activities_follow_the_device():
    import torch

    cpu = type("C", (), {"device": torch.device("cpu")})()
    gpu = type("C", (), {"device": torch.device("cuda", 0)})()
    assert activities_for(cpu) == [ProfilerActivity.CPU]
    assert activities_for(gpu) == [ProfilerActivity.CPU, ProfilerActivity.CUDA]
