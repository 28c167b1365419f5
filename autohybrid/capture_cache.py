"""An in-process memo of captured graphs, keyed by everything a capture depends on.

Owns the key (a fingerprint of the model's structure and code, the loss function, the
example shapes and the global state that changes a trace) and the memo; capture.py asks
it before exporting and stores what it exported. It does not trace anything itself.

Why: every rank of a job, and every case of a test that trains one model under several
plans, would otherwise export the same graph again (a second or more each time). A hit
returns the graph captured before, never another model instance's tensors: the captured
graph holds none (parameters and buffers are placeholders fed from the model at hand;
tensor constants are re-read from the new model, or refused when they cannot be).

What the key covers (a part it cannot fingerprint makes the capture uncacheable, never a
guess):

- each module's path, class (by identity: a class defined again is another class), its
  plain attributes (numbers, strings, dtypes, configs, containers of them, tensors by
  shape/dtype), its parameters and buffers by name, shape, dtype, device, requires_grad;
  a module with hooks is not cached;
- the code: every function of each module class and its bases below nn.Module (by
  identity, so a method patched onto the class misses); for `forward` and the methods it
  names, the functions they call by global name (three calls deep), the attributes of
  modules they name (`F.relu`: by identity) and the global values they read;
- the loss function's code, defaults and closure values, and the globals it reads;
- example inputs and targets by shape, dtype and device; with_loss; autocast dtype;
- torch's version, grad mode, default dtype and deterministic-algorithms flag, and the
  capture mode (AUTOHYBRID_CAPTURE: once per block, or the full export).

What it does not see: code more than three calls below a forward; a global object that
has no value fingerprint (it is taken by identity, so a change of its attributes goes
unseen); state outside the model that a forward reads through a call into C++. In-process
only: nothing is written to disk, so a file edited on disk is a new process's concern.
`AUTOHYBRID_CAPTURE_CACHE=0` switches the memo off (each capture exports afresh);
`AUTOHYBRID_CAPTURE_CACHE_SIZE` sets how many graphs it keeps (default 16, least recently
used dropped first).

    >>> key = capture_key(model, inputs, targets, loss_fn, with_loss=True, autocast=None)
    >>> cached = lookup(key, model)      # None, or a CapturedGraph for this model
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import itertools
import logging
import os
import re
import types
import weakref
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from .errors import CaptureError
from .sample_stats import RemedyLoss, StatsLoss

MAX_ENTRIES = 16          # graphs kept per process (least recently used dropped first)
#: environment variable: how many graphs a process keeps instead (a test suite that
#: trains dozens of small models in each warm rank sets it higher)
SIZE_ENV = "AUTOHYBRID_CAPTURE_CACHE_SIZE"
_CODE_DEPTH = 3           # levels of called functions whose globals are fingerprinted
_VALUE_DEPTH = 8          # nesting of attribute values (configs, containers)

_MODULE_INTERNALS = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
    "_backward_pre_hooks", "_backward_hooks", "_is_full_backward_hook", "_forward_hooks",
    "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"})
_HOOKS = ("_backward_pre_hooks", "_backward_hooks", "_forward_hooks", "_forward_pre_hooks")

_log = logging.getLogger("autohybrid.capture")
_memo: "OrderedDict[tuple, tuple[Any, list]]" = OrderedDict()


class Uncacheable(Exception):
    """Some part of the capture's inputs has no fingerprint: export afresh."""


def enabled() -> bool:
    return os.environ.get("AUTOHYBRID_CAPTURE_CACHE", "1") != "0"


def clear() -> None:
    _memo.clear()


def max_entries() -> int:
    """Graphs kept per process: `AUTOHYBRID_CAPTURE_CACHE_SIZE`, else MAX_ENTRIES."""
    raw = os.environ.get(SIZE_ENV, "").strip()
    if not raw:
        return MAX_ENTRIES
    try:
        size = int(raw)
    except ValueError:
        size = -1
    if size < 1:
        raise CaptureError(f"{SIZE_ENV}={raw!r}: give a whole number of graphs, 1 or more "
                          f"(default {MAX_ENTRIES}; AUTOHYBRID_CAPTURE_CACHE=0 switches "
                          "the memo off)")
    return size


# ----------------------------------------------------------------------------- the key
def capture_key(model: nn.Module, inputs: Sequence[torch.Tensor],
                targets: Sequence[torch.Tensor], loss_fn: Callable | None, *,
                with_loss: bool, autocast: torch.dtype | None) -> tuple[tuple, list] | None:
    """The memo key of one capture, with the objects it names kept alive beside it (so
    no id in it is ever reused); None when something has no fingerprint or the memo is
    off."""
    if not enabled():
        return None
    walk = _Walker()
    key = _key(walk, model, inputs, targets, loss_fn, with_loss, autocast)
    return None if key is None else (key, walk.refs)


