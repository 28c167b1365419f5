"""Fused regions: generated Triton kernels behind one custom op, `autohybrid::fused_region`.

passes/fusion.py asks `supported(node)` / `is_reduction(node)` while it grows regions,
hands each region (an fx GraphModule of ATen ops whose placeholders carry
`meta["val"]`) to `register_region`, and replaces the region's nodes by

    outs = torch.ops.autohybrid.fused_region([x0, x1, ...], key)

`register_region` lowers the region (codegen/lower.py), derives its backward
(codegen/autodiff.py), prints both kernels (codegen/triton.py) to `<cache>/<key>.py`,
and records them in this process under `key`, a hash of the region's structure: the same
region gives the same key on every rank, and each rank registers its own regions when it
runs the passes. Where the op runs:

    CUDA tensors                        the Triton kernels
    CPU tensors, TRITON_INTERPRET=1     the same kernels in Triton's interpreter
    CPU tensors otherwise               the region's own ATen ops (eager); backward by
                                        autograd through them

The backward is its own op, `autohybrid::fused_region_backward(inputs, grads, key)`, so a
joint trace holds only `autohybrid::` nodes; it saves the region's inputs only and
recomputes the rest. `kernels()` lists what this process generated; with
`AUTOHYBRID_DEBUG=1` each kernel file is also written to `$AUTOHYBRID_DUMP_DIR/kernels/`.

    >>> key = register_region(region_gm)
    >>> outs = torch.ops.autohybrid.fused_region([x, bias], key)
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx as fx

from ..codegen import autodiff
from ..codegen import triton as tgen
from ..codegen.ir import Program
from ..codegen.lower import (Lowered, UnsupportedRegion, iteration_shape, lower, shape_from,
                             structure)
from ..codegen.lower import is_reduction as _is_reduction
from ..codegen.lower import supported as _supported
from ..errors import RuntimeFailure

__all__ = ["KernelInfo", "UnsupportedRegion", "fused_region", "fused_region_backward",
           "is_reduction", "kernels", "register_region", "supported"]


def supported(node: fx.Node) -> bool:
    """Whether the code generator can take this ATen node into a region."""
    return _supported(node)


def is_reduction(node: fx.Node) -> bool:
    """Whether the node reduces along the last dim (at most one kind of region per row)."""
    return _is_reduction(node)


@dataclass(frozen=True)
class KernelInfo:
    """One generated region: its kernels' names, sources and Triton signatures."""

    key: str
    name: str                         # forward kernel; the backward is `<name>_bwd`
    ops: tuple[str, ...]              # the region's ATen ops, in graph order
    reduction: bool                   # whether the forward reduces along rows
    forward_source: str
    backward_source: str
    path: str                         # the file holding both kernels
    forward_signature: tuple[tuple[str, str], ...]
    backward_signature: tuple[tuple[str, str], ...]

    @property
    def backward_name(self) -> str:
        return f"{self.name}_bwd"


@dataclass
class _Region:
    info: KernelInfo
    gm: fx.GraphModule
    lowered: Lowered
    backward: Program
    grad_inputs: tuple[int, ...]      # the float inputs, which get gradients
    loaded: dict = field(default_factory=dict)   # (backward?, interpret?) → kernel


_REGIONS: dict[str, _Region] = {}


def region_key(gm: fx.GraphModule | fx.Graph) -> str:
    return "fr_" + hashlib.sha256(structure(gm).encode()).hexdigest()[:16]


