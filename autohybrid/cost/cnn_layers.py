"""A captured CNN's layers as the ParaDL oracle (cost/oracle.py) sees them.

A layer is one op with a weight (convolution or linear); every weightless op after it
(ReLU, pooling, batch norm, adds, views) is priced with it, those before the first
layer with the first. Per layer, for one sample: |x| (input elements), |y| (output
elements), |w| (weight elements), the channels C (in) and F (out), the output's spatial
extent, the halo a spatial tile needs from its neighbours (forward |x| halo and backward
|dy| halo), and the forward time FW on the cluster's device (the roofline of
cost/compute.py: matmul FLOPs at MATMUL_EFFICIENCY of peak, other ops by bytes at
MEMORY_EFFICIENCY of HBM or by FLOPs at peak, whichever is slower); BW = 2·FW.

Halo, spatial split along the first spatial dim (height; depth for 3-D) into row
blocks: an interior tile computing output rows [o0, o1) of a convolution with kernel
k, stride s, padding q and dilation d reads input rows [o0·s − q, (o1 − 1)·s − q +
d(k − 1)], it owns [o0·s, o1·s), so it needs q rows from above and d(k − 1) − q − s + 1
from below (each at least 0). In the backward, its input-gradient rows [o0·s, o1·s)
take dy rows from ⌊(d(k − 1) − q)/s⌋ above and ⌊(s − 1 + q)/s⌋ below. A row is the
tensor's other spatial dims times its channels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx

from ..errors import ModelError
from ..graph import AH_ROLE, VAL, VIEW_OPS, op_name
from .compute import (MATMUL_EFFICIENCY, MATMUL_OPS, MEMORY_EFFICIENCY, bytes_moved,
                      forward_flops)

CONV_OPS = frozenset({"aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default",
                      "aten.convolution.default"})
LINEAR_OPS = frozenset({"aten.linear.default", "aten.addmm.default", "aten.mm.default"})


@dataclass(frozen=True)
class Layer:
    """One weighted layer, sizes per sample (elements), times per sample (seconds)."""

    name: str
    op: str                      # "conv" | "linear"
    x: int                       # |x|: input elements
    y: int                       # |y|: output elements
    w: int                       # |w|: weight (and bias) elements
    in_channels: int             # C
    out_channels: int            # F
    spatial: tuple[int, ...]     # output spatial extent (empty for linear)
    halo_x: int                  # forward halo elements of an interior tile
    halo_dy: int                 # backward halo elements (of dy)
    fw_s: float                  # forward time of one sample
    bw_s: float                  # backward time of one sample (2·FW)

    @property
    def spatial_size(self) -> int:
        out = 1
        for s in self.spatial:
            out *= s
        return out


def halo_rows(kernel: int, stride: int = 1, padding: int = 0,
              dilation: int = 1) -> tuple[int, int]:
    """(forward rows of x, backward rows of dy) an interior tile needs from its neighbours
    along the split dim (above + below; module docstring)."""
    reach = dilation * (kernel - 1)
    fwd = max(padding, 0) + max(reach - padding - stride + 1, 0)
    bwd = max((reach - padding) // stride, 0) + max((stride - 1 + padding) // stride, 0)
    return fwd, bwd


def _per_sample(value: Any, batch: set[sympy.Symbol]) -> sympy.Expr:
    expr = sympy.sympify(value)
    return expr.subs({s: 1 for s in batch})


def _int(expr: Any, batch: set[sympy.Symbol]) -> int:
    out = _per_sample(expr, batch)
    if not out.is_number:
        raise ModelError(f"the oracle needs static sizes besides the batch dim; got {out} "
                         "(give example inputs of fixed image size)")
    return int(out)


def _numel(t: torch.Tensor, batch: set[sympy.Symbol]) -> int:
    out = 1
    for s in t.shape[1:]:
        out *= _int(s.node.expr if isinstance(s, torch.SymInt) else s, batch)
    return out


def _conv_args(node: fx.Node, dims: int) -> tuple[list[int], list[int], list[int], int]:
    """(stride, padding, dilation, groups) of a conv node, defaults filled in."""
    args = list(node.args)
    if op_name(node) == "aten.convolution.default":
        stride, padding, dilation, groups = args[3], args[4], args[5], args[8]
    else:
        rest = args[3:] + [None] * 4
        stride, padding, dilation, groups = (rest[0] or 1, rest[1] or 0, rest[2] or 1,
                                             rest[3] or 1)
    if isinstance(padding, str):
        raise ModelError(f"{node.name}: padding={padding!r}; the oracle needs numeric "
                         "padding (e.g. padding=1 for a 3x3 'same' convolution)")

    def each(v: Any) -> list[int]:
        return [int(v)] * dims if isinstance(v, int) else [int(x) for x in v]
    return each(stride), each(padding), each(dilation), int(groups)


def _roofline(node: fx.Node, device: Any, dtype: str, batch: set[sympy.Symbol]) -> float:
    peak = device.peak_flops.get(dtype) or max(device.peak_flops.values())
    flops = float(_per_sample(forward_flops(node), batch))
    if op_name(node) in MATMUL_OPS:
        return flops / (peak * MATMUL_EFFICIENCY)
    moved = float(_per_sample(bytes_moved(node), batch))
    return max(moved / (device.memory_bandwidth * MEMORY_EFFICIENCY), flops / peak)


def cnn_layers(gm: fx.GraphModule, batch_symbols: set[sympy.Symbol], device: Any,
               dtype: str) -> tuple[Layer, ...]:
    """The weighted layers of a captured (forward) graph, in graph order."""
    layers: list[dict[str, Any]] = []
    pending = 0.0  # time of weightless ops before the first layer
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = op_name(node)
        args = [a for a in node.args if isinstance(a, fx.Node)]
        params = [a for a in args if a.meta.get(AH_ROLE) == "param"]
        t = 0.0 if name in VIEW_OPS else _roofline(node, device, dtype, batch_symbols)
        if (name in CONV_OPS or name in LINEAR_OPS) and params:
            layers.append(_layer(node, name, params, batch_symbols, t))
        elif layers:
            layers[-1]["fw_s"] += t
            layers[-1]["w"] += sum(_numel_all(p.meta[VAL]) for p in params)  # norms' weights
        else:
            pending += t
    if not layers:
        raise ModelError("the oracle found no convolution or linear layer with weights in "
                         "the model; it prices CNNs (conv / linear layers)")
    layers[0]["fw_s"] += pending
    return tuple(Layer(**d, bw_s=2 * d["fw_s"]) for d in layers)


def _layer(node: fx.Node, name: str, params: list[fx.Node], batch: set[sympy.Symbol],
           fw: float) -> dict[str, Any]:
    x_node = node.args[1] if name == "aten.addmm.default" else node.args[0]
    x, y = x_node.meta[VAL], node.meta[VAL]
    w = sum(_numel_all(p.meta[VAL]) for p in params)
    if name in CONV_OPS:
        weight = node.args[1].meta[VAL]
        dims = weight.dim() - 2
        stride, padding, dilation, _ = _conv_args(node, dims)
        kernel = [int(k) for k in weight.shape[2:]]
        fwd, bwd = halo_rows(kernel[0], stride[0], padding[0], dilation[0])
        in_row = _numel(x, batch) // _int(_dim(x, 2), batch)
        out_row = _numel(y, batch) // _int(_dim(y, 2), batch)
        spatial = tuple(_int(_dim(y, 2 + i), batch) for i in range(dims))
        return dict(name=_module(node), op="conv", x=_numel(x, batch), y=_numel(y, batch), w=w,
                    in_channels=_int(_dim(x, 1), batch), out_channels=_int(_dim(y, 1), batch),
                    spatial=spatial, halo_x=fwd * in_row, halo_dy=bwd * out_row, fw_s=fw)
    return dict(name=_module(node), op="linear", x=_numel(x, batch), y=_numel(y, batch), w=w,
                in_channels=_int(_dim(x, -1), batch), out_channels=_int(_dim(y, -1), batch),
                spatial=(), halo_x=0, halo_dy=0, fw_s=fw)


def _module(node: fx.Node) -> str:
    """The layer's module name (its nn_module_stack's innermost entry), else the node's."""
    stack = node.meta.get("nn_module_stack") or {}
    names = [v[0] for v in stack.values() if isinstance(v, tuple) and v and v[0]]
    return names[-1].removeprefix("model.") if names else node.name


def _dim(t: torch.Tensor, i: int) -> Any:
    s = t.shape[i]
    return s.node.expr if isinstance(s, torch.SymInt) else s


def _numel_all(t: torch.Tensor) -> int:
    return int(t.numel())
