"""The per-stage numerics self-check (`check="stage"`): the first step, stage by stage.

For models too big for one rank. compiled.py calls it; runtime/selfcheck.py decides when
it runs. No rank holds the whole model: stage s's reference runs on one rank of the pp
coordinate that runs s (its dp=0, tp=0 rank, `StageCheck.ref`), which holds the unsharded
parameters of that stage's graph only — gathered over tp and ZeRO shards by the ranks of
that coordinate, never over pp — and the compiled gradients of those same parameters.

What the reference runs: the captured, unsharded training graph (model + loss, ATen
training IR, before any pass), interpreted node by node with real tensors on the same
global batch and from the same RNG state as the compiled step. Its nodes are assigned to
stages by `pipeline_split.assign_stages` from the plan's boundaries; everything else is
this module's own: which values cross stages (any value made in stage a and read in
stage b goes straight from a's reference rank to b's, not forwarded), the batch-only
nodes each stage recomputes, the gradients sent back, and the sum of a tied parameter's
partial gradients over the stages that read it. The last stage's reference compares
the loss; each parameter's gradient is compared on the reference rank of the first stage
that reads it. The verdict — the first differing parameter in `named_parameters` order,
or the loss — reaches every rank, and every rank raises `NumericsError` before clipping
and before the optimizer steps.

What it catches: anything the passes or the runtime change in the numbers — tensor and
sequence parallelism (shards, collectives and their backward contracts, the
vocabulary-parallel loss), ZeRO, recomputation, fusion kernels, overlap, `global_loss`,
the pipeline's stage graphs (what `pipeline_split.build_split` sends, forwards,
recomputes and feeds each stage), its schedule, microbatching, loss scaling and the sum
of tied weights' gradients over stages.
What it cannot catch, unlike `check="whole"` (the user's eager modules): a capture that
differs from the user's eager model (the reference is the captured graph), and a stage
assignment that is itself wrong — one that separates a write in place from its readers
(`assign_stages` is shared by both sides). The parameters' values are the compiled
model's, gathered from its shards, so a shard that loses values and gathers back the
same wrong values goes unseen here (the gradients it produces are still compared).

The batch: the same global batch as the compiled step, in one piece, not a smaller one:
a smaller batch would check another computation than the step about to be applied and
needs a second compiled step. A stage's activations for the whole batch are what its
reference costs beyond its parameters and their gradients; when they do not fit, call
the checked first `train_step` on a smaller global batch.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from ..errors import NumericsError
from ..passes.manager import copy_graph_module
from ..passes.pipeline_split import assign_stages, recomputed
from ..plan import Plan
from .materialize import retarget_device
from .compare import _RTOL, _DEFAULT_RTOL, _close, _differs, refuse_random
from .stage_exchange import recv_like, recv_value, send_tensor, send_value, wait_all


class StageRoutes:
    """Which nodes each stage's reference runs and which values cross between stages,
    from the captured graph and the plan's boundaries alone (the same on every rank)."""

    def __init__(self, gm: fx.GraphModule, boundaries: tuple[str, ...], num_stages: int):
        self.gm, self.stages = gm, num_stages
        self.nodes = list(gm.graph.nodes)
        self.stage_of = assign_stages(gm, boundaries, num_stages)
        self.recompute, groups = recomputed(gm)
        self.group_of = {m: members for members in groups for m in members}
        self.runs: dict[int, list[fx.Node]] = {}
        self.crossing: dict[tuple[int, int], list[fx.Node]] = {}
        for s in range(num_stages):
            self._route(s)

    def _route(self, s: int) -> None:
        own = [n for n in self.nodes if n.op == "call_function"
               and n not in self.recompute and self.stage_of[n] == s]
        if s == self.stages - 1:
            own.append(self.nodes[-1])  # the output: the loss and the graph's outputs
        local, stack, external = set(own), list(own), set()
        while stack:
            for a in stack.pop().all_input_nodes:
                if a in local:
                    continue
                if a.op in ("placeholder", "get_attr"):
                    local.add(a)
                elif a in self.recompute:   # recomputed here, a tensor built in place whole
                    for m in self.group_of.get(a, [a]):
                        if m not in local:
                            local.add(m)
                            stack.append(m)
                else:
                    external.add(a)
        self.runs[s] = [n for n in self.nodes if n in local]
        for a in (n for n in self.nodes if n in external):
            self.crossing.setdefault((self.stage_of[a], s), []).append(a)

    def params(self, s: int) -> list[fx.Node]:
        return [n for n in self.runs[s] if n.op == "placeholder"
                and n.meta.get("ah_role") == "param"]


