"""Both two-node checks in one torchrun job: tests/scripts/multinode_train.py (placement and
training on dp × tp, pp × tp and the planner's plan), then
tests/scripts/hierarchical_train.py (the hierarchical and segmented all-reduce), on one
start of the ranks and one process group, each check's lines under its own label.

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --node-rank N \\
        --master-addr HOST --master-port PORT tests/scripts/two_nodes_train.py

tests/conftest.py's `two_nodes_logs` runs it once for tests/test_multinode.py and
tests/test_hierarchical.py (starting two torchruns costs more than either check's work).
Each script also runs on its own.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))           # the two scripts
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))        # tests/_procs.py

import hierarchical_train  # noqa: E402
import multinode_train  # noqa: E402
from _procs import torchrun_mains  # noqa: E402

if __name__ == "__main__":
    torchrun_mains({"multinode": multinode_train.main,
                    "hierarchical": hierarchical_train.main})
