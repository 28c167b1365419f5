"""A mixture-of-experts layer's experts as one op: dispatch, expert MLPs, combine.

`moe_experts(x, top_k_index, top_k_weights, gate_up, down, num_experts, act, axis,
chunks=1, tp_axis="")` is what Hugging Face's `*Experts` modules compute (their 3-D weight
layout, with `gate_up[e]` of shape (2I, H), gate rows first, and `down[e]` of (H, I)):

    out[t] = Σ_j  top_k_weights[t, j] · down[e] · (act(gate[e]·x[t]) ⊙ up[e]·x[t]),
             e = top_k_index[t, j]

dropless (every routed token reaches its expert), for tokens `x` (T, H) and routes
(T, k); an index equal to `num_experts` (Hugging Face's "no expert" sentinel) adds
nothing. The zoo's MoE model calls it; capture routes Hugging Face experts to it
(`hf_experts_forward`) and folds hand-written expert loops into it (capture_moe_loop.py),
so a captured graph holds one `autohybrid::moe_experts` node per MoE layer — the block
expert parallelism rewrites.

Expert parallelism (`axis` names a mesh axis of ep ranks; "" = none): rank r of the axis
holds experts [r·E/ep, (r+1)·E/ep) (`gate_up` and `down` are its slices) and the tokens of
its own data shard. Rows sorted by expert are sent to the experts' ranks with one
all-to-all (variable counts, after an all-to-all of the per-expert counts), computed
there expert by expert, and sent back with a second; the source rank weights and sums
them. Backward runs the same two all-to-alls on the gradients in reverse. The expert
weights' gradients are then sums over the tokens of every rank of the axis: reducing
them over the ranks holding the same experts is the reducer's job, not this op's.

`chunks` > 1 (under an axis): the tokens go in that many chunks of rows, and chunk i+1's
dispatch (an asynchronous all-to-all) travels while chunk i's experts compute, chunk i's
combine while chunk i+1's compute — forward and, for the gradients, backward. Every rank
of the axis runs the same number of chunks (some may be empty); the counts of every chunk
travel in one all-to-all first.

Expert tensor parallelism (`tp_axis` names a mesh axis; "" = none; with `axis` or
without): every rank of it has the same tokens and routes and holds the same slice j of
every (local) expert's intermediate size — rows [j·I/tp, (j+1)·I/tp) of the gate and of
the up projection (`gate_up` is (E, 2I/tp, H), its gate rows first) and those columns of
`down` (E, H, I/tp). Each rank computes its slice's share of every expert output, and
one all-reduce over the axis sums the combined tokens (Megatron's row-parallel second
linear). Backward: the output's
gradient is the same on every rank; the slices' weight gradients are this rank's own, and
the gradients of `x` and of the router weights (sums over the slices) are all-reduced.

Backward reuses what forward computed (the received rows, the gate/up projections, the
expert outputs) when forward ran eagerly with autograd recording: the op's forward
leaves them for the `setup_context` that autograd calls right after it, tied to the
output's identity, which saves them as saved tensors (activation checkpointing frees and
recomputes them like any other). Where it did not (a traced forward), backward computes
them again.

Example::

    out = moe_experts(x, idx, w, gate_up, down, 8, "silu", "")     # (T, H)
    out = moe_experts(x, idx, w, gate_up[:2], down[:2], 8, "silu", "ep", 4)  # ep=4, 4 chunks
    out = moe_experts(x, idx, w, gate_up_slice, down_slice, 8, "silu", "", 1, "tp")  # tp
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import RuntimeFailure
from . import groups
from .partition import balanced_bounds

#: activations of the gate projection, as Hugging Face names them (ACT2FN)
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")


def tensor_parallel_experts(tp: int, sp: bool, inter_sizes) -> bool:
    """Whether tensor parallelism splits the MoE layers' experts (`tp_axis`): tp > 1
    without sequence parallelism (whose tp ranks hold different tokens: the experts stay
    whole there, each rank computing its own tokens), and tp dividing every layer's
    intermediate size (`inter_sizes`); under ep it splits each ep rank's experts. The
    expert_parallel pass and the planner's pricing both ask this."""
    return tp > 1 and not sp and all(int(i) % tp == 0 for i in inter_sizes)


