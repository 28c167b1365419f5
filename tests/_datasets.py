"""Small datasets for the ah.data tests (no download): scikit-learn's bundled digits,
synthetic Gaussian classes, and a partition by class."""
from __future__ import annotations

import torch


def digits() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """scikit-learn's bundled 8×8 digits: 1400 to train on, 397 held out."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])


def clusters(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """10 Gaussian classes in 20-D whose centres overlap (a linear-ish task at ~92 %)."""
    centres = torch.randn(10, 20, generator=torch.Generator().manual_seed(99)) * 0.7
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=g)
    return centres[y] + torch.randn(n, 20, generator=g), y


def by_class(y: torch.Tensor, workers: int) -> list[list[int]]:
    """Samples sorted by class and cut into equal parts: each worker sees few classes."""
    order = torch.sort(y, stable=True).indices.tolist()
    size = len(order) // workers
    return [order[w * size:(w + 1) * size] if w < workers - 1 else order[w * size:]
            for w in range(workers)]
