"""Partial local shuffling (Nguyen et al., IPDPS 2022): each worker keeps a shard of the
dataset and, before every epoch, swaps only a fraction Q of it with the other workers.

The dataset is partitioned once across the M workers (by default a seeded permutation cut
into M parts of ⌊N/M⌋ or ⌈N/M⌉ samples; or a given partition, e.g. by class for a
non-IID study). Before epoch e every worker shuffles its part (a generator seeded by
seed, e and the worker) and sends its first k = ⌊Q·N/M⌋ samples away: they are cut into
M − 1 chunks of ⌊k/(M−1)⌋ or ⌈k/(M−1)⌉ samples, chunk j going to worker w + j + 1
(mod M). Worker r thus receives chunk (r − w − 1) mod M from each other worker w — every
chunk position once — so it receives exactly k samples as it sends k: the parts keep
their sizes, a worker never holds more than its part plus k (≤ (1 + Q)·⌈N/M⌉) while
the exchange is in flight, and no sample is lost or duplicated. Q = 0 is local
shuffling; Q = 1 sends every sample of equal parts away (a global reshuffle).

The plan is a function of (partition, seed, epoch) only, so every worker computes the
whole of it (sample ids are small) and the exchange of epoch e + 1 can be started while
epoch e trains. `exchange` moves the samples' tensors over torch.distributed (one
`all_to_all_single` per tensor with per-peer sizes; `async_op=True` returns a handle
whose `wait()` gives the new part, to overlap with training — run it on a process group
of its own, e.g. `dist.new_group()`, so its collectives never interleave with the
training's); `bytes_sent` counts what it sent.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import TrainingArgumentError


@dataclass(frozen=True)
class EpochExchange:
    """What the workers swap before one epoch: `sends[w][r]` the sample ids worker w
    sends to worker r (empty for r = w), and the parts after it."""
    epoch: int
    sends: tuple[tuple[tuple[int, ...], ...], ...]
    parts: tuple[tuple[int, ...], ...]

    def sent(self, worker: int) -> int:
        return sum(len(ids) for ids in self.sends[worker])

    def received(self, worker: int) -> int:
        return sum(len(row[worker]) for row in self.sends)


def _generator(*keys: int) -> torch.Generator:
    seed = 0
    for k in keys:
        seed = (seed * 1_000_003 + k) % (2 ** 62)
    return torch.Generator().manual_seed(seed)


def _chunks(k: int, pieces: int) -> list[int]:
    base, extra = divmod(k, pieces)
    return [base + (j < extra) for j in range(pieces)]


@dataclass
class PartialShuffle:
    """Partial local shuffling of `num_samples` samples over `workers` workers with
    fraction `q`; see the module docstring. `advance(epoch)` applies that epoch's
    exchange to the parts (every worker calls it with the same epochs)."""

    num_samples: int
    workers: int
    q: float = 0.1
    seed: int = 0
    partition: Sequence[Sequence[int]] | None = None
    parts: list[list[int]] = field(init=False)
    epoch: int = field(init=False, default=-1)
    bytes_sent: int = field(init=False, default=0)
    samples_sent: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.workers < 1 or self.num_samples < self.workers:
            raise TrainingArgumentError(
                f"PartialShuffle: {self.num_samples} samples over {self.workers} workers: "
                "give at least one sample per worker")
        if not 0.0 <= self.q <= 1.0:
            raise TrainingArgumentError(f"PartialShuffle: q {self.q} must be in [0, 1]")
        if self.partition is None:
            order = torch.randperm(self.num_samples, generator=_generator(self.seed)).tolist()
            sizes = _chunks(self.num_samples, self.workers)
            starts = [sum(sizes[:w]) for w in range(self.workers)]
            self.parts = [order[s:s + n] for s, n in zip(starts, sizes)]
        else:
            self.parts = [list(map(int, p)) for p in self.partition]
            flat = sorted(i for p in self.parts for i in p)
            if len(self.parts) != self.workers or flat != list(range(self.num_samples)):
                raise TrainingArgumentError(
                    f"PartialShuffle: the partition must give {self.workers} parts holding "
                    f"every sample id in [0, {self.num_samples}) exactly once")
            low = self.per_worker_sent()
            if any(len(p) < low for p in self.parts):
                raise TrainingArgumentError(
                    f"PartialShuffle: a part of {min(map(len, self.parts))} samples cannot "
                    f"send the {low} that q = {self.q} asks of every worker")

    def per_worker_sent(self) -> int:
        """k = ⌊Q · N / M⌋: what every worker sends (and receives) per epoch."""
        return int(math.floor(self.q * self.num_samples / self.workers + 1e-9))

    def plan(self, epoch: int) -> EpochExchange:
        """The exchange before `epoch` from the parts now (nothing is changed)."""
        m, k = self.workers, self.per_worker_sent()
        sizes = _chunks(k, m - 1) if m > 1 else []
        sends = [[() for _ in range(m)] for _ in range(m)]
        kept = []
        for w, part in enumerate(self.parts):
            order = torch.randperm(len(part), generator=_generator(self.seed, epoch, w))
            shuffled = [part[i] for i in order.tolist()]
            out = shuffled[:k] if m > 1 else []
            kept.append(shuffled[len(out):])
            start = 0
            for j, size in enumerate(sizes):
                sends[w][(w + j + 1) % m] = tuple(out[start:start + size])
                start += size
        parts = tuple(tuple(kept[r]) + tuple(i for w in range(m) for i in sends[w][r])
                      for r in range(m))
        return EpochExchange(epoch, tuple(tuple(row) for row in sends), parts)

    def advance(self, epoch: int) -> EpochExchange:
        """Apply the exchange before `epoch` to the parts (bookkeeping only; `exchange`
        also moves the data)."""
        if epoch <= self.epoch:
            raise TrainingArgumentError(f"PartialShuffle.advance({epoch}): epoch {self.epoch} "
                                        "is already applied; epochs go forward")
        plan = self.plan(epoch)
        self.parts = [list(p) for p in plan.parts]
        self.epoch = epoch
        self.samples_sent += sum(plan.sent(w) for w in range(self.workers))
        return plan

    def local_order(self, worker: int) -> list[int]:
        """Worker `worker`'s part in this epoch's training order (a seeded shuffle)."""
        part = self.parts[worker]
        order = torch.randperm(len(part), generator=_generator(self.seed, self.epoch, worker,
                                                                7))
        return [part[i] for i in order.tolist()]

    # ---------------------------------------------------------------- moving the data
    def exchange(self, epoch: int, tensors: Sequence[torch.Tensor], *, group: Any = None,
                 async_op: bool = False) -> Any:
        """Advance to `epoch`, moving this worker's samples: `tensors` (on the group's
        device: CUDA for NCCL) hold its current part (row i = sample `parts[rank][i]`);
        the result (or, with `async_op`, a handle
        whose `wait()` returns it) holds the new part in `parts[rank]` order. Every worker
        of `group` (default: the world, rank = worker) calls it."""
        rank = dist.get_rank(group) if group is not None else dist.get_rank()
        if (dist.get_world_size(group) if group is not None else dist.get_world_size()) \
                != self.workers:
            raise TrainingArgumentError("PartialShuffle.exchange: the group's size must be "
                                        f"the {self.workers} workers")
        before = {i: row for row, i in enumerate(self.parts[rank])}
        for t in tensors:
            if t.shape[0] != len(before):
                raise TrainingArgumentError(
                    f"PartialShuffle.exchange: a tensor of {t.shape[0]} rows for a part of "
                    f"{len(before)} samples")
        plan = self.advance(epoch)
        sends = plan.sends[rank]
        out_ids = [i for r in range(self.workers) for i in sends[r]]
        in_sizes = [len(plan.sends[w][rank]) for w in range(self.workers)]
        device = tensors[0].device if tensors else torch.device("cpu")   # index_select's
        rows = torch.tensor([before[i] for i in out_ids], dtype=torch.long, device=device)
        kept_ids = list(plan.parts[rank][:len(plan.parts[rank]) - sum(in_sizes)])
        kept_rows = torch.tensor([before[i] for i in kept_ids], dtype=torch.long,
                                 device=device)
        works, received = [], []
        for t in tensors:
            src = t.index_select(0, rows).contiguous()
            dst = t.new_empty((sum(in_sizes), *t.shape[1:]))
            work = dist.all_to_all_single(dst, src, output_split_sizes=in_sizes,
                                          input_split_sizes=[len(sends[r])
                                                             for r in range(self.workers)],
                                          group=group, async_op=async_op)
            self.bytes_sent += src.numel() * src.element_size()
            works.append(work)
            received.append(dst)
        kept = [t.index_select(0, kept_rows) for t in tensors]

        def done() -> list[torch.Tensor]:
            for work in works:
                if work is not None:
                    work.wait()
            # received rows come sender by sender, as parts[rank] lists them after the kept
            return [torch.cat([k, r]) for k, r in zip(kept, received)]

        return _Handle(done) if async_op else done()

    def state_dict(self) -> dict[str, Any]:
        return {"parts": [list(p) for p in self.parts], "epoch": self.epoch,
                "bytes_sent": self.bytes_sent, "samples_sent": self.samples_sent}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        parts = [list(map(int, p)) for p in state["parts"]]
        if len(parts) != self.workers or sorted(i for p in parts for i in p) != \
                list(range(self.num_samples)):
            raise TrainingArgumentError("PartialShuffle.load_state_dict: the saved parts are "
                                        f"not a partition of {self.num_samples} samples over "
                                        f"{self.workers} workers")
        self.parts, self.epoch = parts, int(state["epoch"])
        self.bytes_sent, self.samples_sent = int(state["bytes_sent"]), int(state["samples_sent"])


class _Handle:
    def __init__(self, done):
        self._done, self._result = done, None

    def wait(self) -> list[torch.Tensor]:
        if self._result is None:
            self._result = self._done()
        return self._result
