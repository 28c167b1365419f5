"""A drawable view of one rank's program: its nodes grouped into layers, and DOT text.

A rank's rewritten graph has hundreds of ATen nodes per transformer block; a reader of
the plan report wants the layers (embedding, blocks.0.attn, blocks.0.mlp, …, loss) in
execution order, each with its pipeline stage, how tensor parallelism splits its
parameters (column / row / vocab-parallel / replicated), the collectives the passes
inserted into it, and the data edges between layers. `coarse_view` builds that;
`node_view` keeps one group per node (the full per-node view, for DOT files). `to_dot`
turns either into Graphviz DOT text (one cluster per pipeline stage, colored by stage);
no graphviz binary is needed to produce it.

How nodes are grouped (why: `nn_module_stack` names the module each node came from):

* a node's module path (the capture's `model.` wrapper prefix dropped) is cut below the
  first numbered container (`blocks.0.attn.qkv` → `blocks.0.attn`), or at its first
  component when nothing is numbered (`tok_emb`, `ln_f`, `lm_head`); the loss (the
  capture wrapper itself) is `loss`;
* nodes of no module below the model (symbolic sizes, position ids, residual adds of a
  block, the global loss' sums) join the group of the node before them in execution
  order (the first group when there is none), so they never make groups of their own;
* nodes inside recomputed regions (`checkpoint_region(sub, *inputs)`) count in the
  groups of their own modules, and the group says it is recomputed;
* with pp > 1 the stages' graphs (`RankProgram.pipeline`) are walked in stage order, a
  value a stage receives being the one the previous stage sent, so every node has its
  stage and edges cross stages where activations travel;
* edges follow the group order: a dependency against it (from nodes the overlap pass
  moved across a layer boundary) is not drawn;
* when there are more than `max_groups` groups, blocks are taken whole
  (`blocks.3`) and then runs of identical blocks in one stage fold into one group
  (`blocks.2–9`, `repeat` 8), so the view of a 96-layer model stays small.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

import torch.fx as fx

from ..graph import AH_PARAM, AH_ROLE, MODULE_STACK, VIEW_OPS, op_name, output_node

#: autohybrid ops that compute only (generated fused kernels): counted apart from
#: the collectives
COMPUTE_ONLY = frozenset({"fused_region", "term_weight"})
#: pipeline-stage colors (fill, stroke), cycled; shared with svg.py so both agree
STAGE_COLORS = (("#dbeafe", "#2563eb"), ("#dcfce7", "#16a34a"), ("#fef3c7", "#d97706"),
                ("#fce7f3", "#db2777"), ("#ede9fe", "#7c3aed"), ("#cffafe", "#0891b2"),
                ("#fee2e2", "#dc2626"), ("#e5e7eb", "#4b5563"))
DEFAULT_MAX_GROUPS = 40
_GLUE = ""        # module key of nodes that belong to no module below the model
_LOSS = "loss"


def stage_color(stage: int | None) -> tuple[str, str]:
    """(fill, stroke) of pipeline stage `stage` (grey when unknown)."""
    if stage is None:
        return ("#f3f4f6", "#6b7280")
    return STAGE_COLORS[stage % len(STAGE_COLORS)]


# ---------------------------------------------------------------------- data classes
@dataclass(frozen=True)
class Group:
    """One drawn box: a layer (or one node, or a folded run of identical blocks)."""

    id: str                              # "g0", "g1", … (valid DOT / SVG ids)
    name: str                            # "blocks.0.attn"
    module_type: str                     # "CausalSelfAttention" ("" when unknown)
    stage: int | None                    # pipeline stage (0 when pp = 1)
    ops: int                             # compute nodes (placeholders and getitems not);
    #                                      ops, fused_kernels, collectives: totals of a
    #                                      folded run
    sharding: str                        # "column: qkv · row: proj", "replicated", ""
    collectives: tuple[tuple[str, int], ...] = ()   # (autohybrid op, count), by name
    fused_kernels: int = 0
    recomputed: bool = False
    params: tuple[str, ...] = ()         # canonical parameter names it reads
    repeat: int = 1                      # identical blocks folded into this group

    @property
    def collective_count(self) -> int:
        return sum(n for _, n in self.collectives)


@dataclass(frozen=True)
class Edge:
    src: str             # Group.id
    dst: str
    values: int          # graph values flowing from src to dst
    crosses_stage: bool  # an activation sent through the pipeline


@dataclass
class GraphView:
    """Groups in execution order, data edges between them, and where they came from."""

    title: str
    groups: list[Group]
    edges: list[Edge]
    num_stages: int
    stage_ranks: tuple[int, ...] = ()    # pp coordinate of each stage
    tp: int = 1
    folded: bool = False
    notes: list[str] = field(default_factory=list)

    def group(self, gid: str) -> Group:
        for g in self.groups:
            if g.id == gid:
                return g
        raise KeyError(f"no group {gid!r} in this view")

    def stages(self) -> list[int]:
        """Every stage index of the program (a stage may hold no group only if empty)."""
        return list(range(self.num_stages))

    def collectives(self) -> dict[str, int]:
        """All collectives of the view by op name."""
        total: Counter = Counter()
        for g in self.groups:
            total.update(dict(g.collectives))
        return dict(sorted(total.items()))


# ---------------------------------------------------------------------- walking graphs
@dataclass
class _Item:
    """A compute node of the flattened program: its stage and its producers."""

    node: fx.Node
    stage: int
    preds: list[fx.Node]
    recomputed: bool


class _Walker:
    """Flattens a rank's graphs (stages, recomputed regions) into `_Item`s in execution
    order, resolving every input to the node that really produced it."""

    def __init__(self) -> None:
        self.alias: dict[fx.Node, fx.Node | None] = {}
        self.items: list[_Item] = []
        self.params: dict[fx.Node, str] = {}      # parameter placeholder → canonical name
        self.param_ndim: dict[str, int] = {}

    def resolve(self, node: Any) -> fx.Node | None:
        while isinstance(node, fx.Node) and node in self.alias:
            node = self.alias[node]
        return node if isinstance(node, fx.Node) else None

    def walk(self, gm: fx.GraphModule, stage: int, received: list[Any] | None = None,
             recomputed: bool = False) -> list[Any]:
        """Walk `gm`; its first placeholders stand for `received`. Returns the values
        its output returns (resolved), flattened."""
        holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for i, node in enumerate(holders):
            if received is not None and i < len(received):
                self.alias[node] = received[i]
            elif node.meta.get(AH_ROLE) == "param":
                name = node.meta.get(AH_PARAM, node.name)
                self.params[node] = name
                self.param_ndim[name] = getattr(node.meta.get("val"), "ndim", 2)
        for node in gm.graph.nodes:
            if node.op == "call_function" and _is_checkpoint(node):
                self._region(gm, node, stage)
            elif node.op == "call_function":
                preds = [p for p in (self.resolve(a) for a in node.all_input_nodes) if p]
                self.items.append(_Item(node, stage, preds, recomputed))
        out: list[Any] = []
        fx.node.map_arg(output_node(gm).args, lambda a: out.append(self.resolve(a)))
        return out

    def _region(self, gm: fx.GraphModule, call: fx.Node, stage: int) -> None:
        """A checkpointed region: its nodes join the walk; the call's getitems alias the
        region's outputs."""
        holder = call.args[0]
        sub = getattr(gm, holder.target) if isinstance(holder, fx.Node) else holder
        inputs = [self.resolve(a) for a in call.args[1:]]
        outs = self.walk(sub, stage, inputs, recomputed=True)
        for user in call.users:
            if user.op == "call_function" and op_name(user) == "getitem" \
                    and isinstance(user.args[1], int) and user.args[1] < len(outs):
                self.alias[user] = outs[user.args[1]]
            else:
                self.alias[user] = outs[0] if outs else None


