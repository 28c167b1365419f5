"""What one rank puts in a checkpoint, and takes back from one.

The tensors (checkpoint.Entry, with the boxes of checkpoint_layout.py): every parameter
as `model.<canonical name>` from what this rank holds of it (the model's own tensor, its
tp shard, its ZeRO flat shard; with pipeline parallelism only its stages' parameters),
every persistent buffer as `model.<name>`, the optimizer's per-parameter state as
`optim.<parameter>.<key>` laid out like the parameter (a 0-d one, such as Adam's `step`,
whole), and this rank's random generators as `rng.<rank>.cpu` / `.cuda`. The non-tensor
state (the optimizer's hyperparameters, the scheduler's and loss scaler's state) is JSON
in the manifest: nothing is pickled.

Optimizer state is resharded with its parameter, so an elementwise optimizer (SGD, Adam,
AdamW, RMSprop, Adagrad, ...) resumes under any plan; state of another shape than its
parameter is refused by name.
"""
from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn

from ..capture import canonical_names
from ..errors import CheckpointError
from ..ops.zero import shard_of
from ..program import ShardSpec
from .checkpoint import Entry
from .checkpoint_layout import Box, boxes, zero_range

_WHOLE_SCALAR = [Box((), (), 0, ())]


def param_entries(model: nn.Module, sharded: Any, zero: Any, owned: set[str] | None
                  ) -> dict[str, Entry]:
    """`model.<name>` for each parameter this rank holds, by canonical name (`sharded`:
    runtime/tp_state.ShardedParameters or None; `zero`: runtime/zero.ZeroShards or None;
    `owned`: the parameters of this rank's pipeline stages, None without pp)."""
    out: dict[str, Entry] = {}
    for name, p in model.named_parameters():
        if owned is not None and name not in owned:
            continue
        whole = tuple(p.shape)
        spec: ShardSpec | None = sharded.specs.get(name) if sharded is not None else None
        if zero is not None and name in zero.shards:
            local, tp_local = zero.shards[name], zero.shape[name]
            flat = zero_range(math.prod(tp_local), zero.ways(name), zero.index(name))
        elif spec is not None:
            local, tp_local, flat = sharded.local[name], tuple(sharded.local[name].shape), None
        else:
            local, tp_local, flat = p, whole, None
        if local.is_meta:
            continue
        out[name] = Entry(f"model.{name}", whole, p.dtype, local,
                          boxes(whole, tp_local, spec, flat))
    return out


def buffer_entries(model: nn.Module) -> list[Entry]:
    """`model.<name>` for each persistent buffer (whole; the same on every rank that
    holds it: pipeline parallelism refuses models whose forward updates buffers)."""
    persistent = set(model.state_dict(keep_vars=True))
    return [Entry(f"model.{name}", tuple(b.shape), b.dtype, b, boxes(b.shape, b.shape))
            for name, b in model.named_buffers() if name in persistent and not b.is_meta]


