"""The runtime's own collective tensors (loss counts, nonfinite flags, norm
accumulators, bucket counts, calibration's all-reduce) are made on the collective's
device (runtime/comm_device.py), never on the default one: NCCL fails on a CPU tensor,
and a rank holding no gradients or no parameters used to hand it one. On CPU a missing
`device=` cannot show in a run, so the sources are read: every tensor factory call in
the modules that feed collectives names its device."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from autohybrid.runtime import comm_device

PACKAGE = Path(__file__).resolve().parents[1] / "autohybrid"
#: modules whose tensors reach torch.distributed
FEEDING = ["runtime/executor.py", "runtime/precision.py", "runtime/gathered.py",
           "runtime/tp_state.py", "runtime/reducer.py", "runtime/zero.py",
           "runtime/pipeline.py", "runtime/selfcheck.py", "runtime/selfcheck_stage.py",
           "runtime/collectives.py", "calibrate.py"]
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange"}
#: calls that make a CPU tensor on purpose, each moved or kept off collectives:
#: (module, the enclosing function) -> why
ALLOWED = {
    ("runtime/gathered.py", "clip_grad_norm"): "one process, no collective: the norm "
                                               "of no gradients",
}


def _factory_calls_without_device(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
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
    missing = []
    for module in FEEDING:
        for function, line in _factory_calls_without_device(PACKAGE / module):
            if (module, function) not in ALLOWED:
                missing.append(f"{module}:{line} in {function}")
    assert not missing, ("tensor factories without device= where tensors reach "
                         f"collectives (use comm_device(group)): {missing}")


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
