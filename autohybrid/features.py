"""What the runtime can execute today: the features `ah.compile`'s search consults, and
the torch and Triton releases it runs on.

`ah.plan` may rank plans with other features and marks them; `ah.compile` searches only
among plans for which `unsupported(plan)` is empty, and refuses a pinned constraint or a
saved plan that needs a missing feature with `NotExecutableError`. A feature being here
is necessary, not sufficient: the search also runs the passes of the plan it would
choose on the model's graph (trial.py PassTrial) and drops a plan they reject.

Versions. autohybrid runs on torch `TORCH_SUPPORTED` and Triton `TRITON_SUPPORTED`
([lowest, first unsupported) release): the GPU machines' torch 2.11 + Triton 3.6 through
this project's torch 2.13 + Triton 3.9; `import autohybrid` checks both
(`check_versions`, a `VersionError` naming the installed release and the range). The
pipeline runtime (runtime/pipeline.py) overrides and calls private members of
torch.distributed.pipelining (`PIPELINE_PRIVATE`), which may change within the range:
`pipelining_problems()` says what is missing, a pipeline-parallel plan is then not
executable (`unsupported`), and the runner refuses before any step.
"""
from __future__ import annotations

import functools
import inspect
import re
from importlib import metadata

from .errors import NotExecutableError, VersionError
from .plan import Plan

#: torch releases autohybrid runs on: (lowest, first unsupported) as (major, minor)
TORCH_SUPPORTED = ((2, 11), (3, 0))
#: Triton releases the generated kernels compile with (ASTSource with constexprs by name,
#: GPUTarget, the interpreter's InterpretedFunction)
TRITON_SUPPORTED = ((3, 6), (4, 0))

#: runtime/pipeline.py's private use of torch.distributed.pipelining: the PipelineStage
#: methods `_Stage` overrides (with the leading parameters it passes on by position),
#: the helpers of `_backward` it calls, the keys of the backward's keyword dict it reads
PIPELINE_OVERRIDES = {
    "backward_one_chunk": (),
    "backward_maybe_with_nosync": ("backward_type", "bwd_kwargs", "last_backward"),
    "backward_weight_one_chunk": (),
}
PIPELINE_HELPERS = ("_get_grad_fn_or_grad_acc", "construct_reverse_graph", "get_param_groups",
                    "reverse_closure")
