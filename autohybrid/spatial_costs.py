"""What a spatial tiling costs: the graph as the spatial pass rewrites it, profiled.

The planner prices a spatial mesh (`Mesh.spatial`: the tp axis tiles activations) from
the program one of its ranks would run, not from formulas of its own: the costed graph
is rewritten on fake process groups by the passes that shape it (global_loss,
spatial_parallel; rewrite.py) for a middle tile, which exchanges halos on every side,
and that graph (convolutions, pools, element-wise ops and BatchNorm on tiles, the layers
the pass could not tile whole) is profiled as any graph is (search/space.py), with
nothing split over tp. Its collectives are the ones the pass inserted, each on the mesh
axis it runs on:

- `halo_fetch`: the rows received from the neighbouring tiles ("halo", forward; its
  backward `halo_return` sends as many gradient rows back where the input needs grad);
- `spatial_gather`: an all-gather of the whole activation (forward);
- `spatial_split` of a value that needs grad: an all-gather of its gradient (backward);
- `sync_batch_norm` (on axis "stats": the tiles and dp): the statistics (sum, count;
  then the centred sum of squares) all-reduced forward, the two gradient sums backward;
- `tp_copy` of a parameter: its gradient all-reduced over the tiles (backward).

Parameters stay whole on every rank, so the memory model holds each one whole. A graph
the pass refuses (nothing to tile at this tile count) gives the reason instead.

Example::

    costs = SpatialCosts(captured)
    costs.tilings(4)          # [(4,), (2, 2)] for images (N, C, H, W)
    costs((2, 2))             # a ModelProfile, or why the graph cannot be tiled so
"""
from __future__ import annotations

import math

import sympy
import torch
import torch.fx as fx

from .capture import CapturedGraph
from .cost.compute import grad_nodes, nbytes_expr
from .errors import AutohybridError
from .graph import VAL, op_name
from .passes import ORDER
from .passes.spatial_parallel import WINDOW_OPS
from .plan import MAX_SPATIAL_DIMS, Mesh, Plan, RankPlacement
from .rewrite import rewrite
from .search.sharding import Collective, TensorParallelLayout
from .search.space import ModelProfile, profile

#: the passes that shape a spatial rank's graph; the others leave its costs alone
_SHAPING = ("global_loss", "spatial_parallel")


class SpatialCosts:
    """The profiles of `captured` under each spatial tiling, built once per tiling."""

    def __init__(self, captured: CapturedGraph, example_inputs: tuple = ()):
        self.captured, self.example_inputs = captured, tuple(example_inputs)
        self.dims = max((_spatial_dims(n) for n in captured.gm.graph.nodes
                         if n.op == "call_function" and op_name(n) in WINDOW_OPS), default=0)
        self._profiles: dict[tuple[int, ...], ModelProfile | str] = {}

    @property
    def applies(self) -> bool:
        """Whether the graph has a convolution or pooling to tile at all."""
        return self.dims > 0

    def tilings(self, tp: int) -> list[tuple[int, ...]]:
        """The tilings of `tp` ranks the graph's windows allow: (tp,) along the first
        spatial dim, and (a, b) with a · b = tp, a, b ≥ 2 over two of them."""
        if tp < 2 or not self.applies:
            return []
        out = [(tp,)]
        if min(self.dims, MAX_SPATIAL_DIMS) >= 2:
            out += [(a, tp // a) for a in range(2, tp // 2 + 1) if tp % a == 0]
        return out

    def __call__(self, tiles: tuple[int, ...]) -> ModelProfile | str:
        if tiles not in self._profiles:
            self._profiles[tiles] = self._profile(tuple(tiles))
        return self._profiles[tiles]

    def _profile(self, tiles: tuple[int, ...]) -> ModelProfile | str:
        mesh = Mesh(tp=math.prod(tiles), spatial=tiles)
        plan = Plan(model_hash=self.captured.hash, cluster="spatial costs",
                    cluster_hash="spatial costs", mesh=mesh,
                    placement=tuple(RankPlacement(rank=r, node=0, device=r)
                                    for r in range(mesh.world_size)),
                    global_batch=1, microbatch_size=1, num_microbatches=1)
        try:
            program = rewrite(self.captured, plan, _middle(tiles),
                              example_inputs=self.example_inputs,
                              fake_groups=True,
                              skip=tuple(n for n in ORDER if n not in _SHAPING))
        except AutohybridError as exc:
            return (str(exc).strip().splitlines() or ["the spatial pass refused"])[0]
        gm = program.runnable.gm
        layout = TensorParallelLayout(collectives=collectives(gm))
        return profile(gm, self.captured.dim_roles, layout=layout)


def _middle(tiles: tuple[int, ...]) -> int:
    """The tp rank of a middle tile: it receives halo rows from both sides of each
    tiled dim (rank 0's corner tile only from one), as most tiles of a large mesh do."""
    if len(tiles) == 1:
        return tiles[0] // 2
    a, b = tiles
    return (a // 2) * b + b // 2


def _spatial_dims(node: fx.Node) -> int:
    x = node.args[0] if node.args else None
    val = x.meta.get(VAL) if isinstance(x, fx.Node) else None
    return val.dim() - 2 if isinstance(val, torch.Tensor) else 0


def collectives(gm: fx.GraphModule) -> list[Collective]:
    """The communication of a graph the spatial pass rewrote (module docstring)."""
    needs_grad = grad_nodes(gm)
    out: list[Collective] = []

    def add(node: fx.Node, kind: str, direction: str, nbytes, axis: str) -> None:
        out.append(Collective(node.name, kind, direction, sympy.sympify(nbytes), axis))

    for node in gm.graph.nodes:
        name = op_name(node)
        if node.op != "call_function" or not name.startswith("autohybrid."):
            continue
        val = node.meta.get(VAL)
        if name == "autohybrid.halo_fetch.default":
            halo = nbytes_expr(val) - nbytes_expr(node.args[0].meta[VAL])
            add(node, "halo", "forward", halo, node.args[8])
            if node in needs_grad:
                add(node, "halo", "backward", halo, node.args[8])
        elif name == "autohybrid.spatial_gather.default":
            add(node, "all_gather", "forward", nbytes_expr(val), node.args[3])
        elif name == "autohybrid.spatial_split.default" and node.args[0] in needs_grad:
            add(node, "all_gather", "backward", nbytes_expr(node.args[0].meta[VAL]),
                node.args[2])
        elif name == "autohybrid.sync_batch_norm.default":
            x = node.args[0].meta[VAL]
            channels, width = x.shape[1], x.element_size()
            # over the tiles and dp (plan.spatial_stats_axis), whatever dp the plan has
            add(node, "all_reduce", "forward", (2 * channels + 1) * width, "stats")
            add(node, "all_reduce", "backward", 2 * channels * width, "stats")
        elif name == "autohybrid.tp_copy.default":
            add(node, "all_reduce", "backward", nbytes_expr(node.args[0].meta[VAL]),
                node.args[1])
    return out
