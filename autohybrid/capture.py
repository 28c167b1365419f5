"""Capture: model (+ loss) → one ATen training-IR GraphModule with lifted parameters.

Owns tracing (torch.export first — block by block where a model repeats its blocks, see
capture_blocks.py —, torch.fx.symbolic_trace lowered through export for models export
rejects), the roles of placeholders, which symbolic dims are batch and
sequence, and readable capture errors. It does not decide anything about parallelism.

Example::

    >>> import torch, autohybrid as ah
    >>> model = ah.models.mlp(16, 32, 8)
    >>> cap = capture(model, (torch.randn(4, 16),), loss_fn=torch.nn.functional.cross_entropy,
    ...               example_targets=torch.randint(0, 8, (4,)))
    >>> loss = cap.run(cap.default_state(model), (torch.randn(6, 16),), (torch.randint(0, 8, (6,)),))
"""
from __future__ import annotations

import contextlib
import inspect
import linecache
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import sympy
import torch
import torch.fx as fx
import torch.nn as nn
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from . import capture_cache, capture_functions, capture_wire
from .capture_blocks import export_by_blocks
from .capture_moe import routed_experts
from .capture_moe_loop import drop_unused_symbols, fold_expert_loops
from .errors import CaptureError
from .graph import AH_BUFFER, AH_PARAM, AH_ROLE, VAL, graph_hash, verify
from .sample_stats import StatsLoss

_WRAPPER_PREFIX = "model."
_TARGET_KWARGS = ("labels", "targets", "target", "y")


@dataclass
class CapturedGraph:
    """A captured graph and what is needed to run it.

    Placeholders come in this order: parameters, buffers, constants, model inputs,
    targets. `param_fqns[i]` names the i-th parameter placeholder with the model's own
    name; tied parameters appear once per name and `canonical` maps each name to the
    first one (they are fed the same tensor, so autograd sums their gradients).
    """

    gm: fx.GraphModule
    param_fqns: list[str]
    buffer_fqns: list[str]
    constants: dict[str, torch.Tensor]
    num_inputs: int
    num_targets: int
    canonical: dict[str, str]
    mutated_buffers: list[tuple[int, str]]      # (output index, buffer fqn)
    user_outputs: list[int]                     # output indices of user outputs
    dim_roles: dict[sympy.Symbol, str]          # symbol → "batch" | "seq"
    method: str                                 # "export" | "symbolic_trace"
    with_loss: bool
    hash: str = ""
    example_shapes: list[tuple[int, ...]] = field(default_factory=list)
    #: mixed precision: the graph was captured, and runs, under torch.autocast to this
    #: dtype (its fake values carry autocast's dtypes; the parameters keep theirs)
    autocast: torch.dtype | None = None
    #: the exported program `gm` is the graph module of, without the model's tensors
    #: (what capture_wire.py sends)
    exported: ExportedProgram | None = field(default=None, repr=False, compare=False)
    #: where the graph came from: "export" (this process traced the model) or "wire:"
    #: and the fingerprint of the rank's graph it was loaded from (capture_wire.py)
    origin: str = "export"

    def default_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Parameters and buffers of `model` keyed by the canonical names of the graph."""
        state: dict[str, torch.Tensor] = {}
        for fqn in self.param_fqns:
            state.setdefault(self.canonical[fqn], model.get_parameter(self.canonical[fqn]))
        for fqn in self.buffer_fqns:
            state.setdefault(fqn, model.get_buffer(fqn))
        return state

    def flat_args(self, state: dict[str, torch.Tensor], inputs: Sequence[torch.Tensor],
                  targets: Sequence[torch.Tensor] = ()) -> list[Any]:
        params = [state[self.canonical[f]] for f in self.param_fqns]
        buffers = [state[f] for f in self.buffer_fqns]
        return [*params, *buffers, *self.constants.values(), *inputs, *targets]

    def run(self, state: dict[str, torch.Tensor], inputs: Sequence[torch.Tensor],
            targets: Sequence[torch.Tensor] = ()) -> Any:
        """Run the graph and apply buffer mutations; the user outputs (one, or a tuple)."""
        args = self.flat_args(state, inputs, targets)
        with self.autocast_context(args):
            outs = self.gm(*args)
        with torch.no_grad():
            for index, fqn in self.mutated_buffers:
                state[fqn].copy_(outs[index])
        user = [outs[i] for i in self.user_outputs]
        return user[0] if len(user) == 1 else tuple(user)

    def autocast_context(self, tensors: Sequence[Any]):
        """torch.autocast as at capture (on the device of `tensors`), or nothing."""
        if self.autocast is None:
            return contextlib.nullcontext()
        device = next((t.device.type for t in tensors if isinstance(t, torch.Tensor)), "cpu")
        return torch.autocast(device_type=device, dtype=self.autocast)

    def sizes(self, batch: int, seq: int | None = None) -> dict[sympy.Symbol, int]:
        """Values for the graph's symbols at a given (local) batch and sequence length."""
        env: dict[sympy.Symbol, int] = {}
        for sym, role in self.dim_roles.items():
            if role == "batch":
                env[sym] = batch
            elif seq is not None:
                env[sym] = seq
        return env