def portable_digest(model: nn.Module, inputs: Sequence[torch.Tensor],
                    targets: Sequence[torch.Tensor], loss_fn: Callable | None, *,
                    with_loss: bool, autocast: torch.dtype | None) -> str | None:
    """The key of `capture_key` as a digest that is the same in every process running
    the same code on the same model: objects are named by module, qualified name and
    the digest of their code instead of by identity (runtime/capture_share.py compares
    it across ranks before one rank's graph serves them all), and the devices with
    their index (on GPUs each rank traces its own). None where the key is."""
    if not enabled():
        return None
    key = _key(_PortableWalker(), model, inputs, targets, loss_fn, with_loss, autocast)
    # the devices by index too: a graph names the device its ops create tensors on
    # (arange(..., device=cuda:0)), so a graph traced on another GPU is not this rank's
    devices = sorted({str(t.device) for t in (*inputs, *targets)} |
                     {str(t.device) for t in itertools.islice(model.parameters(), 1)})
    return None if key is None else \
        hashlib.sha256(repr((key, devices)).encode()).hexdigest()


def _key(walk: "_Walker", model: nn.Module, inputs: Sequence[torch.Tensor],
         targets: Sequence[torch.Tensor], loss_fn: Callable | None, with_loss: bool,
         autocast: torch.dtype | None) -> tuple | None:
    try:
        key = (torch.__version__, os.environ.get("AUTOHYBRID_CAPTURE", ""),
               torch.is_grad_enabled(), torch.get_default_dtype(),
               torch.are_deterministic_algorithms_enabled(), with_loss, autocast,
               _tensors(inputs), _tensors(targets), walk.model(model),
               walk.callable(loss_fn, _CODE_DEPTH) if with_loss else None)
        hash(key)
    except (Uncacheable, TypeError, ValueError, RecursionError) as exc:
        _log.info("capture not memoized: %s", exc)
        return None
    return key


def _tensors(ts: Sequence[torch.Tensor]) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device.type, t.requires_grad) for t in ts)


