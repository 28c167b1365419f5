"""autohybrid.init: seeded, slice-addressable initialization and eager materialization.

Pure tensor tests (no processes): any slice equals the same slice of the whole tensor,
values follow the documented scheme, `materialize` of meta zoo models keeps ties and
runs, and a slice never computes the whole tensor.
"""
from __future__ import annotations

import hashlib
import math
import statistics

import pytest
import torch
from torch import nn

import autohybrid.models as zoo
from autohybrid import init
from autohybrid.errors import ModelError
from autohybrid.init import InitSpec, flat_values, init_specs, materialize, shard_values, values
from autohybrid.models._common import residual_std_for

N = InitSpec.normal(0.02)
U = InitSpec.uniform(-1.0, 3.0)


def _whole(spec: InitSpec, shape: tuple[int, ...], name: str = "w", seed: int = 0,
           **kw) -> torch.Tensor:
    return values(spec, shape, seed, name, **kw)


# ------------------------------------------------------------------- slices vs whole


@pytest.mark.parametrize("spec", [N, U], ids=["normal", "uniform"])
def test_slices_equal_slices_of_whole(spec: InitSpec) -> None:
    shape = (300, 500)                           # 150000 elements: crosses CHUNK twice
    full = _whole(spec, shape)
    assert full.shape == shape and full.dtype == torch.float32
    cases = [
        (slice(10, 20),),                         # rows
        (slice(None), slice(128, 256)),           # tp column shard
        (slice(7, 190), slice(33, 301)),          # 2-D block
        (slice(299, 300), slice(499, 500)),       # last element
        slice(0, 150),                            # a bare slice means dim 0
    ]
    for index in cases:
        key = index if isinstance(index, tuple) else (index,)
        assert torch.equal(_whole(spec, shape, index=index), full[key]), index


def test_flat_ranges_cross_chunk_boundaries() -> None:
    shape = (3, init.CHUNK)                       # rows are exactly one chunk wide
    full = _whole(N, shape).reshape(-1)
    n = full.numel()
    for a, b in [(0, n), (init.CHUNK - 5, init.CHUNK + 5), (1, 2 * init.CHUNK + 3),
                 (n - 1, n), (17, 17)]:
        assert torch.equal(flat_values(N, n, 0, "w", a, b), flat_values(N, n, 0, "w", 0, n)[a:b])
        assert torch.equal(_whole(N, shape, flat=(a, b)), full[a:b])


def test_flat_range_of_a_column_shard() -> None:
    # A ZeRO chunk of a tp shard: flat range of full[index], flattened row-major.
    shape, index = (64, 96), (slice(None), slice(32, 64))
    shard = _whole(U, shape)[index].reshape(-1)
    for a, b in [(0, 32), (5, 37), (100, 2048), (2047, 2048), (0, 2048)]:
        assert torch.equal(_whole(U, shape, index=index, flat=(a, b)), shard[a:b])


def test_values_do_not_depend_on_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    shape, index = (40, 50, 7), (slice(3, 31), slice(10, 45), slice(2, 6))
    ref = _whole(N, shape, index=index)
    monkeypatch.setattr(init, "CHUNK", 97)
    assert torch.equal(_whole(N, shape, index=index), ref)
    assert torch.equal(_whole(N, shape)[index], ref)


def test_empty_and_scalar() -> None:
    assert _whole(N, (8, 16), index=(slice(5, 5),)).shape == (0, 16)
    assert _whole(N, (8, 16), index=(slice(None), slice(16, 16))).shape == (8, 0)
    assert _whole(N, (8, 16), flat=(3, 3)).shape == (0,)
    assert _whole(N, (0, 4)).shape == (0, 4)
    scalar = _whole(N, ())
    assert scalar.shape == () and torch.equal(scalar.reshape(1), _whole(N, (1,)))


def test_dtype_device_and_constants() -> None:
    f64 = _whole(N, (33, 7), dtype=torch.float64)
    assert torch.equal(_whole(N, (33, 7), dtype=torch.bfloat16), f64.to(torch.bfloat16))
    assert torch.equal(_whole(N, (33, 7)), f64.to(torch.float32))
    ones = _whole(InitSpec.constant(1.0), (4, 5), index=(slice(1, 3),), dtype=torch.float16)
    assert ones.dtype == torch.float16 and torch.equal(ones, torch.ones(2, 5, dtype=torch.float16))
    assert torch.count_nonzero(_whole(InitSpec.constant(0.0), (9,))) == 0


# --------------------------------------------------------------- seeds and statistics


def test_seeds_names_and_reproducibility() -> None:
    a = _whole(N, (64, 64), seed=0)
    assert torch.equal(a, _whole(N, (64, 64), seed=0))
    assert not torch.equal(a, _whole(N, (64, 64), seed=1))
    assert not torch.equal(a, _whole(N, (64, 64), name="v"))
    # Values depend on the flat index only, not on the full shape's layout.
    assert torch.equal(a.reshape(-1), _whole(N, (4096,)))
    # A different std scales the same draws.
    b = _whole(InitSpec.normal(0.04), (64, 64), dtype=torch.float64)
    assert torch.allclose(b, 2 * _whole(N, (64, 64), dtype=torch.float64), rtol=1e-15, atol=0)


