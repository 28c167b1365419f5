"""Graph passes: one table, in the order they run, each row with why it runs there.

`PASSES` is the order; each row names the passes it must run after, and that order is
checked when this module is imported (`check_order`), so a reordering that breaks a
dependency fails at once. The manager (manager.py) runs them; `autohybrid/rewrite.py`
is the one caller that turns their result into a RankProgram.
"""
from __future__ import annotations

from dataclasses import dataclass

from .collective_matmul import collective_matmul
from .expert_parallel import expert_parallel
from .fusion import fusion
from .global_loss import global_loss
from .manager import Pass, PassContext, run_passes
from .overlap import overlap
from .sync_batch_norm import sync_batch_norm
from .pipeline_split import pipeline_split
from .recompute import recompute
from .sequence_parallel import sequence_parallel
from .spatial_parallel import spatial_parallel
from .tensor_parallel import tensor_parallel
from .zero import zero


@dataclass(frozen=True)
class PassRow:
    """One pass: its name, its function, why it runs where it does, the passes it must
    follow, and whether it runs on training graphs (model + loss) only."""

    name: str
    fn: Pass
    why: str
    after: tuple[str, ...] = ()
    train_only: bool = False


PASSES: tuple[PassRow, ...] = (
    PassRow("global_loss", global_loss,
            "only touches the loss; every later pass must see the rewritten outputs",
            train_only=True),
    PassRow("spatial_parallel", spatial_parallel,
            "tiles the activations of convolutions, pooling and BatchNorm over the tp "
            "axis (Plan mesh.spatial); its BatchNorms reduce over tiles and dp, so it runs "
            "before sync_batch_norm, which syncs the others over dp", after=("global_loss",)),
    PassRow("sync_batch_norm", sync_batch_norm,
            "depends only on the data-parallel axis, on the graph as captured (but for "
            "the BatchNorms on tiles)", after=("global_loss", "spatial_parallel")),
    PassRow("expert_parallel", expert_parallel,
            "splits each MoE layer's experts over ep (dp ranks) and dispatches their tokens "
            "by all-to-all, or (tp without sp or ep) every expert's intermediate size over "
            "tp; before tensor_parallel, which then treats whole expert slices as the "
            "replicated weights they are over tp", after=("global_loss",)),
    PassRow("tensor_parallel", tensor_parallel,
            "splits the graph over tp; it sees the loss already a sum, so the "
            "vocabulary-parallel loss keeps it one", after=("global_loss", "expert_parallel")),
    PassRow("sequence_parallel", sequence_parallel,
            "turns tensor_parallel's f/g pairs into all-gather/reduce-scatter and slices "
            "the regions between them by sequence", after=("tensor_parallel",)),
    PassRow("zero", zero,
            "ZeRO-3: parameters become dp shards gathered by each layer before use, on the "
            "finished tp-local graph and before the cut, so each gather lands in its "
            "layer's stage", after=("tensor_parallel", "sequence_parallel")),
    PassRow("collective_matmul", collective_matmul,
            "fuses the sp gathers and reduce-scatters of the Plan's layers with their "
            "linears into chunked ops: after zero, whose gathers may feed the weights; "
            "before the cut, so each lands in its layer's stage",
            after=("sequence_parallel", "zero")),
    PassRow("pipeline_split", pipeline_split,
            "cuts the finished rank-local graph into stages, so a stage's graph carries "
            "its tp/sp collectives and sends tp-local activations",
            after=("tensor_parallel", "sequence_parallel", "zero", "collective_matmul")),
    PassRow("recompute", recompute,
            "wraps the blocks (or attention cores) of the graph and of every stage in "
            "checkpointed submodules: it sees the final per-rank and per-stage graphs",
            after=("pipeline_split",)),
    PassRow("overlap", overlap,
            "splits each forward tp/sp collective into issue and wait and moves issues, "
            "waits and independent compute to hide it (within byte and memory budgets), "
            "on the final graphs", after=("pipeline_split", "recompute")),
    PassRow("fusion", fusion,
            "replaces element-wise chains and row reductions by generated kernels on the "
            "graph, every stage and every checkpointed submodule, after everything that "
            "moves or wraps nodes: its regions never span a collective, a stage boundary "
            "or a checkpointed region, and recomputation reruns the kernels",
            after=("pipeline_split", "recompute", "overlap")),
)


def check_order(rows: tuple[PassRow, ...]) -> None:
    """Refuse a table whose rows repeat a name, name an unknown pass, or run a pass
    before one it must follow."""
    names = [row.name for row in rows]
    if len(set(names)) != len(names):
        raise AssertionError(f"passes/__init__.py: a pass name repeats in {names}")
    for index, row in enumerate(rows):
        for before in row.after:
            if before not in names:
                raise AssertionError(f"passes/__init__.py: pass {row.name!r} runs after "
                                     f"{before!r}, which is no pass ({names})")
            if names.index(before) > index:
                raise AssertionError(f"passes/__init__.py: pass {row.name!r} must run after "
                                     f"{before!r}, but the table puts it first")


check_order(PASSES)

REGISTRY: dict[str, Pass] = {row.name: row.fn for row in PASSES}
ORDER: tuple[str, ...] = tuple(row.name for row in PASSES)


def passes_for(graph_kind: str) -> list[tuple[str, Pass]]:
    """The passes in order for a "train" (model + loss) or "forward" graph (each one's
    function as REGISTRY holds it: a test may stand another in for it)."""
    return [(row.name, REGISTRY[row.name]) for row in PASSES
            if graph_kind == "train" or not row.train_only]


__all__ = ["PASSES", "PassRow", "REGISTRY", "ORDER", "Pass", "PassContext", "check_order",
           "passes_for", "run_passes"]