# ----------------------------------------------------------------------------- wrappers
def target_kwarg(model: nn.Module) -> str | None:
    """The keyword `model.forward` takes its targets by (labels=, targets=, ...), if any."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((k for k in _TARGET_KWARGS if k in params), None)


class _WithLoss(nn.Module):
    """model + loss_fn as one module: forward(*inputs, *targets) -> scalar loss; with a
    `StatsLoss` (sample_stats.py), -> (loss, per-sample statistics)."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None, num_inputs: int):
        super().__init__()
        self.model = model
        self.stats = loss_fn if isinstance(loss_fn, StatsLoss) else None
        self.loss_fn = loss_fn.loss_fn if self.stats is not None else loss_fn
        self.num_inputs = num_inputs
        self.target_kwarg = target_kwarg(model)
        self.same_batch: tuple[int, ...] = ()   # see _one_batch

    def forward(self, *args: torch.Tensor) -> Any:
        _one_batch(args, self.same_batch)
        inputs, targets = args[: self.num_inputs], args[self.num_inputs:]
        target = targets[0] if len(targets) == 1 else tuple(targets)
        if self.loss_fn is not None:
            out = self.model(*inputs)
            loss = self.loss_fn(out, target)
        else:
            if self.target_kwarg is not None:
                out = self.model(*inputs, **{self.target_kwarg: target})
            else:
                out = self.model(*inputs, *targets)
            loss = _extract_loss(out)
        if self.stats is None:
            return loss
        return loss, self.stats.stats(out, target)


