"""The boxes a rank's local tensor holds (runtime/checkpoint_layout.py), checked against
the shards the runtime really makes (ShardSpec.local, ops/zero.shard_of): every box's
view equals the whole tensor's box, the views write through, and the ranks' boxes cover
every element of the whole tensor once (replicas holding identical boxes)."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from autohybrid.ops.zero import shard_of
from autohybrid.program import ShardSpec
from autohybrid.runtime.checkpoint_layout import boxes, flat_spans, tp_pieces, zero_range


def _specs(shape, dim, tp):
    """ShardSpecs of every tp rank for a few layouts of `dim`: plain, padded (size not
    divisible), fused blocks (qkv), uneven blocks (grouped-query), kv replicas (ways < tp)."""
    size = shape[dim]
    layouts = [dict(size=size, padded=math.ceil(size / tp) * tp, chunks=1, ways=tp)]
    if size % 3 == 0 and (size // 3) % tp == 0:
        layouts.append(dict(size=size, padded=size, chunks=3, ways=tp))
    if size >= 4 and tp == 2:
        blocks = (size - 2, 1, 1)
        layouts.append(dict(size=size, padded=size, chunks=3, ways=1, blocks=blocks))
    if tp == 4 and size % 2 == 0:
        layouts.append(dict(size=size, padded=size, chunks=1, ways=2))
    for layout in layouts:
        ways = layout["ways"]
        yield [ShardSpec(dim=dim, index=t * ways // tp, **layout) for t in range(tp)]


def _cover(whole, locals_and_boxes):
    seen = torch.zeros(whole.shape, dtype=torch.int64)
    values = {}
    for local, bs in locals_and_boxes:
        for b in bs:
            index = tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))
            torch.testing.assert_close(b.view(local), whole[index], rtol=0, atol=0)
            key = (b.offsets, b.sizes)
            if key in values:  # a replica: the same box, counted once
                continue
            values[key] = True
            seen[index] += 1
    assert bool((seen == 1).all()), "boxes must cover every element exactly once"


@pytest.mark.parametrize("shape", [(7,), (6, 5), (12, 4), (3, 4, 5), ()])
@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_zero_shards_of_whole_tensors(shape, dp):
    whole = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    parts = []
    for r in range(dp):
        shard = shard_of(whole, dp, r)
        parts.append((shard, boxes(shape, shape, flat=zero_range(whole.numel(), dp, r))))
    _cover(whole, parts)


@pytest.mark.parametrize("shape,dim", [((12, 5), 0), ((5, 12), 1), ((9, 4), 0), ((6, 3, 4), 1),
                                       ((10,), 0)])
@pytest.mark.parametrize("tp,dp", [(2, 1), (2, 3), (4, 1), (4, 2)])
def test_tp_shards_alone_and_under_zero(shape, dim, tp, dp):
    whole = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    for specs in _specs(shape, dim, tp):
        parts = []
        for spec in specs:
            local = spec.local(whole)
            if dp == 1:
                parts.append((local, boxes(shape, local.shape, spec)))
                continue
            for r in range(dp):
                flat = zero_range(local.numel(), dp, r)
                parts.append((shard_of(local, dp, r), boxes(shape, local.shape, spec, flat)))
        _cover(whole, parts)


@pytest.mark.parametrize("ep,tp,dp", [(2, 2, 1), (2, 2, 3), (4, 2, 2), (2, 4, 1)])
def test_expert_slices_cut_again_by_tp_alone_and_under_zero(ep, tp, dp):
    """Expert tensor parallelism under ep: each ep rank's experts (dim 0) cut over tp
    along the intermediate size — gate_up's two blocks of dim 1, down's dim 2. The
    shards' shapes, their gathering back (inner axis first), and the boxes."""
    experts, inter, hidden = 4, 8, 3
    for dim, shape, chunks in ((1, (experts, 2 * inter, hidden), 2),
                               (2, (experts, hidden, inter), 1)):
        whole = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
        specs = [[ShardSpec(0, experts, experts, 1, ep, e, axis="ep",
                            inner=ShardSpec(dim, shape[dim], shape[dim], chunks, tp, t))
                  for t in range(tp)] for e in range(ep)]
        parts, outer_shards = [], []
        for row in specs:
            locals_ = [spec.local(whole) for spec in row]
            assert all(tuple(x.shape) == row[0].local_shape(shape) for x in locals_)
            assert locals_[0].shape[0] == experts // ep \
                and locals_[0].shape[dim] == shape[dim] // tp
            outer_shards.append(row[0].inner.gather(locals_))   # over tp: the ep slice
            for spec, local in zip(row, locals_):
                for r in range(dp):
                    flat = zero_range(local.numel(), dp, r) if dp > 1 else None
                    held = shard_of(local, dp, r) if dp > 1 else local
                    parts.append((held, boxes(shape, local.shape, spec, flat)))
        torch.testing.assert_close(specs[0][0].gather(outer_shards), whole, rtol=0, atol=0)
        _cover(whole, parts)
    with pytest.raises(ValueError, match="another dim over another axis"):
        ShardSpec(0, 4, 4, 1, 2, 0, axis="ep", inner=ShardSpec(0, 2, 2, 1, 2, 0))


def test_views_write_through_to_the_shard():
    shape = (6, 5)
    spec = ShardSpec(dim=0, size=6, padded=8, chunks=1, ways=2, index=1)  # rows 4..5 + pad
    local = torch.zeros(4, 5)
    shard = shard_of(local, 3, 1)
    bs = boxes(shape, local.shape, spec, zero_range(local.numel(), 3, 1))
    for b in bs:
        b.view(shard).fill_(1.0)
    assert shard.sum().item() == sum(b.numel for b in bs) > 0


def test_flat_spans_are_contiguous_and_in_order():
    shape = (3, 4, 5)
    for lo, hi in itertools.combinations(range(0, 61, 7), 2):
        flat = torch.arange(60).reshape(shape)
        got = []
        for start, sizes in flat_spans(shape, lo, hi):
            index = tuple(slice(s, s + z) for s, z in zip(start, sizes))
            got += flat[index].reshape(-1).tolist()
        assert got == list(range(lo, hi))


def test_tp_pieces_skip_padding():
    spec = ShardSpec(dim=0, size=5, padded=6, chunks=1, ways=2, index=1)
    assert tp_pieces(spec) == [(0, 3, 2)]       # rows 3..4 of the whole; row 2 of 3 is padding
    last = ShardSpec(dim=0, size=4, padded=8, chunks=1, ways=4, index=3)
    assert tp_pieces(last) == []                # all padding: this rank holds nothing
