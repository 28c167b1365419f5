"""Pass: spatial parallelism for CNNs on the tp axis (the Plan's `mesh.spatial`).

Every rank of the tp axis gets the same batch; with `spatial=(n,)` each holds one of n
tiles of every activation along dim 2 (H of N,C,H,W; D of N,C,D,H,W), with `(a, b)` one
of a × b tiles along dims 2 and 3 (ops/spatial.py). Walking the graph in order:

- a convolution or pooling (conv1d/2d/3d, max/avg pool) on a tiled or a replicated input
  whose output has at least as many rows as tiles along each tiled dim: the input is
  split (`spatial_split`, when not yet tiled), `halo_fetch` brings the rows its output
  tile needs (zeros, or -inf for max pooling, outside the image), and the op runs on the
  slab with no padding along the tiled dims: its output is tiled;
- training BatchNorm on a tile: `sync_batch_norm` over the tiles (and dp) — the
  statistics of the whole activation; eval BatchNorm, element-wise ops, activations,
  residual adds and `cat` along channels keep the tiling of their tiled operands (a
  replicated operand spanning a tiled dim is split; one broadcast along it is read whole);
- anything else (adaptive pooling, flatten, linear, dropout with p > 0 — whose mask must
  be eager's —,
  shape reads, outputs) gets its tiled operands gathered (`spatial_gather`) and runs
  replicated, as every op on every rank does before the first window op.

Every replicated tensor an op on tiles reads (weights, biases, BN affine) goes through
`tp_copy`: forward the identity, backward its gradient — a sum over this rank's tile —
summed over the tiles. The data-parallel reduction then sums over dp as for any plan.
Where a layer cannot be tiled the graph stays replicated there, which is exact; a graph
with nothing to tile is refused, since the plan would be tp-way redundant compute.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import ops  # noqa: F401  (registers the autohybrid ops)
from ..errors import PlanError
from ..graph import AH_PASS, VAL, fake_mode, new_node, op_name, refresh_fake, schema_args
from ..ops.spatial import conv_output_size
from ..plan import Mesh, spatial_stats_axis, spatial_tile_axes
from .manager import PassContext
from .sync_batch_norm import replace_batch_norm

ah_ops = torch.ops.autohybrid
PASS = "spatial_parallel"

_CONV = {"aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default",
         "aten.convolution.default"}
_MAX_POOL = {"aten.max_pool1d.default", "aten.max_pool2d.default", "aten.max_pool3d.default"}
_AVG_POOL = {"aten.avg_pool1d.default", "aten.avg_pool2d.default", "aten.avg_pool3d.default"}
#: the window ops the pass tiles (with a halo exchange)
WINDOW_OPS = frozenset(_CONV | _MAX_POOL | _AVG_POOL)
#: ops (by base name, in-place variants included) computed value by value: a tile of the
#: inputs gives the tile of the output (dropout is not one: its mask must be eager's)
_ELEMENTWISE = {"add", "sub", "mul", "div", "neg", "relu", "relu6", "gelu", "silu", "tanh",
                "sigmoid", "hardtanh", "hardswish", "hardsigmoid", "leaky_relu", "elu",
                "mish", "exp", "pow", "sqrt", "rsqrt", "clone", "contiguous", "_to_copy",
                "to", "alias", "detach", "type_as", "clamp", "clamp_min", "clamp_max",
                "abs", "square", "reciprocal"}

#: A value's tiling: per tile axis, (its dim, the dim's global size)
Tiling = tuple[tuple[int, int], ...]


def spatial_parallel(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    mesh = ctx.plan.mesh
    if not mesh.spatial:
        return gm
    tiler = _Tiler(gm, mesh)
    tiler.run()
    if not tiler.windows:
        raise PlanError(f"the mesh {mesh.describe()} tiles activations, but no convolution "
                        "or pooling of this graph can be tiled (none, or each output has "
                        f"fewer rows than the {mesh.spatial} tiles along dims "
                        f"{list(range(2, 2 + len(mesh.spatial)))}): every rank would compute "
                        "the whole model; plan without spatial")
    return gm


def _per_dim(value, n: int) -> list:
    """A conv/pool argument given as an int or a list of 1 or n entries, as n entries."""
    if isinstance(value, int):
        return [value] * n
    value = list(value)
    return value * n if len(value) == 1 else value


class _Tiler:
    def __init__(self, gm: fx.GraphModule, mesh: Mesh):
        self.gm, self.graph = gm, gm.graph
        self.tiles = mesh.spatial
        self.axes = spatial_tile_axes(mesh)
        self.stats_axis = spatial_stats_axis(mesh)
        self.mode = fake_mode(gm)
        self.tiled: dict[fx.Node, Tiling] = {}
        self.gathered: dict[fx.Node, fx.Node] = {}
        self.split_of: dict[tuple[fx.Node, Tiling], fx.Node] = {}
        self.summed: dict[fx.Node, fx.Node] = {}
        self.windows: list[str] = []   # the window ops tiled (names)

    # ------------------------------------------------------------------ helpers
    def call(self, op, args, like: fx.Node) -> fx.Node:
        return new_node(self.graph, op, args, None, pass_name=PASS, mode=self.mode, like=like)

    def gather(self, x: fx.Node) -> fx.Node:
        """The whole of tiled `x` (one gather per value, right after it)."""
        if x not in self.gathered:
            out = x
            for axis, (dim, size) in reversed(list(zip(self.axes, self.tiled[x]))):
                with self.graph.inserting_after(out):
                    out = self.call(ah_ops.spatial_gather.default, (out, dim, size, axis), x)
            self.gathered[x] = out
        return self.gathered[x]

    def split(self, x: fx.Node, tiling: Tiling, before: fx.Node) -> fx.Node:
        """This rank's tile of replicated `x` (`tiling`: its dims and their sizes)."""
        key = (x, tiling)
        if key not in self.split_of:
            with self.graph.inserting_before(before):
                out = x
                for axis, (dim, _size) in zip(self.axes, tiling):
                    out = self.call(ah_ops.spatial_split.default, (out, dim, axis), before)
            self.tiled[out] = tiling
            self.split_of[key] = out
        return self.split_of[key]

    def replicated_operand(self, a: fx.Node, user: fx.Node) -> fx.Node:
        """`a` (replicated, read whole by an op on tiles) through tp_copy: its gradient
        on this rank covers this tile only, and is summed over the tiles."""
        val = a.meta.get(VAL)
        if not isinstance(val, torch.Tensor) or not val.is_floating_point():
            return a
        if a not in self.summed:
            with self.graph.inserting_before(user):
                self.summed[a] = self.call(ah_ops.tp_copy.default, (a, "tp"), user)
        return self.summed[a]

    def gather_inputs(self, node: fx.Node) -> None:
        for a in node.all_input_nodes:
            if a in self.tiled:
                node.replace_input_with(a, self.gather(a))

    def can_tile(self, val: torch.Tensor, sizes: list[int]) -> bool:
        """Whether an activation with output sizes `sizes` along the tiled dims has at
        least one row per tile on each (and static sizes)."""
        if not isinstance(val, torch.Tensor) or val.dim() < 2 + len(self.tiles):
            return False
        return all(isinstance(s, int) and s >= n for s, n in zip(sizes, self.tiles))

    # ------------------------------------------------------------------ the walk
    def run(self) -> None:
        for node in list(self.graph.nodes):
            if node.op == "output":
                self.gather_inputs(node)
                continue
            if node.op != "call_function" or node.meta.get(AH_PASS) == PASS:
                continue
            name = op_name(node)
            if name == "aten.sym_size.int" and node.args[0] in self.tiled and \
                    node.args[1] % node.args[0].meta[VAL].dim() not in \
                    {d for d, _ in self.tiled[node.args[0]]}:
                continue   # the batch or channel count: the same on a tile
            if name in _CONV or name in _MAX_POOL or name in _AVG_POOL:
                if self.window(node, name):
                    continue
            elif name == "aten.batch_norm.default" and node.args[0] in self.tiled:
                self.batch_norm(node)
                continue
            elif self.elementwise(node, name):
                continue
            self.gather_inputs(node)

    def window(self, node: fx.Node, name: str) -> bool:
        """Tile a conv / pool (True), or leave it to run replicated (False)."""
        args = schema_args(node)
        first = "input" if "input" in args else "self"
        x = args[first]
        val = x.meta.get(VAL)
        if not isinstance(val, torch.Tensor):
            return False
        nd = val.dim() - 2
        if name in _CONV:
            if args.get("transposed") or isinstance(args["padding"], str):
                return False   # transposed convs and padding="same"/"valid" stay whole
            kernel = list(args["weight"].meta[VAL].shape[2:])
            stride, padding, dilation = (_per_dim(args[k], nd)
                                         for k in ("stride", "padding", "dilation"))
            pad_value = 0.0
        else:
            kernel = _per_dim(args["kernel_size"], nd)
            stride = _per_dim(args["stride"] or kernel, nd)
            padding = _per_dim(args["padding"], nd)
            dilation = _per_dim(args.get("dilation", 1), nd)
            if args.get("ceil_mode"):
                return False   # ceil mode's last window is not floor arithmetic
            if name in _AVG_POOL and not args.get("count_include_pad", True) and any(
                    padding[i] for i in range(len(self.tiles))):
                return False   # the divisor would count the halo's padding rows
            pad_value = float("-inf") if name in _MAX_POOL else 0.0
        dims = list(range(2, 2 + len(self.tiles)))
        if nd < len(self.tiles):
            return False
        # global sizes: a tile's own value holds only its rows
        sizes = ([size for _d, size in self.tiled[x]] if x in self.tiled
                 else [val.shape[d] for d in dims])
        outs = [conv_output_size(s, kernel[d - 2], stride[d - 2], padding[d - 2],
                                 dilation[d - 2]) if isinstance(s, int) else s
                for s, d in zip(sizes, dims)]
        if not self.can_tile(val, outs):
            return False
        tiling = tuple(zip(dims, sizes))
        if x in self.tiled:
            if self.tiled[x] != tiling:
                return False
            tile = x
        else:
            tile = self.split(x, tiling, node)
        slab = tile
        with self.graph.inserting_before(node):
            for axis, d, out in zip(self.axes, dims, outs):
                i = d - 2
                slab = self.call(ah_ops.halo_fetch.default,
                                 (slab, d, sizes[i], out, kernel[i], stride[i],
                                  padding[i], dilation[i], axis, pad_value), node)
        for i in range(len(self.tiles)):
            padding[i] = 0
        args[first] = slab
        args["padding"] = padding
        for key in ("weight", "bias"):
            if isinstance(args.get(key), fx.Node):
                args[key] = self.replicated_operand(args[key], node)
        schema = node.target._schema
        node.args = tuple(args[a.name] for a in schema.arguments if a.name in args)
        node.kwargs = {}
        refresh_fake(node, self.mode)
        self.tiled[node] = tuple(zip(dims, outs))
        self.windows.append(node.name)
        return True

    def batch_norm(self, node: fx.Node) -> None:
        training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training")
        for i in (1, 2):   # weight, bias
            if isinstance(node.args[i], fx.Node):
                node.replace_input_with(node.args[i],
                                        self.replicated_operand(node.args[i], node))
        tiling = self.tiled[node.args[0]]
        if not training:   # eval mode: per channel, value by value
            refresh_fake(node, self.mode)
            self.tiled[node] = tiling
            return
        created = replace_batch_norm(self.gm, node, self.stats_axis, PASS)
        for new in created:
            refresh_fake(new, self.mode)
        self.tiled[created[1]] = tiling   # getitem 0: the normalized tile

    def elementwise(self, node: fx.Node, name: str) -> bool:
        """Keep the tiling through a value-by-value op or a cat along channels (True)."""
        inputs = [a for a in node.all_input_nodes if a in self.tiled]
        if not inputs:
            return False
        tilings = {self.tiled[a] for a in inputs}
        out = node.meta.get(VAL)
        if len(tilings) != 1 or not isinstance(out, torch.Tensor):
            return False
        tiling = next(iter(tilings))
        base = name.split(".")[1].rstrip("_") if name.startswith("aten.") else None
        if name == "aten.dropout.default" and (node.args[1] == 0 or not node.args[2]):
            base = "alias"   # p = 0 or eval: the identity, no mask drawn
        if name == "aten.cat.default":
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
            if dim % out.dim() in {d for d, _ in tiling} or \
                    len(inputs) != len(node.args[0]):
                return False
        elif base not in _ELEMENTWISE:
            return False
        if any(self.tiled[a] and a.meta[VAL].dim() != out.dim() for a in inputs):
            return False
        for a in node.all_input_nodes:
            if a in self.tiled:
                continue
            val = a.meta.get(VAL)
            if not isinstance(val, torch.Tensor):
                continue
            shift = out.dim() - val.dim()
            spans = tuple((d - shift, size) for d, size in tiling
                          if d - shift >= 0 and val.shape[d - shift] != 1)
            if spans and len(spans) != len(tiling):
                return False   # spans one tiled dim but not the other: left whole
            if spans:
                node.replace_input_with(a, self.split(a, spans, node))
            else:
                node.replace_input_with(a, self.replicated_operand(a, node))
        refresh_fake(node, self.mode)
        self.tiled[node] = tiling
        return True