def test_statistics() -> None:
    x = _whole(InitSpec.normal(0.02, mean=0.5), (1 << 20,), dtype=torch.float64)
    assert abs(x.mean().item() - 0.5) < 1e-4
    assert abs(x.std().item() - 0.02) < 2e-4
    assert abs(((x - 0.5).abs() < 0.02).double().mean().item() - 0.6827) < 3e-3
    u = _whole(U, (1 << 20,), dtype=torch.float64)
    assert -1.0 < u.min().item() < -0.99 and 2.99 < u.max().item() < 3.0
    assert abs(u.mean().item() - 1.0) < 0.01
    assert abs(u.var().item() - 16 / 12) < 0.01


def _reference_u(seed: int, name: str, i: int) -> float:
    """The documented scheme, in plain Python integers."""
    m = (1 << 64) - 1
    d = hashlib.sha256(f"autohybrid.init/v1/{seed}/{name}".encode()).digest()
    k1, k2 = int.from_bytes(d[0:8], "little"), int.from_bytes(d[8:16], "little")

    def mix64(z: int) -> int:
        z ^= z >> 30
        z = (z * 0xBF58476D1CE4E5B9) & m
        z ^= z >> 27
        z = (z * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    r = mix64(mix64((i * 0x9E3779B97F4A7C15 + k1) & m) ^ k2)
    return ((r >> 12) + 0.5) * 2.0 ** -52


def test_documented_scheme() -> None:
    numel = 1 << 41                              # a flat index beyond 2**40 too
    for i in [0, 1, 2, 12345, (1 << 40) + 7, numel - 1]:
        u = _reference_u(7, "blocks.0.w", i)
        got = flat_values(InitSpec.uniform(0.0, 1.0), numel, 7, "blocks.0.w", i, i + 1,
                          dtype=torch.float64)
        assert got.item() == u                   # the integer part is exact
        z = flat_values(N, numel, 7, "blocks.0.w", i, i + 1, dtype=torch.float64).item()
        assert math.isclose(z, 0.02 * statistics.NormalDist().inv_cdf(u), rel_tol=1e-12)


# ---------------------------------------------------------- no whole-tensor generation


def test_slice_computes_only_its_elements(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    real = init._uniform

    def counting(keys, idx):  # noqa: ANN001
        sizes.append(idx.numel())
        return real(keys, idx)

    monkeypatch.setattr(init, "_uniform", counting)
    shape = (4096, 4096)                          # 16M elements: never drawn whole here
    row = values(N, shape, 0, "big", index=(slice(100, 101),))
    assert row.shape == (1, 4096) and sum(sizes) == 4096
    sizes.clear()
    cols = values(N, shape, 0, "big", index=(slice(None), slice(128, 256)))
    assert cols.shape == (4096, 128) and sum(sizes) == 4096 * 128
    assert max(sizes) <= init.CHUNK
    sizes.clear()
    chunk = flat_values(N, 4096 * 4096, 0, "big", 10_000_000, 10_000_010)  # a ZeRO chunk
    assert sum(sizes) == 10
    row = values(N, shape, 0, "big", index=(slice(2441, 2442),))  # 10_000_000 = 2441·4096+1664
    assert torch.equal(chunk, row.reshape(-1)[1664:1674])
    sizes.clear()
    assert values(InitSpec.constant(1.0), shape, 0, "big", index=(slice(0, 1),)).sum() == 4096
    assert sizes == []                            # constants draw nothing


# ----------------------------------------------------------------------- materialize


def _check_materialized(model: nn.Module, seed: int) -> None:
    specs = init_specs(model)
    for name, p in model.named_parameters():
        assert not p.is_meta and isinstance(p, nn.Parameter)
        assert torch.equal(p, values(specs[name], p.shape, seed, name, dtype=p.dtype)), name
    assert not any(b.is_meta for b in model.buffers())


def test_materialize_gpt_tiny_keeps_ties() -> None:
    model = zoo.preset("gpt-tiny", device="meta")
    specs = init_specs(model)
    assert list(specs) == [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in specs          # tied: canonical name is tok_emb.weight
    assert specs["tok_emb.weight"] == InitSpec.normal(0.02)
    assert specs["blocks.1.attn.proj.weight"] == InitSpec.normal(residual_std_for(2))
    assert specs["blocks.1.mlp.fc.bias"] == InitSpec.constant(0.0)
    assert specs["ln_f.weight"] == InitSpec.constant(1.0)
    assert materialize(model, seed=3) is model
    _check_materialized(model, 3)
    named = dict(model.named_parameters(remove_duplicate=False))
    assert named["lm_head.weight"] is named["tok_emb.weight"]
    (ids,), _ = zoo.example_batch("gpt-tiny", batch=2)
    assert torch.isfinite(model(ids)).all()


@pytest.mark.parametrize("name", ["llama-tiny", "mlp-tiny", "resnet-tiny"])
def test_materialize_zoo(name: str) -> None:
    model = materialize(zoo.preset(name, device="meta"), seed=5)
    _check_materialized(model, 5)
    again = materialize(zoo.preset(name, device="meta"), seed=5)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  again.state_dict().values()))
    inputs, _ = zoo.example_batch(name, batch=2)
    assert torch.isfinite(model(*inputs)).all()


def test_materialize_resnet_rules_and_buffers() -> None:
    model = zoo.preset("resnet-tiny", device="meta")
    specs = init_specs(model)
    w = model.layer4[0].conv1.weight
    assert specs["layer4.0.conv1.weight"] == InitSpec.normal(
        math.sqrt(2.0 / (w.shape[0] * w.shape[2] * w.shape[3])))
    assert specs["bn1.weight"] == InitSpec.constant(1.0)
    materialize(model, seed=0)
    assert torch.equal(model.bn1.running_var, torch.ones(8))
    assert model.bn1.num_batches_tracked.dtype == torch.long


def test_materialize_real_model_and_eager_rule_agree() -> None:
    torch.manual_seed(0)
    real = zoo.preset("gpt-tiny")                 # eager: torch's RNG, same rule
    assert getattr(real, init.INIT_RULE_ATTR) == init.TransformerRule(0.02, residual_std_for(2))
    assert init_specs(real) == init_specs(zoo.preset("gpt-tiny", device="meta"))
    weight = real.tok_emb.weight
    materialize(real, seed=1)                     # real parameters: overwritten in place
    assert real.tok_emb.weight is weight and real.lm_head.weight is weight
    meta = materialize(zoo.preset("gpt-tiny", device="meta"), seed=1)
    assert all(torch.equal(a, b) for a, b in zip(real.parameters(), meta.parameters()))


def test_shard_values() -> None:
    model = zoo.preset("llama-tiny", device="meta")
    name = "blocks.0.mlp.up.weight"               # (64, 32)
    cols = (slice(None), slice(8, 16))
    ref = materialize(zoo.preset("llama-tiny", device="meta"), seed=2)
    full = dict(ref.named_parameters())[name]
    assert torch.equal(shard_values(model, name, None, 2, index=cols), full[cols])
    specs = init_specs(model)
    assert torch.equal(shard_values(specs, name, (64, 32), 2, index=cols, flat=(3, 40)),
                       full[cols].reshape(-1)[3:40])
    with pytest.raises(ModelError, match="did you mean"):
        shard_values(specs, "blocks.0.mlp.up.weigth", (64, 32), 2)
    with pytest.raises(ModelError, match="full_shape"):
        shard_values(specs, name, None, 2)


# ---------------------------------------------------------------------- rules, errors


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4, device="meta")
        self.scale = nn.Parameter(torch.empty(4, device="meta"))


