"""Seeded, slice-addressable parameter initialization, for sharded materialization.

Why: a model built on the meta device holds no memory; at scale no rank can afford to
build the whole model and then throw away what it does not own. Each rank must allocate
and initialize only its own shards (a tp row or column block, a ZeRO flat chunk, a
pipeline stage), and the shards of all ranks together must hold exactly the values the
whole model would hold, so that an eager reference (`materialize`, same seed) is
comparable number for number. That needs an initialization in which *any slice of any
parameter* can be computed without computing the rest: a counter-based one.

What this module owns: the init rule (which distribution each parameter gets: an
`InitSpec`), the value of every element under a seed (`values`, `flat_values`,
`shard_values`), and eager materialization (`materialize`, `materialize_buffers`). It
does not decide shardings or touch process groups; the runtime asks it for slices.

The scheme (version 1), precisely, so that anyone can reproduce it::

    digest = sha256(f"autohybrid.init/v1/{seed}/{name}".encode("utf-8"))  # seed: int
    k1, k2 = digest[0:8], digest[8:16] as little-endian unsigned 64-bit integers
    for the element at flat index i of the FULL tensor (row-major over its full shape):
        r = mix64(mix64(i * 0x9E3779B97F4A7C15 + k1) ^ k2)         # all mod 2**64
        u = ((r >> 12) + 0.5) * 2**-52                             # in (0, 1), exact
    mix64(z): z ^= z >> 30; z *= 0xBF58476D1CE4E5B9
              z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31  # SplitMix64's mixer
    normal(mean, std):   mean + std * ndtri(u)    (float64: torch.special.ndtri)
    uniform(low, high):  low + (high - low) * u   (float64)
    constant(value):     value                    (no draws)
    then cast to the parameter's dtype with `Tensor.to(dtype)`.

So a value depends only on (seed, name, flat index in the full tensor) and the spec,
never on which slice was asked for, how it was chunked, the dtype of the draw or the
device: a tp shard, a ZeRO chunk of that shard and the whole tensor agree bitwise. `u`
is exact integer arithmetic, identical on every platform (uniform and constant values
too); `ndtri` is floating point, and its float64 result can differ in the last bit
between CPU kernels (torch's AVX2 and AVX512 kernels agree; the non-SIMD "default" one
differs by <= 1e-15 relative in some elements), which a cast to float32 almost always
hides. A slice costs only its own elements (a column shard draws no other column) and
is computed in chunks of `CHUNK` elements: temporary memory stays O(CHUNK). `name` is
the canonical parameter name (`model.named_parameters()`, tied parameters once, under
their first name).

(Why not one `torch.Generator` per block of the tensor: CPU generators keep only the low
32 bits of their seed, so blocks of a large model would collide; and a column shard
would have to draw every block it crosses, i.e. the whole matrix.)

Rules, first match wins: the `rule=` callable given to `init_specs` / `materialize`;
the rule a zoo model records at construction (`_ah_init_rule`, e.g. `TransformerRule`,
the one `models._common.init_transformer_` applies eagerly, so eager construction and
`materialize` give the same distributions); then `default_rule`: norm weights one and
biases zero (LayerNorm, RMSNorm, BatchNorm, GroupNorm, any module class named `*Norm`),
other `bias`/`*_bias` zero, conv weights He-normal fan-out (as the zoo ResNet and
torchvision), any other >= 2-D parameter N(0, 0.02) (so the zoo ResNet's final Linear,
which eager construction leaves at PyTorch's uniform default, is N(0, 0.02) with a zero
bias here). Anything else raises `ModelError` naming the parameter. Buffers come from
the module's own construction: only meta BatchNorm-style running statistics are
recomputed (`materialize_buffers`); any other meta buffer is refused with an error.

Example::

    model = ah.models.preset("gpt-tiny", device="meta")
    specs = init_specs(model)                     # {"tok_emb.weight": N(0, 0.02), ...}
    w = values(specs["blocks.0.mlp.fc.weight"], (128, 32), seed=0,
               name="blocks.0.mlp.fc.weight", index=(slice(64, 128), slice(None)))
    ref = materialize(ah.models.preset("gpt-tiny", device="meta"), seed=0)
    torch.equal(w, ref.blocks[0].mlp.fc.weight[64:128])    # True
"""
from __future__ import annotations

