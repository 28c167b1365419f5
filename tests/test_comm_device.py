"""The runtime's own collective tensors (loss counts, nonfinite flags, norm
accumulators, bucket counts, calibration's all-reduce) are made on the collective's
device (runtime/comm_device.py), never on the default one: NCCL fails on a CPU tensor,
and a rank holding no gradients or no parameters used to hand it one. On CPU a missing
`device=` cannot show in a run, so the sources are read: every tensor factory call in
the modules that feed collectives names its device."""
from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest
import torch

from autohybrid.runtime import comm_device

PACKAGE = Path(__file__).resolve().parents[1] / "autohybrid"
#: what hands tensors to torch.distributed: `dist.<name>(...)` or ops/groups.py's forms
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
               "broadcast", "reduce", "gather", "scatter", "all_to_all",
               "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv"}
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange"}
#: calls that make a CPU tensor on purpose, each kept off collectives or moved to the
#: collective's device before one: (module, the enclosing function) -> why
ALLOWED = {
    ("runtime/batch_agreement.py", "fingerprint"): "7 numbers assembled on the host; "
        "start_agreement moves them to the batch's device before its all-gather",
    ("runtime/batch_agreement.py", "_one"): "the fingerprint's host part (the sums run on "
                                            "the batch's device)",
    ("runtime/batch_agreement.py", "start_agreement"): "the refusal flag, concatenated "
        "to the fingerprint, all moved with .to(device) before the all-gather",
    ("runtime/stage_exchange.py", "_header"): "a header built on the host; send_value "
                                              "moves it with .to(device) before isend",
    ("baselines.py", "_qkv_rows_by_rank"): "an index permuting a weight's rows, never "
                                           "a collective's",
}


def _calls_collectives(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in COLLECTIVES:
                return True
    return False


def _feeding() -> dict[str, ast.AST]:
    """Every module of autohybrid that calls a tensor collective, parsed."""
    trees = {str(p.relative_to(PACKAGE)): ast.parse(p.read_text())
             for p in sorted(PACKAGE.rglob("*.py"))}
    return {name: tree for name, tree in trees.items() if _calls_collectives(tree)}


def _factory_calls_without_device(tree: ast.AST) -> list[tuple[str, int]]:
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef,
                                                    ast.AsyncFunctionDef)) else function
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and child.func.attr in FACTORIES
                    and isinstance(child.func.value, ast.Name)
                    and child.func.value.id == "torch"
                    and not any(k.arg == "device" for k in child.keywords)):
                found.append((name, child.lineno))
            visit(child, name)
    visit(tree, "<module>")
    return found


def test_every_tensor_factory_feeding_a_collective_names_its_device():
    feeding = _feeding()
    # the discovery finds the runtime's collective code (a renamed call would hide it)
    assert {"runtime/executor.py", "runtime/precision.py", "runtime/gathered.py",
            "runtime/tp_state.py", "runtime/reducer.py", "runtime/zero.py",
            "runtime/pipeline.py", "runtime/stage_exchange.py", "runtime/collectives.py",
            "runtime/batch_agreement.py", "runtime/selfcheck_stage.py", "calibrate.py",
            "ops/tensor_parallel.py", "ops/zero.py"} <= set(feeding), feeding
    missing, used = [], set()
    for module in feeding:
        for function, line in _factory_calls_without_device(feeding[module]):
            if (module, function) in ALLOWED:
                used.add((module, function))
            else:
                missing.append(f"{module}:{line} in {function}")
    assert not missing, ("tensor factories without device= where tensors reach "
                         f"collectives (use comm_device(group)): {missing}")
    assert used == set(ALLOWED), f"stale allowlist entries: {set(ALLOWED) - used}"


def test_the_lint_sees_a_factory_without_device():
    tree = ast.parse("import torch\ndef f(g):\n    t = torch.zeros(())\n"
                     "    u = torch.ones(2, device=t.device)\n    dist.all_reduce(t)\n")
    assert _calls_collectives(tree)
    assert _factory_calls_without_device(tree) == [("f", 3)]


