"""The ParaDL oracle (Kahira et al., HPDC'21) for CNNs: per-epoch time and memory of each
parallel strategy, from the captured graph's layers (cost/cnn_layers.py).

Formulas (shared/reference/hardware_and_formulas.md, "Per-strategy costs for CNN
layers"; D samples per epoch, B global batch, p PEs, δ bytes per element; I = D/B
iterations; α/β from `Cluster.link_for` of the ranks each collective spans, through
cost/comm.py):

  compute  serial D·Σ(FW+BW); data/spatial/filter/channel (D/p)·Σ(FW+BW);
           pipeline (D(p+S−1)/S)·(max_i FW_Gi + max_i BW_Gi)
  comm     data     I·all_reduce(p, Σ|w|δ)  = 2I(p−1)(α + Σ|w|δβ/p)
           spatial  data term + I·Σ_l (2α + B(halo(x_l) + halo(dy_l))δβ)
           filter / channel  I·Σ_l (all_gather + all_reduce of B|y_l|δ)
                    = 3I(p−1)·Σ_l(α + B|y_l|δβ/p)
           pipeline 2(D(p+S−2)/B)·max_i(α + (B/S)|y_Gi|δβ)
           data×filter  filter term over p2 with B/p1 samples + data term over p1 of
                    Σ|w|/p2; data×spatial  halo over p2 with B/p1 samples + the
                    gradient all-reduce over all p (the weights are replicated)
  memory   per PE: activations δ·b·Σ(|x|+|y|) for the b samples (or slices) it holds,
           plus 2·|w|δ (weights and their gradients) for the weights it holds

Hybrids split p = p1·p2 with the model part (p2 = devices per node) inside a node and
the data part (p1 = nodes) across nodes. Not modelled: overlap of communication with
compute, the optimizer's update and its state, and the tail of an epoch not divisible
by B. Limits on p: data p ≤ B, spatial p ≤ min_l spatial(l) (conv layers), filter p ≤
min_l F_l, channel p ≤ min_l C_l, pipeline p ≤ layers (and S ≤ B).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from . import comm
from .cnn_layers import Layer

STRATEGIES = ("serial", "data", "spatial", "filter", "channel", "pipeline", "data×filter",
              "data×spatial")
ALIASES = {"data-filter": "data×filter", "data-spatial": "data×spatial",
           "data_filter": "data×filter", "data_spatial": "data×spatial",
           "dataxfilter": "data×filter", "dataxspatial": "data×spatial"}


@dataclass(frozen=True)
class StrategyCost:
    """One strategy's per-epoch seconds and per-PE bytes; `broken` names the limit on p
    it breaks (None: it applies)."""

    strategy: str
    p: int
    split: tuple[int, int] | None   # hybrids: (p1 data across nodes, p2 model in a node)
    compute_s: float
    comm_s: float
    memory_bytes: float
    limit: str                      # the limit on p, e.g. "p ≤ B = 32"
    broken: str | None = None

    @property
    def applies(self) -> bool:
        return self.broken is None

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclass(frozen=True)
class OracleResult:
    """Every asked strategy's cost on one cluster; `ranking`: those that apply, fastest
    first."""

    model: str
    cluster: str
    p: int
    dataset_size: int
    global_batch: int
    dtype_bytes: int
    segments: int
    layers: tuple[Layer, ...]
    strategies: tuple[StrategyCost, ...]

    @property
    def ranking(self) -> tuple[StrategyCost, ...]:
        return tuple(sorted((s for s in self.strategies if s.applies),
                            key=lambda s: (s.total_s, STRATEGIES.index(s.strategy))))

    def __getitem__(self, strategy: str) -> StrategyCost:
        key = canonical(strategy)
        for s in self.strategies:
            if s.strategy == key:
                return s
        raise KeyError(strategy)

    def to_dict(self) -> dict:
        """The result as JSON-ready data, with `ranking` (strategy names, fastest first)."""
        out = asdict(self)
        for row, s in zip(out["strategies"], self.strategies):
            row.update(applies=s.applies, total_s=s.total_s)
        out["ranking"] = [s.strategy for s in self.ranking]
        return out

    def table(self) -> str:
        head = (f"ParaDL oracle: {self.model} on {self.cluster} (p = {self.p}), D = "
                f"{self.dataset_size}, B = {self.global_batch}, δ = {self.dtype_bytes} B, "
                f"{len(self.layers)} layers, pipeline S = {self.segments}")
        rows = [f"{'strategy':<13} {'p':>9} {'compute s':>11} {'comm s':>11} {'total s':>11} "
                f"{'memory/PE':>11}  limit"]
        for s in self.strategies:
            p = f"{s.split[0]}x{s.split[1]}" if s.split else str(s.p)
            note = s.limit if s.applies else f"BREAKS {s.broken}"
            rows.append(f"{s.strategy:<13} {p:>9} {s.compute_s:>11.4g} {s.comm_s:>11.4g} "
                        f"{s.total_s:>11.4g} {_gib(s.memory_bytes):>11}  {note}")
        ranked = self.ranking
        rank = ("ranking by total time: " + " < ".join(s.strategy for s in ranked)
                if ranked else "ranking: no strategy applies at this p")
        out = [head, *rows, rank]
        for s in self.strategies:
            if not s.applies:
                out.append(f"{s.strategy} does not apply: {s.broken}")
        return "\n".join(out)

    __str__ = table


def _gib(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n / 2**10:.3g} KiB"


def canonical(strategy: str) -> str:
    key = strategy.strip().lower().replace("*", "×").replace(" ", "")
    key = ALIASES.get(key, key)
    if key not in STRATEGIES:
        from ..errors import InputError
        raise InputError(f"unknown oracle strategy {strategy!r}; choose one of "
                         f"{', '.join(STRATEGIES)} (or None for all)")
    return key


class _Costs:
    """The formulas for one cluster, model and (D, B, δ)."""

    def __init__(self, layers: Sequence[Layer], cluster, dataset_size: int, batch: int,
                 delta: int, segments: int):
        self.layers, self.cluster = tuple(layers), cluster
        self.D, self.B, self.delta, self.S = dataset_size, batch, delta, segments
        self.I = dataset_size / batch
        self.fwbw = sum(l.fw_s + l.bw_s for l in self.layers)
        self.W = sum(l.w for l in self.layers)
        self.acts = sum(l.x + l.y for l in self.layers)

    # limits -----------------------------------------------------------------------
    def min_spatial(self) -> tuple[int, str]:
        convs = [l for l in self.layers if l.op == "conv"]
        if not convs:
            return 0, "no convolution layer"
        low = min(convs, key=lambda l: l.spatial_size)
        return low.spatial_size, f"{low.name}'s {'x'.join(map(str, low.spatial))}"

    def limit(self, kind: str, p: int) -> tuple[str, str | None]:
        if kind == "data":
            bound, what = self.B, "B"
        elif kind == "spatial":
            bound, where = self.min_spatial()
            what = f"min spatial size ({where})"
        elif kind in ("filter", "channel"):
            attr = "out_channels" if kind == "filter" else "in_channels"
            low = min(self.layers, key=lambda l: getattr(l, attr))
            bound = getattr(low, attr)
            what = f"min {'F' if kind == 'filter' else 'C'} ({low.name})"
        else:  # pipeline
            bound, what = len(self.layers), "layers"
        text = f"p ≤ {what} = {bound}"
        return text, (None if p <= bound else f"{text} (p = {p})")

    # collectives --------------------------------------------------------------------
    def grad_allreduce(self, ranks: Sequence[int], weights: float) -> float:
        return self.I * comm.all_reduce(self.cluster, ranks, weights * self.delta)

    def model_parallel(self, ranks: Sequence[int], samples: float) -> float:
        per_iter = sum(comm.all_gather(self.cluster, ranks, samples * l.y * self.delta)
                       + comm.all_reduce(self.cluster, ranks, samples * l.y * self.delta)
                       for l in self.layers)
        return self.I * per_iter

    def halo(self, ranks: Sequence[int], samples: float) -> float:
        if len(ranks) <= 1:
            return 0.0
        # a forward exchange of x's halo and a backward one of dy's: 2α + n β
        per_iter = sum(comm.send_recv(self.cluster, ranks, samples * l.halo_x * self.delta)
                       + comm.send_recv(self.cluster, ranks, samples * l.halo_dy * self.delta)
                       for l in self.layers if l.op == "conv")
        return self.I * per_iter


def stages(layers: Sequence[Layer], p: int) -> list[list[Layer]]:
    """Contiguous groups of `layers` for p stages minimising the slowest stage's FW+BW
    (a DP over the chain; ties: the earlier cut)."""
    n = len(layers)
    cost = [0.0]
    for l in layers:
        cost.append(cost[-1] + l.fw_s + l.bw_s)
    best = {(0, 0): (0.0, [])}
    for k in range(1, p + 1):
        for j in range(k, n - (p - k) + 1):
            options = [(max(best[(k - 1, i)][0], cost[j] - cost[i]), best[(k - 1, i)][1] + [i])
                       for i in range(k - 1, j) if (k - 1, i) in best]
            best[(k, j)] = min(options, key=lambda o: o[0])
    cuts = best[(p, n)][1][1:] + [n]
    out, start = [], 0
    for c in cuts:
        out.append(list(layers[start:c]))
        start = c
    return out


def evaluate(layers: Sequence[Layer], cluster, *, dataset_size: int, global_batch: int,
             dtype_bytes: int, strategies: Sequence[str] = STRATEGIES,
             segments: int | None = None, model: str = "model") -> OracleResult:
    """Price `strategies` for `layers` on every rank of `cluster` (module docstring)."""
    p, g = cluster.world_size, cluster.devices_per_node
    S = segments or min(global_batch, 4 * p)
    c = _Costs(layers, cluster, dataset_size, global_batch, dtype_bytes, S)
    D, B, d = dataset_size, global_batch, dtype_bytes
    ranks = list(range(p))
    out = []
    for name in strategies:
        name = canonical(name)
        if name == "serial":
            out.append(StrategyCost(name, 1, None, D * c.fwbw, 0.0,
                                    d * (B * c.acts + 2 * c.W), "p = 1"))
            continue
        if name in ("data", "spatial", "filter", "channel"):
            limit, broken = c.limit(name, p)
            comp = D / p * c.fwbw
            if name == "data":
                cm, mem = c.grad_allreduce(ranks, c.W), d * (B / p * c.acts + 2 * c.W)
            elif name == "spatial":
                halo = sum(l.halo_x + l.halo_dy for l in layers)
                cm = c.grad_allreduce(ranks, c.W) + c.halo(ranks, B)
                mem = d * (B * (c.acts / p + halo) + 2 * c.W)
            else:
                cm = c.model_parallel(ranks, B)
                own = sum(l.y if name == "filter" else l.x for l in layers)
                mem = d * (B * (c.acts - own + own / p) + 2 * c.W / p)
            out.append(StrategyCost(name, p, None, comp, cm, mem, limit, broken))
        elif name == "pipeline":
            limit, broken = c.limit("pipeline", p)
            if broken is None and S > B:
                broken = f"S ≤ B = {B} (S = {S})"
            groups = stages(layers, p) if broken is None else [list(layers)]
            comp = D * (p + S - 1) / S * (max(sum(l.fw_s for l in gr) for gr in groups)
                                          + max(sum(l.bw_s for l in gr) for gr in groups))
            sends = [comm.send_recv(cluster, [i, i + 1], B / S * gr[-1].y * d)
                     for i, gr in enumerate(groups[:-1])]
            cm = 2 * D * (p + S - 2) / B * max(sends, default=0.0)
            mem = max(d * (B * sum(l.x + l.y for l in gr) + 2 * sum(l.w for l in gr))
                      for gr in groups)
            out.append(StrategyCost(name, p, None, comp, cm, mem, limit, broken))
        else:  # hybrids: p1 nodes of data parallelism, p2 = devices per node of the model
            p1, p2 = cluster.nodes, g
            model_kind = name.split("×")[1]
            l1, b1 = c.limit("data", p1)
            l2, b2 = c.limit(model_kind, p2)
            limit = f"p1 {l1[2:]}; p2 {l2[2:]}"
            broken = "; ".join(f"p{i} {b[2:].replace('(p =', f'(p{i} =')}"
                               for i, b in ((1, b1), (2, b2)) if b) or None
            inner, across = list(range(p2)), list(range(0, p, p2))
            comp = D / p * c.fwbw
            if model_kind == "filter":
                cm = c.model_parallel(inner, B / p1) + c.grad_allreduce(across, c.W / p2)
                mem = d * (B / p1 * (c.acts - sum(l.y for l in layers)
                                     + sum(l.y for l in layers) / p2) + 2 * c.W / p2)
            else:
                halo = sum(l.halo_x + l.halo_dy for l in layers)
                cm = c.halo(inner, B / p1) + c.grad_allreduce(ranks, c.W)
                mem = d * (B / p1 * (c.acts / p2 + halo) + 2 * c.W)
            out.append(StrategyCost(name, p, (p1, p2), comp, cm, mem, limit, broken))
    return OracleResult(model, cluster.name, p, D, B, d, S, tuple(layers), tuple(out))
