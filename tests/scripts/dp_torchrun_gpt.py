"""gpt-tiny data-parallel training equals eager, run under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/scripts/dp_torchrun_gpt.py

The script is what a user writes for `ah.launch`; torchrun starts the processes instead
and `ah.launch` runs `main` for this process's rank only (a one-element result list).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/_equiv.py

import autohybrid as ah  # noqa: E402
from _equiv import (OPTIMIZERS, Failures, lm_loss, report, train_and_compare,  # noqa: E402
                    zoo_batches, zoo_model)

WORLD = 2


def main(rank: int) -> list[str]:
    fails = Failures()
    batches = zoo_batches("gpt-tiny", 8)
    train_and_compare(fails, "gpt-tiny/sgd/torchrun", zoo_model("gpt-tiny"), batches, WORLD,
                      loss_fn=lm_loss, optimizer=OPTIMIZERS["sgd"])
    return fails


if __name__ == "__main__":
    results = ah.launch(main, ah.Cluster.local(WORLD))
    rank = int(os.environ["RANK"])
    assert len(results) == 1, f"under torchrun launch returns [this rank's result], got {results}"
    assert not results[0], report([results[0]])
    print(f"rank {rank} of {WORLD}: equal to eager", flush=True)