class _Walker:
    """Builds one key: `refs` keeps every object whose id the key holds alive; each
    function is walked once (`fns`), which also ends cycles through closures."""

    def __init__(self) -> None:
        self.refs: list = []
        self.fns: dict[int, tuple] = {}

    def ref(self, obj: Any) -> int:
        self.refs.append(obj)
        return id(obj)

    def model(self, model: nn.Module) -> tuple:
        if (nn.modules.module._global_forward_hooks or
                nn.modules.module._global_forward_pre_hooks or
                nn.modules.module._global_backward_hooks):
            raise Uncacheable("global module hooks")
        classes: set[type] = set()
        out = []
        for name, m in model.named_modules(remove_duplicate=False):
            if any(getattr(m, h, None) for h in _HOOKS):
                raise Uncacheable(f"hooks on {name or 'the model'}")
            if type(m) not in classes:
                classes.add(type(m))
                out.append(("class", self.class_code(type(m))))
            attrs = tuple(sorted((k, self.value(v, _VALUE_DEPTH)) for k, v in vars(m).items()
                                 if k not in _MODULE_INTERNALS))
            params = tuple((k, None if p is None else _tensors([p])[0])
                           for k, p in m._parameters.items())
            buffers = tuple((k, None if b is None else _tensors([b])[0],
                             k in m._non_persistent_buffers_set) for k, b in m._buffers.items())
            out.append((name, self.ref(type(m)), attrs, params, buffers, tuple(m._modules)))
        # tied parameters: which names share one tensor changes the graph's placeholders
        first: dict[int, str] = {}
        ties = tuple((n, first.setdefault(id(p), n))
                     for n, p in model.named_parameters(remove_duplicate=False))
        return tuple(out) + (ties,)

    def class_code(self, cls: type) -> tuple:
        """Every function defined by `cls` and its bases below nn.Module, by identity (a
        method patched onto the class is another function); `forward` and the methods it
        names are walked for the globals they read."""
        out = []
        names = {"forward"}
        for base in cls.__mro__:
            if base in (nn.Module, object):
                break
            fns = {}
            for name, attr in vars(base).items():
                fn = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
                fn = attr.fget if isinstance(attr, property) else fn
                if isinstance(fn, types.FunctionType):
                    fns[name] = fn
            if "forward" in fns:
                names |= _names(fns["forward"].__code__)
            for name, fn in fns.items():
                walked = self.callable(fn, _CODE_DEPTH) if name in names else None
                out.append((base.__qualname__, name, self.ref(fn), walked))
        return (self.ref(cls), tuple(out))

    def callable(self, fn: Any, depth: int) -> tuple:
        """A function by identity of its code, with its defaults, closure and (`depth`
        levels of calls deep) the globals it reads: a fresh lambda from the same line
        has the same key."""
        if fn is None:
            return ("none",)
        if isinstance(fn, functools.partial):
            return ("partial", self.callable(fn.func, depth),
                    self.value(fn.args, _VALUE_DEPTH), self.value(fn.keywords, _VALUE_DEPTH))
        if isinstance(fn, types.MethodType):
            return ("method", self.callable(fn.__func__, depth),
                    self.value(fn.__self__, _VALUE_DEPTH))
        if isinstance(fn, nn.Module):
            return ("module", self.model(fn))
        if isinstance(fn, StatsLoss):   # a loss with per-sample statistics: its functions
            return ("stats", self.callable(fn.loss_fn, depth),
                    self.callable(fn.stats_fn, depth))
        if isinstance(fn, RemedyLoss):
            return ("remedy", fn.gamma, fn.temperature, fn.weighted)
        if not isinstance(fn, types.FunctionType):
            if isinstance(fn, (types.BuiltinFunctionType, type)) or \
                    getattr(fn, "__module__", "").startswith("torch"):
                return ("builtin", self.ref(fn))
            raise Uncacheable(f"callable {type(fn).__name__}")
        memo = (id(fn), depth)
        if memo in self.fns:
            return self.fns[memo]
        self.fns[memo] = ("cycle", self.ref(fn.__code__))
        closure = tuple(self.value(c.cell_contents, _VALUE_DEPTH) for c in fn.__closure__ or ())
        defaults = (self.value(fn.__defaults__, _VALUE_DEPTH),
                    self.value(fn.__kwdefaults__, _VALUE_DEPTH))
        globals_ = self.globals_read(fn.__code__, fn.__globals__, depth) if depth > 0 else ()
        self.fns[memo] = ("fn", self.ref(fn.__code__), closure, defaults, globals_)
        return self.fns[memo]

    def globals_read(self, code: types.CodeType, globals_: dict, depth: int) -> tuple:
        names = _names(code)
        out = []
        for name in sorted(n for n in names if n in globals_):
            obj = globals_[name]
            if isinstance(obj, types.ModuleType):   # module.attr: the attributes it names
                attrs = tuple((a, self.ref(getattr(obj, a))) for a in sorted(names)
                              if a in vars(obj) and
                              not isinstance(getattr(obj, a), types.ModuleType))
                out.append((name, self.ref(obj), attrs))
            elif isinstance(obj, types.FunctionType):
                out.append((name, self.callable(obj, depth - 1)))
            elif isinstance(obj, type) or callable(obj):
                out.append((name, self.ref(obj)))
            else:   # a value it reads; an object no value fingerprints, by identity
                try:
                    out.append((name, self.value(obj, _VALUE_DEPTH)))
                except Uncacheable:
                    out.append((name, "object", self.ref(obj)))
        return tuple(out)

    def held_module(self, m: nn.Module, depth: int) -> tuple:
        """A module an attribute holds outside the module tree, as a tree module is keyed:
        its class and code, plain attributes, parameters and buffers by shape, and its
        submodules (depth-limited); one with hooks has no fingerprint."""
        out = []
        for name, sub in m.named_modules(remove_duplicate=False):
            if any(getattr(sub, h, None) for h in _HOOKS):
                raise Uncacheable(f"hooks on a held module's {name or 'root'}")
            attrs = tuple(sorted((k, self.value(x, depth - 1)) for k, x in vars(sub).items()
                                 if k not in _MODULE_INTERNALS))
            params = tuple((k, None if t is None else _tensors([t])[0])
                           for k, t in sub._parameters.items())
            buffers = tuple((k, None if t is None else _tensors([t])[0])
                            for k, t in sub._buffers.items())
            out.append((name, self.class_code(type(sub)), attrs, params, buffers))
        return ("module", tuple(out))

    def value(self, v: Any, depth: int) -> Any:
        """A hashable fingerprint of an attribute value; Uncacheable when it has none."""
        if depth < 0:
            raise Uncacheable("value nested too deeply")
        if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
            return (type(v).__name__, repr(v))
        if isinstance(v, (torch.dtype, torch.device, torch.Size, torch.memory_format,
                          torch.layout, enum.Enum)):
            return (type(v).__name__, repr(v))
        if isinstance(v, torch.Tensor):
            return ("tensor",) + _tensors([v])[0]
        if isinstance(v, (tuple, list)):
            return (type(v).__name__, tuple(self.value(x, depth - 1) for x in v))
        if isinstance(v, (set, frozenset)):
            return (type(v).__name__, tuple(sorted(repr(self.value(x, depth - 1)) for x in v)))
        if isinstance(v, dict):
            items = ((repr(self.value(k, depth - 1)), self.value(x, depth - 1))
                     for k, x in v.items())
            return ("dict", tuple(sorted(items, key=lambda kv: kv[0])))
        if isinstance(v, weakref.ref):   # e.g. an LSTM's references to its weights
            return ("weakref", self.value(v(), depth - 1))
        if isinstance(v, nn.Module):   # held outside the module tree (transformers 5.25
            return self.held_module(v, depth)   # keeps kernel wrappers in `_kernel_funcs`)
        if isinstance(v, (types.FunctionType, types.MethodType, functools.partial)):
            return self.callable(v, min(depth, _CODE_DEPTH))
        if isinstance(v, (type, types.BuiltinFunctionType, types.ModuleType, logging.Logger)):
            return ("ref", self.ref(v))
        if hasattr(v, "__dict__"):   # configs and the like
            return ("obj", self.ref(type(v)), self.value(dict(vars(v)), depth - 1))
        raise Uncacheable(f"attribute of type {type(v).__name__}")