class _ForwardOnly(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.same_batch: tuple[int, ...] = ()   # see _one_batch

    def forward(self, *inputs: torch.Tensor) -> Any:
        _one_batch(inputs, self.same_batch)
        out = self.model(*inputs)
        if hasattr(out, "to_tuple") and hasattr(out, "items"):  # Hugging Face ModelOutput:
            # keep its tensors (logits, ...), drop caches export cannot return
            return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
        return out


def _batch_group(args: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """The positions of the tensors whose dim 0 is as long as the first's (the batch the
    runtime splits them into alike), when there are two or more."""
    group = tuple(i for i, t in enumerate(args) if t.shape[0] == args[0].shape[0])
    return group if len(group) > 1 else ()


def _one_batch(args: Sequence[torch.Tensor], group: tuple[int, ...]) -> None:
    """Tell the trace that the tensors of `group` (`_batch_group`) have one batch size.

    Each input's dim 0 is its own Dim.AUTO, so without this export gives each its own
    symbol unless the model happens to combine them, and an op that reads one tensor's
    rows at positions counted from another's batch (Hugging Face's causal mask indexes
    the padding mask by `arange(batch)` of the token ids) mixes two symbols the proof of
    passes/batch_flow.py cannot equate: every dp plan was refused. The runtime splits
    every input and target along dim 0 into the same samples, and BatchSpec checks each
    batch against the graph's symbols (one symbol: one size), so the fact holds wherever
    the graph runs. `torch._check` makes the sizes one symbol (a guard, no graph node);
    unlike a shared named Dim, it leaves Dim.AUTO free to specialize the batch size or
    relate other dims to it (targets flattened to batch·seq)."""
    first = args[group[0]].shape[0] if group else None
    for i in group[1:]:
        torch._check(args[i].shape[0] == first)


def _extract_loss(out: Any) -> torch.Tensor:
    """The loss from what a model returns: a scalar, `.loss`, or the scalar of a tuple."""
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, (tuple, list)):
        scalars = [o for o in out if isinstance(o, torch.Tensor) and o.dim() == 0]
        if len(scalars) == 1:
            return scalars[0]
    raise CaptureError(
        "loss_fn=None, but the model did not return a loss: expected a scalar tensor, an "
        f"object with .loss, or a tuple with exactly one scalar; got {type(out).__name__}. "
        "Pass loss_fn=..., or make forward(inputs, targets) return the loss.")


# ----------------------------------------------------------------------------- capture
def as_tuple(x: Any) -> tuple:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def capture(model: nn.Module, example_inputs: Any, loss_fn: Callable | None = None,
            example_targets: Any = None, *, with_loss: bool = True,
            autocast: torch.dtype | None = None) -> CapturedGraph:
    """Capture `model` (with `loss_fn` when `with_loss`) as an ATen training-IR graph.

    Dim 0 of every input and target is the batch dim (one symbol for all whose dim 0 is
    as long as the first input's: `_one_batch`); dim 1 of integer inputs with two or
    more dims is the sequence dim; both are symbolic in the graph. `autocast` (mixed
    precision): capture under `torch.autocast` to that dtype, as eager would run; the
    graph keeps autocast's dtypes in its fake values and `run` applies autocast again
    (export records the ops, not autocast's casts).
    """
    inputs, targets = _prepare(model, example_inputs, example_targets, with_loss)
    key = capture_cache.capture_key(model, inputs, targets, loss_fn, with_loss=with_loss,
                                    autocast=autocast)
    cached = capture_cache.lookup(key, model)
    if cached is not None:  # this process exported the same graph before
        return cached
    wrapper = _WithLoss(model, loss_fn, len(inputs)) if with_loss else _ForwardOnly(model)
    args = (*inputs, *targets)
    wrapper.same_batch = _batch_group(args)
    dynamic = tuple(_dynamic_dims(t) for t in args)
    context = (torch.autocast(device_type=args[0].device.type, dtype=autocast)
               if autocast is not None else contextlib.nullcontext())
    # a model run without targets whose forward takes them (labels=...) may need them
    missing = target_kwarg(model) if not targets else None
    with context, routed_experts(model), capture_functions.recording() as applied:
        # a model of repeated blocks: export a few, replicate them (capture_blocks.py)
        ep, method = export_by_blocks(wrapper, args, dynamic), "export"
        if ep is None:
            ep, method = _export_with_fallback(wrapper, model, args, dynamic, missing)
    cap = _finish(ep, model, method, inputs, targets, with_loss, autocast)
    if with_loss:   # custom autograd.Functions: the graph lost their backward
        with context:
            capture_functions.check_backward(
                model, lambda: as_tuple(wrapper(*args))[0],
                lambda: as_tuple(cap.run(cap.default_state(model), inputs, targets))[0],
                applied)
    capture_cache.store(key, cap)
    return cap


def capture_digest(model: nn.Module, example_inputs: Any, loss_fn: Callable | None = None,
                   example_targets: Any = None, *, with_loss: bool = True,
                   autocast: torch.dtype | None = None) -> tuple[str | None, str | None]:
    """(digest, origin) of what `capture` with these arguments would return: the digest
    names everything the graph depends on the same way in every process (None: some part
    has no fingerprint); origin is the memoized graph's (`CapturedGraph.origin`), None
    when this process has not captured it. runtime/capture_share.py compares both
    across ranks."""
    inputs, targets = _prepare(model, example_inputs, example_targets, with_loss)
    digest = capture_cache.portable_digest(model, inputs, targets, loss_fn,
                                           with_loss=with_loss, autocast=autocast)
    key = capture_cache.capture_key(model, inputs, targets, loss_fn, with_loss=with_loss,
                                    autocast=autocast)
    cached = capture_cache.lookup(key, model)
    return digest, None if cached is None else cached.origin


def capture_from(data: bytes, model: nn.Module, example_inputs: Any,
                 loss_fn: Callable | None = None, example_targets: Any = None, *,
                 with_loss: bool = True, autocast: torch.dtype | None = None) -> CapturedGraph:
    """What `capture` returns for these arguments, loaded from another process's capture
    of the same model (`capture_wire.dumps`) instead of exported here; not memoized
    (`memoize` does, once the caller knows every rank runs it). Raises
    `capture_wire.WireMismatch` when the loaded graph is not the sent one."""
    inputs, targets = _prepare(model, example_inputs, example_targets, with_loss)
    wrapper = _WithLoss(model, loss_fn, len(inputs)) if with_loss else _ForwardOnly(model)
    ep, method, expected = capture_wire.loads(data, wrapper)
    cap = _finish(ep, model, method, inputs, targets, with_loss, autocast)
    found = capture_wire.fingerprint(cap)
    if found != expected:
        raise capture_wire.WireMismatch(
            f"the loaded graph (fingerprint {found[:12]}) is not the one sent "
            f"({expected[:12]})")
    cap.origin = f"wire:{expected[:24]}"
    return cap


def memoize(cap: CapturedGraph, model: nn.Module, example_inputs: Any,
            loss_fn: Callable | None = None, example_targets: Any = None, *,
            with_loss: bool = True, autocast: torch.dtype | None = None) -> None:
    """Keep `cap` (from `capture_from`) as what `capture` with these arguments returns in
    this process from now on."""
    inputs, targets = _prepare(model, example_inputs, example_targets, with_loss)
    capture_cache.store(capture_cache.capture_key(model, inputs, targets, loss_fn,
                                                  with_loss=with_loss, autocast=autocast),
                        cap)


def _prepare(model: nn.Module, example_inputs: Any, example_targets: Any,
             with_loss: bool) -> tuple[tuple, tuple]:
    """The example inputs and targets as capture traces them (checked, on the model's
    meta device where it is on one, size-1 dynamic dims widened)."""
    if not isinstance(model, nn.Module):
        raise CaptureError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    inputs, targets = as_tuple(example_inputs), as_tuple(example_targets) if with_loss else ()
    for name, group in (("example_inputs", inputs), ("example_targets", targets)):
        for i, t in enumerate(group):
            if not isinstance(t, torch.Tensor):
                raise CaptureError(f"{name}[{i}] must be a tensor, got {type(t).__name__}")
            if t.dim() == 0:
                raise CaptureError(f"{name}[{i}] is a scalar; inputs need a batch dim (dim 0)")
    if not inputs:
        raise CaptureError("example_inputs is empty: give at least one input tensor")
    device = next((p.device for p in model.parameters()), None)
    if device is not None and device.type == "meta":
        inputs = tuple(t.to("meta") for t in inputs)
        targets = tuple(t.to("meta") for t in targets)
    return _widen(inputs), _widen(targets)


def _finish(ep: ExportedProgram, model: nn.Module, method: str, inputs: tuple,
            targets: tuple, with_loss: bool, autocast: torch.dtype | None) -> CapturedGraph:
    cap = _from_exported(ep, model, method, len(inputs), len(targets), with_loss)
    if fold_expert_loops(cap.gm):   # hand-written MoE loops → autohybrid::moe_experts
        drop_unused_symbols(ep)
    cap.autocast = autocast
    cap.example_shapes = [tuple(t.shape) for t in (*inputs, *targets)]
    cap.exported = _without_tensors(ep)
    verify(cap.gm, "capture")
    cap.hash = graph_hash(cap.gm)
    return cap


def _widen(tensors: tuple) -> tuple:
    """Repeat size-1 batch/sequence dims to 2 so export keeps them symbolic."""
    out = []
    for t in tensors:
        for d in _dynamic_dims(t):
            if t.shape[d] == 1:
                t = t.repeat_interleave(2, dim=d) if t.device.type != "meta" else \
                    t.new_empty(*[2 if i == d else s for i, s in enumerate(t.shape)])
        out.append(t)
    return tuple(out)


def _dynamic_dims(t: torch.Tensor) -> dict[int, Any]:
    dims = {0: Dim.AUTO}
    if t.dim() >= 2 and not t.is_floating_point() and not t.is_complex():
        dims[1] = Dim.AUTO
    return dims


def _export_with_fallback(wrapper: nn.Module, model: nn.Module, args: tuple,
                          dynamic: tuple, missing_target: str | None = None
                          ) -> tuple[ExportedProgram, str]:
    try:
        ep = torch.export.export(wrapper, args, dynamic_shapes=(dynamic,), strict=False)
        return ep, "export"
    except CaptureError:
        raise
    except Exception as export_exc:  # torch raises many types; all become CaptureError
        try:
            # Only the model goes through symbolic_trace; the loss wrapper is re-applied.
            wrapper.model = _symbolic_trace(model)
            ep = torch.export.export(wrapper, args, dynamic_shapes=(dynamic,),
                                     strict=False)
            return ep, "symbolic_trace"
        except Exception as trace_exc:
            raise (_loss_fn_error(export_exc, getattr(wrapper, "loss_fn", None))
                   or _capture_error(export_exc, trace_exc, model, missing_target)
                   ) from export_exc
        finally:
            wrapper.model = model


def _symbolic_trace(model: nn.Module) -> fx.GraphModule:
    """Trace `model` with fx (buffers as attributes so shape slicing of masks works)."""

    class _Tracer(fx.Tracer):
        proxy_buffer_attributes = True

    graph = _Tracer().trace(model)
    gm = fx.GraphModule(model, graph)
    # fx registers every tensor attribute the graph reads as a buffer; a plain tensor
    # attribute of the model is no buffer of it, so it goes back to being a constant.
    model_buffers = {name for name, _ in model.named_buffers()}
    for name, tensor in list(gm.named_buffers()):
        if name not in model_buffers:
            owner_path, _, attr = name.rpartition(".")
            owner = gm.get_submodule(owner_path)
            del owner._buffers[attr]
            setattr(owner, attr, tensor)
    return gm


def _loss_fn_error(exc: BaseException, loss_fn: Callable | None) -> CaptureError | None:
    """A CaptureError naming `loss_fn` when the failure was raised inside it (None when
    it was not: the model's forward failed, or there is no loss_fn)."""
    if loss_fn is None:
        return None
    target = getattr(loss_fn, "func", loss_fn)  # functools.partial
    code = getattr(target, "__code__", None) or getattr(
        getattr(type(target), "forward", None), "__code__", None)
    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
    if code is None or not any(frame.f_code is code for frame in frames):
        return None
    name = getattr(target, "__qualname__", type(target).__name__)
    where = f"{code.co_filename}:{code.co_firstlineno}"
    reason = (str(exc).strip().splitlines() or [""])[0]
    return CaptureError(
        f"could not capture the loss: loss_fn {name} ({where}) raised "
        f"{type(exc).__name__}: {reason}\n"
        "  what to do: check it in eager, loss_fn(model(*example_inputs), example_targets), "
        "and fix it (or its targets: the model's output shape must match what it expects)")


def _capture_error(export_exc: BaseException, trace_exc: BaseException,
                   model: nn.Module, missing_target: str | None = None) -> CaptureError:
    """A CaptureError that names the module and source line that failed, why, and a fix."""
    names = {id(m): (n or "<root>", type(m).__name__) for n, m in model.named_modules()}
    frame_info = module = None
    for frame, lineno in traceback.walk_tb(export_exc.__traceback__):
        code = frame.f_code
        # The innermost module of the model on the stack, even inside torch (nn.Linear).
        first = frame.f_locals.get(code.co_varnames[0]) if code.co_varnames else None
        if isinstance(first, nn.Module) and id(first) in names:
            module = names[id(first)]
        if "site-packages" in code.co_filename or "/torch/" in code.co_filename:
            continue
        if code.co_filename.endswith("autohybrid/capture.py") or code.co_filename.startswith("<"):
            continue  # (generated code, `<string>`, has no line to show)
        frame_info = (code.co_filename, lineno, code.co_name)
    reason = (str(export_exc).strip().splitlines() or [type(export_exc).__name__])[0]
    where = f"module {module[0]} ({module[1]})" if module else "somewhere inside torch"
    if frame_info:
        filename, lineno, func = frame_info
        line = linecache.getline(filename, lineno).strip()
        called = f"called from {func} at {filename}:{lineno}: `{line}`"
        where = f"{where}, {called}" if module else called
    hint = _hint(export_exc, missing_target)
    return CaptureError(
        f"could not capture the model: torch.export failed in {where}\n"
        f"  reason: {type(export_exc).__name__}: {reason}\n"
        f"  torch.fx.symbolic_trace fallback also failed: {type(trace_exc).__name__}: "
        f"{(str(trace_exc).strip().splitlines() or [''])[0]}\n"
        f"  what to do: {hint}")


def _hint(exc: BaseException, missing_target: str | None = None) -> str:
    text = f"{type(exc).__name__}: {exc}"
    if "data-dependent" in text or "GuardOnDataDependent" in text:
        hint = ("replace Python control flow on tensor values (if x.sum() > 0, .item(), "
                ".tolist()) with torch.where or torch.cond, so the graph does not depend on data")
    elif "FakeTensor" in text and any(word in text for word in ("size", "shape")):
        hint = ("the model uses a tensor's values as a size, which torch.export cannot "
                "trace (a PackedSequence from pack_padded_sequence carries its batch sizes "
                "as a tensor; torch.zeros(n) with n a tensor): take sizes from .shape, or "
                "run the RNN over the padded batch and mask what the padding produces")
    elif any(word in text for word in ("shape", "size", "mat1 and mat2", "dim")):
        hint = ("check that example_inputs (and example_targets) have the shapes the model "
                "expects: dim 0 is the batch, the rest must match the model's layers")
    else:
        hint = "make forward traceable by torch.export (non-strict); see torch.export's docs"
    if missing_target is None:
        return hint
    return (f"the model ran without targets, but its forward takes `{missing_target}`: if it "
            f"needs them to run (an encoder-decoder such as T5 or BART derives its decoder "
            f"inputs from {missing_target}), give example_targets (with loss_fn=None when the "
            f"model computes its own loss) to ah.compile / ah.plan, which then capture the "
            f"training graph and never the forward without targets; otherwise, {hint}")


def _from_exported(ep: ExportedProgram, model: nn.Module, method: str, num_inputs: int,
                   num_targets: int, with_loss: bool) -> CapturedGraph:
    gm = ep.graph_module
    sig = ep.graph_signature
    strip = lambda name: name[len(_WRAPPER_PREFIX):] if name.startswith(_WRAPPER_PREFIX) else name
    canonical = canonical_names(model)
    params, buffers, constants = [], [], {}
    nodes = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    user_index = 0
    for spec in sig.input_specs:
        node = nodes[spec.arg.name]
        if spec.kind == InputKind.PARAMETER:
            params.append(strip(spec.target))
            node.meta[AH_ROLE] = "param"
            node.meta[AH_PARAM] = canonical.get(params[-1], params[-1])
        elif spec.kind == InputKind.BUFFER:
            buffers.append(strip(spec.target))
            node.meta[AH_ROLE] = "buffer"
            node.meta[AH_BUFFER] = buffers[-1]
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            constants[spec.target] = ep.constants[spec.target]
            node.meta[AH_ROLE] = "constant"
            _refuse_parameter_as_constant(constants[spec.target], node, model)
        elif spec.kind == InputKind.USER_INPUT:
            node.meta[AH_ROLE] = "input" if user_index < num_inputs else "target"
            user_index += 1
        else:
            raise CaptureError(f"unsupported graph input kind {spec.kind} for {spec.target}")
    mutated, user_outputs = [], []
    for i, spec in enumerate(sig.output_specs):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            mutated.append((i, strip(spec.target)))
        elif spec.kind in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT):
            user_outputs.append(i)
        else:
            raise CaptureError(f"the model mutates its inputs ({spec.kind}: {spec.target}); "
                               "autohybrid needs forward to leave its inputs unchanged")
    return CapturedGraph(
        gm=gm, param_fqns=params, buffer_fqns=buffers, constants=constants,
        num_inputs=num_inputs, num_targets=num_targets,
        canonical={p: canonical.get(p, p) for p in params},
        mutated_buffers=mutated, user_outputs=user_outputs,
        dim_roles=_dim_roles(gm), method=method, with_loss=with_loss)


