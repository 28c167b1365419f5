"""What the runtime can execute today: the features `ah.compile`'s search consults.

`ah.plan` may rank plans with other features and marks them; `ah.compile` searches only
among plans for which `unsupported(plan)` is empty, and refuses a pinned constraint or a
saved plan that needs a missing feature with `NotExecutableError`. A feature being here
is necessary, not sufficient: the search also runs the passes of the plan it would
choose on the model's graph (trial.py PassTrial) and drops a plan they reject.
"""
from __future__ import annotations

from .plan import Plan

def unsupported(plan: Plan) -> list[str]:
    """Why the runtime cannot run `plan` yet (empty when it can)."""
    # every collective_algorithm runs (runtime/collectives.py); collective matmul too
    # (passes/collective_matmul.py)
    return []