def register_region(gm: fx.GraphModule | fx.Graph) -> str:
    """Generate (or find) the kernels of region `gm`; its key. Raises UnsupportedRegion
    (naming the node) when the region does not fit the code generator. A region given
    as a Graph becomes a GraphModule (which runs it eagerly on CPU) only when its key is
    new: a model's repeated blocks register the same few regions many times."""
    key = region_key(gm)
    if key in _REGIONS:
        _dump(_REGIONS[key].info, gm)
        return key
    if isinstance(gm, fx.Graph):
        gm = fx.GraphModule(torch.nn.Module(), gm, class_name="FusedRegion")
    lowered = lower(gm)
    backward = autodiff.backward(lowered.program)
    rank, name = lowered.rank, key
    doc = "Fused: " + ", ".join(lowered.ops)
    forward_src = tgen.source(lowered.program, name, rank, doc)
    backward_src = tgen.source(backward, f"{name}_bwd", rank, "Backward of " + doc[7:])
    path = tgen.write_source(key, tgen.module_source([forward_src, backward_src],
                                                     f"autohybrid fused region {key}"))
    grad_inputs = tuple(i for i, d in enumerate(lowered.in_dtypes) if d.is_floating_point)
    fwd_sig = tgen.signature(lowered.program, rank, list(lowered.in_dtypes),
                             list(lowered.out_dtypes))
    bwd_sig = tgen.signature(backward, rank, [*lowered.in_dtypes, *lowered.out_dtypes],
                             [lowered.in_dtypes[i] for i in grad_inputs])
    info = KernelInfo(key, name, lowered.ops, lowered.program.reduces, forward_src,
                      backward_src, str(path), tuple(fwd_sig.items()), tuple(bwd_sig.items()))
    _REGIONS[key] = _Region(info, gm, lowered, backward, grad_inputs)
    _dump(info, gm)
    return key


def kernels() -> list[KernelInfo]:
    """Every region this process generated kernels for, in registration order."""
    return [r.info for r in _REGIONS.values()]


def _dump(info: KernelInfo, gm: fx.GraphModule | fx.Graph) -> None:
    if os.environ.get("AUTOHYBRID_DEBUG", "") in ("", "0"):
        return
    if isinstance(gm, fx.Graph):
        gm = fx.GraphModule(torch.nn.Module(), gm, class_name="FusedRegion")
    root = Path(os.environ.get("AUTOHYBRID_DUMP_DIR", "autohybrid_dump")) / "kernels"
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{info.key}.py").write_text(Path(info.path).read_text())
    (root / f"{info.key}.region.py").write_text(gm.print_readable(print_output=False))


def _region(key: str) -> _Region:
    region = _REGIONS.get(key)
    if region is None:
        raise RuntimeFailure(
            f"autohybrid::fused_region: no fused region registered under key {key!r} in "
            f"this process ({len(_REGIONS)} registered); kernels are registered by "
            "ops.fused.register_region when the passes run — run the fusion pass in this "
            "process (every rank runs its own passes) before running its graph")
    return region


def _mode(tensors: list[torch.Tensor]) -> str:
    if any(t.is_cuda for t in tensors):
        return "gpu"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "interpret"
    return "eager"


def _kernel(region: _Region, backward: bool, interpret: bool):
    slot = (backward, interpret)
    if slot not in region.loaded:
        name = region.info.backward_name if backward else region.info.name
        region.loaded[slot] = tgen.load_kernel(Path(region.info.path), name, interpret)
    return region.loaded[slot]


def _shape(inputs: list[torch.Tensor]) -> list:
    return iteration_shape([list(t.shape) for t in inputs])