PIPELINE_BWD_KEYS = ("stage_output", "output_grads", "input_values")
#: pipeline schedule → its class in torch.distributed.pipelining (runtime/pipeline.py)
PIPELINE_SCHEDULES = {
    "gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B", "looped-bfs": "ScheduleLoopedBFS",
    "zero-bubble": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
PIPELINE_PRIVATE = (tuple(f"PipelineStage.{m}" for m in PIPELINE_OVERRIDES)
                    + tuple(f"pipelining._backward.{h}" for h in PIPELINE_HELPERS))


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: "2.13.0+cpu", "2.11.0a0+git1234", "3.6.0"."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    if not match:
        raise VersionError(f"cannot read the release of version {version!r}")
    return int(match.group(1)), int(match.group(2))


def _range(bounds: tuple[tuple[int, int], tuple[int, int]]) -> str:
    (a, b), (c, d) = bounds
    return f">={a}.{b},<{c}.{d}"


def version_problems(torch_version: str | None = None,
                     triton_version: str | None = "installed") -> list[str]:
    """Why the installed (or given) torch and Triton are outside the supported range
    (empty when they are inside). Triton None: not installed (the kernels then run as
    their ATen ops on CPU and cannot run on a GPU: no problem here)."""
    import torch
    out = []
    torch_version = torch.__version__ if torch_version is None else torch_version
    low, high = TORCH_SUPPORTED
    if not low <= release(torch_version) < high:
        out.append(f"torch {torch_version} is outside autohybrid's supported range "
                   f"torch{_range(TORCH_SUPPORTED)}; install a torch in that range")
    if triton_version == "installed":
        try:
            triton_version = metadata.version("triton")
        except metadata.PackageNotFoundError:
            triton_version = None
    low, high = TRITON_SUPPORTED
    if triton_version is not None and not low <= release(triton_version) < high:
        out.append(f"triton {triton_version} is outside the range autohybrid's generated "
                   f"kernels compile with, triton{_range(TRITON_SUPPORTED)}; install the "
                   "Triton of a torch in the supported range")
    return out


def check_versions() -> None:
    """Raise VersionError when torch or Triton is outside the supported range."""
    problems = version_problems()
    if problems:
        raise VersionError("; ".join(problems))


def pipelining_problems(stage_class=None, backward_module=None) -> list[str]:
    """What runtime/pipeline.py needs of torch.distributed.pipelining and this torch
    lacks (empty when nothing): a PipelineStage method it overrides, the leading
    parameters of one it calls on by position, a `_backward` helper, a key of the
    backward's keyword dict (read from `backward_one_chunk`'s source)."""
    if stage_class is None or backward_module is None:
        import torch.distributed.pipelining as tpp
        from torch.distributed.pipelining import _backward
        stage_class = tpp.PipelineStage if stage_class is None else stage_class
        backward_module = _backward if backward_module is None else backward_module
    import torch
    where = f"torch {torch.__version__}'s torch.distributed.pipelining"
    out = []
    for name, leading in PIPELINE_OVERRIDES.items():
        method = getattr(stage_class, name, None)
        if not callable(method):
            out.append(f"{where} has no PipelineStage.{name}, which autohybrid's pipeline "
                       "stages override")
            continue
        try:
            params = list(inspect.signature(method).parameters)[1:1 + len(leading)]
        except (TypeError, ValueError):
            params = None
        if leading and params != list(leading):
            out.append(f"{where}: PipelineStage.{name} takes ({', '.join(params or ['?'])}"
                       f"), autohybrid's override passes ({', '.join(leading)})")
    for name in PIPELINE_HELPERS:
        if not callable(getattr(backward_module, name, None)):
            out.append(f"{where} has no _backward.{name}, which autohybrid's split "
                       "backward calls")
    method = getattr(stage_class, "backward_one_chunk", None)
    try:
        text = inspect.getsource(method) if method is not None else ""
    except (OSError, TypeError):
        text = None                       # no source to read: the keys are not checked
    if text is not None and method is not None:
        missing = [k for k in PIPELINE_BWD_KEYS if f'"{k}"' not in text and f"'{k}'" not in text]
        if missing:
            out.append(f"{where}: the backward's keyword dict has no {', '.join(missing)}, "
                       "which autohybrid's split backward reads")
    return out


def schedule_problem(schedule: str, module=None) -> str | None:
    """Why pipeline `schedule` has no class in this torch (None when it has one)."""
    if module is None:
        import torch.distributed.pipelining as module
    name = PIPELINE_SCHEDULES.get(schedule)
    if name is not None and getattr(module, name, None) is None:
        import torch
        return (f"pipeline schedule {schedule!r} ({name}) is not in torch "
                f"{torch.__version__}'s torch.distributed.pipelining; choose another schedule")
    return None


@functools.lru_cache(maxsize=1)
def _pipelining_problems() -> tuple[str, ...]:
    return tuple(pipelining_problems())


def check_pipelining(schedule: str) -> None:
    """Raise NotExecutableError when this torch cannot run autohybrid's pipeline stages
    under `schedule` (what `pipelining_problems` and `schedule_problem` find)."""
    problems = [*_pipelining_problems(), *filter(None, [schedule_problem(schedule)])]
    if problems:
        raise NotExecutableError("pipeline parallelism cannot run: " + "; ".join(problems)
                                 + "; use pp=1 or a torch where these exist")


def unsupported(plan: Plan) -> list[str]:
    """Why the runtime cannot run `plan` yet (empty when it can)."""
    # every collective_algorithm runs (runtime/collectives.py); collective matmul too
    # (passes/collective_matmul.py)
    if plan.num_stages > 1:
        return [*_pipelining_problems(), *filter(None, [schedule_problem(plan.schedule)])]
    return []
