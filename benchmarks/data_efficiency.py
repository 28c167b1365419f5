"""Data efficiency (ah.data) on 4 local ranks: adaptive sample hiding against training on
every sample, and partial local shuffling against a global reshuffle, on shards
partitioned by class — samples processed, wall time, bytes exchanged and held-out
accuracy of each method beside its baseline, in one run.

    python benchmarks/data_efficiency.py [--epochs N] [--dataset digits|clusters|both]
                                         [--train N]

Every run is `ah.compile(..., constraints=Constraints(dp=4))` on `ah.Cluster.local(4)`
(gloo, one thread per rank) and `compiled.fit(dataset, epochs=..., sampler=..., shuffle=...)`,
from the same seed:

    hiding     HidingSampler(F=0.3, τ=0.7, the F milestone 4 epochs before the end)
               against the same sampler with F=0 (every sample, every epoch), an MLP
               64 → 10 with SGD (momentum 0.9);
    shuffle    PartialShuffle(q) over parts that each hold 2–3 classes (samples sorted
               by class, cut in 4): Q = 1 (every sample sent away: a global reshuffle),
               Q = 0.1, Q = 0 (local shuffling), an MLP with BatchNorm, SGD;
    distill    Q = 0 with Distillation(γ=0.5, T=2) against the previous epoch's model
               (its logits of every sample, from an end-of-epoch forward), against Q = 1;
    impact     Q = 0 with ImpactFactors(shared=64): each worker's gradient weighted by
               its first-order lookahead loss on a shared batch, against Q = 1.

Datasets: scikit-learn's bundled 8×8 digits (1400 train, 397 held out; no download; 12
epochs) and synthetic 10-class Gaussian clusters in 20-D (2400 / 1000; 10 epochs;
tests/test_data_fit.py trains on 1600 for 8); `--epochs` overrides both, `--train N`
keeps the first N training samples (a quick run). Wall time is fit's (rank 0),
including the statistics' gathers and the end-of-epoch forwards ("forwarded": hidden
samples, or every sample for the teacher); bytes are what rank 0 sent in the exchanges
(all_to_all_single of the samples' rows).

Under autohybrid's data parallelism every step's gradient is the mean over the whole
global batch and BatchNorm uses the global batch's statistics (what eager computes), so
a class-skewed shard only shapes which samples share a batch: each global batch holds
an equal share from every worker (stratified). The accuracy cost of local shuffling
reported for DDP-style training comes from per-worker BatchNorm statistics and
per-worker updates, which autohybrid does not have; the Q = 0 row measures what is left.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import autohybrid as ah  # noqa: E402


def digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])


def clusters():
    centres = torch.randn(10, 20, generator=torch.Generator().manual_seed(99)) * 0.7

    def draw(seed, n):
        g = torch.Generator().manual_seed(seed)
        y = torch.randint(0, 10, (n,), generator=g)
        return centres[y] + torch.randn(n, 20, generator=g), y
    return draw(1, 2400), draw(2, 1000)


DATASETS = {"digits": digits, "clusters": clusters}
EPOCHS = {"digits": 12, "clusters": 10}


def by_class(y: torch.Tensor, workers: int) -> list[list[int]]:
    order = torch.sort(y, stable=True).indices.tolist()
    size = len(order) // workers
    return [order[w * size:(w + 1) * size] if w < workers - 1 else order[w * size:]
            for w in range(workers)]


def run(rank: int, dataset: str, method: str, value: float, epochs: int,
        train: int | None = None) -> dict:
    (xt, yt), (xv, yv) = DATASETS[dataset]()
    xt, yt = xt[:train], yt[:train]
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(64)] if method in ("shuffle", "distill", "impact") else []
    model = nn.Sequential(nn.Linear(xt.shape[1], 64), *norm, nn.ReLU(), nn.Linear(64, 10))
    lr = 0.1 if dataset == "digits" and method == "hiding" else 0.05
    compiled = ah.compile(model, ah.Cluster.local(4), (xt[:64],), loss_fn=F.cross_entropy,
                          example_targets=yt[:64], constraints=ah.Constraints(dp=4, zero=0),
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.9))
    if method == "hiding":
        kwargs = {"sampler": ah.data.HidingSampler(len(xt), 64, fraction=value,
                                                   milestones=(max(epochs - 4, 1),),
                                                   seed=1, drop_last=True)}
    else:
        kwargs = {"shuffle": ah.data.PartialShuffle(len(xt), 4, value,
                                                    partition=by_class(yt, 4), seed=2),
                  "batch_size": 64}
        if method == "distill":
            kwargs["distill"] = ah.data.Distillation(gamma=0.5, temperature=2.0)
        if method == "impact":
            kwargs["impact"] = ah.data.ImpactFactors(shared=64)
    start = time.perf_counter()
    result = compiled.fit((xt, yt), epochs=epochs, log_every=None, **kwargs)
    wall = time.perf_counter() - start
    compiled.model.eval()
    with torch.no_grad():
        accuracy = (compiled(xv).argmax(-1) == yv).double().mean().item()
    return {"samples": result.samples, "forwarded": result.forwarded, "wall": wall,
            "bytes": result.bytes_exchanged, "exchanged": result.exchanged,
            "accuracy": accuracy}


ROWS = (("hiding", 0.0, "all samples"), ("hiding", 0.3, "hiding F=0.3"),
        ("shuffle", 1.0, "global Q=1"), ("shuffle", 0.1, "partial Q=0.1"),
        ("shuffle", 0.0, "local Q=0"), ("distill", 0.0, "local Q=0 + distill"),
        ("impact", 0.0, "local Q=0 + impact"))


def run_all(rank: int, names: tuple, epochs_of: dict, train: int | None) -> None:
    """Every row of every dataset, one after another on the same 4 ranks; rank 0 prints."""
    for name in names:
        epochs = epochs_of[name]
        if rank == 0:
            print(f"\n{name}, {epochs} epochs")
            print(f"  {'method':<22} {'samples':>7}  {'vs base':>7}  {'forwarded':>10}  "
                  f"{'wall s':>6}  {'vs base':>7}  {'exchanged':>9}  {'bytes(r0)':>9}  "
                  f"{'accuracy':>8}  {'vs base':>9}", flush=True)
        base: dict[str, dict] = {}
        for method, value, label in ROWS:
            r = run(rank, name, method, value, epochs, train)
            ref = base.setdefault("hiding" if method == "hiding" else "shuffle", r)
            if rank == 0:
                print(f"  {label:<22} {r['samples']:>7}  {r['samples'] / ref['samples']:>7.1%}  "
                      f"{r['forwarded']:>10}  {r['wall']:>6.2f}  "
                      f"{r['wall'] / ref['wall']:>7.1%}  {r['exchanged']:>9}  "
                      f"{r['bytes']:>9}  {r['accuracy']:>8.2%}  "
                      f"{(r['accuracy'] - ref['accuracy']) * 100:>+6.2f} pt", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--dataset", choices=("digits", "clusters", "both"), default="both")
    parser.add_argument("--train", type=int, default=None)
    args = parser.parse_args()
    names = ("digits", "clusters") if args.dataset == "both" else (args.dataset,)
    print(f"4 local ranks (dp=4), load average {os.getloadavg()[0]:.2f}", flush=True)
    ah.launch(run_all, ah.Cluster.local(4),
              args=(names, {n: args.epochs or EPOCHS[n] for n in names}, args.train))


if __name__ == "__main__":
    main()
