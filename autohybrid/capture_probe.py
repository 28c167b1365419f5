"""A cheap trace of what each block of a model does, to prove blocks trace identically.

Owns the probe behind capture per distinct block (capture_blocks.py): one forward of the
model (with its loss) on the meta device or under a FakeTensorMode — no compute, no
graph — recording every
top-level torch call (`TorchFunctionMode`) as (function, arguments, result). Tensors in
the record are named by where they came from, not by identity: a parameter by its name
(a block's own parameters relative to the block), a tensor made by an earlier call by
its position (inside the current segment: relative to the segment's start; in the part
before the first block: absolute), an input by its position. Two blocks whose records
are equal call the same torch functions with the same scalars, shapes and wiring, so
torch.export records the same ops for them. It does not export and touches no graph.

Example::

    >>> trace = probe(wrapper, blocks, "model.blocks", args)
    >>> trace.blocks[0] == trace.blocks[1]      # two identical GPT blocks
    True
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._pytree import tree_leaves

_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
            torch.memory_format)


@dataclass
class Trace:
    """The record of one forward, cut at the block calls."""

    prefix: list = field(default_factory=list)     # before the first block
    blocks: list[list] = field(default_factory=list)
    gaps: list[list] = field(default_factory=list)  # between block i and block i + 1
    suffix: list = field(default_factory=list)     # after the last block (the loss included)


class Refused(Exception):
    """Capturing block by block is not safe for this model (capture exports all of it)."""


class _Recorder(TorchFunctionMode):
    """Records top-level torch calls; block markers cut the record into segments."""

    def __init__(self, names: dict[int, str], inputs: tuple, list_path: str):
        super().__init__()
        self.entries: list = []
        self.where: dict[int, int] = {id(t): -1 - i for i, t in enumerate(inputs)}
        self.keep: list = list(inputs)     # keeps ids unique while the record lives
        self.names = names
        self.pattern = re.compile(rf"^{re.escape(list_path)}\.(\d+)\.(.*)$")
        self.block = -1                   # the block being run, or the last one run
        self.inside = False
        self.prefix_end: int | None = None
        self.seg_start = 0
        self.bounds: list[tuple[int, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = resolve_name(func) or getattr(func, "__qualname__", None) or repr(func)
        self.entries.append((name, self._enc((args, kwargs)), self._result(out)))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.where[id(leaf)] = len(self.entries) - 1
                self.keep.append(leaf)
        return out

    def enter(self, index: int) -> None:
        if self.inside or index != len(self.bounds):
            raise Refused(f"block {index} is called out of order or inside another block")
        if self.prefix_end is None:
            self.prefix_end = len(self.entries)
        self.inside, self.block, self.seg_start = True, index, len(self.entries)
        self.bounds.append((len(self.entries), -1))

    def leave(self, index: int) -> None:
        self.inside = False
        self.bounds[index] = (self.bounds[index][0], len(self.entries))
        self.seg_start = len(self.entries)

    def _ref(self, t: torch.Tensor) -> tuple:
        fqn = self.names.get(id(t))
        if fqn is not None:
            m = self.pattern.match(fqn)
            return ("param", fqn) if m is None else ("block param", int(m[1]) - self.block, m[2])
        j = self.where.get(id(t))
        if j is None:
            return ("tensor", tuple(t.shape), str(t.dtype))
        if j < 0:
            return ("input", -1 - j)
        if self.prefix_end is None or j < self.prefix_end:
            return ("prefix", j)
        return ("made", j - self.seg_start)

    def _enc(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._ref(obj)
        if isinstance(obj, (list, tuple)):
            return (type(obj).__name__, tuple(self._enc(o) for o in obj))
        if isinstance(obj, dict):
            return ("dict", tuple((k, self._enc(v)) for k, v in obj.items()))
        if isinstance(obj, slice):
            return ("slice", self._enc(obj.start), self._enc(obj.stop), self._enc(obj.step))
        if isinstance(obj, _SCALARS) or obj is Ellipsis:
            return repr(obj)
        return ("object", type(obj).__module__, type(obj).__qualname__)

    def _result(self, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return (tuple(out.shape), tuple(out.stride()), str(out.dtype), out.requires_grad)
        if isinstance(out, (list, tuple)):
            return tuple(self._result(o) for o in out)
        return repr(out) if isinstance(out, _SCALARS) else type(out).__qualname__


@contextlib.contextmanager
def _marked(blocks: nn.ModuleList, recorder: _Recorder) -> Iterator[None]:
    """Each block's forward tells the recorder when it starts and ends."""
    def marked(index: int, forward):
        def run(*args, **kwargs):
            recorder.enter(index)
            out = forward(*args, **kwargs)
            recorder.leave(index)
            return out
        return run

    for i, block in enumerate(blocks):
        block.__dict__["forward"] = marked(i, block.forward)
    try:
        yield
    finally:
        for block in blocks:
            block.__dict__.pop("forward", None)


@contextlib.contextmanager
def _fake_state(module: nn.Module, mode) -> Iterator[None]:
    """Every parameter and buffer of `module` replaced by its fake (None: left alone)."""
    saved = []
    if mode is not None:
        for m in module.modules():
            for table in (m._parameters, m._buffers):
                for key, t in table.items():
                    if t is not None:
                        saved.append((table, key, t))
                        table[key] = mode.from_tensor(t)   # memoized: tied stay tied
    try:
        yield
    finally:
        for table, key, t in saved:
            table[key] = t


def probe(wrapper: nn.Module, blocks: nn.ModuleList, list_path: str, args: tuple) -> Trace:
    """Run `wrapper(*args)` once on fake tensors and record it, cut at `blocks`' calls.

    `list_path` is the name of `blocks` inside `wrapper` (parameter names start with it).
    Raises Refused when a block is not called exactly once, in order.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    on_meta = all(t.device.type == "meta" for t in [*args, *wrapper.parameters(),
                                                      *wrapper.buffers()])
    # a model on the meta device runs as it is (cheapest); others on fake copies of their
    # parameters and buffers (a BatchNorm must not count the probe as a batch)
    mode = contextlib.nullcontext() if on_meta else FakeTensorMode(allow_non_fake_inputs=True)
    with mode, _fake_state(wrapper, None if on_meta else mode):
        names: dict[int, str] = {}
        for name, t in [*wrapper.named_parameters(remove_duplicate=False),
                        *wrapper.named_buffers(remove_duplicate=False)]:
            names.setdefault(id(t), name)
        fake = args if on_meta else tuple(mode.from_tensor(a) for a in args)
        recorder = _Recorder(names, fake, list_path)
        with _marked(blocks, recorder), recorder:  # grad on: export traces with it
            wrapper(*fake)
    bounds, entries = recorder.bounds, recorder.entries
    if len(bounds) != len(blocks) or any(end < 0 for _, end in bounds):
        raise Refused(f"{len(bounds)} of {len(blocks)} blocks were called")
    return Trace(prefix=entries[:bounds[0][0]],
                 blocks=[entries[s:e] for s, e in bounds],
                 gaps=[entries[bounds[i][1]:bounds[i + 1][0]] for i in range(len(bounds) - 1)],
                 suffix=entries[bounds[-1][1]:])
