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
