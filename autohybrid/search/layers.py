"""Layers of a captured graph: the units pipeline stages are cut from and costed by.

A layer is a run of consecutive graph nodes that come from one entry of a ModuleList
(`model.blocks.7`) or one top-level child module (`model.wte`, `model.lm_head`). Glue
nodes of the model's own forward (position ids, the embedding sum) and the loss join the
neighbouring layer; a module that runs again after other layers (one activation module
shared by every block) names each later run `name#2`, `name#3`, … so that layer names,
which stage boundaries use, are unique. Layers with the same structure (same ops, shapes and wiring, other
parameter names) share a `signature`, so a 96-block GPT is costed as a handful of
distinct layers.

Example::

    layers = segment(cap.gm)
    [l.name for l in layers]   # ['model.wte', 'model.blocks.0', ..., 'model.lm_head']
"""
from __future__ import annotations

import hashlib
import operator
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..graph import AH_ROLE, MODULE_STACK, VAL, is_param, op_name

_INDEX = re.compile(r"\.\d+$")


@dataclass(frozen=True)
class Layer:
    name: str
    nodes: tuple[fx.Node, ...]
    signature: str

    def params(self) -> list[fx.Node]:
        """Parameter placeholders this layer's nodes read (in first-use order)."""
        seen: dict[str, fx.Node] = {}
        for node in self.nodes:
            for arg in node.all_input_nodes:
                if is_param(arg):
                    seen.setdefault(arg.name, arg)
        return list(seen.values())

    def param_count(self) -> int:
        return sum(p.meta[VAL].numel() for p in self.params())


_BLOCK = re.compile(r"\.\d+(#\d+)?$")  # a ModuleList entry (a later run of one: `#k`)


def is_block(name: str) -> bool:
    """Whether layer `name` is a ModuleList entry (a transformer block): the unit full
    recomputation checkpoints (passes/recompute.py) and the cost model prices so."""
    return bool(_BLOCK.search(name))


def layer_key(node: fx.Node) -> str:
    """The layer a node belongs to: a ModuleList entry, else the top-level child; "" = glue."""
    paths = [path for path, _ in (node.meta.get(MODULE_STACK) or {}).values()]
    for path in paths:
        if _INDEX.search(path):
            return path
    depth = [p for p in paths if p]
    if not depth:
        return ""
    root = depth[0]
    children = [p for p in depth if p.count(".") == root.count(".") + 1]
    return children[0] if children else ""


def segment(gm: fx.GraphModule) -> list[Layer]:
    """Split the compute nodes of `gm` into layers, in execution order."""
    runs: list[tuple[str, list[fx.Node]]] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        key = layer_key(node)
        if node.target is operator.getitem or op_name(node) == "aten.sym_size.int":
            key = runs[-1][0] if runs else key
        if runs and runs[-1][0] == key:
            runs[-1][1].append(node)
        else:
            runs.append((key, [node]))
    merged: list[tuple[str, list[fx.Node]]] = []
    pending: list[fx.Node] = []
    for key, nodes in runs:
        if not key:  # glue: attach to the previous layer (or the next one when first)
            if merged:
                merged[-1][1].extend(nodes)
            else:
                pending.extend(nodes)
            continue
        if merged and merged[-1][0] == key:
            merged[-1][1].extend(nodes)
        else:
            merged.append((key, pending + nodes))
            pending = []
    if pending:
        merged.append(("loss", pending))
    seen: dict[str, int] = {}
    layers = []
    for key, nodes in merged:  # a module used again later (a shared activation) gets #2, …
        seen[key] = seen.get(key, 0) + 1
        name = key if seen[key] == 1 else f"{key}#{seen[key]}"
        layers.append(Layer(name=name, nodes=tuple(nodes), signature=_signature(nodes)))
    return layers


def _signature(nodes: list[fx.Node]) -> str:
    """Structural hash: ops, shapes, dtypes and wiring relative to the layer."""
    index = {n: i for i, n in enumerate(nodes)}
    digest = hashlib.sha256()

    def ref(arg: fx.Node) -> str:
        if arg in index:
            return f"%{index[arg]}"
        val = arg.meta.get(VAL)
        shape = tuple(str(s) for s in val.shape) if isinstance(val, torch.Tensor) else ()
        return f"ext{shape}:{arg.meta.get(AH_ROLE, 'act')}"

    for node in nodes:
        args = fx.node.map_arg((node.args, node.kwargs), ref)
        val = node.meta.get(VAL)
        shape = tuple(str(s) for s in val.shape) if isinstance(val, torch.Tensor) else None
        digest.update(repr((op_name(node), args, shape)).encode())
    return digest.hexdigest()[:16]


def gather_groups(sizes: list[float], stage_starts: list[bool], limit: float) -> list[list[int]]:
    """ZeRO-3's gathers over layers with parameters of `sizes` bytes (in execution order):
    the indices each gather serves. A layer smaller than `limit` joins the previous
    gather (the first layer's: the next one's), as does the next layer while a gather is
    that small; a layer starting a pipeline stage (`stage_starts`) always starts one.
    passes/zero.py places the gathers so; search/pricing.py counts them."""
    groups: list[list[int]] = []
    held = 0.0
    for i, (size, starts) in enumerate(zip(sizes, stage_starts)):
        if groups and not starts and min(size, held) < limit:
            groups[-1].append(i)
            held += size
        else:
            groups.append([i])
            held = size
    return groups