def test_default_rule_and_unknown_modules() -> None:
    generic = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Conv1d(8, 6, 3),
                            nn.BatchNorm1d(6), nn.MultiheadAttention(6, 2))
    specs = init_specs(generic)
    assert specs["0.weight"] == InitSpec.normal(0.02)
    assert specs["0.bias"] == specs["1.bias"] == specs["4.in_proj_bias"] == InitSpec.constant(0)
    assert specs["1.weight"] == specs["3.weight"] == InitSpec.constant(1.0)
    assert specs["2.weight"] == InitSpec.normal(math.sqrt(2.0 / 18))
    with pytest.raises(ModelError, match=r"'scale' \(_Scaled.scale"):
        init_specs(_Scaled())

    def rule(module_name, module, param_name, param):  # noqa: ANN001, ANN202
        return InitSpec.constant(2.0) if param_name == "scale" else None

    model = materialize(_Scaled(), seed=0, rule=rule)
    assert torch.equal(model.scale, torch.full((4,), 2.0))
    with pytest.raises(ModelError, match="returned"):
        init_specs(_Scaled(), rule=lambda *a: 0.5)


def test_bad_slices_and_arguments() -> None:
    cases = [((slice(0, 8, 2),), "step 1"), ((slice(0, 9),), "out of range"),
             ((slice(-1, None),), "out of range"), ((slice(3, 2),), "out of range"),
             ((3,), "not a slice"), ((slice(None),) * 3, "has 3 entries")]
    for index, match in cases:
        with pytest.raises(ValueError, match=match):
            values(N, (8, 4), 0, "w", index=index)
    with pytest.raises(ValueError, match="flat range"):
        values(N, (8, 4), 0, "w", index=(slice(0, 2),), flat=(0, 9))
    with pytest.raises(ModelError, match="seed"):
        values(N, (8, 4), 1.5, "w")             # type: ignore[arg-type]
    with pytest.raises(ModelError, match="kind"):
        InitSpec("xavier")
    with pytest.raises(ModelError, match="low <= high"):
        InitSpec.uniform(1.0, 0.0)


def test_meta_buffers_that_cannot_be_recomputed() -> None:
    model = _Scaled()
    model.register_buffer("table", torch.empty(3, device="meta"), persistent=False)
    with pytest.raises(ModelError, match="buffer 'table'"):
        init.materialize_buffers(model)
