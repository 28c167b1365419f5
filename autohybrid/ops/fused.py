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

The backward is its own op, `autohybrid::fused_region_backward(inputs, grads, key,
wanted)`, so a joint trace holds only `autohybrid::` nodes; it saves the region's inputs
only and recomputes the rest. It computes the gradients autograd asks for only
(`ctx.needs_input_grad`; a subset's kernel is printed at its first use), and a broadcast
input's gradient is summed inside the kernel into small partials (`fold_of`: over the
rows, along the row or both) where the broadcast allows, not written at full size.
Rows longer than one tile (`codegen.triton.MAX_ROW`) run each kernel's looped variant. `kernels()` lists what this process generated; with
`AUTOHYBRID_DEBUG=1` each kernel file is also written to `$AUTOHYBRID_DUMP_DIR/kernels/`.

    >>> key = register_region(region_gm)
    >>> outs = torch.ops.autohybrid.fused_region([x, bias], key)
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

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
           "is_reduction", "kernels", "region_graph", "register_region", "runs_eagerly",
           "supported"]


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
    #: the looped kernels in the file (rows over MAX_ROW; same signature as the one-tile
    #: kernel of the same name without `_loop`)
    looped: tuple[str, ...] = ()

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
    loaded: dict = field(default_factory=dict)   # (wanted or None, interpret, looped) → kernel
    subsets: dict = field(default_factory=dict)  # wanted → (backward program, name, path)


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
    grad_inputs = tuple(i for i, d in enumerate(lowered.in_dtypes) if d.is_floating_point)
    shapes = [list(_val_shape(n)) for n in _placeholders(gm)]
    folds = tuple(fold_of(shapes[i], lowered.rank) for i in grad_inputs)
    full = autodiff.backward(lowered.program)
    backward = Program(full.inputs, full.outputs, full.dtype, folds)
    rank, name = lowered.rank, key
    doc = "Fused: " + ", ".join(lowered.ops)
    forward_src = tgen.source(lowered.program, name, rank, doc)
    backward_src = tgen.source(backward, f"{name}_bwd", rank, "Backward of " + doc[7:])
    loops = [*_loops(lowered.program, name, rank, doc),
             *_loops(backward, f"{name}_bwd", rank, "Backward of " + doc[7:])]
    path = tgen.write_source(key, tgen.module_source([forward_src, backward_src, *loops],
                                                     f"autohybrid fused region {key}"))
    fwd_sig = tgen.signature(lowered.program, rank, list(lowered.in_dtypes),
                             list(lowered.out_dtypes))
    bwd_sig = tgen.signature(backward, rank, [*lowered.in_dtypes, *lowered.out_dtypes],
                             [lowered.in_dtypes[i] if f is None else full.dtype
                              for i, f in zip(grad_inputs, folds)])
    info = KernelInfo(key, name, lowered.ops, lowered.program.reduces, forward_src,
                      backward_src, str(path), tuple(fwd_sig.items()), tuple(bwd_sig.items()),
                      tuple(text.split("def ", 1)[1].split("(", 1)[0] for text in loops))
    _REGIONS[key] = _Region(info, gm, lowered, backward, grad_inputs)
    _dump(info, gm)
    return key


def _placeholders(gm) -> list[fx.Node]:
    graph = gm if isinstance(gm, fx.Graph) else gm.graph
    return [n for n in graph.nodes if n.op == "placeholder"]


def _val_shape(n: fx.Node):
    return n.meta["val"].shape


def fold_of(shape, rank: int) -> str | None:
    """How the backward kernel sums the gradient of an input of `shape` over an
    iteration shape of `rank` (`ir.Program.folds`), from the shape's structure alone (a
    dim is broadcast where it is missing or a static 1): every leading dim broadcast →
    "rows", the last dim broadcast → "cols", both → "both"; no broadcast, or one over
    only some leading dims → None (a full-size buffer, summed down by `sum_to_size`)."""
    aligned = [1] * (rank - len(shape)) + list(shape)
    one = [isinstance(s, int) and s == 1 for s in aligned]
    rows_b = rank > 1 and all(one[:-1])
    cols_b = one[-1]
    if rank > 1 and any(one[:-1]) and not rows_b:
        return None
    if rows_b:
        return "both" if cols_b else "rows"
    return "cols" if cols_b else None


def _loops(program: Program, name: str, rank: int, doc: str) -> list[str]:
    """The looped kernel of a program that reduces along rows (rows over MAX_ROW)."""
    return [tgen.loop_source(program, f"{name}_loop", rank, doc)] if tgen.whole_rows(program) \
        else []


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


def region_graph(key: str) -> fx.GraphModule:
    """The ATen graph of the region registered under `key` (placeholders: its inputs;
    output: the tuple of its outputs)."""
    return _region(key).gm


def runs_eagerly(device: torch.device) -> bool:
    """Whether regions on `device` would run their own ATen ops (CPU without Triton's
    interpreter): the runtime then puts those ops back in the graph instead
    (passes/fusion.py `inline_regions`), since the op's eager backward recomputes them."""
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def _mode(tensors: list[torch.Tensor]) -> str:
    if any(t.is_cuda for t in tensors):
        return "gpu"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "interpret"
    return "eager"