def model_tensors(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Shape and dtype of every tensor a checkpoint of `model` holds (the manifest's
    record, to refuse another model's checkpoint by name)."""
    persistent = set(model.state_dict(keep_vars=True))
    out = {f"model.{n}": _describe(p) for n, p in model.named_parameters()}
    out.update({f"model.{n}": _describe(b) for n, b in model.named_buffers() if n in persistent})
    return out


def first_mismatch(saved: dict[str, Any], mine: dict[str, Any]) -> str | None:
    """The first tensor whose presence, shape or dtype differs, described."""
    for fqn in sorted(set(saved) | set(mine)):
        if fqn not in mine:
            return f"the checkpoint holds {fqn!r} ({_text(saved[fqn])}), which this model lacks"
        if fqn not in saved:
            return f"this model's {fqn!r} ({_text(mine[fqn])}) is not in the checkpoint"
        if saved[fqn] != mine[fqn]:
            return f"{fqn!r} is {_text(saved[fqn])} in the checkpoint, {_text(mine[fqn])} here"
    return None


# ---------------------------------------------------------------------- optimizer
def optimizer_entries(optimizer: torch.optim.Optimizer, named: dict[str, torch.Tensor],
                      params: dict[str, Entry]) -> list[Entry]:
    """`optim.<name>.<key>` for the state of each optimizer parameter (`named`: name →
    the tensor the optimizer steps), laid out like the parameter's entry."""
    out = []
    for name, p in named.items():
        if name not in params:
            continue
        for key, value in optimizer.state.get(p, {}).items():
            out.append(_state_entry(name, key, value, p, params[name]))
    return out


def optimizer_layout(optimizer: torch.optim.Optimizer,
                     named: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """{parameter: {key: {"kind": "param" | "scalar", "dtype": ...}}} of this rank's
    optimizer state (the manifest's record: what a load creates before reading)."""
    out: dict[str, dict[str, Any]] = {}
    for name, p in named.items():
        state = optimizer.state.get(p, {})
        if state:
            out[name] = {key: {"kind": "param" if _param_shaped(v, p) else "scalar",
                               "dtype": str(v.dtype).removeprefix("torch.")}
                         for key, v in state.items() if isinstance(v, torch.Tensor)}
    return out


def prepare_optimizer_state(optimizer: torch.optim.Optimizer, named: dict[str, torch.Tensor],
                            layout: dict[str, dict[str, Any]], saved_class: str) -> None:
    """This optimizer's state made ready for a load of `layout` (a manifest's record):
    tensors of each saved key created where missing, state the checkpoint lacks dropped."""
    if type(optimizer).__name__ != saved_class:
        raise CheckpointError(f"the checkpoint's optimizer is {saved_class}, this model's "
                              f"{type(optimizer).__name__}: build the optimizer the "
                              "checkpoint was saved with (optimizer=...)")
    for name, p in named.items():
        keys = layout.get(name)
        if keys is None:
            optimizer.state.pop(p, None)
            continue
        state = optimizer.state[p]
        extra = sorted(set(k for k, v in state.items() if isinstance(v, torch.Tensor)) - set(keys))
        if extra:
            raise CheckpointError(f"this optimizer keeps {extra} for {name!r}, which the "
                                  "checkpoint does not hold: it was saved with other "
                                  "optimizer settings")
        for key, info in keys.items():
            dtype = getattr(torch, info["dtype"])
            if key in state and isinstance(state[key], torch.Tensor):
                continue
            if info["kind"] == "param":
                state[key] = torch.zeros_like(p, dtype=dtype)
            else:
                group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
                on_device = group.get("capturable") or group.get("fused")
                state[key] = torch.zeros((), dtype=dtype,
                                         device=p.device if on_device else "cpu")


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings but its parameters, as JSON values."""
    return [{k: _jsonable(v, f"optimizer.param_groups[{i}][{k!r}]")
             for k, v in g.items() if k != "params"}
            for i, g in enumerate(optimizer.param_groups)]


def restore_hyperparameters(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    groups = optimizer.param_groups
    if len(saved) != len(groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved)} param groups, "
                              f"this one {len(groups)}: build it as it was built for the save")
    for group, values in zip(groups, saved):
        for key, value in values.items():
            current = group.get(key)
            if isinstance(current, torch.Tensor):
                current.fill_(value)
            elif isinstance(current, tuple) and isinstance(value, list):
                group[key] = tuple(value)
            else:
                group[key] = value


# ---------------------------------------------------------------------- random state
def rng_entries(rank: int, *, source: int | None = None, shapes: dict[str, list[int]] | None = None,
                device: torch.device | None = None) -> list[Entry]:
    """This rank's generators (`rng.<rank>.cpu`, and `.cuda` on a CUDA device); for a
    load, empty tensors of the saved `shapes` to read rank `source`'s into."""
    saving = shapes is None
    out = []
    for kind in ("cpu", "cuda"):
        if kind == "cuda" and (device is None or device.type != "cuda"):
            continue
        if saving:
            state = torch.get_rng_state() if kind == "cpu" else torch.cuda.get_rng_state(device)
            fqn = f"rng.{rank}.{kind}"
        else:
            if kind not in shapes:
                continue
            state = torch.empty(shapes[kind], dtype=torch.uint8)
            fqn = f"rng.{source}.{kind}"
        out.append(Entry(fqn, tuple(state.shape), torch.uint8, state,
                         boxes(state.shape, state.shape)))
    return out


def apply_rng(entries: list[Entry], device: torch.device | None) -> None:
    for e in entries:
        if e.fqn.endswith(".cpu"):
            torch.set_rng_state(e.local)
        else:
            torch.cuda.set_rng_state(e.local, device)


# ---------------------------------------------------------------------- JSON state
def jsonable(value: Any, what: str) -> Any:
    """`value` (a state_dict of numbers, strings, lists, dicts, None) as JSON, or a
    CheckpointError naming the part that is not."""
    return _jsonable(value, what)


def _jsonable(value: Any, what: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, f"{what}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): _jsonable(v, f"{what}[{k!r}]") for k, v in value.items()}
    raise CheckpointError(f"{what} is a {type(value).__name__}, which a checkpoint cannot "
                          "hold (its non-tensor state is JSON: numbers, strings, lists, dicts)")


def _state_entry(name: str, key: str, value: Any, p: torch.Tensor, param: Entry) -> Entry:
    fqn = f"optim.{name}.{key}"
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"the optimizer keeps {type(value).__name__} {key!r} for "
                              f"{name!r}: a checkpoint holds tensor optimizer state only")
    if _param_shaped(value, p):
        return Entry(fqn, param.shape, value.dtype, value, param.boxes)
    if value.dim() == 0:
        return Entry(fqn, (), value.dtype, value, list(_WHOLE_SCALAR))
    raise CheckpointError(f"the optimizer's {key!r} for {name!r} has shape "
                          f"{tuple(value.shape)}, not its parameter's {tuple(p.shape)}: "
                          "checkpoints reshard elementwise optimizer state (SGD, Adam, "
                          "AdamW, ...) only")


def _param_shaped(value: torch.Tensor, p: torch.Tensor) -> bool:
    return tuple(value.shape) == tuple(p.shape) and (p.dim() > 0 or value.dim() > 0)


def _describe(t: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


def _text(d: dict[str, Any]) -> str:
    return f"{tuple(d['shape'])} {d['dtype']}"


# ---------------------------------------------------------------------- a compiled model
def save_compiled(c: Any, directory: Any, extra: dict | None, keep_last: int | None):
    """compiled.save: this rank's tensors and the manifest (`c`: a CompiledModel)."""
    from importlib import metadata as _md
    from . import checkpoint
    rank = c.rank
    params = param_entries(c.model, c.sharded, c.zero, c._owned)
    entries = [*params.values(), *buffer_entries(c.model)]
    optimizer, named = c.optimizer, c._optimizer_named() if c.optimizer is not None else {}
    if optimizer is not None:
        entries += optimizer_entries(optimizer, named, params)
    rngs = rng_entries(rank, device=c.device)
    entries += rngs
    layout = checkpoint._gather_dicts(optimizer_layout(optimizer, named)) if optimizer else {}
    scheduler = getattr(c, "scheduler", None)
    manifest = {
        "plan": c.plan.to_dict(), "graph_hash": c.plan.model_hash,
        "versions": {"autohybrid": _version(_md), "torch": torch.__version__},
        "world_size": c.cluster.world_size,
        "tensors": model_tensors(c.model),
        "optimizer": None if optimizer is None else {
            "class": type(optimizer).__name__, "param_groups": hyperparameters(optimizer),
            "state": dict(sorted(layout.items()))},
        "scheduler": None if scheduler is None else jsonable(scheduler.state_dict(),
                                                             "scheduler.state_dict()"),
        "scaler": None if c.scaler is None else jsonable(vars(c.scaler), "loss scaler"),
        "rng": {"world": c.cluster.world_size,
                **{e.fqn.rsplit(".", 1)[1]: list(e.shape) for e in rngs}},
        "extra": jsonable(extra or {}, "extra"),
    }
    return checkpoint.save(directory, [e for e in entries if e.boxes], manifest, c.step,
                           keep_last)


def load_compiled(c: Any, path: Any, strict: bool) -> dict:
    """compiled.load: every tensor this rank holds read from the checkpoint at `path`
    (resharded from whatever plan saved it), then the non-tensor state; returns `extra`."""
    from . import checkpoint
    where, manifest = checkpoint.read_manifest(path)
    checkpoint.verify(where, manifest)
    mismatch = first_mismatch(manifest.get("tensors", {}), model_tensors(c.model))
    if mismatch:
        raise CheckpointError(f"checkpoint {where} is of another model: {mismatch}")
    if strict and manifest.get("graph_hash") != c.plan.model_hash:
        raise CheckpointError(
            f"checkpoint {where} was saved from another graph (hash "
            f"{manifest.get('graph_hash')}, this model's {c.plan.model_hash}): the model's code "
            "or its loss differs though every tensor matches; load(..., strict=False) takes "
            "the tensors anyway")
    # ZeRO 1/2 ranks hold the whole (tp-local) parameters: read those and cut the shards
    # from them here, instead of reading the shards and all-gathering the rest
    whole_params = c.zero is not None and c.zero.stage < 3
    params = param_entries(c.model, c.sharded, None if whole_params else c.zero, c._owned)
    entries = [*params.values(), *buffer_entries(c.model)]
    optimizer = c.optimizer
    saved_opt = manifest.get("optimizer")
    if optimizer is not None and saved_opt is not None:
        named = c._optimizer_named()
        prepare_optimizer_state(optimizer, named, saved_opt["state"], saved_opt["class"])
        shards = param_entries(c.model, c.sharded, c.zero, c._owned) if whole_params else params
        entries += optimizer_entries(optimizer, named, shards)
    rng = manifest["rng"]
    source = c.rank if c.rank < rng["world"] else c.rank % rng["world"]
    rngs = rng_entries(c.rank, source=source, device=c.device,
                       shapes={k: v for k, v in rng.items() if k != "world"})
    entries += rngs
    checkpoint.load(where, [e for e in entries if e.boxes])
    if whole_params:
        with torch.no_grad():
            for name, shard in c.zero.shards.items():
                shard.copy_(shard_of(c.zero.params[name], c.zero.ways(name),
                                     c.zero.index(name)))
    if optimizer is not None and saved_opt is not None:
        restore_hyperparameters(optimizer, saved_opt["param_groups"])
    scheduler = getattr(c, "scheduler", None)
    if scheduler is not None and manifest.get("scheduler") is not None:
        scheduler.load_state_dict(manifest["scheduler"])
    if c.scaler is not None and manifest.get("scaler") is not None:
        for key, value in manifest["scaler"].items():
            setattr(c.scaler, key, value)
    _refresh_check_reference(c, None)
    apply_rng(rngs, c.device)
    c.step = int(manifest["step"])
    return manifest.get("extra", {})


def _refresh_check_reference(c: Any, state_dict: dict[str, torch.Tensor] | None) -> None:
    """check=True's eager copy (rank 0's, taken at compile) given the loaded values, so
    the first step is compared from them (`state_dict`: the whole state loaded; None:
    gather it, every rank taking part). The per-stage check reads the state at the step."""
    check = getattr(c, "_check", None)
    if check is None or check.done or check.per_stage:
        return
    whole = state_dict if state_dict is not None else c.full_state_dict()
    if check.reference is not None:
        check.reference.load_state_dict(whole)


def _version(md: Any) -> str:
    try:
        return md.version("autohybrid")
    except Exception:
        return "unknown"


# ---------------------------------------------------------------------- whole state dicts
def load_whole_state(c: Any, state_dict: dict[str, torch.Tensor]) -> None:
    """Every tensor this rank holds taken from a whole state dict (`model.state_dict()`
    names, tied aliases included): its boxes of the whole tensors, so tp and ZeRO shards
    receive what `model.load_state_dict` gives the model; no collective (ranks may call it
    at different times). Keys missing or of another shape are left to torch's own load
    to report."""
    aliases = parameter_aliases(c.model)
    with torch.no_grad():
        for name, entry in param_entries(c.model, c.sharded, c.zero, c._owned).items():
            full = next((state_dict[k] for k in aliases.get(name, [name]) if k in state_dict), None)
            if not isinstance(full, torch.Tensor) or tuple(full.shape) != entry.shape:
                continue
            for b in entry.boxes:
                index = tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))
                b.view(entry.local).copy_(full[index])
            if c.zero is not None and c.zero.stage < 3 and name in c.zero.params:
                whole = c.zero.params[name]
                spec = c.sharded.specs.get(name) if c.sharded is not None else None
                whole.copy_(spec.local(full.to(whole.device)) if spec is not None else full)


def parameter_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Each parameter's canonical (first) name → every name it has (tied ones)."""
    aliases: dict[str, list[str]] = {}
    for name, first in canonical_names(model).items():
        aliases.setdefault(first, []).append(name)
    return aliases


def guard_optimizer_load(optimizer: torch.optim.Optimizer, named: dict[str, torch.Tensor]) -> None:
    """Refuse, in `optimizer.load_state_dict`, state whose tensors do not fit this rank's
    parameters (an optimizer state dict of another plan: torch would take it and the
    first step would fail on a size mismatch)."""
    if getattr(optimizer, "_autohybrid_load_guard", False):
        return
    optimizer._autohybrid_load_guard = True
    names = {id(p): name for name, p in named.items()}

    def check(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        params = [p for g in opt.param_groups for p in g["params"]]
        saved = [i for g in state_dict.get("param_groups", []) for i in g.get("params", [])]
        if len(saved) != len(params):
            raise CheckpointError(
                f"optimizer.load_state_dict: the state dict has {len(saved)} parameters, this "
                f"rank's optimizer {len(params)}: it is another plan's (or model's) optimizer "
                "state; save with compiled.save and load with compiled.load, which reshard")
        for index, p in zip(saved, params):
            for key, value in state_dict.get("state", {}).get(index, {}).items():
                if (isinstance(value, torch.Tensor) and value.dim() > 0
                        and tuple(value.shape) != tuple(p.shape)):
                    raise CheckpointError(
                        f"optimizer.load_state_dict: state {key!r} of parameter "
                        f"{names.get(id(p), index)!r} has shape {tuple(value.shape)}, this "
                        f"rank's parameter {tuple(p.shape)}: it is another plan's optimizer "
                        "state; save with compiled.save and load with compiled.load, which "
                        "reshard")
    optimizer.register_load_state_dict_pre_hook(check)


def hook_whole_loads(c: Any) -> Any:
    """`c.model.load_state_dict(...)` after compile also loads this rank's shards
    (load_whole_state); the hook holds `c` weakly. Returns the hook's handle."""
    ref = weakref.ref(c)

    def hook(module, state_dict, prefix, *_):
        compiled = ref()
        if compiled is not None:
            whole = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
            load_whole_state(compiled, whole)
            _refresh_check_reference(compiled, whole)
    return c.model.register_load_state_dict_pre_hook(hook)
