"""autohybrid: automatic hybrid-parallel training for PyTorch models.

Public API only; see DESIGN.md. `ah.compile(model, cluster, ...)` captures the model and
its loss as one graph, plans how to split it, rewrites it per rank and runs it across
processes; `ah.plan(...)` plans without processes (models on the meta device included).
"""
from __future__ import annotations

from .features import check_versions

check_versions()  # torch and Triton in the supported range (features.TORCH_SUPPORTED)

from . import data, init, logs, models  # noqa: E402
from .api import compile, oracle, plan
from .bench import BenchResult, bench
from .calibrate import Profile, calibrate
from .cluster import Cluster
from .errors import (AutohybridError, CaptureError, CheckpointError, ClusterError,
                     InputError, ModelError, NoPlanFitsError, NotExecutableError,
                     NumericsError, PlanError, RankFailure, RankUnresponsive, RuntimeFailure,
                     TrainingArgumentError, UserFunctionError, VersionError)
from .plan import Constraints, Plan
from .runtime import launch as _launch
from .runtime.launch import launch

_launch.PRELOAD_MODULES.append("autohybrid.compiled")  # what ah.compile imports on a rank

__version__ = "0.1.0"
logs.configure_from_env()

__all__ = [
    "AutohybridError", "BenchResult", "CaptureError", "CheckpointError", "Cluster",
    "ClusterError", "Constraints", "InputError", "ModelError", "Profile", "UserFunctionError",
    "bench", "calibrate",
    "NoPlanFitsError", "NotExecutableError", "NumericsError", "Plan", "PlanError", "RankFailure",
    "RankUnresponsive", "RuntimeFailure", "TrainingArgumentError", "VersionError", "compile", "init", "launch", "models", "oracle",
    "plan",
]