import difflib
import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from .errors import ModelError

#: Standard deviation of the GPT-2 style normal initialization (and of the default rule).
INIT_STD = 0.02
#: Elements computed per step: bounds the temporary memory of `values` (a few CHUNK-sized
#: int64/float64 tensors), never the result. Values do not depend on it. Kept below
#: torch's intra-op grain size (32768): threading each small op costs more than it gains.
CHUNK = 1 << 15
#: Attribute on which a model records the rule its constructor applies.
INIT_RULE_ATTR = "_ah_init_rule"
KINDS = ("normal", "uniform", "constant")
_VERSION = "autohybrid.init/v1"


@dataclass(frozen=True)
class InitSpec:
    """How one parameter is initialized: N(mean, std), U(low, high) or a constant."""

    kind: str
    mean: float = 0.0
    std: float = 0.0
    low: float = 0.0
    high: float = 0.0
    value: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ModelError(f"InitSpec: kind={self.kind!r}; use one of {KINDS}")
        if self.kind == "normal" and not self.std >= 0:
            raise ModelError(f"InitSpec: normal std={self.std} must be >= 0")
        if self.kind == "uniform" and not self.low <= self.high:
            raise ModelError(f"InitSpec: uniform needs low <= high, got {self.low} > {self.high}")

    @classmethod
    def normal(cls, std: float, mean: float = 0.0) -> InitSpec:
        return cls("normal", mean=float(mean), std=float(std))

    @classmethod
    def uniform(cls, low: float, high: float) -> InitSpec:
        return cls("uniform", low=float(low), high=float(high))

    @classmethod
    def constant(cls, value: float) -> InitSpec:
        return cls("constant", value=float(value))

    def draw_(self, t: torch.Tensor) -> torch.Tensor:
        """Fill `t` in place from torch's global RNG, as eager construction does (these
        are not the counter-based `values`)."""
        if self.kind == "normal":
            return t.normal_(self.mean, self.std)
        if self.kind == "uniform":
            return t.uniform_(self.low, self.high)
        return t.fill_(self.value)

    def __str__(self) -> str:
        if self.kind == "normal":
            return f"N({self.mean:g}, {self.std:g})"
        if self.kind == "uniform":
            return f"U({self.low:g}, {self.high:g})"
        return f"constant({self.value:g})"


#: rule(module_name, module, param_name, param) -> InitSpec, or None for "not mine".
Rule = Callable[[str, nn.Module, str, torch.Tensor], "InitSpec | None"]
_ZEROS, _ONES = InitSpec.constant(0.0), InitSpec.constant(1.0)
_NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)


def is_norm(module: nn.Module) -> bool:
    """A normalization layer (torch's, or any class whose name ends in ``Norm``)."""
    return isinstance(module, _NORM_TYPES) or type(module).__name__.endswith("Norm")


@dataclass(frozen=True)
class TransformerRule:
    """GPT-2 style rule: Linear and Embedding weights N(0, std); Linear layers flagged
    ``_ah_residual_proj`` N(0, residual_std) when given; biases zero; norm weights one.
    `models._common.init_transformer_` applies it eagerly and records it on the model."""

    std: float = INIT_STD
    residual_std: float | None = None

    def __call__(self, module_name: str, module: nn.Module, param_name: str,
                 param: torch.Tensor) -> InitSpec | None:
        if isinstance(module, nn.Linear):
            if param_name == "weight":
                residual = self.residual_std is not None and getattr(
                    module, "_ah_residual_proj", False)
                return InitSpec.normal(self.residual_std if residual else self.std)
            return _ZEROS if param_name == "bias" else None
        if isinstance(module, nn.Embedding):
            return InitSpec.normal(self.std) if param_name == "weight" else None
        if is_norm(module):
            return {"weight": _ONES, "bias": _ZEROS}.get(param_name)
        if getattr(module, "_ah_experts", False) and param.dim() == 3:
            return InitSpec.normal(self.std)  # stacked expert weights (models/moe.py)
        return None