class _PortableWalker(_Walker):
    """A `_Walker` whose references name objects the same way in every process: a
    function or class by module, qualified name and code digest, a module by name,
    code by a digest of its bytecode, constants and names."""

    def ref(self, obj: Any) -> Any:
        if isinstance(obj, types.CodeType):
            return ("code", _code_digest(obj))
        if isinstance(obj, types.ModuleType):
            return ("module", obj.__name__)
        if isinstance(obj, logging.Logger):
            return ("logger", obj.name)
        name = (getattr(obj, "__module__", None), getattr(obj, "__qualname__", None))
        if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)) or \
                all(isinstance(n, str) for n in name):
            if not all(isinstance(n, str) for n in name):
                raise Uncacheable(f"{type(obj).__name__} without a qualified name")
            code = getattr(obj, "__code__", None)
            return ("named", name, _code_digest(code) if code is not None else None)
        # an object without a value fingerprint: by its type and address-free repr
        try:
            text = repr(obj)
        except Exception as exc:  # noqa: BLE001 — no repr: no portable name
            raise Uncacheable(f"{type(obj).__name__} without a repr") from exc
        return ("object", type(obj).__module__, type(obj).__qualname__,
                _ADDRESS.sub("0x", text)[:200])


_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def _code_digest(code: types.CodeType) -> str:
    consts = tuple(_code_digest(c) if isinstance(c, types.CodeType)
                   else _ADDRESS.sub("0x", repr(c)) for c in code.co_consts)
    return hashlib.sha256(repr((code.co_code, code.co_names, code.co_varnames,
                                code.co_freevars, code.co_cellvars, consts)).encode()
                          ).hexdigest()[:24]


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


# ----------------------------------------------------------------------------- the memo
def lookup(key: Any, model: nn.Module) -> Any | None:
    """The graph captured under `key` (a CapturedGraph), its constants re-read from
    `model`; None on a miss or when a constant cannot be re-read."""
    if key is None or not enabled():
        return None
    k, _refs = key
    entry = _memo.get(k)
    if entry is None:
        return None
    _memo.move_to_end(k)
    cap = entry[0]
    constants = {}
    for name, t in cap.constants.items():
        fresh = _constant_of(model, name, t)
        if fresh is None:
            return None
        constants[name] = fresh
    return _copy(cap, constants=constants)


def store(key: Any, cap: Any) -> None:
    if key is None or not enabled():
        return
    k, refs = key
    size = max_entries()   # a bad setting is refused before the memo changes
    _memo[k] = (_copy(cap), refs)
    _memo.move_to_end(k)
    while len(_memo) > size:
        _memo.popitem(last=False)


def _copy(cap: Any, **changes: Any) -> Any:
    """A CapturedGraph sharing the graph module (which nothing modifies: passes rewrite a
    copy) with its own lists and dicts, so a caller's edits never reach the memo."""
    fields = {f.name: getattr(cap, f.name) for f in dataclasses.fields(cap)}
    fields = {k: (type(v)(v) if isinstance(v, (list, dict)) else v) for k, v in fields.items()}
    return dataclasses.replace(cap, **{**fields, **changes})


def _constant_of(model: nn.Module, name: str, old: Any) -> Any | None:
    """A tensor constant of the captured graph for `model`: the model's own attribute
    when the constant is one (checked alike), else the constant the trace created (a
    value of the code, the same for every instance the key matches)."""
    path = name[len("model."):] if name.startswith("model.") else name
    obj: Any = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            break
    if obj is None:   # export's name for a tensor the trace made (torch.tensor(...))
        return old if re.fullmatch(r"(c_)?lifted_tensor_\d+|_tensor_constant\d+", path) \
            else None
    if not isinstance(obj, torch.Tensor) or not isinstance(old, torch.Tensor) or \
            _tensors([obj]) != _tensors([old]):
        return None
    return obj
