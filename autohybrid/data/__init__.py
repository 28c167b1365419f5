"""Data efficiency for any compiled model and plan (`ah.data`): adaptive sample hiding
(KAKURENBO, hiding.py), partial local shuffling (shuffle.py) and the non-IID remedies
(remedies.py: distillation against the previous epoch's model, impact-factor weighted
gradients); fit.py runs them in `compiled.fit`. Plain data and torch.distributed only:
the parts are usable from a plain PyTorch loop too."""
from __future__ import annotations

from ..sample_stats import pack_targets
from .hiding import DECAY, HidingSampler, sample_stats
from .remedies import Distillation, ImpactFactors
from .shuffle import EpochExchange, PartialShuffle

__all__ = ["DECAY", "Distillation", "EpochExchange", "HidingSampler", "ImpactFactors",
           "PartialShuffle", "pack_targets", "sample_stats"]