def default_rule(module_name: str, module: nn.Module, param_name: str,
                 param: torch.Tensor) -> InitSpec | None:
    """The fallback rule (see the module docstring); None where it has no answer."""
    if is_norm(module) and param_name in ("weight", "bias"):
        return _ONES if param_name == "weight" else _ZEROS
    if param_name == "bias" or param_name.endswith("_bias"):
        return _ZEROS
    if isinstance(module, nn.modules.conv._ConvNd) and param_name == "weight":
        fan_out = param.shape[0] * math.prod(param.shape[2:])  # kaiming_normal_ fan_out
        return InitSpec.normal(math.sqrt(2.0 / max(fan_out, 1)))
    if param.dim() >= 2:
        return InitSpec.normal(INIT_STD)
    return None


def init_specs(model: nn.Module, rule: Rule | None = None) -> dict[str, InitSpec]:
    """Canonical parameter name -> `InitSpec`, in `model.named_parameters()` order (tied
    parameters once, by their first owner). Raises `ModelError` for an uncovered one."""
    recorded: dict[str, Rule | None] = {}
    specs: dict[str, InitSpec] = {}
    seen: set[int] = set()
    for mname, m in model.named_modules():
        own = getattr(m, INIT_RULE_ATTR, None)
        recorded[mname] = own if own is not None else recorded.get(mname.rpartition(".")[0])
        for pname, p in m._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            name = f"{mname}.{pname}" if mname else pname
            rules = [r for r in (rule, recorded[mname], default_rule) if r is not None]
            specs[name] = _spec_for(name, mname, m, pname, p, rules)
    return specs


def _spec_for(name: str, mname: str, m: nn.Module, pname: str, p: torch.Tensor,
              rules: list[Rule]) -> InitSpec:
    for r in rules:
        spec = r(mname, m, pname, p)
        if spec is not None:
            if not isinstance(spec, InitSpec):
                raise ModelError(f"init rule {r!r} returned {spec!r} for {name!r}; "
                                 "a rule returns an InitSpec or None")
            return spec
    raise ModelError(
        f"init: no rule covers parameter {name!r} ({type(m).__name__}.{pname}, shape "
        f"{tuple(p.shape)}); the default rule covers norm weights, biases and >= 2-D "
        "weights. Pass rule=lambda module_name, module, param_name, param: "
        "InitSpec.normal(0.02) if ... else None to init_specs/materialize.")


# ----------------------------------------------------------------------------- values

_M64 = (1 << 64) - 1


