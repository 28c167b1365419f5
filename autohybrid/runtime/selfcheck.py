"""The numerics self-check of `ah.compile(..., check=...)`: the first step against eager.

Owns which check runs (`requested_check`, `check_mode`), the whole-model eager reference
and the comparison; compiled.py calls it. The per-stage check, for models too big for one
rank, is runtime/selfcheck_stage.py.

Which check: `check="whole"` is the one below; `check="stage"` checks each pipeline stage
on its own rank; `check=True` takes "whole" where rank 0's predicted share of the plan
plus what the whole check adds (an eager copy of the model and its gradients, the
gathered gradients, eager's activations of the global batch: `whole_check_bytes`) fits
its device memory (less `cost.memory.MEMORY_HEADROOM`), "stage" otherwise. A plan
without pipeline stages that does not fit is refused at compile time with the figures;
nothing is skipped silently.

check="whole": rank 0 holds an eager
copy of the model, taken before anything is sharded (a model on the meta device is
materialized with `ah.init`'s values, as its shards are). After the compiled model's
first forward and backward — before clipping and before the optimizer steps — every rank
gathers the whole gradients (`full_grads`), rank 0 runs eager's forward and backward on
the same global batch, and compares the loss and each parameter's gradient. The verdict
is broadcast; on a mismatch every rank raises `NumericsError` naming the first parameter
(in `named_parameters` order) whose gradient differs, with the size of the difference,
so nothing has been stepped.

Tolerance: a gradient differs when its largest deviation exceeds `atol + rtol * max|g|`
of eager's gradient (rtol 1e-3 in float32/float64, 5e-2 under 16-bit mixed precision;
atol 1e-6 of the largest gradient in the model), far below a wrong sharding (a lost
share is tens of percent) and above reordered floating-point sums.

Random ops (dropout): both sides start from the same RNG state, which reproduces eager's
masks under tp / sp / pp (the same seed on every rank); a plan that splits the batch
(dp > 1 or several microbatches) draws other masks by design and cannot be compared, so
`check=True` refuses it at compile time with the reason.

    >>> compiled = ah.compile(model, cluster, (x,), loss_fn=loss_fn, example_targets=y,
    ...                       optimizer=opt, check=True)
    >>> compiled.train_step(x, y)   # raises NumericsError if the first step differs
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from ..cost.memory import usable_bytes
from ..errors import AutohybridError, NumericsError
from ..plan import Plan
from .compare import (_DEFAULT_RTOL, _RTOL, _close, _differs, has_random_ops,  # noqa: F401
                      refuse_random)

#: the values of ah.compile(check=...) besides True / False
CHECK_MODES = ("whole", "stage")



def requested_check(check: Any) -> str | None:
    """The check `ah.compile(check=...)` asks for: None (off), "auto" (True: the whole
    model where it fits on one rank, stage by stage otherwise), "whole" or "stage"."""
    if check is None or check is False:
        return None
    if check is True:
        return "auto"
    if isinstance(check, str) and check in CHECK_MODES:
        return check
    raise AutohybridError(
        f"check={check!r}: give check=True (the whole model where it fits on one rank, "
        "each pipeline stage on its own otherwise), check='whole' (rank 0 runs the whole "
        "eager model), check='stage' (one rank per pipeline stage runs that stage) or "
        "check=False")


def check_mode(request: str | None, plan: Plan, param_bytes: int,
               device_bytes: int) -> str | None:
    """"whole" or "stage" for `request` under `plan` (see `requested_check`); refuses,
    naming the memory figures, a check that cannot run: the whole model does not fit on
    rank 0 beside its compiled share and the plan has no pipeline stages to check one at
    a time, or "stage" under a plan without pipeline stages."""
    if request is None or request == "whole":
        return request
    if request == "stage":
        if plan.mesh.pp == 1:
            raise AutohybridError(
                f"check='stage' checks each pipeline stage on its own, and this plan "
                f"({plan.mesh.describe()}) has a single stage: pin pipeline stages "
                "(constraints=ah.Constraints(pp=2)) or use check='whole'")
        return "stage"
    need, figures = whole_check_bytes(plan, param_bytes)
    usable = usable_bytes(device_bytes)
    if need <= usable:
        return "whole"
    if plan.mesh.pp > 1:
        return "stage"
    raise AutohybridError(
        f"check=True cannot compare this plan ({plan.mesh.describe()}) with eager: the "
        f"whole-model check needs about {_gib(need)} on rank 0 ({figures}) of its "
        f"{_gib(usable)} usable, and the plan has no pipeline stages to check one at a "
        "time. Compile the checked run with pipeline stages "
        "(constraints=ah.Constraints(pp=2) or more; check then runs stage by stage), or "
        "check a smaller model of the same architecture, or pass check='whole' to try "
        "anyway")


def whole_check_bytes(plan: Plan, param_bytes: int) -> tuple[int, str]:
    """Rank 0's bytes under check='whole' (its predicted compiled share, an eager copy of
    the model and its gradients, the gathered gradients, eager's activations of the
    global batch: the plan's per-microbatch activations of every stage, unsharded), and
    the figures as words."""
    from ..search.pricing import in_flight   # the plan has the fields a Layout prices

    predicted = plan.predicted
    per_pp = predicted.memory_per_pp_rank or (predicted.memory,) * plan.mesh.pp
    per_microbatch = sum(m.activations / in_flight(plan, c) for c, m in enumerate(per_pp))
    activations = int(per_microbatch * plan.mesh.tp * plan.global_batch
                      / plan.microbatch_size)
    share = predicted.memory_of_rank(plan, 0).total
    need = share + 3 * param_bytes + activations
    return need, (f"its compiled share {_gib(share)}, an eager copy of the model and its "
                  f"gradients 2 × {_gib(param_bytes)}, the gathered gradients "
                  f"{_gib(param_bytes)}, eager activations of the global batch "
                  f"≈ {_gib(activations)}")


def make_check(mode: str | None, model: nn.Module, plan: Plan, rank: int,
               init_seed: int | None, autocast: torch.dtype | None) -> Any:
    """The check object for `mode` (None: no check)."""
    if mode == "whole":
        return FirstStepCheck(model, rank, init_seed, autocast)
    if mode == "stage":
        from .selfcheck_stage import StageCheck
        return StageCheck(plan, rank, autocast)
    return None


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"

class FirstStepCheck:
    """Rank 0's eager copy of the model and the comparison of the first step."""

    per_stage = False

    def __init__(self, model: nn.Module, rank: int, init_seed: int | None,
                 autocast: torch.dtype | None):
        self.rank, self.autocast, self.done = rank, autocast, False
        self.reference: nn.Module | None = None
        if rank == 0:
            self.reference = copy.deepcopy(model)
            if any(p.is_meta for p in model.parameters()):
                from ..init import materialize
                self.reference = materialize(self.reference, init_seed)

    def refuse_unless_comparable(self, gm: fx.GraphModule, dp: int,
                                 num_microbatches: int) -> None:
        refuse_random(gm, dp, num_microbatches)

    def rng_state(self) -> torch.Tensor:
        return torch.random.get_rng_state()

    def verify(self, loss: torch.Tensor, grads: dict[str, torch.Tensor | None],
               eager_loss: Callable[[nn.Module], torch.Tensor], rng: torch.Tensor) -> None:
        """Compare the compiled step with eager's on rank 0; raise on every rank if they
        differ. `grads` are the compiled model's gathered gradients (every rank)."""
        self.done = True
        verdict: list[Any] = [None]
        if self.rank == 0:
            verdict[0] = self._compare(loss, grads, eager_loss, rng)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            raise NumericsError(verdict[0])
        self.reference = None  # the check ran; free the copy

    def _compare(self, loss: torch.Tensor, grads: dict[str, torch.Tensor | None],
                 eager_loss: Callable[[nn.Module], torch.Tensor],
                 rng: torch.Tensor) -> str | None:
        ref = self.reference
        for p in ref.parameters():
            p.grad = None
        state = torch.random.get_rng_state()
        torch.random.set_rng_state(rng)
        try:
            expected = eager_loss(ref)
            expected.backward()
        finally:
            torch.random.set_rng_state(state)
        rtol = _RTOL.get(self.autocast, _DEFAULT_RTOL)
        want = {n: p.grad for n, p in ref.named_parameters()}
        scale = max((g.abs().max().item() for g in want.values()
                     if g is not None and g.numel()), default=0.0)
        atol = 1e-6 * scale
        if not _close(loss.detach().to(expected.dtype), expected.detach(), rtol, atol):
            return (f"check=True: the compiled first step's loss {loss.item():.8g} differs "
                    f"from eager's {expected.item():.8g} on the same batch; nothing was "
                    "stepped. Pin another plan (constraints=...) or report the model")
        for name, g in want.items():
            problem = _differs(name, grads.get(name), g, rtol, atol)
            if problem:
                return (f"check=True: the compiled first step's gradient of parameter "
                        f"{name!r} differs from eager's: {problem}; nothing was stepped. "
                        "The plan's sharding of this parameter (or of what feeds it) does "
                        "not compute eager's gradient, or the captured graph does not: pin "
                        "another layout (e.g. constraints=ah.Constraints(tp=1)); if the "
                        "layout of one rank (dp=1, tp=1, pp=1) differs too, the capture "
                        "is at fault (an op whose backward torch.export does not keep). "
                        "Report the model")
        return None