def _is_checkpoint(node: fx.Node) -> bool:
    return "checkpoint_region" in op_name(node) or \
        getattr(node.target, "_name", "") == "autohybrid_checkpoint_region"


def _walk_program(gm: fx.GraphModule, split: Any) -> _Walker:
    walker = _Walker()
    if split is None:
        walker.walk(gm, 0)
        return walker
    sent: list[Any] = []
    for stage in split.stages:
        # the first stage receives the model's inputs: its placeholders stay placeholders;
        # a later one receives what the previous stage returned, in order
        received = None if stage.index == 0 else sent[:len(stage.received)]
        sent = walker.walk(stage.gm, stage.index, received)
    return walker


# ---------------------------------------------------------------------- module keys
def _module_entries(node: fx.Node) -> list[tuple[str, str]]:
    stack = node.meta.get(MODULE_STACK) or {}
    return [(str(path), str(kind)) for path, kind in stack.values()]


def _relative(path: str) -> str | None:
    """The path below the capture's `model` wrapper; None for the wrapper itself."""
    if path == "model":
        return None
    return path[len("model."):] if path.startswith("model.") else path


def module_key(node: fx.Node, level: str = "layer") -> str:
    """The group key of `node`: `_LOSS`, `_GLUE` or a module path (see module docstring).
    `level` "layer" cuts one below the first numbered container, "block" at it."""
    entries = _module_entries(node)
    if not entries or entries[-1][0].startswith("_empty_nn_module_stack"):
        return _GLUE
    path, kind = entries[-1]
    if path == "" and kind.endswith("_WithLoss"):
        return _LOSS
    rel = _relative(path)
    if not rel:
        return _GLUE
    parts = rel.split(".")
    numbered = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    if numbered is None:
        return parts[0]
    depth = numbered + (2 if level == "layer" else 1)
    if len(parts) < depth:
        return _GLUE      # a block's own ops (residual adds) join their neighbours
    return ".".join(parts[:depth])


