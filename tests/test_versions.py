"""The supported torch / Triton range and torch's private pipelining members
(autohybrid/features.py), process-free: fake versions, a torch missing a method.

GPU machines here run torch 2.11 + Triton 3.6, this one torch 2.13 + Triton 3.9: both are
inside the range; a release outside it fails at `import autohybrid` with the range; a
torch whose torch.distributed.pipelining lacks what runtime/pipeline.py overrides or
calls makes pipeline plans not executable and the runner refuse before any step.
"""
import ast
import inspect
import types
from pathlib import Path

import pytest
import torch

import autohybrid as ah
from autohybrid import features
from autohybrid.codegen import triton as tgen
from autohybrid.runtime import pipeline, split_backward

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("torch_version,triton_version,bad", [
    ("2.11.0+cu128", "3.6.0", ()), ("2.13.0+cpu", "3.9.0", ()), ("2.12.1", None, ()),
    ("2.11.0a0+git1a2b3c", "3.6.0", ()), ("2.10.0", "3.6.0", ("torch 2.10.0",)),
    ("3.0.0", "3.6.0", ("torch 3.0.0",)), ("2.13.0", "3.5.1", ("triton 3.5.1",)),
    ("2.6.0", "4.0.0", ("torch 2.6.0", "triton 4.0.0")),
])
def test_version_range(torch_version, triton_version, bad):
    problems = features.version_problems(torch_version, triton_version)
    assert len(problems) == len(bad)
    for problem, name in zip(problems, bad):
        assert problem.startswith(name) and "range" in problem


def test_installed_versions_pass_and_a_fake_torch_fails_with_the_range(monkeypatch):
    features.check_versions()                 # this machine: torch 2.13, Triton 3.9
    monkeypatch.setattr(torch, "__version__", "2.10.2+cu126")
    with pytest.raises(ah.VersionError, match=r"torch 2\.10\.2\+cu126 .*torch>=2\.11,<3\.0"):
        features.check_versions()
    monkeypatch.setattr(torch, "__version__", "2.11.0")
    monkeypatch.setattr(features.metadata, "version", lambda name: "3.2.0")
    with pytest.raises(ah.VersionError, match=r"triton 3\.2\.0 .*triton>=3\.6,<4\.0"):
        features.check_versions()


def test_import_checks_versions_before_anything_else():
    """`import autohybrid` runs check_versions before importing any other module of its
    own (an older torch fails with the range, not inside some module's import)."""
    tree = ast.parse((ROOT / "autohybrid" / "__init__.py").read_text())
    body = [n for n in tree.body if not isinstance(n, ast.Expr) or not isinstance(
        getattr(n, "value", None), ast.Constant)]
    imports = [n for n in body if isinstance(n, ast.ImportFrom) and n.module != "__future__"]
    first = body.index(imports[0])
    assert imports[0].module == "features" and [a.name for a in imports[0].names] == ["check_versions"]
    call = body[first + 1]
    assert isinstance(call, ast.Expr) and ast.unparse(call) == "check_versions()"
    assert ah.VersionError.__mro__[1] is ah.AutohybridError


def test_this_torch_has_what_the_pipeline_runtime_overrides():
    assert features.pipelining_problems() == []
    assert all(features.schedule_problem(s) is None for s in features.PIPELINE_SCHEDULES)
    assert all(pipeline.SCHEDULE_CLASSES[s] is not None for s in features.PIPELINE_SCHEDULES)


def test_overrides_listed_are_the_overrides_made():
    """Every method `_Stage` overrides and every `_backward` helper pipeline.py and
    split_backward.py import is one `pipelining_problems` checks."""
    own = {n for n, v in vars(pipeline._Stage).items() if callable(v) and n != "__init__"}
    assert own == set(features.PIPELINE_OVERRIDES)
    for name, leading in features.PIPELINE_OVERRIDES.items():
        params = list(inspect.signature(getattr(pipeline._Stage, name)).parameters)[1:]
        assert params[:len(leading)] == list(leading)
    helpers = {a.name for module in (pipeline, split_backward)
               for n in ast.walk(ast.parse(inspect.getsource(module)))
               if isinstance(n, ast.ImportFrom)
               and n.module == "torch.distributed.pipelining._backward" for a in n.names}
    assert helpers == set(features.PIPELINE_HELPERS)


def _fake_stage(**changes):
    """A PipelineStage subclass with methods removed (value None) or replaced."""
    from torch.distributed.pipelining import PipelineStage
    attrs = {}
    for name, fn in changes.items():
        attrs[name] = fn
    cls = type("FakeStage", (PipelineStage,), attrs)
    for name, fn in changes.items():
        if fn is None:   # hide the inherited one as well
            setattr(cls, name, None)
    return cls


def test_a_torch_missing_a_private_member_is_named():
    from torch.distributed.pipelining import _backward
    problems = features.pipelining_problems(_fake_stage(backward_weight_one_chunk=None), _backward)
    assert len(problems) == 1 and "PipelineStage.backward_weight_one_chunk" in problems[0]

    def renamed(self, kind, kwargs, last=False):
        return None
    problems = features.pipelining_problems(_fake_stage(backward_maybe_with_nosync=renamed),
                                            _backward)
    assert len(problems) == 1 and "takes (kind, kwargs, last)" in problems[0]

    def chunk(self, bwd_chunk_id, loss=None):
        bwd_kwargs = {"stage_output": loss, "output_grads": None}   # noqa: F841
    problems = features.pipelining_problems(_fake_stage(backward_one_chunk=chunk), _backward)
    assert len(problems) == 1 and "input_values" in problems[0]
    lacking = types.SimpleNamespace(_get_grad_fn_or_grad_acc=_backward._get_grad_fn_or_grad_acc,
                                    construct_reverse_graph=_backward.construct_reverse_graph,
                                    get_param_groups=_backward.get_param_groups)
    from torch.distributed.pipelining import PipelineStage
    problems = features.pipelining_problems(PipelineStage, lacking)
    assert len(problems) == 1 and "_backward.reverse_closure" in problems[0]
    old = types.SimpleNamespace(ScheduleGPipe=object)
    assert "ScheduleDualPipeV" in features.schedule_problem("dualpipev", old)
    assert features.schedule_problem("gpipe", old) is None


def test_pipeline_plans_not_executable_and_the_runner_refuses_before_any_step(monkeypatch):
    monkeypatch.setattr(features, "_pipelining_problems",
                        lambda: ("torch 9.9's torch.distributed.pipelining has no X",))
    pp_plan = types.SimpleNamespace(num_stages=2, schedule="1f1b")
    assert features.unsupported(pp_plan) == ["torch 9.9's torch.distributed.pipelining has no X"]
    assert features.unsupported(types.SimpleNamespace(num_stages=1, schedule="none")) == []
    with pytest.raises(ah.NotExecutableError, match="has no X.*use pp=1"):
        pipeline.PipelineRunner(pp_plan, None, None, {}, 0, None, torch.device("cpu"))


def test_triton_compile_api_checked():
    import triton
    tgen.check_compile_api(triton.compiler.ASTSource, triton.__version__)

    class OldSource:     # Triton 3.0 / 3.1
        def __init__(self, fn, signature, constants=None, attrs=None):
            pass
    with pytest.raises(ah.VersionError, match=r"triton 3\.1\.0: .*constexprs.*triton>=3\.6"):
        tgen.check_compile_api(OldSource, "3.1.0")
