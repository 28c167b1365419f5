"""Graph passes, registered by name, applied in a fixed order.

Order (why): `global_loss` first, because it only touches the loss and every later pass
must see the rewritten outputs; `sync_batch_norm` after it, since it depends only on the
data-parallel axis; `tensor_parallel` then splits the graph over the tp axis (it sees the
loss already as a sum, so the vocabulary-parallel loss keeps it one); `sequence_parallel`
then turns its f/g pairs into all-gather/reduce-scatter and slices the regions between
them by sequence; `zero` (ZeRO-3 only) then makes parameters dp shards gathered by each
layer before use, on the finished tp-local graph and before the stages are cut, so each
gather lands in the stage of its layer; `collective_matmul` then fuses the sp gathers and
reduce-scatters of the layers the Plan lists with their linears into chunked ops (after
`zero`, whose gathers may feed the weights; before the cut, so each lands in its layer's
stage); `pipeline_split` last cuts the finished rank-local graph into stages (so
a stage's graph carries its tp/sp collectives and sends tp-local activations);
`recompute` after it wraps the blocks (or attention cores) of the graph and of every stage
in checkpointed submodules, so it sees the final per-rank and per-stage graphs; `overlap`
last splits each forward tp/sp collective into an issue and a wait, moves waits to their
first use and issues (ZeRO-3's gathers too) up within a budget of bytes in flight, and
moves independent compute between them to hide each collective, within a peak-memory
budget, on those final graphs; `fusion` very last replaces chains of element-wise ops
and row reductions by generated kernels (one `fused_region` node each) on the graph, on
every stage and inside every checkpointed submodule, after everything that moves or
wraps nodes, so that its regions never span a collective, a stage boundary or a
checkpointed region, and recomputation reruns the fused kernels.
"""
from __future__ import annotations

from .collective_matmul import collective_matmul
from .fusion import fusion
from .global_loss import global_loss
from .manager import Pass, PassContext, run_passes
from .overlap import overlap
from .sync_batch_norm import sync_batch_norm
from .pipeline_split import pipeline_split
from .recompute import recompute
from .sequence_parallel import sequence_parallel
from .tensor_parallel import tensor_parallel
from .zero import zero

REGISTRY: dict[str, Pass] = {
    "global_loss": global_loss,
    "sync_batch_norm": sync_batch_norm,
    "tensor_parallel": tensor_parallel,
    "sequence_parallel": sequence_parallel,
    "zero": zero,
    "collective_matmul": collective_matmul,
    "pipeline_split": pipeline_split,
    "recompute": recompute,
    "overlap": overlap,
    "fusion": fusion,
}
# "fusion" goes last in ORDER once ops/fused.py's CPU (eager) backward gives gradients
ORDER = ("global_loss", "sync_batch_norm", "tensor_parallel", "sequence_parallel", "zero",
         "collective_matmul", "pipeline_split", "recompute", "overlap", "fusion")


def passes_for(graph_kind: str) -> list[tuple[str, Pass]]:
    """The passes in order for a "train" (model + loss) or "forward" graph."""
    names = ORDER if graph_kind == "train" else tuple(n for n in ORDER if n != "global_loss")
    return [(name, REGISTRY[name]) for name in names]


__all__ = ["REGISTRY", "ORDER", "Pass", "PassContext", "passes_for", "run_passes"]
