"""The plan space as data, its validity rules, and the cases the matrix tests run.

A `Case` is one point of the space: a zoo model, a mesh (pp, dp, tp), a pipeline
schedule, a ZeRO stage, a recomputation mode, sequence parallelism, a precision and an
optimizer. `valid(case)` says why a point cannot run (None: it can), from the library's
own checks (`autohybrid.plan.schedule_problem`, the layers a model has for pp × v stages)
and from what an option means (ZeRO shards over dp, sp splits the tp axis, selective
recomputation checkpoints attention). Virtual stages and microbatches follow from the
schedule and pp (`SCHEDULES`); every case trains on `GLOBAL_BATCH` samples.

`ci_sample()` is a deterministic all-pairs cover, cheap by `Case.seconds`: every valid
pair of option values (any two dimensions) appears in at least one case, every mesh
appears, and the 8-rank mesh meets every model and ZeRO stage. (At least 32 cases: the 8
schedules × 4 ZeRO stages are all valid pairs; it has 57.) `full_cases()` is the rest
of what `make test-full` runs: every valid plan on 1–4 ranks (`in_full_matrix`: both
optimizers under ZeRO, one, alternating, without), plus an all-pairs cover of the 8-rank
mesh's own cells (its full product would take most of a day on two cores), minus the CI
sample. Nothing here starts processes; tests/test_matrix.py runs the cases.

Adding a precision: its name in `PRECISIONS` and a `Precision` row in `PRECISION_SETUP`
(e.g. "bf16": an fp32 model compiled with `dtype=torch.bfloat16`, the eager copy's
forward under `torch.autocast`, compared within a tolerance); tests/test_matrix.py's
`_run_case` already trains and compares that way, and the samples grow by themselves.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections import Counter
from dataclasses import dataclass
from functools import cache
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

import autohybrid as ah
from autohybrid.plan import schedule_problem

MODELS = ("gpt-tiny", "llama-tiny", "mlp-tiny")
#: (pp, dp, tp) on 1, 2 and 4 ranks (every factorization), and 2 × 2 × 2 on 8
MESHES = ((1, 1, 1),
          (2, 1, 1), (1, 2, 1), (1, 1, 2),
          (4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2),
          (2, 2, 2))
EIGHT_RANKS = (2, 2, 2)
#: schedule -> (virtual stages, microbatches per dp rank at pp 1/2, at pp 4), as in
#: tests/test_pp_equivalence.py; "none" (pp 1) accumulates 2 microbatches
SCHEDULES: dict[str, tuple[int, int, int]] = {
    "none": (1, 2, 2), "gpipe": (1, 2, 4), "1f1b": (1, 2, 4), "interleaved": (2, 2, 4),
    "looped-bfs": (2, 2, 4), "zero-bubble": (2, 2, 4), "zbv": (2, 4, 8),
    "dualpipev": (2, 4, 8)}
ZEROS = (0, 1, 2, 3)
RECOMPUTES = ("none", "selective", "full")
SEQUENCE_PARALLEL = (False, True)
PRECISIONS = ("fp64",)
OPTIMIZERS = ("sgd", "adamw")
#: every case trains on global batches of this many samples (at least 2 per microbatch:
#: dp × microbatches is at most 8), so that the cases of one model variant capture the
#: same graph and later ones find it in the capture memo (autohybrid/capture_cache.py)
GLOBAL_BATCH = 16
STEPS = 3


@dataclass(frozen=True)
class Precision:
    """How a precision trains: the model's dtype, `ah.compile(dtype=)` (None: the
    model's), the eager side's autocast dtype (None: none), and the comparison's
    `assert_close` tolerances (None: its defaults for the dtype)."""

    model_dtype: torch.dtype
    compile_dtype: torch.dtype | None = None
    autocast_dtype: torch.dtype | None = None
    tolerance: tuple[float, float] | None = None   # (rtol, atol)


PRECISION_SETUP: dict[str, Precision] = {"fp64": Precision(torch.float64)}

#: the dimensions pairs are counted over, in `Case` field order, with their values
DIMENSIONS: dict[str, tuple] = {
    "model": MODELS, "pp": (1, 2, 4), "dp": (1, 2, 4), "tp": (1, 2, 4),
    "schedule": tuple(SCHEDULES), "zero": ZEROS, "recompute": RECOMPUTES,
    "sp": SEQUENCE_PARALLEL, "precision": PRECISIONS, "optimizer": OPTIMIZERS}
#: the 8-rank mesh (the one cell where pp, dp and tp all exceed 1) meets every value of
#: these dimensions in the CI sample; every mesh appears in it at least once
EIGHT_RANK_PAIRED = ("model", "zero")

#: deeper zoo variants so that pp × v stages each get a layer (as in test_pp_equivalence)
DEPTHS: dict[tuple[str, int], dict[str, int]] = {
    ("mlp-tiny", 2): dict(layers=3),
    ("mlp-tiny", 4): dict(layers=6), ("gpt-tiny", 4): dict(layers=4),
    ("llama-tiny", 4): dict(layers=5)}
#: layers `autohybrid.search.layers.segment` finds in each variant (the most stages it
#: can be cut into); checked against the captured graphs by tests/test_matrix.py
LAYERS: dict[tuple[str, int], int] = {
    ("gpt-tiny", 1): 6, ("gpt-tiny", 2): 6, ("gpt-tiny", 4): 8,
    ("llama-tiny", 1): 5, ("llama-tiny", 2): 5, ("llama-tiny", 4): 8,
    ("mlp-tiny", 1): 3, ("mlp-tiny", 2): 5, ("mlp-tiny", 4): 11}
ATTENTION_MODELS = ("gpt-tiny", "llama-tiny")
#: seconds per case on 4 ranks of a 2-core machine, after a launch's warm-up: mostly
#: `ah.compile` (each rank captures the model; the 3 steps take well under a second), so
#: the cost grows with the ranks sharing the cores (`WORLD_FACTOR`) and not with tp or the
#: schedule. Measured: tests/test_matrix.py's module docstring.
MODEL_SECONDS = {"gpt-tiny": 4.0, "llama-tiny": 7.0, "mlp-tiny": 1.0}
WORLD_FACTOR = {1: 0.6, 2: 0.7, 4: 1.0, 8: 3.0}


@dataclass(frozen=True)
class Case:
    """One point of the plan space; the fields are the `DIMENSIONS`."""

    model: str
    pp: int
    dp: int
    tp: int
    schedule: str
    zero: int
    recompute: str
    sp: bool
    precision: str
    optimizer: str

    @property
    def mesh(self) -> tuple[int, int, int]:
        return self.pp, self.dp, self.tp

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def virtual_stages(self) -> int:
        return SCHEDULES[self.schedule][0]

    @property
    def num_microbatches(self) -> int:
        return SCHEDULES[self.schedule][2 if self.pp == 4 else 1]

    @property
    def global_batch(self) -> int:
        return GLOBAL_BATCH

    @property
    def chunked(self) -> bool:
        """Whether the sp linears run as collective matmuls (ops/collective_matmul.py):
        about half the sp cases of the attention models, alternating along every other
        dimension as
        `checkerboard_optimizer` does, so both kinds meet every option value without a
        dimension of their own (which would add cases to the CI sample)."""
        if not self.sp or self.model not in ATTENTION_MODELS:  # (no sequence: no sp collectives)
            return False
        parity = sum(DIMENSIONS[d].index(getattr(self, d)) for d in DIMENSIONS if d != "sp")
        return parity % 2 == 0

    @property
    def algorithm(self) -> str:
        """The dp gradient all-reduce. Where the dp group can span 2 "nodes" × 2 ranks
        (dp 4 with ZeRO 0), the case runs on the CPU preset's 2 nodes with the
        hierarchical or the segmented all-reduce (runtime/collectives.py), alternating
        as `chunked` does; elsewhere flat, on one node."""
        if self.dp != 4 or self.zero or self.world != 4:
            return "flat"
        parity = sum(DIMENSIONS[d].index(getattr(self, d)) for d in DIMENSIONS)
        return ("hierarchical", "segmented")[parity % 2]

    def cluster(self) -> ah.Cluster:
        if self.algorithm == "flat":
            return ah.Cluster.local(self.world)
        return ah.Cluster.preset("cpu", nodes=2, devices_per_node=self.world // 2)

    @property
    def name(self) -> str:
        sp = ("+sp+cm" if self.chunked else "+sp") if self.sp else ""
        schedule = "" if self.pp == 1 else f" {self.schedule}×{self.virtual_stages}"
        return (f"{self.model}/{self.optimizer}/{self.precision}/pp{self.pp}×dp{self.dp}"
                f"×tp{self.tp}{sp}{schedule} m={self.num_microbatches} zero{self.zero} "
                f"{'' if self.algorithm == 'flat' else self.algorithm + ' '}"
                f"recompute={self.recompute}")

    def constraints(self) -> ah.Constraints:
        """Every choice pinned (the planner only fills microbatch size and bucket size)."""
        return ah.Constraints(pp=self.pp, dp=self.dp, tp=self.tp, sp=self.sp,
                              schedule=self.schedule, virtual_stages=self.virtual_stages,
                              num_microbatches=self.num_microbatches, zero=self.zero,
                              recompute=self.recompute, collective_matmul=self.chunked,
                              collective_algorithm=self.algorithm)

    def seconds(self) -> float:
        """A rough cost on two cores (`MODEL_SECONDS`, `WORLD_FACTOR`); pp 4 builds deeper
        models."""
        deeper = 1.3 if self.pp == 4 else 1.0
        return MODEL_SECONDS[self.model] * WORLD_FACTOR[self.world] * deeper


# ----------------------------------------------------------------------------- validity
#: Library bugs found by the matrix: (name, predicate, reason). A case matching one is
#: left out (`valid` returns the reason) until the bug is fixed; then delete the row.
KNOWN_BUGS: tuple[tuple[str, Callable[[Case], bool], str], ...] = ()


def valid(case: Case) -> str | None:
    """Why `case` is not a point of the plan space that can run (None: it is one)."""
    if case.mesh not in MESHES:
        return f"mesh pp{case.pp}×dp{case.dp}×tp{case.tp} is not in the matrix"
    problem = schedule_problem(case.schedule, case.pp, case.virtual_stages,
                               case.num_microbatches)
    if problem is not None:
        return problem
    layers = LAYERS[case.model, case.pp]
    if case.pp * case.virtual_stages > layers:
        return (f"{case.model} (pp {case.pp} variant) has {layers} layers, fewer than "
                f"pp × virtual_stages = {case.pp * case.virtual_stages} stages")
    if GLOBAL_BATCH % (case.dp * case.num_microbatches * 2):
        return (f"{GLOBAL_BATCH} samples do not give dp {case.dp} × {case.num_microbatches} "
                "microbatches 2 samples or more each")
    if case.zero and case.dp == 1:
        return f"ZeRO-{case.zero} shards over dp; at dp=1 it is ZeRO-0"
    if case.sp and case.tp == 1:
        return "sequence parallelism splits the tp axis; needs tp > 1"
    if case.recompute == "selective" and case.model not in ATTENTION_MODELS:
        return f"selective recomputation checkpoints attention, which {case.model} lacks"
    if case.precision not in PRECISION_SETUP:
        return f"precision {case.precision!r} has no setup in PRECISION_SETUP"
    for name, applies, reason in KNOWN_BUGS:
        if applies(case):
            return f"known bug {name}: {reason}"
    return None


@cache
def all_valid_cases() -> tuple[Case, ...]:
    """Every valid point of the product of `DIMENSIONS`, in product order."""
    out = []
    for values in itertools.product(*DIMENSIONS.values()):
        case = Case(*values)
        if valid(case) is None:
            out.append(case)
    return tuple(out)


# ----------------------------------------------------------------------------- pairs
Pair = tuple[str, Any, str, Any]


def pairs_of(case: Case) -> set[Pair]:
    """The (dimension, value, dimension, value) pairs `case` covers, plus its mesh alone
    ("mesh", (pp, dp, tp), "", None) and the 8-rank mesh's pairs with
    `EIGHT_RANK_PAIRED` dimensions."""
    values = [(d, getattr(case, d)) for d in DIMENSIONS]
    out = {(a, x, b, y) for (a, x), (b, y) in itertools.combinations(values, 2)}
    out.add(("mesh", case.mesh, "", None))
    if case.mesh == EIGHT_RANKS:
        out |= {("mesh", case.mesh, d, getattr(case, d)) for d in EIGHT_RANK_PAIRED}
    return out


def required_pairs(cases: Iterable[Case]) -> set[Pair]:
    """The pairs a cover of `cases` must hold: every pair some case of them has."""
    return set().union(*(pairs_of(c) for c in cases))


def all_pairs_cover(cases: Iterable[Case], seed: int = 0) -> list[Case]:
    """A cheap subset of `cases` holding all their pairs (greedy, deterministic).

    Greedy first: each step takes the case with the most uncovered pairs (ties: the
    cheapest by `Case.seconds`, then a shuffle seeded by `seed`). Then, dearest first,
    a case whose pairs the others hold is dropped, and one whose own pairs (those no
    other chosen case holds) a cheaper set of cases covers is replaced by that set,
    until neither helps.
    """
    pool = list(cases)
    random.Random(seed).shuffle(pool)
    pairs = {c: pairs_of(c) for c in pool}
    holders: dict[Pair, list[Case]] = {}
    for case in pool:
        for pair in pairs[case]:
            holders.setdefault(pair, []).append(case)
    order = {c: i for i, c in enumerate(pool)}   # candidates in pool order, not set order
    chosen = _greedy(pool, pairs, set(holders))
    while True:
        held = Counter(p for c in chosen for p in pairs[c])
        for case in sorted(chosen, key=lambda c: -c.seconds()):
            unique = {p for p in pairs[case] if held[p] == 1}
            if any(len(holders[p]) == 1 for p in unique):
                continue                          # no other case holds one of its pairs
            candidates = sorted({c for p in unique for c in holders[p]} - {case},
                                key=order.__getitem__)
            instead = _greedy(candidates, pairs, unique, per_second=True)
            if sum(c.seconds() for c in instead) < case.seconds():
                chosen = [c for c in chosen if c != case] + instead
                break
        else:
            return chosen


def _greedy(pool: list[Case], pairs: dict[Case, set[Pair]], uncovered: set[Pair],
            per_second: bool = False) -> list[Case]:
    """Cases of `pool` covering `uncovered`: the most new pairs first (`per_second`: the
    most per estimated second)."""
    def gain(c: Case) -> tuple[float, float]:
        new = len(pairs[c] & uncovered)
        return (new / c.seconds(), 0.0) if per_second else (new, -c.seconds())

    chosen: list[Case] = []
    uncovered = set(uncovered)
    while uncovered:
        best = max(pool, key=gain)
        chosen.append(best)
        uncovered -= pairs[best]
    return chosen


# ----------------------------------------------------------------------------- samples
CI_SEED = 0


@cache
def ci_sample() -> tuple[Case, ...]:
    """The cases CI runs: an all-pairs cover of every valid case, ordered by world size."""
    return tuple(sorted(all_pairs_cover(all_valid_cases(), CI_SEED), key=_order))


def checkerboard_optimizer(case: Case) -> str:
    """The one optimizer the full matrix trains `case`'s plan with when ZeRO is off:
    alternating along every dimension (cases differing in one option get different ones)."""
    parity = sum(DIMENSIONS[d].index(getattr(case, d)) for d in DIMENSIONS if d != "optimizer")
    return OPTIMIZERS[parity % len(OPTIMIZERS)]


def in_full_matrix(case: Case) -> bool:
    """Whether the full matrix runs a valid case of up to 4 ranks: every plan (model, mesh,
    schedule, ZeRO, recompute, sp, precision) once, under both optimizers where ZeRO
    shards the optimizer's state, else under `checkerboard_optimizer` (the full product
    takes about 1.8 h on two cores, over the 2 h budget once the machine is busy)."""
    return case.zero > 0 or case.optimizer == checkerboard_optimizer(case)


@cache
def full_cases() -> tuple[Case, ...]:
    """What `make test-full` adds to the CI sample: the valid cases of up to 4 ranks that
    `in_full_matrix` keeps, and an all-pairs cover of the 8-rank cells, less the CI
    sample; ordered by world size."""
    small = [c for c in all_valid_cases() if c.world <= 4 and in_full_matrix(c)]
    eight = all_pairs_cover([c for c in all_valid_cases() if c.world == 8], CI_SEED)
    ci = set(ci_sample())
    return tuple(sorted((c for c in (*small, *eight) if c not in ci), key=_order))


def _order(case: Case) -> tuple:
    return (case.world, case.mesh, case.model, case.schedule, case.zero, case.recompute,
            case.sp, case.precision, case.optimizer)


def chunks(cases: Iterable[Case], seconds: float) -> list[tuple[Case, ...]]:
    """`cases` split by world size into runs of at most about `seconds` estimated each,
    evenly (one `ah.launch` per run)."""
    out: list[tuple[Case, ...]] = []
    for _, group in itertools.groupby(sorted(cases, key=_order), key=lambda c: c.world):
        group = list(group)
        total = sum(c.seconds() for c in group)
        share = total / math.ceil(total / seconds)
        run: list[Case] = []
        for case in group:
            if run and sum(c.seconds() for c in run) + case.seconds() / 2 > share:
                out.append(tuple(run))
                run = []
            run.append(case)
        out.append(tuple(run))
    return out


# ----------------------------------------------------------------------------- inputs
def build_model(case: Case, seed: int = 0) -> nn.Module:
    """The zoo model of `case` (deeper for pp 2/4 where the stages need it), in the
    precision's model dtype."""
    torch.manual_seed(seed)
    depth = DEPTHS.get((case.model, case.pp), {})
    return ah.models.preset(case.model, **depth).to(PRECISION_SETUP[case.precision].model_dtype)


def build_batches(case: Case) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """`STEPS` different global batches of `case.global_batch` samples (float inputs in
    the model dtype; the same draws as tests/_equiv.py's `zoo_batches`)."""
    dtype = PRECISION_SETUP[case.precision].model_dtype
    return [ah.models.example_batch(case.model, case.global_batch, seed=100 + step,
                                     dtype=dtype) for step in range(STEPS)]


def replace(case: Case, **changes: Any) -> Case:
    return dataclasses.replace(case, **changes)