def _act(g: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        return torch.nn.functional.silu(g)
    if act == "gelu":
        return torch.nn.functional.gelu(g)
    if act == "gelu_tanh":
        return torch.nn.functional.gelu(g, approximate="tanh")
    return torch.relu(g)


def _act_backward(grad: torch.Tensor, g: torch.Tensor, act: str) -> torch.Tensor:
    aten = torch.ops.aten
    if act == "silu":
        return aten.silu_backward(grad, g)
    if act in ("gelu", "gelu_tanh"):
        return aten.gelu_backward(grad, g, approximate="none" if act == "gelu" else "tanh")
    return aten.threshold_backward(grad, torch.relu(g), 0)


# ------------------------------------------------------------------ the routing, as data

@dataclass
class Routing:
    """Where each routed row of one chunk of tokens goes, and what forward left for
    backward."""

    order: torch.Tensor        # (n,) flat (t·k + j) slots of the chunk's valid routes, by expert
    tokens: torch.Tensor       # (n,) their token rows (order // k)
    send: list[int]            # rows sent to each rank of the axis (one entry: no axis)
    recv: list[int]            # rows received from each rank
    local: torch.Tensor        # (m,) received rows in local-expert order (a permutation)
    counts: list[int]          # rows per local expert, in that order
    xe: torch.Tensor | None = None   # (m, H) received rows, local-expert order
    h: torch.Tensor | None = None    # (m, 2I) their gate/up projections
    ys: torch.Tensor | None = None   # (n, H) expert outputs back at the source, by `order`


def chunk_bounds(tokens: int, chunks: int) -> list[tuple[int, int]]:
    """[start, stop) token rows of each of `chunks` chunks, as equal as they can be; some
    empty when there are fewer tokens than chunks (every rank of the axis runs the same
    number of chunks, each an all-to-all, whatever its share of the batch)."""
    return balanced_bounds(tokens, chunks)


def _route(top_k_index: torch.Tensor, num_experts: int, local_experts: int,
           group: dist.ProcessGroup | None, chunks: int) -> list[Routing]:
    """The routing of each chunk of tokens; over an axis, one all-to-all of every chunk's
    per-expert counts tells each rank what it receives."""
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) > num_experts):
        raise RuntimeFailure(
            f"autohybrid::moe_experts: expert indices must lie in [0, {num_experts}] "
            f"({num_experts} = no expert); got values in [{int(flat.min())}, "
            f"{int(flat.max())}]")
    parts = []
    for start, stop in chunk_bounds(top_k_index.shape[0], chunks):
        keys = top_k_index[start:stop].reshape(-1)
        per_expert = torch.bincount(keys, minlength=num_experts + 1)[:num_experts]
        n = int(per_expert.sum())
        order = torch.argsort(keys, stable=True)[:n]   # the sentinel sorts last: dropped
        tokens = start + torch.div(order, k, rounding_mode="floor")
        parts.append((order + start * k, tokens, per_expert))
    if group is None:
        return [Routing(order, tokens, [len(order)], [len(order)],
                        torch.arange(len(order), device=flat.device), per_expert.tolist())
                for order, tokens, per_expert in parts]
    ep = dist.get_world_size(group)
    # [chunk, rank, local expert] → every rank's block of all chunks together
    mine = torch.stack([p[2] for p in parts]).view(len(parts), ep, local_experts)
    theirs = torch.empty_like(mine.transpose(0, 1).contiguous())
    dist.all_to_all_single(theirs, mine.transpose(0, 1).contiguous(), group=group)
    out = []
    for c, (order, tokens, per_expert) in enumerate(parts):
        matrix = theirs[:, c]                              # [source rank, local expert]
        expert_of_row = torch.repeat_interleave(
            torch.arange(local_experts, device=flat.device).repeat(ep), matrix.reshape(-1))
        out.append(Routing(order, tokens, per_expert.view(ep, local_experts).sum(1).tolist(),
                           matrix.sum(1).tolist(), torch.argsort(expert_of_row, stable=True),
                           matrix.sum(0).tolist()))
    return out


def _start(rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
           group: dist.ProcessGroup | None) -> tuple[torch.Tensor, object | None]:
    """Issue the all-to-all of `rows` (asynchronous): (its result buffer, its work)."""
    if group is None:
        return rows, None
    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    work = dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=out_splits,
                                  input_split_sizes=in_splits, group=group, async_op=True)
    return out, work


def _finish(issued: tuple[torch.Tensor, object | None]) -> torch.Tensor:
    out, work = issued
    if work is not None:
        work.wait()
    return out