class StageCheck:
    """One rank's part of the per-stage check (a reference only on the stages' ref ranks)."""

    per_stage = True

    def __init__(self, plan: Plan, rank: int, autocast: torch.dtype | None):
        self.plan, self.rank, self.autocast, self.done = plan, rank, autocast, False
        width = plan.mesh.dp * plan.mesh.tp
        self.ref = [coord * width for coord in plan.stage_ranks()]
        self.mine = [s for s, r in enumerate(self.ref) if r == rank]
        self.buffers: dict[str, torch.Tensor] = {}
        #: canonical name → bytes of each parameter this rank's reference held (tests)
        self.held: dict[str, int] = {}

    def refuse_unless_comparable(self, gm: fx.GraphModule, dp: int,
                                 num_microbatches: int) -> None:
        refuse_random(gm, dp, num_microbatches)

    def rng_state(self) -> torch.Tensor:
        return torch.random.get_rng_state()

    def before_step(self, state: dict[str, torch.Tensor], buffers: list[str]) -> None:
        """Keep the buffers as they are before the compiled step writes them (BatchNorm's
        running statistics), on reference ranks only."""
        if self.mine:
            self.buffers = {n: state[n].detach().clone() for n in buffers if n in state}

    def verify(self, loss: torch.Tensor, cap: Any, values: dict[str, torch.Tensor],
               grads: dict[str, torch.Tensor | None], order: list[str],
               batch: tuple[tuple, tuple], rng: torch.Tensor) -> None:
        """Compare this rank's stages with their references; raise on every rank when any
        stage differs. `values`/`grads`: this pp coordinate's parameters and compiled
        gradients, whole (gathered over tp and ZeRO); `order`: every parameter's canonical
        name in `named_parameters` order; `batch`: (inputs, targets), global."""
        self.done = True
        want: dict[str, torch.Tensor | None] = {}
        ref_loss = None
        if self.mine:
            gm = copy_graph_module(cap.gm)   # a meta model's factory ops: this device
            retarget_device(gm, batch[0][0].device)
            run = _Reference(self, StageRoutes(gm, self.plan.stage_boundaries,
                                               self.plan.num_stages), cap, values, batch)
            state = torch.random.get_rng_state()
            torch.random.set_rng_state(rng)
            try:
                ref_loss, want = run.step()
            finally:
                torch.random.set_rng_state(state)
        peak = torch.tensor(max((g.abs().max().item() for g in want.values()
                                 if g is not None and g.numel()), default=0.0),
                            dtype=torch.float64, device=loss.device)
        if dist.is_initialized():
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        rtol = _RTOL.get(self.autocast, _DEFAULT_RTOL)
        found = self._compare(loss, ref_loss, grads, want, order, rtol, 1e-6 * peak.item())
        verdicts: list[Any] = [found]
        if dist.is_initialized() and dist.get_world_size() > 1:
            verdicts = [None] * dist.get_world_size()
            dist.all_gather_object(verdicts, found)
        problems = sorted(p for v in verdicts if v for p in v)
        self.buffers = {}
        if problems:
            raise NumericsError(problems[0][1])

    def _compare(self, loss: torch.Tensor, ref_loss: torch.Tensor | None,
                 grads: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor | None],
                 order: list[str], rtol: float, atol: float) -> list[tuple[int, str]]:
        """(position in `order`, message) of each difference this rank found; the loss
        after every parameter."""
        out = []
        if ref_loss is not None and not _close(loss.detach().to(ref_loss.dtype),
                                               ref_loss.detach(), rtol, atol):
            out.append((len(order), (
                f"check='stage': the compiled first step's loss {loss.item():.8g} differs "
                f"from the reference's {ref_loss.item():.8g} (the captured graph run stage "
                f"by stage, last stage on rank {self.rank}) on the same batch; nothing was "
                "stepped. Pin another plan (constraints=...) or report the model")))
        for name, g in want.items():
            problem = _differs(name, grads.get(name), g, rtol, atol)
            if problem:
                out.append((order.index(name), (
                    f"check='stage': the compiled first step's gradient of parameter "
                    f"{name!r} differs from the reference's (stage by stage, compared on "
                    f"rank {self.rank}): {problem}; nothing was stepped. The plan's "
                    "sharding of this parameter (or of what feeds it) does not compute "
                    "the captured graph's gradient: pin another layout "
                    "(e.g. constraints=ah.Constraints(tp=1)) and report the model")))
        return out