def _module_type(nodes: Iterable[fx.Node], key: str) -> str:
    for node in nodes:
        for path, kind in _module_entries(node):
            if _relative(path) == key or (key == _LOSS and path == ""):
                return kind.rsplit(".", 1)[-1]
    return ""


# ---------------------------------------------------------------------- sharding labels
def shard_dims(program: Any = None, plan: Any = None) -> dict[str, int]:
    """Split dim of each tp-sharded parameter (canonical name), from the program's
    `param_shards` (the tensor-parallel pass') or else the Plan's `shardings`."""
    specs = getattr(program, "param_shards", None) or {}
    if specs:
        return {name: int(spec.dim) for name, spec in specs.items()}
    out: dict[str, int] = {}
    for s in getattr(plan, "shardings", ()) or ():
        match = re.fullmatch(r"shard\((\d+)\)", s.placement)
        if match and (s.node.endswith(".weight") or s.node.endswith(".bias")):
            out[s.node] = int(match.group(1))
    return out


def _param_label(dim: int, users: list[fx.Node], ndim: int) -> str:
    ops = {op_name(u) for u in users}
    if any("embedding" in o for o in ops):
        return "vocab-parallel" if dim == 0 else f"shard({dim})"
    if ndim >= 2 and any("linear" in o or "matmul" in o or "addmm" in o for o in ops):
        return "column" if dim == 0 else "row" if dim == 1 else f"shard({dim})"
    if ndim >= 2 and any("conv" in o for o in ops):
        return "out-channels" if dim == 0 else "in-channels" if dim == 1 else f"shard({dim})"
    return f"shard({dim})"


def _sharding(group_name: str, params: dict[str, list[fx.Node]], dims: dict[str, int],
              ndims: dict[str, int], tp: int) -> str:
    """`column: qkv · row: proj` for the group's split weights; `replicated` when tp > 1
    and nothing of it is split; "" when tp = 1."""
    if tp <= 1:
        return ""
    parts: list[str] = []
    for name, users in params.items():
        if name not in dims or name.endswith(".bias"):
            continue
        short = name[:-len(".weight")] if name.endswith(".weight") else name
        if short.startswith(group_name + "."):
            short = short[len(group_name) + 1:]
        elif short != group_name:                 # a tied parameter of another module
            short = f"{short} (shared)"
        label = _param_label(dims[name], users, ndims.get(name, 2))
        part = label if short == group_name else f"{label}: {short}"
        if part not in parts:
            parts.append(part)
    return " · ".join(parts) if parts else ("replicated" if params else "")


