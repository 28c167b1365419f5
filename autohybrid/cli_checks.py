"""What `autohybrid` checks before a command does any work, and its outputs on failure.

- Output paths (`--out`, `--report`, `--trace`, `--save`; `--plots`, `--dot` folders): their directory
  exists and they are not directories, checked before planning or launching, so a typo
  costs nothing; `Outputs` removes what a failing command already wrote, so no partial
  output is left behind.
- A plan given to `train` / `bench` (`--plan`): for the cluster's world size, the MODEL's
  parameters (its names and shapes, built on the meta device in this process) and the
  run's dtype, refused before any rank is launched.
- Code: a MODEL naming `file.py:factory` runs that file; a plan records its MODEL, so
  `inspect` of a plan someone else wrote asks for `--trust-model-code` first.

Everything raises UsageError or the planning layer's typed errors (exit status 2).
Imports the API's checks (when used: the CLI starts without torch) and nothing that
runs a model.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Iterable

from .errors import UsageError

FILE_OUTPUTS = ("out", "report", "trace", "save")


def check_outputs(args: argparse.Namespace) -> None:
    """Every output path given can be written: refused before any work is done."""
    for name in FILE_OUTPUTS:
        value = getattr(args, name, None)
        if not value:
            continue
        path = Path(value)
        if path.is_dir():
            raise UsageError(f"--{name} {value}: is a directory; give a file name")
        if not path.parent.is_dir():
            raise UsageError(f"--{name} {value}: no directory {str(path.parent)!r}; create "
                             "it first or give another path")
    for name in ("plots", "dot"):
        folder = getattr(args, name, None)
        if folder and Path(folder).exists() and not Path(folder).is_dir():
            raise UsageError(f"--{name} {folder}: is a file; give a directory")


class Outputs:
    """The files a command wrote; `remove()` deletes them when it then fails."""

    def __init__(self) -> None:
        self.paths: list[Path] = []

    def wrote(self, paths: Iterable[Any]) -> None:
        self.paths.extend(Path(p) for p in paths)

    def remove(self) -> None:
        for path in self.paths:
            path.unlink(missing_ok=True)
        self.paths.clear()


def check_run_plan(plan: Any, workload: Any, world_size: int, dtype: str,
                   command: str = "train") -> None:
    """A `--plan` fits this run: world size, the MODEL's parameters, the dtype."""
    from .checks import check_plan_params, check_plan_world_size  # (imports torch)

    check_plan_world_size(plan, world_size)
    check_plan_params(plan, workload.model)
    if plan.dtype != dtype:
        fix = (f"pass --dtype {plan.dtype} to train as planned, or " if command == "train"
               else "bench compares with eager in the model's dtype: ")
        raise UsageError(
            f"--plan: the plan trains in {plan.dtype} (`autohybrid plan` plans bfloat16 "
            f"unless --dtype says otherwise) but this run trains in {dtype}: {fix}plan "
            f"again with --dtype {dtype}")


def check_model_code(plan: Any, trusted: bool) -> None:
    """Refuse to rebuild a plan's model from a Python file unless the user trusts it."""
    from .models import spec as model_spec

    ref = plan.model_ref
    if not ref or trusted:
        return
    spec = model_spec.parse(ref)  # checks the text and that the file exists; runs nothing
    if spec.is_file:
        path = spec.source.rsplit(":", 1)[0]
        raise UsageError(
            f"the plan's model_ref {ref!r} names a Python file: inspecting the plan rebuilds "
            f"its model by running {path}. Pass --trust-model-code if you trust that file "
            "(a plan file from elsewhere can name any file)")
