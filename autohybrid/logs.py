"""Named loggers switched on by environment: `AUTOHYBRID_LOG=passes,search,runtime`.

Each module logs to `autohybrid.<name>`; this turns the listed ones up to INFO with one
stderr handler (prefixed with the rank when torch.distributed says which). `all` turns
on every autohybrid logger.
"""
from __future__ import annotations

import logging
import os


def configure_from_env() -> None:
    names = [n.strip() for n in os.environ.get("AUTOHYBRID_LOG", "").split(",") if n.strip()]
    if not names:
        return
    handler = logging.StreamHandler()
    rank = os.environ.get("RANK", "-")
    handler.setFormatter(logging.Formatter(f"[autohybrid rank {rank}] %(name)s: %(message)s"))
    for name in names:
        logger = logging.getLogger("autohybrid" if name == "all" else f"autohybrid.{name}")
        logger.setLevel(logging.INFO)
        if not logger.handlers:
            logger.addHandler(handler)


# ---------------------------------------------------------------------- progress
class _Silent:
    """The default progress: counts, draws nothing (libraries and tests stay quiet)."""

    def __init__(self, total: int | None, description: str) -> None:
        self.total, self.description, self.done = total, description, 0

    def __enter__(self) -> "_Silent":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def advance(self, n: int = 1) -> None:
        self.done += n


_progress_factory = None


def set_progress_factory(factory) -> None:
    """Draw progress with `factory(total, description)` (a context manager whose value has
    `.advance(n=1)`); None restores the silent default. The CLI installs rich's bars here
    (report/terminal.py) for search, calibration and benchmarks."""
    global _progress_factory
    _progress_factory = factory


def has_progress() -> bool:
    """Whether a progress factory is installed (someone wants to see bars)."""
    return _progress_factory is not None


def progress(total: int | None, description: str):
    """A progress context for `total` units of work: `with progress(n, "search") as p:
    ... p.advance()` (`total` None: unknown in advance); silent unless a factory was
    installed."""
    if _progress_factory is None:
        return _Silent(total, description)
    return _progress_factory(total, description)