def _unpermute(rows: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """`out[perm] = rows`: rows in `perm` order back to their original positions."""
    out = torch.empty_like(rows)
    out[perm] = rows
    return out


def _experts(xe: torch.Tensor, counts: list[int], gate_up: torch.Tensor,
             down: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert outputs, gate/up projections) of rows grouped by local expert."""
    inter = down.shape[-1]
    h = xe.new_empty((xe.shape[0], 2 * inter))
    ys = xe.new_empty((xe.shape[0], down.shape[1]))
    start = 0
    for e, c in enumerate(counts):
        if c:
            seg = slice(start, start + c)
            h[seg] = xe[seg] @ gate_up[e].t()
            gate, up = h[seg].split(inter, dim=-1)
            ys[seg] = (_act(gate, act) * up) @ down[e].t()
        start += c
    return ys, h


def _forward(x, top_k_index, top_k_weights, gate_up, down, num_experts, act, axis, chunks):
    """Chunk by chunk: chunk i+1's rows travel to their experts while chunk i's are
    computed, and chunk i's results travel back while chunk i+1's are."""
    group = groups.peers(axis)
    routings = _route(top_k_index, num_experts, gate_up.shape[0], group,
                      chunks if group is not None else 1)
    issued = _start(x[routings[0].tokens], routings[0].recv, routings[0].send, group)
    back = []
    for i, r in enumerate(routings):
        received = _finish(issued)
        if i + 1 < len(routings):
            nxt = routings[i + 1]
            issued = _start(x[nxt.tokens], nxt.recv, nxt.send, group)
        r.xe = received[r.local]
        ye, r.h = _experts(r.xe, r.counts, gate_up, down, act)
        back.append(_start(_unpermute(ye, r.local), r.send, r.recv, group))
    weights = top_k_weights.reshape(-1)
    out = torch.zeros(x.shape, dtype=torch.promote_types(x.dtype, top_k_weights.dtype),
                      device=x.device)
    for r, issued in zip(routings, back):
        r.ys = _finish(issued)
        out.index_add_(0, r.tokens, r.ys * weights[r.order].unsqueeze(-1))
    return out.to(x.dtype), routings


def _check(x, top_k_index, top_k_weights, gate_up, down, num_experts, act, axis,
           chunks, tp_axis="") -> None:
    if chunks < 1:
        raise RuntimeFailure(f"autohybrid::moe_experts: chunks must be ≥ 1, got {chunks}")
    if act not in ACTIVATIONS:
        raise RuntimeFailure(f"autohybrid::moe_experts: activation {act!r} is not one of "
                             f"{ACTIVATIONS}")
    ep = 1 if not axis else groups.size(axis)
    if gate_up.shape[0] * ep != num_experts or down.shape[0] != gate_up.shape[0]:
        raise RuntimeFailure(
            f"autohybrid::moe_experts: {num_experts} experts over {ep} rank(s) of axis "
            f"{axis or '(none)'!r} need {num_experts // max(ep, 1)} local experts; got "
            f"gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}")
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] != 2 * down.shape[2]:
        raise RuntimeFailure(
            f"autohybrid::moe_experts: gate_up (E, 2I, H) and down (E, H, I) must share "
            f"the intermediate size I (this rank's slice of it under axis "
            f"{tp_axis or '(none)'!r}); got gate_up {tuple(gate_up.shape)}, down "
            f"{tuple(down.shape)}")
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != x.shape[0]:
        raise RuntimeFailure(
            f"autohybrid::moe_experts: routes {tuple(top_k_index.shape)} and weights "
            f"{tuple(top_k_weights.shape)} must both be (tokens, k) for x {tuple(x.shape)}")


# what the eager forward leaves for its setup_context: (weakref to the output, Routing)
_LEFT = threading.local()


@torch.library.custom_op("autohybrid::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, num_experts: int, act: str,
                axis: str, chunks: int = 1, tp_axis: str = "") -> torch.Tensor:
    """The routed experts' weighted sum per token (module docstring)."""
    _check(x, top_k_index, top_k_weights, gate_up, down, num_experts, act, axis, chunks,
           tp_axis)
    out, routings = _forward(x, top_k_index, top_k_weights, gate_up, down, num_experts, act,
                             axis, chunks)
    if tp_axis:   # each rank's share of the intermediate size: the sum over the slices
        groups.all_reduce(out, tp_axis)
    _LEFT.value = None
    # (torch runs a custom op's forward with grad mode off, recording or not: whether
    # setup_context follows shows only there; when it does not, the rows go with `out`)
    if any(t.requires_grad for t in (x, top_k_weights, gate_up, down)):
        _LEFT.value = (weakref.ref(out, _forget), routings)
    return out


def _forget(ref: weakref.ref) -> None:
    """The output a stash was left for is gone (no setup_context took it: a forward
    without autograd recording): drop the stash, unless a later call's replaced it."""
    left = getattr(_LEFT, "value", None)
    if left is not None and left[0] is ref:
        _LEFT.value = None


@moe_experts.register_fake
def _(x, top_k_index, top_k_weights, gate_up, down, num_experts, act, axis, chunks=1,
      tp_axis=""):
    return x.new_empty(x.shape)


#: the tensors of a Routing saved for backward, in this order
_SAVED = ("order", "tokens", "local", "xe", "h", "ys")


def _setup(ctx, inputs, output) -> None:
    """Save the inputs and, from an eager forward, its routing's tensors — through
    `save_for_backward`, so activation checkpointing frees them with the rest and its
    recomputation (which runs this op again) restores them; the routing's counts stay on
    ctx."""
    x, top_k_index, top_k_weights, gate_up, down, num_experts, act, axis, chunks, tp_axis = \
        inputs
    left, _LEFT.value = getattr(_LEFT, "value", None), None
    routings = left[1] if left is not None and left[0]() is output else None
    ctx.counts = [(r.send, r.recv, r.counts) for r in routings] if routings else None
    ctx.args = (num_experts, act, axis, chunks, tp_axis)
    rows = [getattr(r, name) for r in routings or () for name in _SAVED]
    ctx.save_for_backward(x, top_k_index, top_k_weights, gate_up, down, *rows)


def _saved_routings(ctx, rows: tuple) -> list[Routing] | None:
    if ctx.counts is None:
        return None
    n = len(_SAVED)
    out = []
    for i, (send, recv, counts) in enumerate(ctx.counts):
        t = dict(zip(_SAVED, rows[i * n:(i + 1) * n]))
        out.append(Routing(t["order"], t["tokens"], send, recv, t["local"], counts,
                           t["xe"], t["h"], t["ys"]))
    return out


def _backward(ctx, grad):
    x, top_k_index, top_k_weights, gate_up, down, *rows = ctx.saved_tensors
    num_experts, act, axis, chunks, tp_axis = ctx.args
    routings = _saved_routings(ctx, tuple(rows))
    if routings is None:
        with torch.no_grad():
            _, routings = _forward(x, top_k_index, top_k_weights, gate_up, down, num_experts,
                                   act, axis, chunks)
    gx, gw, ggu, gd = experts_backward(grad, x, top_k_weights, gate_up, down, act, axis,
                                       routings)
    if tp_axis:   # sums over the intermediate slices of every rank of the axis
        groups.all_reduce(gx, tp_axis)
        groups.all_reduce(gw, tp_axis)
    return gx, None, gw, ggu, gd, None, None, None, None, None


def experts_backward(grad: torch.Tensor, x: torch.Tensor, top_k_weights: torch.Tensor,
                     gate_up: torch.Tensor, down: torch.Tensor, act: str, axis: str,
                     routings: list[Routing]) -> tuple[torch.Tensor, ...]:
    """(grad x, grad weights, grad gate_up, grad down) of `moe_experts` given the routing
    and saved rows of each chunk, pipelined as forward is: chunk i+1's output gradients
    travel to the experts while chunk i's expert backward runs."""
    group = groups.peers(axis)
    weights = top_k_weights.reshape(-1)
    gw = torch.zeros(top_k_weights.numel(), dtype=top_k_weights.dtype, device=x.device)

    def rows(r: Routing) -> tuple[torch.Tensor, object | None]:
        gs = grad[r.tokens]
        gw[r.order] = (gs * r.ys).sum(-1).to(gw.dtype)
        return _start((gs * weights[r.order].unsqueeze(-1)).to(x.dtype), r.recv, r.send, group)

    inter = down.shape[-1]
    ggu, gd = torch.zeros_like(gate_up), torch.zeros_like(down)
    issued, back = rows(routings[0]), []
    for i, r in enumerate(routings):
        ge = _finish(issued)[r.local]
        if i + 1 < len(routings):
            issued = rows(routings[i + 1])
        gxe = torch.empty_like(r.xe)
        start = 0
        for e, c in enumerate(r.counts):
            if c:
                seg = slice(start, start + c)
                gate, up = r.h[seg].split(inter, dim=-1)
                a = _act(gate, act)
                gd[e] += ge[seg].t() @ (a * up)
                ga = ge[seg] @ down[e]
                gh = torch.cat([_act_backward(ga * up, gate, act), ga * a], dim=-1)
                ggu[e] += gh.t() @ r.xe[seg]
                gxe[seg] = gh @ gate_up[e]
            start += c
        back.append(_start(_unpermute(gxe, r.local), r.send, r.recv, group))
    gx = torch.zeros_like(x)
    for r, issued in zip(routings, back):
        gx.index_add_(0, r.tokens, _finish(issued).to(x.dtype))
    return gx, gw.view_as(top_k_weights), ggu, gd


moe_experts.register_autograd(_backward, setup_context=_setup)