def _backward_of(region: _Region, wanted: tuple[int, ...]) -> tuple[Program, str, Path]:
    """The backward program of the gradients of inputs `wanted` only (a subset of
    `grad_inputs`), its kernel name and file: the whole backward is printed at
    registration; a subset's is printed at its first use into `<key>_g<mask>.py` (the
    same text on every rank), and computes and writes nothing for the other inputs."""
    if wanted == region.grad_inputs:
        return region.backward, region.info.backward_name, Path(region.info.path)
    if wanted not in region.subsets:
        full = region.backward
        picked = [region.grad_inputs.index(i) for i in wanted]
        program = Program(full.inputs, [full.outputs[k] for k in picked], full.dtype,
                          tuple(full.folds[k] for k in picked))
        tag = "".join("1" if i in wanted else "0" for i in region.grad_inputs)
        name, rank = f"{region.info.name}_bwd{tag}", region.lowered.rank
        doc = f"Backward of {', '.join(region.lowered.ops)} (inputs {list(wanted)})"
        path = tgen.write_source(f"{region.info.key}_g{tag}", tgen.module_source(
            [tgen.source(program, name, rank, doc), *_loops(program, name, rank, doc)],
            f"autohybrid fused region {region.info.key}, gradients of inputs {list(wanted)}"))
        region.subsets[wanted] = (program, name, path)
    return region.subsets[wanted]


def _kernel(region: _Region, wanted: tuple[int, ...] | None, interpret: bool, looped: bool):
    """The forward kernel (`wanted` None) or the backward kernel of inputs `wanted`."""
    slot = (wanted, interpret, looped)
    if slot not in region.loaded:
        if wanted is None:
            name, path = region.info.name, Path(region.info.path)
        else:
            _, name, path = _backward_of(region, wanted)
        region.loaded[slot] = tgen.load_kernel(path, name + ("_loop" if looped else ""),
                                               interpret)
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
    kernel = _kernel(region, None, mode == "interpret", tgen.looped(low.program, shape[-1]))
    tgen.launch(kernel, low.program, list(inputs), outs, shape, mode == "interpret")
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
def fused_region_backward(inputs: list[torch.Tensor], grads: list[torch.Tensor], key: str,
                          wanted: Optional[list[int]] = None) -> list[torch.Tensor]:
    """Gradients of region `key`'s float inputs `wanted` (input indices, in order; None:
    every float input), given its inputs and one gradient per output. Only those are
    computed: the kernel of that subset stores nothing else."""
    region = _region(key)
    want = region.grad_inputs if wanted is None else tuple(wanted)
    mode = _mode(inputs)
    if mode == "eager":
        return _eager_backward(region, inputs, grads, want)
    shape = _shape(inputs)
    program, _, _ = _backward_of(region, want)
    buffers = tgen.partials(program, shape, mode == "interpret", inputs[0].device)
    for k, (i, fold) in enumerate(zip(want, program.folds)):
        x = inputs[i]
        if fold is not None:           # summed in the kernel into partials
            continue
        if list(x.shape) == list(shape):
            buffers[k] = torch.empty(shape, device=x.device, dtype=x.dtype)
        else:  # broadcast over only some leading dims: a full buffer, summed down here
            buffers[k] = torch.empty(shape, device=x.device, dtype=program.dtype)
    grads = [_once(g, shape) if v.kind == "full" else g
             for g, v in zip(grads, region.lowered.program.outputs)]
    kernel = _kernel(region, want, mode == "interpret", tgen.looped(program, shape[-1]))
    tgen.launch(kernel, program, [*inputs, *grads], buffers, shape, mode == "interpret")
    return [_summed(b, inputs[i], fold) for i, b, fold in zip(want, buffers, program.folds)]


def _summed(buffer: torch.Tensor, x: torch.Tensor, fold) -> torch.Tensor:
    """Input `x`'s gradient from the kernel's `buffer` (partials when `fold`)."""
    if fold == "rows":
        buffer = buffer.sum(0)
    elif fold == "cols":
        buffer = buffer.sum(1)
    elif fold == "both":
        buffer = buffer.sum()
    elif buffer.shape == x.shape:
        return buffer
    else:
        return buffer.sum_to_size(x.shape).to(x.dtype)
    return buffer.reshape(x.shape).to(x.dtype)


@fused_region_backward.register_fake
def _(inputs, grads, key, wanted=None):
    want = _region(key).grad_inputs if wanted is None else wanted
    return [inputs[i].new_empty(inputs[i].shape) for i in want]


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


def _eager_backward(region: _Region, inputs, grads, wanted: tuple[int, ...]
                    ) -> list[torch.Tensor]:
    """Autograd through the region's ops, for the inputs `wanted`. Inside an op's kernel
    the dispatcher excludes the autograd keys; they are switched back on here for the
    recomputation."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    with torch.enable_grad(), torch._C._ForceDispatchKeyGuard(
            torch._C._dispatch_tls_local_include_set(), _without_autograd(exclude)):
        xs = [x.detach().requires_grad_(i in wanted) for i, x in enumerate(inputs)]
        outs = _as_list(region.gm(*xs))
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
        wrt = [xs[i] for i in wanted]
        got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                  allow_unused=True) if pairs and wrt else [None] * len(wrt)
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
    region = _region(ctx.key)
    needs = ctx.needs_input_grad[0] if ctx.needs_input_grad and \
        isinstance(ctx.needs_input_grad[0], (list, tuple)) else [True] * ctx.count
    wanted = tuple(i for i in region.grad_inputs if needs[i])
    result: list = [None] * ctx.count
    if not wanted:
        return result, None
    grads = [torch.zeros(s, dtype=d, device=xs[0].device) if g is None else g
             for g, (s, d) in zip(grads, ctx.out_like)]
    if _mode(list(xs)) == "eager":  # autograd through the region's ops, outside any op body
        got = _eager_backward(region, list(xs), grads, wanted)
    else:
        got = fused_region_backward(list(xs), grads, ctx.key,
                                    None if wanted == region.grad_inputs else list(wanted))
    for i, g in zip(wanted, got):
        result[i] = g
    return result, None


fused_region.register_autograd(_backward, setup_context=_setup)
