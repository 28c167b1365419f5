"""A mixture-of-experts layer's experts as one op: dispatch, expert MLPs, combine.

`moe_experts(x, top_k_index, top_k_weights, gate_up, down, num_experts, act, axis)` is
what Hugging Face's `*Experts` modules compute (their 3-D weight layout, with
`gate_up[e]` of shape (2I, H), gate rows first, and `down[e]` of (H, I)):

    out[t] = Σ_j  top_k_weights[t, j] · down[e] · (act(gate[e]·x[t]) ⊙ up[e]·x[t]),
             e = top_k_index[t, j]

dropless (every routed token reaches its expert), for tokens `x` (T, H) and routes
(T, k); an index equal to `num_experts` (Hugging Face's "no expert" sentinel) adds
nothing. The zoo's MoE model calls it; capture routes Hugging Face experts to it
(`hf_experts_forward`), so a captured graph holds one `autohybrid::moe_experts` node per
MoE layer — the block expert parallelism rewrites.

Expert parallelism (`axis` names a mesh axis of ep ranks; "" = none): rank r of the axis
holds experts [r·E/ep, (r+1)·E/ep) (`gate_up` and `down` are its slices) and the tokens of
its own data shard. Rows sorted by expert are sent to the experts' ranks with one
all-to-all (variable counts, after an all-to-all of the per-expert counts), computed
there expert by expert, and sent back with a second; the source rank weights and sums
them. Backward runs the same two all-to-alls on the gradients in reverse. The expert
weights' gradients are then sums over the tokens of every rank of the axis: reducing
them over the ranks holding the same experts is the reducer's job, not this op's.

Backward reuses what forward computed (the received rows, the gate/up projections, the
expert outputs) when forward ran eagerly with autograd recording: the op's forward
leaves them for the `setup_context` that autograd calls right after it, tied to the
output's identity. Where it did not (a traced forward), backward computes them again.

Example::

    out = moe_experts(x, idx, w, gate_up, down, 8, "silu", "")     # (T, H)
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import RuntimeFailure
from . import groups

#: activations of the gate projection, as Hugging Face names them (ACT2FN)
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")


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


def _group(axis: str) -> dist.ProcessGroup | None:
    if not axis:
        return None
    group = groups.get(axis)
    return group if group is not None and dist.get_world_size(group) > 1 else None


# ------------------------------------------------------------------ the routing, as data

@dataclass
class Routing:
    """Where each routed row goes, and what forward left for backward."""

    order: torch.Tensor        # (n,) flat (t·k + j) slots of the valid routes, by expert
    tokens: torch.Tensor       # (n,) their token rows (order // k)
    send: list[int]            # rows sent to each rank of the axis (one entry: no axis)
    recv: list[int]            # rows received from each rank
    local: torch.Tensor        # (m,) received rows in local-expert order (a permutation)
    counts: list[int]          # rows per local expert, in that order
    xe: torch.Tensor | None = None   # (m, H) received rows, local-expert order
    h: torch.Tensor | None = None    # (m, 2I) their gate/up projections
    ys: torch.Tensor | None = None   # (n, H) expert outputs back at the source, by `order`


def _route(top_k_index: torch.Tensor, num_experts: int, local_experts: int,
           group: dist.ProcessGroup | None) -> Routing:
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) > num_experts):
        raise RuntimeFailure(
            f"autohybrid::moe_experts: expert indices must lie in [0, {num_experts}] "
            f"({num_experts} = no expert); got values in [{int(flat.min())}, "
            f"{int(flat.max())}]")
    order = torch.argsort(flat, stable=True)
    per_expert = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    n = int(per_expert.sum())
    order = order[:n]                     # the sentinel sorts last: drop its slots
    tokens = torch.div(order, k, rounding_mode="floor")
    if group is None:
        counts = per_expert.tolist()
        ident = torch.arange(n, device=flat.device)
        return Routing(order, tokens, [n], [n], ident, counts)
    ep = dist.get_world_size(group)
    matrix = torch.empty_like(per_expert)
    dist.all_to_all_single(matrix, per_expert.contiguous(), group=group)
    matrix = matrix.view(ep, local_experts)         # [source rank, local expert]
    send = per_expert.view(ep, local_experts).sum(1).tolist()
    recv = matrix.sum(1).tolist()
    expert_of_row = torch.repeat_interleave(
        torch.arange(local_experts, device=flat.device).repeat(ep), matrix.reshape(-1))
    local = torch.argsort(expert_of_row, stable=True)
    return Routing(order, tokens, send, recv, local, matrix.sum(0).tolist())


def _exchange(rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
              group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is None:
        return rows
    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=out_splits,
                           input_split_sizes=in_splits, group=group)
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


def _forward(x, top_k_index, top_k_weights, gate_up, down, num_experts, act, axis):
    group = _group(axis)
    r = _route(top_k_index, num_experts, gate_up.shape[0], group)
    xs = x[r.tokens]
    xe = _exchange(xs, r.recv, r.send, group)[r.local]
    ye, h = _experts(xe, r.counts, gate_up, down, act)
    ys = _exchange(_unpermute(ye, r.local), r.send, r.recv, group)
    weights = top_k_weights.reshape(-1)[r.order]
    weighted = ys * weights.unsqueeze(-1)
    out = torch.zeros(x.shape, dtype=weighted.dtype, device=x.device)
    out.index_add_(0, r.tokens, weighted)
    r.xe, r.h, r.ys = xe, h, ys
    return out.to(x.dtype), r


def _check(x, top_k_index, top_k_weights, gate_up, down, num_experts, act, axis) -> None:
    if act not in ACTIVATIONS:
        raise RuntimeFailure(f"autohybrid::moe_experts: activation {act!r} is not one of "
                             f"{ACTIVATIONS}")
    ep = 1 if not axis else groups.size(axis)
    if gate_up.shape[0] * ep != num_experts or down.shape[0] != gate_up.shape[0]:
        raise RuntimeFailure(
            f"autohybrid::moe_experts: {num_experts} experts over {ep} rank(s) of axis "
            f"{axis or '(none)'!r} need {num_experts // max(ep, 1)} local experts; got "
            f"gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}")
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != x.shape[0]:
        raise RuntimeFailure(
            f"autohybrid::moe_experts: routes {tuple(top_k_index.shape)} and weights "
            f"{tuple(top_k_weights.shape)} must both be (tokens, k) for x {tuple(x.shape)}")


# what the eager forward leaves for its setup_context: (weakref to the output, Routing)
_LEFT = threading.local()


@torch.library.custom_op("autohybrid::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, num_experts: int, act: str,
                axis: str) -> torch.Tensor:
    """The routed experts' weighted sum per token (module docstring)."""
    _check(x, top_k_index, top_k_weights, gate_up, down, num_experts, act, axis)
    out, routing = _forward(x, top_k_index, top_k_weights, gate_up, down, num_experts, act,
                            axis)
    _LEFT.value = None
    if torch.is_grad_enabled() and any(t.requires_grad for t in
                                       (x, top_k_weights, gate_up, down)):
        _LEFT.value = (weakref.ref(out), routing)
    return out


