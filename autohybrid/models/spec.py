"""MODEL strings: which model to build, with which arguments, as one line of text.

The CLI takes them, `ah.bench` takes them, and a Plan records the one it was made for
(`plan.model_ref`), so `autohybrid inspect plan.json` can rebuild the model later:

    gpt-tiny                                  a zoo preset (`autohybrid plan --list-models`)
    gpt3-1.3b?layers=2&seq=128                a preset with overrides
    path/to/file.py:factory                   a factory in a Python file (code: building
                                              the model runs the file)
    path/to/file.py:factory?hidden=64&batch=4 ... called with hidden=64

After `?`, `&`-separated `key=value` pairs: `batch` (example batch, default 8) and `seq`
(sequence length of token inputs, at most the model's, default the model's) shape the
example inputs; every
other key is an argument of the model: it replaces a preset's config entry, or is passed
to the factory as a keyword. Values are read as int, float, true/false, else text.

A factory returns the model (a zoo model: its example batch is generated), or
`(model, inputs)`, `(model, inputs, targets)` or `(model, inputs, targets, loss_fn)`.
Without a loss function, zoo models and factories that give targets train with
`cross_entropy` over the last dimension (`zoo_loss`); a factory giving no targets must
return a model that computes its own loss.
"""
from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError, UserFunctionError
from .presets import example_batch, get_preset

#: keys that shape the example inputs rather than the model
INPUT_KEYS = ("batch", "seq")
DEFAULT_BATCH = 8


def zoo_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension: next-token loss of a language model's
    (batch, seq, vocab) logits, class loss of a classifier's (batch, classes); a MoE
    model's (logits, balance loss) adds the balance loss (models/moe.moe_loss)."""
    if isinstance(output, (tuple, list)):
        from .moe import moe_loss
        return moe_loss(output, targets)
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))


