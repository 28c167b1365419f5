"""Where `compiled.fit` is in its data: the position, epochs, and a loader's own state.

Owns the data position (`DataPosition`: the epoch count and the batches consumed in the
current epoch), opening an epoch's batches (`epoch_batches`: `set_epoch` on the sampler,
the loader's own state restored or the consumed batches skipped), a loader's state as
JSON (a checkpoint's `extra` is JSON) and the check that a batch is `(inputs, targets)`.
It never trains and never touches the model: runtime/fit.py drives it.

What a resume reproduces: the batches a resumed run trains on are those the
uninterrupted run would have trained on when the loader yields the same batches in the
same order for a given epoch: a list, a DataLoader without shuffling, or one whose
sampler is seeded per epoch (`set_epoch`, as DistributedSampler is; a RandomSampler is
not: its order comes from a generator's state when the epoch began, which a mid-epoch
checkpoint does not hold). A
loader with `state_dict` / `load_state_dict` (torchdata's StatefulDataLoader) is restored
from its own state instead of skipping; without one, the consumed batches are read again
and dropped (loaded, not trained).
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import TrainingArgumentError


@dataclass
class DataPosition:
    """The epoch count (epochs completed) and the batches consumed in the current one."""
    epoch: int = 0
    batches: int = 0

    def to_extra(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches": self.batches}

    @staticmethod
    def from_extra(extra: dict[str, Any], where: str) -> "DataPosition":
        try:
            return DataPosition(int(extra["epoch"]), int(extra["batches"]))
        except (KeyError, TypeError, ValueError):
            raise TrainingArgumentError(
                f"resume: the data position in {where} is malformed ({extra!r}); expected "
                "{'epoch': int, 'batches': int} as fit saves it") from None


def is_one_shot(loader: Iterable) -> bool:
    """A one-shot iterator (a generator, `iter(x)`): its batches are read once."""
    return isinstance(loader, Iterator)


def is_stateful(loader: Any) -> bool:
    """Whether the loader saves and restores its own position (StatefulDataLoader)."""
    return (callable(getattr(loader, "state_dict", None))
            and callable(getattr(loader, "load_state_dict", None)))


def set_epoch(loader: Any, epoch: int) -> None:
    """`set_epoch(epoch)` on the loader, its sampler and batch sampler where they have it
    (DistributedSampler reshuffles by it), each object once."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    seen: set[int] = set()
    for obj in (loader, getattr(loader, "sampler", None), batch_sampler,
                getattr(batch_sampler, "sampler", None)):
        if obj is not None and id(obj) not in seen and callable(getattr(obj, "set_epoch", None)):
            seen.add(id(obj))
            obj.set_epoch(epoch)


def epoch_batches(loader: Iterable, position: DataPosition,
                  loader_state: Any = None) -> Iterator:
    """The batches of `position.epoch` from `position.batches` on: from the loader's own
    state when given (`loader_state`, as `encode_state` wrote it), else by skipping."""
    set_epoch(loader, position.epoch)
    if loader_state is not None:
        loader.load_state_dict(decode_state(loader_state))
        return iter(loader)
    return itertools.islice(iter(loader), position.batches, None)


def as_batch(batch: Any, index: int) -> tuple[Any, Any]:
    """`(inputs, targets)` of one batch, or a typed error naming the batch and the fix."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    what = (f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list))
            else f"a {type(batch).__name__}")
    raise TrainingArgumentError(
        f"fit: batch {index} of the loader is {what}, not (inputs, targets): yield pairs, "
        "inputs a tensor or tuple of tensors as in example_inputs (a dict batch: "
        "((batch['input_ids'],), batch['labels'])); with loss_fn=None the targets are "
        "what the model takes as labels")


def batch_tokens(inputs: Any) -> int:
    """Tokens in a batch: the elements of the first input when it holds integer ids of
    2 or more dims (a language model's tokens), else its samples (first dim)."""
    first = inputs if isinstance(inputs, torch.Tensor) else next(iter(inputs), None)
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return 0
    if first.dim() >= 2 and not first.is_floating_point() and not first.is_complex():
        return first.numel()
    return int(first.shape[0])


# ------------------------------------------------------------------ loader state as JSON
def encode_state(state: Any, where: str = "loader.state_dict()") -> Any:
    """A loader's state as JSON values: tensors (a sampler's generator state) as
    {"__tensor__": dtype, "shape", "data"}, tuples as lists; anything else is refused."""
    if isinstance(state, torch.Tensor):
        return {"__tensor__": str(state.dtype).removeprefix("torch."),
                "shape": list(state.shape), "data": state.flatten().tolist()}
    if isinstance(state, dict):
        bad = [k for k in state if not isinstance(k, str)]
        if bad:
            raise TrainingArgumentError(
                f"fit: {where} has the key {bad[0]!r} ({type(bad[0]).__name__}); a "
                "checkpoint keeps the loader's state as JSON, whose keys are strings: give "
                "the loader string keys, or leave state_dict out of it (fit then skips the "
                "consumed batches on resume)")
        return {k: encode_state(v, f"{where}[{k!r}]") for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [encode_state(v, f"{where}[{i}]") for i, v in enumerate(state)]
    if state is None or isinstance(state, (bool, int, float, str)):
        return state
    raise TrainingArgumentError(
        f"fit: {where} is a {type(state).__name__}, which a checkpoint's JSON cannot hold "
        "(it takes numbers, strings, lists, string-keyed dicts and tensors): make the "
        "loader's state_dict return those, or leave state_dict out of it (fit then skips "
        "the consumed batches on resume)")


def decode_state(state: Any) -> Any:
    """`encode_state`'s inverse (tuples come back as lists)."""
    if isinstance(state, dict):
        if "__tensor__" in state:
            dtype = getattr(torch, state["__tensor__"])
            return torch.tensor(state["data"], dtype=dtype).reshape(state["shape"])
        return {k: decode_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [decode_state(v) for v in state]
    return state