def _refuse_parameter_as_constant(value: Any, node: fx.Node, model: nn.Module) -> None:
    """CaptureError when the lifted constant `value` is a trainable parameter of `model`.

    torch.export lifts a tensor the traced code reads other than through a module
    attribute as a constant: a loss_fn that closes over `model.fc.weight` (an L2 penalty
    written as `lambda out, t: ce(out, t) + lam * w.pow(2).sum()`) gets a detached copy,
    and the compiled model would train without that term's gradient. Meta tensors share
    no storage to compare and are not checked (planning only)."""
    if not isinstance(value, torch.Tensor) or value.device.type == "meta":
        return
    storage = value.untyped_storage().data_ptr()
    for name, p in model.named_parameters():
        if p.requires_grad and p.device == value.device and \
                p.untyped_storage().data_ptr() == storage:
            users = ", ".join(f"{u.name} ({u.target})" for u in node.users) or "none"
            raise CaptureError(
                f"the traced code reads the model's parameter {name!r} other than through "
                f"the model (a loss_fn closing over it, e.g. a weight penalty): torch.export "
                f"lifts it as a constant, so its gradient would be lost (used by {users}). "
                f"Compute the term in the model's forward and return it with the output "
                f"(loss_fn(outputs, targets) then adds it), or use the optimizer's "
                f"weight_decay")


