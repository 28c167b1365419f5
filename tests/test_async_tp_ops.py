"""The issue/wait forms of the forward tp/sp collectives (ops/tensor_parallel.py) equal the
sync ops: `<op>_wait(<op>_start(x, ...), x, ...)` gives `<op>(x, ...)`, and the gradient
it sends to `x` is the sync op's (its partner collective), bit for bit.

On 2 gloo ranks (one `ah.launch`, float64, per-rank data so that a missing collective
changes the answer), for every op and several dims of a non-contiguous input, with other
collectives issued and compute run between a start and its wait, and waits taken out of
issue order (the pending work is found by its buffer). A None group (one rank) needs no
process: the pair is then a copy, as the sync op is.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autohybrid as ah
from _limits import guard
from _pool import launch as pool_launch
from autohybrid.ops import groups
from autohybrid.ops import tensor_parallel as tp

D = torch.float64
#: sync op, its extra arguments (dims to try) — every op with an issue/wait form
AH = torch.ops.autohybrid
CASES = ((AH.tp_reduce.default, (None,)), (AH.tp_gather.default, (0, 1, -1)),
         (AH.sp_gather.default, (0, 1)), (AH.sp_reduce_scatter.default, (0, 1, -1)))


def _args(dim) -> tuple:
    return () if dim is None else (dim,)


def _input(rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 10 + rank)
    return torch.randn(6, 4, 4, dtype=D, generator=g).transpose(0, 1)  # (4, 6, 4), strided


def _check_all(rank: int) -> int:
    """Every case; how many were checked."""
    checked = 0
    for seed, (op, dims) in enumerate(CASES):
        start, wait = tp.ASYNC_FORMS[op]
        for dim in dims:
            x = _input(rank, seed)
            sync_x, async_x = x.clone().requires_grad_(), x.clone().requires_grad_()
            expected = op(sync_x, *_args(dim), "tp")
            buffer = start(async_x, *_args(dim), "tp")
            # another collective issued and compute run while the first is in flight;
            # waits taken in the other order
            other = start(async_x * 2, *_args(dim), "tp")
            busy = (async_x.detach() @ async_x.detach().transpose(-1, -2)).sum()
            second = wait(other, async_x * 2, *_args(dim), "tp")
            got = wait(buffer, async_x, *_args(dim), "tp")
            what = f"{op} dim {dim} rank {rank}"
            assert torch.equal(got, expected), what
            assert torch.equal(second, op(x * 2, *_args(dim), "tp")), what
            assert got.is_contiguous() and torch.isfinite(busy)
            grad = torch.randn(expected.shape, dtype=D,
                               generator=torch.Generator().manual_seed(99 + rank))
            expected.backward(grad)
            got.backward(grad)
            assert torch.equal(async_x.grad, sync_x.grad), f"{what}: gradient"
            checked += 1
    assert not tp._PENDING, "a wait left its work pending"
    return checked


def _rank(rank: int) -> int:
    groups.bind("tp", dist.group.WORLD)
    try:
        return _check_all(rank)
    finally:
        groups.clear()


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_issue_wait_pairs_equal_the_sync_ops_on_two_gloo_ranks():
    results = pool_launch(_rank, 2, timeout_s=guard(90))
    assert results == [sum(len(d) for _, d in CASES)] * 2


def test_a_none_group_makes_each_pair_a_copy():
    groups.bind("tp", None)
    try:
        for op, dims in CASES:
            start, wait = tp.ASYNC_FORMS[op]
            for dim in dims:
                x = _input(0, 1).requires_grad_()
                y = wait(start(x, *_args(dim), "tp"), x, *_args(dim), "tp")
                assert torch.equal(y, x) and y.is_contiguous()
                assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
                y.backward(torch.full_like(y, 3.0))
                assert torch.equal(x.grad, torch.full_like(x, 3.0))
    finally:
        groups.clear()