# ---------------------------------------------------------------------- building views
def _program_parts(source: Any) -> tuple[fx.GraphModule, Any, Any, str]:
    """(graph, pipeline split or None, plan or None, title) of a RankProgram (anything
    with `gm` and `pipeline`) or a bare GraphModule."""
    if isinstance(source, fx.GraphModule):
        return source, None, None, "graph"
    gm = getattr(source, "gm", None)
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"expected a RankProgram (with .gm and .pipeline) or an fx.GraphModule, "
                        f"got {type(source).__name__}")
    rank = getattr(source, "rank", None)
    coords = getattr(source, "coords", None)
    title = f"rank {rank}" + (f" (pp, dp, tp) = {tuple(coords)}" if coords else "") \
        if rank is not None else "program"
    return gm, getattr(source, "pipeline", None), getattr(source, "plan", None), title


def coarse_view(source: Any, *, plan: Any = None, max_groups: int = DEFAULT_MAX_GROUPS
                ) -> GraphView:
    """The layer-level view of a rank's program (or of a GraphModule); see the module
    docstring for the grouping rules."""
    view = _build(source, plan, "layer")
    if len(view.groups) > max_groups:
        view = _build(source, plan, "block")
        view = fold_repeats(view)
        view.notes.append(f"blocks shown whole and identical neighbours folded "
                          f"(more than {max_groups} layers)")
    return view


def node_view(source: Any, *, plan: Any = None) -> GraphView:
    """One group per compute node (the full per-node view; for DOT files, not drawings)."""
    return _build(source, plan, "node")


def _build(source: Any, plan: Any, level: str) -> GraphView:
    gm, split, prog_plan, title = _program_parts(source)
    plan = plan or prog_plan
    walker = _walk_program(gm, split)
    keys = _assign_keys(walker.items, level)
    tp = plan.mesh.tp if plan is not None else 1
    dims = shard_dims(source, plan)
    num_stages = len(split.stages) if split is not None else 1
    order = _group_order(walker.items, keys)
    members: dict[str, list[_Item]] = {name: [] for name in order}
    for item, key in zip(walker.items, keys):
        members[f"{item.stage}/{key}"].append(item)
    ids = {name: f"g{i}" for i, name in enumerate(order)}
    groups = [_make_group(ids[name], name.split("/", 1)[1], members[name], walker, dims, tp,
                          level) for name in order]
    edges = _edges(walker.items, keys, ids)
    stage_ranks = tuple(plan.stage_ranks()) if plan is not None else tuple(range(num_stages))
    return GraphView(title, groups, edges, num_stages, stage_ranks, tp)


def _assign_keys(items: list[_Item], level: str) -> list[str]:
    """Group key of each item. A glue item (no module of its own, or a fused kernel,
    whose module is that of whichever node the fusion started from) takes the key of its
    first consumer that has one, else of the item before it in its stage, else the
    first key of the program."""
    if level == "node":        # names are unique per graph, not across a region's
        seen: set[tuple[int, str]] = set()
        out = []
        for i, item in enumerate(items):
            key = item.node.name
            if (item.stage, key) in seen:
                key = f"{key}#{i}"
            seen.add((item.stage, key))
            out.append(key)
        return out
    own = [_GLUE if op_name(item.node).startswith("autohybrid.fused_region")
           else module_key(item.node, level) for item in items]
    keys = list(own)
    index = {item.node: i for i, item in enumerate(items)}
    users: dict[int, list[int]] = {}
    for i, item in enumerate(items):
        for pred in item.preds:
            if pred in index and items[index[pred]].stage == item.stage:
                users.setdefault(index[pred], []).append(i)
    for i in reversed(range(len(items))):
        if keys[i] == _GLUE:
            mine = sorted(users.get(i, ()))
            # a consumer with a module of its own first (a fused kernel's getitem that
            # stands for a LayerNorm), then one that inherited a key
            keys[i] = next((own[u] for u in mine if own[u] != _GLUE),
                           next((keys[u] for u in mine if keys[u] != _GLUE), _GLUE))
    first = next((k for k in keys if k != _GLUE), "model")
    for i, item in enumerate(items):
        if keys[i] == _GLUE:
            before = [keys[j] for j in range(i) if items[j].stage == item.stage]
            keys[i] = before[-1] if before else first
    return keys