def _as_list(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


# ------------------------------------------------------------------ the ops

@torch.library.custom_op("autohybrid::fused_region", mutates_args=())
def fused_region(inputs: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    """The outputs of fused region `key` on `inputs` (see the module docstring)."""
    region = _region(key)
    mode = _mode(inputs)
    if mode == "eager":
        return _unaliased(_as_list(region.gm(*inputs)), inputs)
    low = region.lowered
    shape = _shape(inputs)
    device = inputs[0].device
    outs = [torch.empty(shape_from(r, shape), dtype=d, device=device)
            for r, d in zip(low.recipes, low.out_dtypes)]
    tgen.launch(_kernel(region, False, mode == "interpret"), low.program, list(inputs), outs,
                shape, mode == "interpret")
    return outs


def _unaliased(outs: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """`outs` with every output that shares storage with an input or an earlier output
    cloned: a custom op may return no alias (torch checks it). A region's ATen ops alias
    where an op is a no-op on its input, e.g. `aten.to.dtype` to the dtype it already has
    (Hugging Face's rotary embedding and T5's layer norm end with one)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs}
    result = []
    for out in outs:
        ptr = out.untyped_storage().data_ptr()
        result.append(out.clone() if ptr in seen else out)
        seen.add(ptr)
    return result


@fused_region.register_fake
def _(inputs, key):
    low = _region(key).lowered
    shape = _shape(inputs)
    return [inputs[0].new_empty(shape_from(r, shape), dtype=d)
            for r, d in zip(low.recipes, low.out_dtypes)]


@torch.library.custom_op("autohybrid::fused_region_backward", mutates_args=())
def fused_region_backward(inputs: list[torch.Tensor], grads: list[torch.Tensor], key: str
                          ) -> list[torch.Tensor]:
    """Gradients of region `key`'s float inputs (in input order), given its inputs and
    one gradient per output."""
    region = _region(key)
    mode = _mode(inputs)
    if mode == "eager":
        return _eager_backward(region, inputs, grads)
    shape = _shape(inputs)
    buffers = []
    for i in region.grad_inputs:   # a broadcast input's gradient is summed down in fp32
        x = inputs[i]
        full = list(x.shape) == list(shape)
        buffers.append(torch.empty(shape, device=x.device, dtype=x.dtype if full else
                                   torch.promote_types(x.dtype, torch.float32)))
    grads = [_once(g, shape) if v.kind == "full" else g
             for g, v in zip(grads, region.lowered.program.outputs)]
    tgen.launch(_kernel(region, True, mode == "interpret"), region.backward,
                [*inputs, *grads], buffers, shape, mode == "interpret")
    return [b if b.shape == inputs[i].shape else
            b.sum_to_size(inputs[i].shape).to(inputs[i].dtype)
            for i, b in zip(region.grad_inputs, buffers)]


@fused_region_backward.register_fake
def _(inputs, grads, key):
    return [inputs[i].new_empty(inputs[i].shape) for i in _region(key).grad_inputs]


def _once(grad: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """The gradient of an output smaller than the iteration shape (it broadcasts), as a
    tensor of that shape holding it once (at index 0 of the broadcast dims), zeros
    elsewhere: the kernel reads output gradients over the whole iteration shape."""
    if list(grad.shape) == list(shape):
        return grad
    full = grad.new_zeros(shape)
    aligned = grad.reshape([1] * (len(shape) - grad.dim()) + list(grad.shape))
    index = tuple(slice(0, 1) if a == 1 and n != 1 else slice(None)
                  for a, n in zip(aligned.shape, shape))
    full[index] = aligned
    return full


def _eager_backward(region: _Region, inputs, grads) -> list[torch.Tensor]:
    """Autograd through the region's ops. Inside an op's kernel the dispatcher excludes
    the autograd keys; they are switched back on here for the recomputation."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    with torch.enable_grad(), torch._C._ForceDispatchKeyGuard(
            torch._C._dispatch_tls_local_include_set(), _without_autograd(exclude)):
        xs = [x.detach().requires_grad_(i in region.grad_inputs) for i, x in enumerate(inputs)]
        outs = _as_list(region.gm(*xs))
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
        wrt = [xs[i] for i in region.grad_inputs]
        got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                  allow_unused=True) if pairs else [None] * len(wrt)
    return [torch.zeros_like(x) if g is None else g.detach() for x, g in zip(wrt, got)]


def _without_autograd(keys):
    for key in (torch._C.DispatchKey.AutogradCPU, torch._C.DispatchKey.AutogradCUDA,
                torch._C.DispatchKey.ADInplaceOrView, torch._C.DispatchKey.AutogradOther):
        keys = keys.remove(key)
    return keys


def _setup(ctx, inputs, output) -> None:
    xs, key = inputs
    ctx.key = key
    ctx.count = len(xs)
    ctx.save_for_backward(*xs)
    ctx.out_like = [(o.shape, o.dtype) for o in output]
    ctx.mark_non_differentiable(*[o for o in output if not o.is_floating_point()])


def _backward(ctx, grads):
    xs = ctx.saved_tensors
    grads = [torch.zeros(s, dtype=d, device=xs[0].device) if g is None else g
             for g, (s, d) in zip(grads, ctx.out_like)]
    region = _region(ctx.key)
    if _mode(list(xs)) == "eager":  # autograd through the region's ops, outside any op body
        got = _eager_backward(region, list(xs), grads)
    else:
        got = fused_region_backward(list(xs), grads, ctx.key)
    result: list = [None] * ctx.count
    for i, g in zip(region.grad_inputs, got):
        result[i] = g
    return result, None


fused_region.register_autograd(_backward, setup_context=_setup)