def _i64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits (torch has no u64 math)."""
    c &= _M64
    return c - (1 << 64) if c >= 1 << 63 else c


_GAMMA, _C1, _C2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _keys(seed: int, name: str) -> tuple[int, int]:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ModelError(f"init: seed must be an int, got {seed!r}")
    d = hashlib.sha256(f"{_VERSION}/{seed}/{name}".encode("utf-8")).digest()
    return _i64(int.from_bytes(d[0:8], "little")), _i64(int.from_bytes(d[8:16], "little"))


def _xorshift_(z: torch.Tensor, s: int) -> torch.Tensor:
    """z ^= z >> s, logical shift on int64 bits (torch shifts int64 arithmetically)."""
    return z.bitwise_xor_((z >> s).bitwise_and_((1 << (64 - s)) - 1))


def _mix64_(z: torch.Tensor) -> torch.Tensor:
    _xorshift_(z, 30).mul_(_C1)   # int64 products wrap mod 2**64, as the scheme needs
    _xorshift_(z, 27).mul_(_C2)
    return _xorshift_(z, 31)


def _uniform(keys: tuple[int, int], idx: torch.Tensor) -> torch.Tensor:
    """float64 u in (0, 1) for the int64 flat indices `idx` (the scheme above)."""
    z = _mix64_(_mix64_(idx.mul(_GAMMA).add_(keys[0])).bitwise_xor_(keys[1]))
    return ((z >> 12).bitwise_and_((1 << 52) - 1).to(torch.float64).add_(0.5)
            .mul_(2.0 ** -52))


def _bounds(shape: tuple[int, ...], index: object, name: str) -> list[tuple[int, int]]:
    """(start, stop) per dim of `index` (a tuple of step-1 slices; missing dims are whole)."""
    if index is None:
        return [(0, s) for s in shape]
    index = (index,) if isinstance(index, slice) else tuple(index)  # type: ignore[arg-type]
    if len(index) > len(shape):
        raise ValueError(f"init: index {index} of {name!r} has {len(index)} entries but the "
                         f"tensor has shape {shape}")
    out = []
    for d, size in enumerate(shape):
        sl = index[d] if d < len(index) else slice(None)
        if not isinstance(sl, slice):
            raise ValueError(f"init: index of {name!r} dim {d} is {sl!r}, not a slice; "
                             f"use slice(i, i + 1)")
        if sl.step not in (None, 1):
            raise ValueError(f"init: index of {name!r} dim {d} is {sl}: only step 1 is "
                             "supported (a shard is a contiguous block)")
        a = 0 if sl.start is None else sl.start
        b = size if sl.stop is None else sl.stop
        if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b <= size):
            raise ValueError(f"init: index of {name!r} dim {d} is {sl}, out of range for "
                             f"size {size} (shape {shape}): need 0 <= start <= stop <= {size}")
        out.append((a, b))
    return out


def _collapse(shape: tuple[int, ...], bounds: list[tuple[int, int]]
              ) -> tuple[list[int], list[tuple[int, int]]]:
    """Merge each whole trailing dim into the one before it: same flat indices, fewer dims
    (a row shard, a whole tensor and a flat range become one contiguous range)."""
    dims, bnds = list(shape), list(bounds)
    while len(dims) > 1 and bnds[-1] == (0, dims[-1]):
        size = dims.pop()
        bnds.pop()
        dims[-1] *= size
        bnds[-1] = (bnds[-1][0] * size, bnds[-1][1] * size)
    return dims, bnds


def _full_index(shape: list[int], bounds: list[tuple[int, int]], p0: int,
                p1: int) -> torch.Tensor:
    """Flat indices in the full tensor of positions [p0, p1) of the sliced, flattened one
    (`shape`, `bounds` as `_collapse` returns them)."""
    if len(shape) <= 1:
        a = bounds[0][0] if bounds else 0
        return torch.arange(p0 + a, p1 + a, dtype=torch.int64)
    pos = torch.arange(p0, p1, dtype=torch.int64)
    idx = torch.zeros_like(pos)
    stride = 1
    for size, (a, b) in zip(reversed(shape), reversed(bounds)):
        idx += (pos % (b - a) + a) * stride
        pos //= b - a
        stride *= size
    return idx


def values(spec: InitSpec, shape: Sequence[int], seed: int, name: str,
           index: Sequence[slice] | slice | None = None,
           flat: tuple[int, int] | None = None, dtype: torch.dtype = torch.float32,
           device: torch.device | str = "cpu") -> torch.Tensor:
    """The values of `full[index]` for the parameter `name` of full `shape` under `seed`.

    `index`: one step-1 slice per leading dim (None: the whole tensor), e.g. a tp column
    shard ``(slice(None), slice(128, 256))``. `flat=(start, stop)`: only that range of
    the sliced tensor flattened row-major, returned 1-D (a ZeRO chunk of a tp shard).
    Computed on the CPU in float64 chunks, cast to `dtype`, then moved to `device`.
    """
    shape = tuple(int(s) for s in shape)
    bounds = _bounds(shape, index, name)
    sub = tuple(b - a for a, b in bounds)
    n = math.prod(sub)
    p0, p1 = (0, n) if flat is None else (int(flat[0]), int(flat[1]))
    if not 0 <= p0 <= p1 <= n:
        raise ValueError(f"init: flat range {flat} of {name!r} is out of range: the sliced "
                         f"tensor {sub} has {n} elements")
    out_shape = sub if flat is None else (p1 - p0,)
    if spec.kind == "constant":
        return torch.full(out_shape, spec.value, dtype=dtype, device=device)
    keys = _keys(seed, name)
    dims, bnds = _collapse(shape, bounds)
    out = torch.empty(p1 - p0, dtype=dtype)
    for c0 in range(p0, p1, CHUNK):
        c1 = min(c0 + CHUNK, p1)
        u = _uniform(keys, _full_index(dims, bnds, c0, c1))
        if spec.kind == "normal":
            x = torch.special.ndtri(u).mul_(spec.std).add_(spec.mean)
        else:
            x = u.mul_(spec.high - spec.low).add_(spec.low)
        out[c0 - p0:c1 - p0] = x.to(dtype)
    return out.view(out_shape).to(device)


def flat_values(spec: InitSpec, numel: int, seed: int, name: str, start: int, stop: int,
                dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """Elements [start, stop) of the whole parameter flattened (a ZeRO chunk), 1-D."""
    return values(spec, (numel,), seed, name, flat=(start, stop), dtype=dtype, device=device)


def shard_values(source: nn.Module | Mapping[str, InitSpec], name: str,
                 full_shape: Sequence[int] | None, seed: int,
                 index: Sequence[slice] | slice | None = None,
                 flat: tuple[int, int] | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu", rule: Rule | None = None) -> torch.Tensor:
    """`values` of parameter `name` looked up in a model (shape and dtype default to the
    parameter's) or in an `init_specs` dict (pass that once-computed dict at scale)."""
    specs = init_specs(source, rule) if isinstance(source, nn.Module) else source
    if name not in specs:
        close = difflib.get_close_matches(name, list(specs), n=3)
        raise ModelError(f"init: no parameter {name!r}"
                         + (f"; did you mean {', '.join(map(repr, close))}?" if close else ""))
    if isinstance(source, nn.Module):
        p = dict(source.named_parameters())[name]
        full_shape = p.shape if full_shape is None else full_shape
        dtype = p.dtype if dtype is None else dtype
    if full_shape is None:
        raise ModelError(f"init: shard_values({name!r}) from a spec dict needs full_shape")
    return values(specs[name], full_shape, seed, name, index=index, flat=flat,
                  dtype=dtype or torch.float32, device=device)


# ----------------------------------------------------------------------- materialize

_RUNNING_STATS = {"running_mean": 0.0, "running_var": 1.0, "num_batches_tracked": 0}


def materialize(model: nn.Module, seed: int, rule: Rule | None = None,
                device: torch.device | str = "cpu") -> nn.Module:
    """Give every parameter its `values` under `seed`, in place; returns `model`.

    A meta parameter becomes a new `nn.Parameter` on `device` (same dtype and
    requires_grad), set on every module that holds it, so tied weights stay one
    Parameter; a real one is overwritten in place. Meta buffers: `materialize_buffers`.
    """
    specs = init_specs(model, rule)
    new: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = values(specs[name], p.shape, seed, name, dtype=p.dtype,
                       device=device if p.is_meta else p.device)
            if p.is_meta:
                new[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
            else:
                p.copy_(t)
    replace_parameters(model, new)
    return materialize_buffers(model, device)


def replace_parameters(model: nn.Module, new: Mapping[int, nn.Parameter]) -> None:
    """Put `new[id(p)]` in place of every parameter `p` it names, in every module that
    holds `p` (so tied weights stay one Parameter)."""
    for m in model.modules():
        for k, p in m._parameters.items():
            if p is not None and id(p) in new:
                m._parameters[k] = new[id(p)]


def materialize_buffers(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """Allocate the meta buffers that can be recomputed (BatchNorm-style running
    statistics: mean 0, var 1, count 0) on `device`; real buffers are kept. Any other
    meta buffer raises `ModelError`: buffers come from the module's own construction."""
    done: dict[int, torch.Tensor] = {}
    for mname, m in model.named_modules():
        for k, b in m._buffers.items():
            if b is None or not b.is_meta:
                continue
            if id(b) not in done:
                full = f"{mname}.{k}" if mname else k
                if not (isinstance(m, nn.modules.batchnorm._NormBase) and k in _RUNNING_STATS):
                    raise ModelError(
                        f"init: buffer {full!r} ({type(m).__name__}.{k}, shape "
                        f"{tuple(b.shape)}) is on the meta device and cannot be recomputed: "
                        "buffers come from the module's construction. Build that module on "
                        "a real device, or compute the tensor in forward (as the zoo's Llama "
                        "does with its rotary tables).")
                done[id(b)] = torch.full(b.shape, _RUNNING_STATS[k], dtype=b.dtype,
                                         device=device)
            m._buffers[k] = done[id(b)]
    return model


__all__ = ["CHUNK", "INIT_STD", "InitSpec", "Rule", "TransformerRule", "default_rule",
           "flat_values", "init_specs", "is_norm", "materialize", "materialize_buffers",
           "shard_values", "values"]