class _Reference:
    """The forward and backward of a rank's stages on the unsharded captured graph."""

    def __init__(self, check: StageCheck, routes: StageRoutes, cap: Any,
                 values: dict[str, torch.Tensor], batch: tuple[tuple, tuple]):
        self.check, self.routes, self.cap, self.values = check, routes, cap, values
        inputs, targets = batch
        self.device = inputs[0].device
        placeholders = [n for n in routes.nodes if n.op == "placeholder"]
        sources: list[Any] = [("param", cap.canonical[f]) for f in cap.param_fqns]
        sources += [("buffer", f) for f in cap.buffer_fqns]
        sources += [("value", t) for t in [*cap.constants.values(), *inputs, *targets]]
        self.source = dict(zip(placeholders, sources))
        self.env: dict[int, dict[fx.Node, Any]] = {}
        self.leaves: dict[tuple[int, str], torch.Tensor] = {}  # (stage, name): one per stage
        self.local: dict[tuple, list] = {}   # messages between two stages of this rank
        self.works: list[dist.Work] = []
        self.outbox: list[tuple] = []        # (kind, dst, src, seq, value, tensor) to send
        S = routes.stages
        self.tags = {"fwd": 1, "bwd": 1 + S * S, "param": 1 + 2 * S * S}

    def step(self) -> tuple[torch.Tensor | None, dict[str, torch.Tensor | None]]:
        mine, last = self.check.mine, self.routes.stages - 1
        loss = None
        with self.cap.autocast_context(list(self.values.values())):
            for i, s in enumerate(mine):
                out = self._forward(s)
                if s == last:
                    loss = out[self.cap.user_outputs[0]]
                ahead = mine[i + 1] if i + 1 < len(mine) else self.routes.stages
                self._flush("fwd", lambda dst: dst < ahead, descending=False)
        for i, s in enumerate(reversed(mine)):
            self._backward(s, loss if s == last else None)
            below = mine[-i - 2] if i + 2 <= len(mine) else -1
            self._flush("bwd", lambda dst: dst > below, descending=True)
        grads = self._param_grads()
        self._flush("param", lambda dst: True, descending=False)
        wait_all(self.works)
        return loss, grads

    # ------------------------------------------------------------------ messages
    def _tag(self, kind: str, src: int, dst: int) -> int:
        return self.tags[kind] + src * self.routes.stages + dst

    def _send(self, kind: str, src: int, dst: int, value: Any, tensor: bool = False) -> None:
        if self.check.ref[dst] == self.check.rank:
            self.local.setdefault((kind, src, dst), []).append(value)
        else:
            self.outbox.append((kind, dst, src, len(self.outbox), value, tensor))

    def _flush(self, kind: str, ready: Any, descending: bool) -> None:
        """Send the waiting messages of `kind` whose destination stage is `ready`, in the
        order the receivers take them: by destination stage (descending in the
        backward, as the receivers run their stages), then source stage, then graph
        order (a tied parameter's partial gradients: by name, then source stage). Tags
        tell gloo's messages apart; NCCL matches by order alone, and this order is the
        receivers' on every pair of ranks."""
        now = [m for m in self.outbox if m[0] == kind and ready(m[1])]
        self.outbox = [m for m in self.outbox if not (m[0] == kind and ready(m[1]))]
        if kind != "param":   # parameters: by name, then source stage (as appended)
            now.sort(key=lambda m: (-m[1] if descending else m[1], m[2], m[3]))
        for _, dst, src, _, value, tensor in now:
            rank, tag = self.check.ref[dst], self._tag(kind, src, dst)
            self.works += (send_tensor(value, rank, tag) if tensor
                           else send_value(value, rank, tag, self.device))

    def _recv(self, kind: str, src: int, dst: int, like: torch.Tensor | None = None) -> Any:
        rank = self.check.ref[src]
        if rank == self.check.rank:
            value = self.local[(kind, src, dst)].pop(0)
            if kind == "fwd" and isinstance(value, torch.Tensor):  # a leaf of this stage
                return value.detach().requires_grad_(value.requires_grad)
            return value
        if like is not None:
            return recv_like(like, rank, self._tag(kind, src, dst))
        return recv_value(rank, self._tag(kind, src, dst), self.device)

    # ------------------------------------------------------------------ passes
    def _forward(self, s: int) -> Any:
        env: dict[fx.Node, Any] = {}
        for t in range(s):
            for a in self.routes.crossing.get((t, s), ()):
                env[a] = self._recv("fwd", t, s)
        result = None
        for n in self.routes.runs[s]:
            if n.op == "placeholder":
                env[n] = self._placeholder(n, s)
            elif n.op == "get_attr":
                env[n] = getattr(self.routes.gm, n.target)
            elif n.op == "call_function":
                args, kwargs = fx.map_arg((n.args, n.kwargs), env.__getitem__)
                env[n] = n.target(*args, **kwargs)
            elif n.op == "output":
                result = fx.map_arg(n.args[0], env.__getitem__)
        self.env[s] = env
        for d in range(s + 1, self.routes.stages):
            for a in self.routes.crossing.get((s, d), ()):
                self._send("fwd", s, d, env[a])
        return result

    def _placeholder(self, n: fx.Node, s: int) -> Any:
        kind, key = self.source[n]
        if kind == "param":  # tied names share the stage's leaf: autograd sums their uses
            if (s, key) not in self.leaves:
                value = self.values[key]
                self.check.held[key] = value.numel() * value.element_size()
                self.leaves[(s, key)] = value.detach().clone().requires_grad_(
                    value.requires_grad)
            return self.leaves[(s, key)]
        if kind == "buffer":
            return self.check.buffers[key].clone()
        return key

    def _backward(self, s: int, loss: torch.Tensor | None) -> None:
        env = self.env[s]
        acc: dict[fx.Node, torch.Tensor] = {}
        for d in range(s + 1, self.routes.stages):
            for a in self.routes.crossing.get((s, d), ()):
                v = env[a]
                if isinstance(v, torch.Tensor) and v.requires_grad:
                    g = self._recv("bwd", d, s, like=v)
                    acc[a] = acc[a] + g if a in acc else g
        roots = [env[a] for a in acc]
        grads = list(acc.values())
        if loss is not None and loss.requires_grad:
            roots.append(loss)
            grads.append(torch.ones_like(loss))
        if roots:
            torch.autograd.backward(roots, grads)
        for t in range(s):
            for a in self.routes.crossing.get((t, s), ()):
                v = env[a]
                if isinstance(v, torch.Tensor) and v.requires_grad:
                    g = v.grad if v.grad is not None else torch.zeros_like(v)
                    self._send("bwd", s, t, g, tensor=True)

    def _param_grads(self) -> dict[str, torch.Tensor | None]:
        """Each parameter's reference gradient on the first stage that reads it, summed
        over every stage that reads it (tied weights)."""
        stages_of: dict[str, list[int]] = {}
        for s in range(self.routes.stages):
            for n in self.routes.params(s):
                stages = stages_of.setdefault(self.source[n][1], [])
                if s not in stages:
                    stages.append(s)
        out: dict[str, torch.Tensor | None] = {}
        for name, stages in stages_of.items():  # graph order: the same on every rank
            home = stages[0]
            for s in stages[1:]:
                if s in self.check.mine:
                    self._send("param", s, home, self.leaves[(s, name)].grad)
            if home not in self.check.mine:
                continue
            total = self.leaves[(home, name)].grad
            for s in stages[1:]:
                part = self._recv("param", s, home)
                if part is not None:
                    total = part if total is None else total + part
            out[name] = total
        return out