def _without_tensors(ep: ExportedProgram) -> ExportedProgram:
    """`ep` holding no tensor of the model it traced (its state dict's entries become
    meta tensors, its example inputs are dropped): the memo keeps captured graphs, and a
    graph must not keep a model's parameters alive after the model is gone. What it is
    kept for (capture_wire.dumps) sends no weights."""
    state = ep.state_dict
    for name, t in list(state.items()):
        meta = torch.empty_like(t, device="meta")
        state[name] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) \
            else meta
    ep.example_inputs = None
    return ep


def describe(cap: CapturedGraph) -> str:
    """Which graph `cap` is, for messages."""
    return "training graph (model + loss)" if cap.with_loss else "forward graph"


def model_hashes(expected: str, graph: CapturedGraph,
                 other: Callable[[], CapturedGraph] | None = None) -> dict[str, str]:
    """The graph hashes of this model a plan's `model_hash` is compared with: {what: hash}.

    A plan names the graph it was made on: the training graph (model + loss, in the
    model's own precision) when it was planned with example targets, else the forward
    graph. `graph` is the one at hand; `other` captures the other kind, called only when
    `graph`'s hash is not `expected` (skipped when that capture fails: a model that needs
    its targets to run has no forward graph).
    """
    hashes = {describe(graph): graph.hash}
    if expected != graph.hash and other is not None:
        try:
            second = other()
        except CaptureError:
            second = None
        if second is not None:
            hashes[describe(second)] = second.hash
    return hashes


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every parameter name of `model` (tied ones included) → the first name of that tensor."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def _dim_roles(gm: fx.GraphModule) -> dict[sympy.Symbol, str]:
    roles: dict[sympy.Symbol, str] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder" or node.meta.get(AH_ROLE) not in ("input", "target"):
            continue
        val = node.meta[VAL]
        for d, size in enumerate(val.shape[:2]):
            if isinstance(size, torch.SymInt):
                expr = size.node.expr
                if isinstance(expr, sympy.Symbol):
                    roles.setdefault(expr, "batch" if d == 0 else "seq")
    return roles
