"""Data efficiency for any compiled model and plan (`ah.data`): adaptive sample hiding
(KAKURENBO, hiding.py) and partial local shuffling (shuffle.py). Plain data and
torch.distributed only: usable from `compiled.fit` and from a plain PyTorch loop."""
from __future__ import annotations

from .hiding import DECAY, HidingSampler, sample_stats
from .shuffle import EpochExchange, PartialShuffle

__all__ = ["DECAY", "EpochExchange", "HidingSampler", "PartialShuffle", "sample_stats"]