def _group_order(items: list[_Item], keys: list[str]) -> list[str]:
    """Groups ("stage/key") by stage, then by their first op that computes (a view such
    as the loss' reshape of the hidden states does not put the loss before the head)."""
    first: dict[str, tuple[int, int, int]] = {}
    for i, (item, key) in enumerate(zip(items, keys)):
        name = f"{item.stage}/{key}"
        view = op_name(item.node) in VIEW_OPS or op_name(item.node) == "getitem"
        rank = (item.stage, 1 if view else 0, i)
        if name not in first or rank < first[name]:
            first[name] = rank
    return sorted(first, key=lambda n: first[n])


def _make_group(gid: str, key: str, items: list[_Item], walker: _Walker,
                dims: dict[str, int], tp: int, level: str) -> Group:
    collectives: Counter = Counter()
    fused = 0
    ops = 0
    params: dict[str, list[fx.Node]] = {}
    for item in items:
        name = op_name(item.node)
        if name.startswith("autohybrid."):
            short = name.split(".")[1]
            if short in COMPUTE_ONLY:
                fused += 1
            elif not short.endswith("_start"):     # an issued collective: count its wait
                collectives[short.removesuffix("_wait")] += 1
        if name != "getitem" and not name.startswith("aten.sym_size"):
            ops += 1
        for arg in item.node.all_input_nodes:
            real = walker.resolve(arg)
            if real in walker.params:
                params.setdefault(walker.params[real], []).append(item.node)
    module_type = op_name(items[0].node) if level == "node" else \
        _module_type((it.node for it in items), key)
    return Group(gid, key, module_type, items[0].stage, ops,
                 _sharding(key, params, dims, walker.param_ndim, tp),
                 tuple(sorted(collectives.items())), fused,
                 any(it.recomputed for it in items), tuple(params))


def _edges(items: list[_Item], keys: list[str], ids: dict[str, str]) -> list[Edge]:
    where = {item.node: ids[f"{item.stage}/{key}"] for item, key in zip(items, keys)}
    stage = {item.node: item.stage for item in items}
    count: Counter = Counter()
    crosses: dict[tuple[str, str], bool] = {}
    for item in items:
        dst = where[item.node]
        for pred in item.preds:
            src = where.get(pred)
            if src is None or src == dst:
                continue
            count[(src, dst)] += 1
            crosses[(src, dst)] = crosses.get((src, dst), False) or stage[pred] != item.stage
    position = {gid: i for i, gid in enumerate(ids.values())}
    return [Edge(s, d, n, crosses[(s, d)]) for (s, d), n in count.items()
            if position[s] < position[d]]


# ---------------------------------------------------------------------- folding
def _signature(group: Group) -> tuple:
    """What neighbouring blocks must share to fold: their name with its numbers dropped,
    module type, stage, sharding, recomputation and the kinds of collectives in them (not
    op counts: fused kernels across block boundaries make the first and last block of a
    stage differ by a few ops)."""
    return (re.sub(r"\d+", "#", group.name), group.module_type, group.stage, group.sharding,
            tuple(name for name, _ in group.collectives), group.recomputed)


def fold_repeats(view: GraphView) -> GraphView:
    """Runs of neighbouring groups with the same `_signature` become one group with
    `repeat` n whose ops, fused kernels and collectives are the run's totals."""
    runs: list[list[Group]] = []
    for g in view.groups:
        if runs and _signature(runs[-1][-1]) == _signature(g):
            runs[-1].append(g)
        else:
            runs.append([g])
    new_id: dict[str, str] = {}
    groups: list[Group] = []
    for i, run in enumerate(runs):
        gid = f"g{i}"
        for g in run:
            new_id[g.id] = gid
        head = run[0]
        name = head.name if len(run) == 1 else f"{head.name}–{run[-1].name.rsplit('.', 1)[-1]}"
        collectives: Counter = Counter()
        for g in run:
            collectives.update(dict(g.collectives))
        groups.append(replace(head, id=gid, name=name, repeat=sum(g.repeat for g in run),
                              ops=sum(g.ops for g in run),
                              fused_kernels=sum(g.fused_kernels for g in run),
                              collectives=tuple(sorted(collectives.items())),
                              params=tuple(p for g in run for p in g.params)))
    merged: dict[tuple[str, str], Edge] = {}
    for e in view.edges:
        s, d = new_id[e.src], new_id[e.dst]
        if s == d:
            continue
        old = merged.get((s, d))
        merged[(s, d)] = Edge(s, d, e.values + (old.values if old else 0),
                              e.crosses_stage or bool(old and old.crosses_stage))
    return GraphView(view.title, groups, list(merged.values()), view.num_stages,
                     view.stage_ranks, view.tp, True, list(view.notes))