def test_the_device_is_the_bound_one_else_by_backend(monkeypatch):
    monkeypatch.setattr(comm_device, "_BOUND", [None])
    assert comm_device.comm_device() == torch.device("cpu")   # no group, not bound
    comm_device.bind("meta")
    assert comm_device.comm_device() == torch.device("meta")


def test_a_rank_without_gradients_flags_on_the_collective_device(monkeypatch):
    """any_nonfinite with no gradient at all (a stage holding only frozen parameters)."""
    from autohybrid.runtime import precision

    monkeypatch.setattr(comm_device, "_BOUND", [torch.device("meta")])
    made = []
    real = torch.zeros

    def spy(*args, **kwargs):
        made.append(kwargs.get("device"))
        return real(*args, **{**kwargs, "device": "cpu"})
    monkeypatch.setattr(torch, "zeros", spy)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: self)
    assert precision.any_nonfinite([None, None]) is False
    assert made == [torch.device("meta")]


# ---------------------------------------------------------------- the collective check
# (runtime/device_check.py; on in every multi-process test through tests/conftest.py)

def test_the_check_names_the_collective_the_device_and_the_expected_one():
    import torch.distributed as dist

    from autohybrid.errors import RuntimeFailure
    from autohybrid.ops import groups
    from autohybrid.runtime import device_check

    with device_check.checking("meta"):   # not a CPU tensor's device: every call refused
        before = device_check.calls()
        with pytest.raises(RuntimeFailure, match=r"all_reduce was handed a tensor on cpu "
                                                 r".*takes tensors on meta"):
            dist.all_reduce(torch.zeros(2))
        with pytest.raises(RuntimeFailure, match="all_gather was handed"):  # in a list
            dist.all_gather([torch.zeros(2, device="meta"), torch.zeros(2)],
                            torch.zeros(2, device="meta"))
        with pytest.raises(RuntimeFailure, match="all_gather_single was handed"):
            groups.all_gather_single(torch.zeros(4, device="meta"), torch.zeros(2))
        dist.distributed_c10d._check_op(dist.isend)  # P2POp takes the wrapped isend
        send = types.SimpleNamespace(op=dist.isend, tensor=torch.zeros(2), peer=1)  # a P2POp
        with pytest.raises(RuntimeFailure, match="batch_isend_irecv was handed"):
            dist.batch_isend_irecv([send])
        assert device_check.calls() - before == 4
    with device_check.checking("cpu"):  # torch's batch_isend_irecv gets the original op
        with pytest.raises((RuntimeError, ValueError, AttributeError)):
            dist.batch_isend_irecv([send])
        assert send.op is device_check._STATE["originals"]["isend"]
    with device_check.checking("cpu"):  # the right device: through to torch (no group here)
        with pytest.raises((RuntimeError, ValueError)) as caught:
            dist.all_reduce(torch.zeros(2))
        assert not isinstance(caught.value, RuntimeFailure)


def test_object_collectives_under_nccl_need_the_current_device(monkeypatch):
    import torch.distributed as dist

    from autohybrid.errors import RuntimeFailure
    from autohybrid.runtime import device_check

    monkeypatch.setattr(device_check, "_is_nccl", lambda group: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    with device_check.checking(torch.device("cuda", 0)):
        with pytest.raises(RuntimeFailure, match=r"all_gather_object under NCCL runs on "
                                                 r"the current CUDA device, cuda:1.*set_device"):
            dist.all_gather_object([None, None], 1)


def test_off_nothing_is_wrapped_and_the_env_turns_it_on(monkeypatch):
    import torch.distributed as dist

    from autohybrid.runtime import device_check

    was = device_check.enabled()
    device_check.disable()
    try:
        original = dist.all_reduce
        monkeypatch.setenv(device_check.ENV, "0")
        assert not device_check.from_env() and dist.all_reduce is original
        monkeypatch.setenv(device_check.ENV, "1")
        assert not device_check.from_env()   # no process group: not a rank
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        assert device_check.from_env() and dist.all_reduce is not original
        assert dist.all_reduce == original   # (as torch's P2POp check needs)
        device_check.disable()
        assert dist.all_reduce is original
    finally:
        if was:
            device_check.enable()