@moe_experts.register_fake
def _(x, top_k_index, top_k_weights, gate_up, down, num_experts, act, axis):
    return x.new_empty(x.shape)


def _setup(ctx, inputs, output) -> None:
    x, top_k_index, top_k_weights, gate_up, down, num_experts, act, axis = inputs
    left, _LEFT.value = getattr(_LEFT, "value", None), None
    ctx.routing = left[1] if left is not None and left[0]() is output else None
    ctx.args = (num_experts, act, axis)
    ctx.save_for_backward(x, top_k_index, top_k_weights, gate_up, down)


def _backward(ctx, grad):
    x, top_k_index, top_k_weights, gate_up, down = ctx.saved_tensors
    num_experts, act, axis = ctx.args
    r, ctx.routing = ctx.routing, None
    if r is None:
        with torch.no_grad():
            _, r = _forward(x, top_k_index, top_k_weights, gate_up, down, num_experts, act,
                            axis)
    gx, gw, ggu, gd = experts_backward(grad, x, top_k_weights, gate_up, down, act, axis, r)
    return gx, None, gw, ggu, gd, None, None, None


def experts_backward(grad: torch.Tensor, x: torch.Tensor, top_k_weights: torch.Tensor,
                     gate_up: torch.Tensor, down: torch.Tensor, act: str, axis: str,
                     r: Routing) -> tuple[torch.Tensor, ...]:
    """(grad x, grad weights, grad gate_up, grad down) of `moe_experts` given its routing
    and saved rows `r`."""
    group = _group(axis)
    gs = grad[r.tokens]
    weights = top_k_weights.reshape(-1)[r.order]
    gw = torch.zeros(top_k_weights.numel(), dtype=top_k_weights.dtype, device=x.device)
    gw[r.order] = (gs * r.ys).sum(-1).to(gw.dtype)
    gy = (gs * weights.unsqueeze(-1)).to(x.dtype)
    ge = _exchange(gy, r.recv, r.send, group)[r.local]
    inter = down.shape[-1]
    ggu, gd = torch.zeros_like(gate_up), torch.zeros_like(down)
    gxe = torch.empty_like(r.xe)
    start = 0
    for e, c in enumerate(r.counts):
        if c:
            seg = slice(start, start + c)
            gate, up = r.h[seg].split(inter, dim=-1)
            a = _act(gate, act)
            gd[e] = ge[seg].t() @ (a * up)
            ga = ge[seg] @ down[e]
            gh = torch.cat([_act_backward(ga * up, gate, act), ga * a], dim=-1)
            ggu[e] = gh.t() @ r.xe[seg]
            gxe[seg] = gh @ gate_up[e]
        start += c
    gxs = _exchange(_unpermute(gxe, r.local), r.send, r.recv, group)
    gx = torch.zeros_like(x).index_add_(0, r.tokens, gxs.to(x.dtype))
    return gx, gw.view_as(top_k_weights), ggu, gd


moe_experts.register_autograd(_backward, setup_context=_setup)