# ---------------------------------------------------------------------- DOT
def _q(text: str) -> str:
    """A DOT double-quoted string (backslashes, quotes and newlines escaped)."""
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def group_lines(g: Group) -> list[str]:
    """The text lines a drawn group shows (shared by DOT and SVG)."""
    head = g.name + (f"  ({g.repeat} blocks)" if g.repeat > 1 else "")
    lines = [head]
    detail = [f"{g.ops} ops"] + ([g.module_type] if g.module_type else [])
    if g.recomputed:
        detail.append("recomputed")
    lines.append(", ".join(detail))
    if g.sharding:
        lines.append("tp " + g.sharding)
    line = ""
    for mark in (f"{name}×{n}" for name, n in g.collectives):
        if line and len(line) + 2 + len(mark) > 36:   # lines short enough for a drawn box
            lines.append(line)
            line = mark
        else:
            line = f"{line}  {mark}" if line else mark
    if line:
        lines.append(line)
    if g.fused_kernels:
        lines.append(f"{g.fused_kernels} fused kernel{'s' if g.fused_kernels > 1 else ''}")
    return lines


def to_dot(source: Any, *, plan: Any = None, name: str = "rank_program",
           full: bool = False) -> str:
    """Graphviz DOT text of a GraphView, or of the coarse (full=True: per-node) view of
    a RankProgram / GraphModule: one `cluster_stage<k>` subgraph per pipeline stage,
    filled with the stage's color; edges that cross stages dashed and labelled."""
    view = source if isinstance(source, GraphView) else (
        node_view(source, plan=plan) if full else coarse_view(source, plan=plan))
    lines = [f"digraph {_q(name)} {{",
             "  graph [rankdir=TB, fontname=Helvetica, compound=true, "
             f"label={_q(view.title)}, labelloc=t];",
             "  node [shape=box, style=\"rounded,filled\", fontname=Helvetica, fontsize=10];",
             "  edge [color=\"#6b7280\", arrowsize=0.6];"]
    for stage in view.stages():
        fill, stroke = stage_color(stage)
        pp = view.stage_ranks[stage] if stage < len(view.stage_ranks) else stage
        lines.append(f"  subgraph {_q(f'cluster_stage{stage}')} {{")
        lines.append(f"    label={_q(f'stage {stage} (pp rank {pp})')}; style=filled; "
                     f"fillcolor={_q(fill)}; color={_q(stroke)};")
        for g in view.groups:
            if g.stage == stage:
                border = 3 if g.collectives else 1
                lines.append(f"    {_q(g.id)} [label={_q(chr(10).join(group_lines(g)))}, "
                             f"fillcolor=\"white\", color={_q(stroke)}, penwidth={border}];")
        lines.append("  }")
    for e in view.edges:
        attrs = [f"label={_q('send')}", "style=dashed", "color=\"#111827\""] \
            if e.crosses_stage else []
        if e.values > 1:
            attrs.append(f"penwidth={min(3.0, 1 + 0.25 * (e.values - 1)):.2f}")
        lines.append(f"  {_q(e.src)} -> {_q(e.dst)}" + (f" [{', '.join(attrs)}]" if attrs else "")
                     + ";")
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_dot(path: str | Path, source: Any, **kwargs: Any) -> Path:
    """Write `to_dot(source, **kwargs)` to `path` (render with `dot -Tsvg` if you have
    graphviz); returns the path."""
    path = Path(path)
    path.write_text(to_dot(source, **kwargs))
    return path
