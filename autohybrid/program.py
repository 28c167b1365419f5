"""What the passes hand on: one rank's program (`RankProgram`) and the types in it.

`rewrite` (autohybrid/rewrite.py) runs the passes for one rank and returns a frozen
RankProgram; the runtime, compiled.py, report/ and cli.py read only that. The types the
passes make and the runtime reads — a split parameter's `ShardSpec`, the pipeline's
`PipelineSplit` of `StageGraph`s, a `FusedRegion` — live here, below both passes/ and
runtime/, so that neither imports the other's internals for them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx

from .capture import CapturedGraph
from .graph import AH_PARAM, is_param, op_name
from .plan import Plan
from .search.sharding import TensorParallelLayout


# ------------------------------------------------------------------ parameter shards
@dataclass(frozen=True)
class ShardSpec:
    """Which part of a full parameter one rank of mesh axis `axis` holds ("tp": tensor
    parallelism; "ep": a MoE layer's experts, split along dim 0 by expert parallelism).

    The parameter's `dim` (full size `size`) holds `chunks` blocks (3 for a fused qkv
    projection): equal ones, or of the sizes `blocks` lists (a fused projection taken
    apart unevenly, e.g. grouped-query q | k | v slices); each equal block is padded to
    `padded` / `chunks` and every block is split into `ways` equal shards; this rank holds
    shard `index` of every block, concatenated.

    `inner`: a second split of that shard along another dim over another axis (expert
    tensor parallelism inside expert parallelism: tp cuts each ep rank's experts), whose
    `size` is the dim's size in the shard; None: the shard is this rank's tensor.
    """

    dim: int
    size: int
    padded: int
    chunks: int
    ways: int
    index: int
    blocks: tuple[int, ...] = ()
    axis: str = "tp"
    inner: "ShardSpec | None" = None

    def __post_init__(self) -> None:
        if self.inner is not None and (self.inner.dim == self.dim
                                       or self.inner.axis == self.axis):
            raise ValueError(f"a nested ShardSpec splits another dim over another axis; got "
                             f"dim {self.dim} / {self.inner.dim}, axis {self.axis!r} / "
                             f"{self.inner.axis!r}")

    @property
    def shard_size(self) -> int:
        """The size of `dim` in this rank's shard (before `inner`)."""
        return self.padded // self.ways

    def local_shape(self, whole: Sequence[int]) -> tuple[int, ...]:
        """This rank's tensor's shape for a parameter of shape `whole`."""
        shape = list(whole)
        shape[self.dim] = self.shard_size
        return self.inner.local_shape(shape) if self.inner is not None else tuple(shape)

    def axes(self) -> tuple[str, ...]:
        """The mesh axes this rank's tensor is cut over, outermost first."""
        return (self.axis, *(self.inner.axes() if self.inner is not None else ()))

    def block_sizes(self) -> tuple[tuple[int, int], ...]:
        """(full size, padded size) of each block."""
        if self.blocks:
            return tuple((b, b) for b in self.blocks)
        return ((self.size // self.chunks, self.padded // self.chunks),) * self.chunks

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the full parameter (a new tensor)."""
        return self.local_from(lambda index: full[index], full.dim())

    def local_from(self, read, ndim: int) -> torch.Tensor:
        """This rank's shard from `read(index)`, which returns `full[index]` for a tuple
        of slices: only the rows (or columns) this rank holds are read (sharded
        materialization reads them from the seeded initialization, autohybrid/init.py);
        `inner` then cuts that shard."""
        out = self._outer_from(read, ndim)
        return self.inner.local(out) if self.inner is not None else out

    def _outer_from(self, read, ndim: int) -> torch.Tensor:
        out, offset = [], 0
        for block, padded in self.block_sizes():  # this rank's piece of each block
            width = padded // self.ways
            lo = self.index * width
            start, stop = offset + min(lo, block), offset + min(lo + width, block)
            index = [slice(None)] * ndim
            index[self.dim] = slice(start, stop)
            piece = read(tuple(index))
            pad = width - (stop - start)  # padding is zeros
            if pad:
                shape = list(piece.shape)
                shape[self.dim] = pad
                piece = torch.cat([piece, piece.new_zeros(shape)], self.dim)
            out.append(piece)
            offset += block
        return torch.cat(out, self.dim).clone()

    def gather(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full parameter from every shard index's tensor, in index order (each the
        shard before `inner`: runtime/tp_state.py gathers the inner shards first)."""
        sizes = self.block_sizes()
        widths = [padded // self.ways for _, padded in sizes]
        per_chunk = [s.split(widths, self.dim) for s in shards]
        blocks = [torch.cat([p[c] for p in per_chunk], self.dim).narrow(self.dim, 0, block)
                  for c, (block, _) in enumerate(sizes)]
        return torch.cat(blocks, self.dim)


# ------------------------------------------------------------------ pipeline stages
@dataclass
class StageGraph:
    """One pipeline stage: its graph and what it exchanges.

    `gm` takes `(*received, *local)`: `received` are the values the previous stage sends
    (for the first stage: the model's inputs), `local` the full graph's placeholders
    (parameters, buffers, constants, inputs, targets) it reads, by their index in the full
    graph's placeholder list (`local_placeholders`). It returns the values it sends to the
    next stage (`sent`), or for the last stage the full graph's outputs.
    """

    index: int
    gm: fx.GraphModule
    received: tuple[str, ...]            # names of the values it receives, in order
    sent: tuple[str, ...]                # names of the values it sends (last: the outputs)
    local_placeholders: tuple[int, ...]  # full-graph placeholder indices it reads
    params: tuple[str, ...]              # canonical names of the parameters it reads
    received_vals: tuple[Any, ...] = ()  # fake values (symbolic shapes) of `received`
    sent_vals: tuple[Any, ...] = ()
    sent_requires_grad: tuple[bool, ...] = ()
    nodes: int = 0

    def describe(self) -> str:
        def shapes(vals):
            return ", ".join(f"{tuple(v.shape)}" for v in vals if isinstance(v, torch.Tensor))
        return (f"stage {self.index}: {self.nodes} ops, {len(self.params)} parameters; "
                f"receives [{shapes(self.received_vals)}], sends [{shapes(self.sent_vals)}]")


@dataclass
class PipelineSplit:
    stages: list[StageGraph]
    input_placeholders: tuple[int, ...]          # full-graph indices of model inputs
    batch_placeholders: tuple[int, ...]          # inputs then targets (keyword arguments)
    shared_params: dict[str, tuple[int, ...]] = field(default_factory=dict)  # name → stages


# ------------------------------------------------------------------ fused regions
@dataclass(frozen=True)
class FusedRegion:
    """One fused region: the graph it is in ("rank", "stage1", "rank/ah_recompute_0"),
    its kernel key, the ops and node names it replaced, and the bytes it moves fused and
    unfused (at the example sizes)."""

    graph: str
    key: str
    ops: tuple[str, ...]
    nodes: tuple[str, ...]
    num_inputs: int
    num_outputs: int
    bytes_fused: int
    bytes_unfused: int


# ------------------------------------------------------------------ the program
@dataclass(frozen=True)
class RankProgram:
    """Rank `rank`'s program for one captured graph under `plan`: what `rewrite` returns.

    `runnable` is the captured graph with the rewritten graph module and the outputs the
    runtime reads (a training graph's last output is the loss denominator global_loss
    appends); the other fields are the facts the passes established, derived from the
    Plan and the graph alone, so they are the same on every rank that shares them.
    """

    plan: Plan
    rank: int
    coords: tuple[int, int, int]            # (pp, dp, tp)
    kind: str                               # "train" (model + loss) or "forward"
    captured: CapturedGraph                 # what the passes started from
    runnable: CapturedGraph                 # the rewritten graph, run by the runtime
    #: how the graph's loss reduces ("mean", "sum", ...; global_loss); None: forward
    loss_kind: str | None = None
    #: the index of the loss among the graph's outputs (None: a forward graph)
    loss_output_index: int | None = None
    #: the index of the per-sample statistics among them (sample_stats.py; None: none)
    stats_output_index: int | None = None
    #: (a, b): per-sample sizes of the batch the split of the batch was proven for
    #: equal (global_loss; BatchSpec checks them on every batch)
    batch_equalities: tuple = ()
    #: the stages (pipeline_split; None without pipeline parallelism)
    pipeline: PipelineSplit | None = None
    #: canonical name → this rank's ShardSpec of each parameter tp splits
    param_shards: Mapping[str, ShardSpec] = field(default_factory=lambda: MappingProxyType({}))
    #: the tp layout the tensor_parallel pass applied (None without tp)
    tp_layout: TensorParallelLayout | None = None
    #: one per region the fusion pass replaced by a generated kernel, in order
    fused_regions: tuple[FusedRegion, ...] = ()
    #: ZeRO-3 parameter gathers inserted (passes/zero.py)
    zero_gathers: int = 0
    #: nodes the overlap pass moved, and collectives it left as issue + wait
    overlap_moved: int = 0
    overlap_split: int = 0
    #: collectives fused with their linears into chunked ops (passes/collective_matmul.py)
    collective_matmuls: int = 0
    #: seconds each pass took, in the order they ran (disabled passes absent)
    pass_seconds: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    #: (pass, copies of the graphs after it) per pass, when rewrite was asked to keep them:
    #: {kind: graph}, or {"stage<k>": graph} once the pipeline is split
    snapshots: tuple[tuple[str, Mapping[str, fx.GraphModule]], ...] = field(
        default=(), repr=False)

    @property
    def gm(self) -> fx.GraphModule:
        """The rewritten graph (with pp > 1: the whole rank-local graph the stages cut)."""
        return self.runnable.gm

    def stage_params(self) -> set[str]:
        """Canonical names of the parameters this rank's pipeline stages read."""
        ranks = self.plan.stage_ranks()
        return {name for stage in self.pipeline.stages
                if ranks[stage.index] == self.coords[0] for name in stage.params}

    def graphs(self) -> dict[str, fx.GraphModule]:
        """The graphs this rank runs: {kind: graph}, or one per pipeline stage it runs."""
        if self.pipeline is None:
            return {self.kind: self.gm}
        return self.mine({f"stage{s.index}": s.gm for s in self.pipeline.stages})

    def mine(self, graphs: Mapping[str, fx.GraphModule]) -> dict[str, fx.GraphModule]:
        """Of `graphs` (a snapshot), those this rank runs (its own pipeline stages)."""
        ranks = self.plan.stage_ranks()
        return {kind: gm for kind, gm in graphs.items()
                if not kind.startswith("stage") or ranks[int(kind[5:])] == self.coords[0]}

    def params(self) -> set[str]:
        """Canonical names of the parameters this rank's graphs read."""
        return {node.meta.get(AH_PARAM, node.name) for gm in self.graphs().values()
                for node in gm.graph.nodes
                if is_param(node)}

    def collectives(self) -> dict[str, int]:
        """autohybrid ops in the rank's graphs (recomputed regions included), by name."""
        counts: dict[str, int] = {}
        for top in self.graphs().values():
            for sub in top.modules():
                if not isinstance(sub, fx.GraphModule):
                    continue
                for node in sub.graph.nodes:
                    name = op_name(node) if node.op == "call_function" else ""
                    if name.startswith("autohybrid."):
                        key = name.split(".")[1]
                        counts[key] = counts.get(key, 0) + 1
        return dict(sorted(counts.items()))
