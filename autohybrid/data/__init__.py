"""Data efficiency for any compiled model and plan (`ah.data`): adaptive sample hiding
(KAKURENBO, hiding.py), partial local shuffling (shuffle.py) and distillation against the
previous epoch's model (`Distillation`, a non-IID remedy); fit.py runs them in
`compiled.fit`. Plain data and torch.distributed only: the parts are usable from a plain
PyTorch loop too."""
from __future__ import annotations

from ..sample_stats import DistillLoss as Distillation
from ..sample_stats import pack_targets
from .hiding import DECAY, HidingSampler, sample_stats
from .shuffle import EpochExchange, PartialShuffle

__all__ = ["DECAY", "Distillation", "EpochExchange", "HidingSampler", "PartialShuffle",
           "pack_targets", "sample_stats"]
