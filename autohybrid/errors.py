"""The typed errors autohybrid raises.

Every error a user can provoke with bad input derives from `AutohybridError`, names the
culprit (the argument, field, node, mesh axis or rank) and says what to do about it.
Nothing here imports torch: any module may raise these.
"""
from __future__ import annotations


class AutohybridError(Exception):
    """Base class of every error autohybrid raises on purpose."""


class CaptureError(AutohybridError):
    """The model (with its loss) could not be captured as a graph."""


class ModelError(AutohybridError, ValueError):
    """A model preset or model configuration is invalid (unknown name, sizes that do not fit)."""


class ClusterError(AutohybridError):
    """A cluster description is invalid (unknown preset, bad JSON field, wrong world size)."""


class PlanError(AutohybridError):
    """A plan is invalid, does not fit, or belongs to another model or cluster."""


class NoPlanFitsError(PlanError):
    """No plan in the searched space fits in device memory; the message gives the numbers."""


class NotExecutableError(PlanError):
    """A plan or constraint asks for a feature the runtime cannot execute yet."""


class InputError(AutohybridError, ValueError):
    """A batch given to `train_step` or `compiled(...)` does not fit what was compiled (its
    count, dtype, shape, index range), or ranks that share the global batch pass different
    ones; raised before anything runs on it."""


class UserFunctionError(AutohybridError):
    """A function the user gave (optimizer factory, loss_fn, MODEL factory) raised or
    returned something it must not; the message names the function."""


class UsageError(AutohybridError, ValueError):
    """A command-line argument is invalid (an output path, a plan for another run, code a
    plan would run): `autohybrid` exits 2 with the message, before doing any work."""


class RuntimeFailure(AutohybridError):
    """Something failed while running: a rank raised, ranks disagree, or a timeout hit."""


class RankFailure(RuntimeFailure):
    """A rank of `ah.launch` failed (raised, exited or was killed); carries the rank, its
    formatted traceback (or how it ended), its exit code and its last step: the number
    of `train_step`s it had completed (None when it compiled no model)."""

    def __init__(self, rank: int, traceback_text: str, exitcode: int | None = None,
                 last_step: int | None = None):
        self.rank = rank
        self.traceback_text = traceback_text
        self.exitcode = exitcode
        self.last_step = last_step
        detail = traceback_text.strip() or f"exit code {exitcode}"
        super().__init__(f"rank {rank} {self._what()}{_steps_note(last_step)}:\n{detail}")

    def _what(self) -> str:
        return "failed"

    def __reduce__(self):
        return type(self), (self.rank, self.traceback_text, self.exitcode, self.last_step)


class RankUnresponsive(RankFailure):
    """A rank of `ah.launch` stopped responding: the ranks waiting for it timed out or
    lost their connections, while it ran on without failing (its stack is in the text)."""

    def _what(self) -> str:
        return "stopped responding"


def _steps_note(last_step: int | None) -> str:
    if last_step is None:
        return ""
    return f" after {last_step} completed train_step{'' if last_step == 1 else 's'}"


class NumericsError(RuntimeFailure):
    """`check=True` found the compiled step computing other numbers than eager."""


class TrainingArgumentError(AutohybridError, ValueError):
    """An argument of the training loop is invalid: `ah.compile(..., scheduler=...)`,
    `compiled.fit(...)`'s options, or a batch its loader yields."""


class VersionError(AutohybridError):
    """torch or Triton is outside the releases autohybrid supports, or this torch lacks
    a private member the runtime relies on; the message names the release and the range."""


class CheckpointError(AutohybridError):
    """A checkpoint cannot be written or read: incomplete, corrupted, of another model, or
    holding state this run cannot take; the message names the file or tensor."""