@dataclass(frozen=True)
class ModelSpec:
    """A parsed MODEL string: `source` (preset name or `file.py:factory`) and arguments."""

    source: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    batch: int = DEFAULT_BATCH
    seq: int | None = None

    @property
    def is_file(self) -> bool:
        return ":" in self.source and self.source.split(":", 1)[0].endswith(".py")

    @property
    def ref(self) -> str:
        """The canonical MODEL string (what a Plan records)."""
        args = dict(self.kwargs)
        if self.batch != DEFAULT_BATCH:
            args["batch"] = self.batch
        if self.seq is not None:
            args["seq"] = self.seq
        query = "&".join(f"{k}={_text(v)}" for k, v in sorted(args.items()))
        return f"{self.source}?{query}" if query else self.source

    def with_inputs(self, batch: int | None = None, seq: int | None = None) -> "ModelSpec":
        for key, value in (("batch", batch), ("seq", seq)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ModelError(f"MODEL {self.ref!r}: {key} must be a positive integer, "
                                 f"got {value!r}")
        return ModelSpec(self.source, dict(self.kwargs), batch or self.batch,
                         seq if seq is not None else self.seq)

    def build(self, device: Any = "meta", seed: int = 0) -> "Workload":
        """The model (seeded with `seed` on a real device), its example inputs and targets
        and the loss to train it with."""
        if device != "meta":
            torch.manual_seed(seed)
        if self.is_file:
            return self._from_file(device)
        config = get_preset(self.source)
        longest = {**config.kwargs, **self.kwargs}.get("seq")
        if self.seq is not None and longest is not None and self.seq > longest:
            raise ModelError(f"MODEL {self.ref!r}: seq={self.seq} (the inputs' length) is "
                             f"longer than the model's {longest} positions")
        try:
            model = config.build(device=device, **self.kwargs)
        except ModelError:
            raise
        except (TypeError, ValueError) as exc:  # an unknown argument, text for a number
            raise ModelError(f"MODEL {self.ref!r}: {_argument_problem(exc, self.kwargs)}; "
                             f"the arguments of {self.source!r} are "
                             f"{', '.join(sorted(config.kwargs))}") from exc
        inputs, targets = example_batch(model, self.batch, seq=self.seq, device=_meta(model))
        return Workload(self.ref, model, inputs, targets, zoo_loss, zoo=True, spec=self)

    def _from_file(self, device: Any) -> "Workload":
        path, name = self.source.rsplit(":", 1)
        factory = load_factory(path, name)
        kwargs = dict(self.kwargs)
        if "device" in inspect.signature(factory).parameters:
            kwargs.setdefault("device", device)
        try:
            result = factory(**kwargs)
        except ModelError:
            raise
        except Exception as exc:
            raise UserFunctionError(f"MODEL {self.ref!r}: the factory {name!r} raised "
                                    f"{type(exc).__name__}: {exc}; fix it or its arguments "
                                    f"({', '.join(sorted(kwargs)) or 'none given'})") from exc
        if isinstance(result, nn.Module):
            result = (result,)
        if not isinstance(result, tuple) or not 1 <= len(result) <= 4 \
                or not isinstance(result[0], nn.Module):
            raise ModelError(f"{self.source} must return a model, (model, inputs), (model, "
                             "inputs, targets) or (model, inputs, targets, loss_fn); got "
                             f"{type(result).__name__}")
        model = result[0]
        zoo = getattr(model, "kind", None) is not None and hasattr(model, "config")
        if len(result) == 1:
            if not zoo:
                raise ModelError(f"{self.source} returned only a model, which is not a zoo "
                                 "model: return (model, example_inputs[, targets, loss_fn])")
            inputs, targets = example_batch(model, self.batch, seq=self.seq, device=_meta(model))
            return Workload(self.ref, model, inputs, targets, zoo_loss, zoo=True, spec=self)
        inputs = result[1] if isinstance(result[1], tuple) else (result[1],)
        targets = result[2] if len(result) > 2 else None
        loss_fn = result[3] if len(result) > 3 else (zoo_loss if targets is not None else None)
        return Workload(self.ref, model, inputs, targets, loss_fn, zoo=False, spec=self)


@dataclass
class Workload:
    """What one MODEL string builds: the model, one example batch, the loss."""

    ref: str
    model: nn.Module
    inputs: tuple
    targets: Any
    loss_fn: Callable | None
    zoo: bool
    spec: ModelSpec

    def batches(self, count: int, batch: int | None = None, seed: int = 0) -> list[tuple]:
        """`count` (inputs, targets) batches: fresh seeded draws for zoo models, the example
        batch again for a factory's model (whose data we cannot invent)."""
        if not self.zoo:
            return [(self.inputs, self.targets)] * count
        return [example_batch(self.model, batch or self.spec.batch, seq=self.spec.seq,
                              seed=seed + i) for i in range(count)]

    @property
    def tokens_per_sample(self) -> int | None:
        """Sequence length for token models (for tokens/s), else None."""
        first = self.inputs[0] if self.inputs else None
        if isinstance(first, torch.Tensor) and first.dim() == 2 and \
                not first.is_floating_point():
            return int(first.shape[1])
        return None


def parse(text: str) -> ModelSpec:
    """A MODEL string → ModelSpec (see the module docstring); clear errors for bad text."""
    if not isinstance(text, str) or not text.strip():
        raise ModelError(f"a MODEL is a zoo preset or path/file.py:factory, got {text!r}")
    source, _, query = text.strip().partition("?")
    kwargs: dict[str, Any] = {}
    for item in filter(None, query.split("&")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ModelError(f"MODEL {text!r}: argument {item!r} is not key=value")
        kwargs[key.strip()] = parse_value(value.strip())
    batch = kwargs.pop("batch", DEFAULT_BATCH)
    seq = kwargs.pop("seq", None)
    for key, value in (("batch", batch), ("seq", seq)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise ModelError(f"MODEL {text!r}: {key} must be a positive integer, got {value!r}")
    spec = ModelSpec(source, kwargs, batch, seq)
    if not spec.is_file:
        get_preset(source)  # unknown names fail here, with the closest matches
    elif not Path(source.rsplit(":", 1)[0]).is_file():
        raise ModelError(f"MODEL {text!r}: no such file {source.rsplit(':', 1)[0]!r}")
    return spec


def _argument_problem(exc: Exception, kwargs: dict[str, Any]) -> str:
    """Which MODEL argument a model constructor's TypeError / ValueError is about."""
    text = str(exc)
    texts = [k for k, v in kwargs.items() if isinstance(v, str)]
    if "unexpected keyword argument" in text:
        return f"unknown argument ({text.split('argument', 1)[1].strip()})"
    if texts and isinstance(exc, TypeError):
        return (f"argument {texts[0]}={kwargs[texts[0]]!r} must be a number "
                f"({type(exc).__name__}: {text})")
    return f"{type(exc).__name__}: {text}"


def load_factory(path: str, name: str) -> Callable:
    """The function `name` of the Python file `path` (running the file: a MODEL naming a
    file is code, as a plan recording one is: `autohybrid inspect` asks first)."""
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if module_spec is None or module_spec.loader is None or not Path(path).is_file():
        raise ModelError(f"cannot load {path!r}: no such Python file")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ModelError(f"{path} has no function {name!r}")
    return factory


def _meta(model: nn.Module) -> str | None:
    """'meta' for a model on the meta device (its inputs go there too), else None (CPU)."""
    first = next(iter(model.parameters()), None)
    return "meta" if first is not None and first.device.type == "meta" else None


def parse_value(text: str) -> Any:
    """`key=value` text → true/false as bool, else int, else float, else the text (MODEL
    arguments here, `--constrain` in the CLI)."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
