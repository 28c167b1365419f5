"""Capture once per job (runtime/capture_share.py, capture_wire.py): rank 0's graph,
serialized and loaded by every rank, is the graph a rank's own export gives, and every
plan rewrites it into the same program; the digest ranks compare names the model's
structure and code the same way in every process, and misses on any change.

The multi-process half runs on warm ranks (tests/_pool.py): ranks load rank 0's graph,
ranks with different models each capture their own, and a capture that fails on rank 0
raises on every rank instead of leaving the others waiting.
"""
from __future__ import annotations

import pytest
import sympy
import torch
import torch.nn as nn

import autohybrid as ah
from _pool import launch as pool_launch
from autohybrid import capture_wire
from autohybrid.capture import capture, capture_digest, capture_from
from autohybrid.capture_blocks import CAPTURE_ENV
from autohybrid.models import coverage, example_batch, preset
from autohybrid.models.coverage import lm_loss
from autohybrid.rewrite import rewrite

PLANS = (dict(dp=2, tp=1, pp=1), dict(dp=1, tp=2, pp=1), dict(dp=1, tp=1, pp=2))


def _zoo(name: str, **overrides):
    model = preset(name, **overrides) if overrides else preset(name)
    (ids,), targets = example_batch(name, batch=4)
    return model, (ids,), lm_loss, (targets,)


def _hf(name: str):
    case = coverage.build(name)
    (x,), y = case.batches[0]
    return case.model, (x,), case.loss_fn, (y,)


def _plans(model, inputs, loss_fn, targets) -> list[ah.Plan]:
    return [ah.plan(model, ah.Cluster.local(2), inputs, loss_fn=loss_fn,
                    example_targets=targets, constraints=ah.Constraints(**mesh))
            for mesh in PLANS]


def _programs(cap, plans: list[ah.Plan]) -> list[tuple]:
    out = []
    for plan in plans:
        program = rewrite(cap, plan, 0, fake_groups=True)
        stages = (() if program.pipeline is None else
                  tuple(s.gm.code for s in program.pipeline.stages))
        out.append((program.runnable.gm.code, stages, program.loss_kind,
                    dict(program.param_shards)))
    return out


@pytest.mark.parametrize("build", [lambda: _zoo("gpt-tiny"),
                                   lambda: _zoo("llama-tiny", layers=8),
                                   lambda: _hf("llama")],
                         ids=["gpt-tiny", "llama-8-blocks", "hf-llama"])
def test_a_loaded_graph_is_the_exported_one_and_rewrites_alike(build, monkeypatch):
    """Serialized and loaded (what a rank receives), a capture has the exported one's
    graph hash and fingerprint (module stacks, stack traces, roles), and dp2, tp2 and pp2
    rewrite both into the same code, stages, loss form and shards. llama with 8
    blocks is captured block by block (capture_blocks.py), so the spliced program
    travels too (`AUTOHYBRID_CAPTURE=blocks`: by default 8 blocks are exported whole)."""
    monkeypatch.setenv(CAPTURE_ENV, "blocks")
    model, inputs, loss_fn, targets = build()
    plans = _plans(model, inputs, loss_fn, targets)
    exported = capture(model, inputs, loss_fn, targets)    # ah.plan's, memoized
    loaded = capture_from(capture_wire.dumps(exported), model, inputs, loss_fn, targets)
    assert loaded.origin.startswith("wire:") and exported.origin == "export"
    assert loaded.hash == exported.hash
    assert capture_wire.fingerprint(loaded) == capture_wire.fingerprint(exported)
    assert loaded.param_fqns == exported.param_fqns
    assert _programs(loaded, plans) == _programs(exported, plans)


def test_a_loaded_graph_reads_this_models_tensors():
    """The bytes carry no weights: a loaded capture runs on the receiving model's own
    parameters, and a model missing one of them is refused."""
    model, inputs, loss_fn, targets = _zoo("gpt-tiny")
    data = capture_wire.dumps(capture(model, inputs, loss_fn, targets))
    assert len(data) < sum(p.numel() * p.element_size() for p in model.parameters())
    other = preset("gpt-tiny")
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    loaded = capture_from(data, other, inputs, loss_fn, targets)
    expected = loss_fn(other(*inputs), *targets)
    torch.testing.assert_close(loaded.run(loaded.default_state(other), inputs, targets),
                               expected)
    smaller = preset("gpt-tiny")
    del smaller.lm_head
    with pytest.raises(capture_wire.WireMismatch, match="lm_head"):
        capture_from(data, smaller, inputs, loss_fn, targets)


def test_a_loaded_graph_of_sliced_inputs_knows_their_stride_symbols():
    """Regression (benchmarks/gpu_check_dist.py, 2026-12-03): example inputs that are views
    (`ids[:, :-1]`, `ids[:, 1:]`) export with a symbolic stride, which torch.export's
    serialized form carries no range for; the loaded graph then failed tp 2 + sp at the
    loss's `reshape(-1, V)` ("vr must not be None for symbol s48"). With the ShapeEnv's
    facts sent along, the loaded graph has every symbol's range and the exported one's
    guards, and rewrites into the exported graph's program; a payload without the ranges
    is refused (so the ranks export for themselves) instead of failing in a pass."""
    import pickle

    from autohybrid.graph import fake_mode

    def loss_fn(logits, targets):
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           targets.reshape(-1))
    model = preset("gpt-tiny")
    ids = torch.randint(0, model.config["vocab"], (4, model.config["seq"] + 1),
                        generator=torch.Generator().manual_seed(3))
    inputs, targets = (ids[:, :-1],), (ids[:, 1:],)
    plan = ah.plan(model, ah.Cluster.local(2), inputs, loss_fn=loss_fn,
                   example_targets=targets, constraints=ah.Constraints(dp=1, tp=2, pp=1,
                                                                       sp=True))
    exported = capture(model, inputs, loss_fn, targets)
    data = capture_wire.dumps(exported)
    loaded = capture_from(data, model, inputs, loss_fn, targets)
    sent, got = fake_mode(exported.gm).shape_env, fake_mode(loaded.gm).shape_env
    strides = {s for n in loaded.gm.graph.nodes if n.op == "placeholder"
               and isinstance(n.meta.get("val"), torch.Tensor)
               for st in n.meta["val"].stride() if isinstance(st, torch.SymInt)
               for s in st.node.expr.free_symbols}
    assert strides and strides <= set(got.var_to_range)    # the case this test is about
    assert capture_wire.symbol_ranges(loaded.gm) == capture_wire.symbol_ranges(exported.gm)
    # the sender's guards over the symbols its graph holds: one a guard replaced by
    # another (the inputs' and targets' one batch, capture._one_batch) no value holds
    assert {got.replace(a) for a in got.get_axioms()} == \
        {sent.replace(a) for a in sent.get_axioms()} - {sympy.true}
    assert _programs(loaded, [plan]) == _programs(exported, [plan])
    payload = pickle.loads(data)
    payload["shape_facts"]["ranges"] = {}
    with pytest.raises(capture_wire.WireMismatch, match="no value range for s"):
        capture_from(pickle.dumps(payload), model, inputs, loss_fn, targets)


class _Net(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class _OtherCode(_Net):
    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_the_portable_digest_names_structure_code_and_shapes():
    """Two instances of one model agree; a changed width, a changed forward, another
    example dtype, another loss or another device each change the digest."""
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    ce = nn.functional.cross_entropy

    def digest(model, x=x, loss=ce):
        return capture_digest(model, (x,), loss, (y,))[0]

    base = digest(_Net())
    assert base is not None and digest(_Net()) == base
    assert digest(_Net(width=16), x=torch.randn(4, 16)) != base
    assert digest(_OtherCode()) != base
    assert digest(_Net(), x=torch.randn(4, 8, dtype=torch.float64)) != base
    assert digest(_Net(), loss=nn.functional.nll_loss) != base
    assert digest(_Net().to("meta")) != base      # the device counts (cuda:0 ≠ cuda:1)


# ----------------------------------------------------------------------------- processes
def _share_rank(rank: int, mode: str) -> tuple:
    from autohybrid.runtime.capture_share import capture_once

    torch.manual_seed(0)
    width = {"same": 8, "differ": 8 * (rank + 2), "refuse": 40, "fails": 8, "own": 56}[mode]
    if mode == "refuse" and rank == 1:   # this rank cannot load rank 0's graph
        from autohybrid.runtime import capture_share

        def refuse(*args, **kwargs):
            raise capture_wire.WireMismatch("injected: this rank cannot load it")
        capture_share.capture_from = refuse   # (the pool replaces this rank after the run)
    model = _Net(width) if mode != "fails" else _Fails()
    x, y = torch.randn(4, width), torch.randint(0, 4, (4,))
    try:
        cap = capture_once(model, (x,), nn.functional.cross_entropy, (y,))
    except ah.CaptureError as exc:
        return ("raised", str(exc).splitlines()[0])
    return (cap.origin, cap.hash)


class _Fails(_Net):
    def forward(self, x):
        if x.sum() > 0:          # data-dependent control flow: no export, no fx trace
            return self.b(self.a(x))
        return self.b(x)


@pytest.mark.procs
def test_ranks_load_rank_zeros_graph_or_capture_their_own(monkeypatch):
    """Ranks with one model all run rank 0's serialized graph (rank 0 too); ranks whose
    models differ each capture their own; when one rank cannot load rank 0's graph,
    every rank runs its own export (rank 0 too: no job mixes loaded and exported
    graphs); a capture that fails raises the same error on every rank (no rank is left
    waiting for rank 0). Sharing is opt-in (AUTOHYBRID_CAPTURE_SHARE=1); off, each rank
    exports its own."""
    monkeypatch.setenv("AUTOHYBRID_CAPTURE_SHARE", "1")   # the ranks take this environment
    same = pool_launch(_share_rank, 2, args=("same",), timeout_s=120)
    assert all(origin.startswith("wire:") for origin, _ in same)
    assert len(set(same)) == 1
    differ = pool_launch(_share_rank, 2, args=("differ",), timeout_s=120)
    assert [origin for origin, _ in differ] == ["export", "export"]
    assert differ[0][1] != differ[1][1]
    refuse = pool_launch(_share_rank, 2, args=("refuse",), timeout_s=120)
    assert [origin for origin, _ in refuse] == ["export", "export"]   # no mixed job
    assert refuse[0][1] == refuse[1][1]
    fails = pool_launch(_share_rank, 2, args=("fails",), timeout_s=120)
    assert [kind for kind, _ in fails] == ["raised", "raised"]
    assert fails[0] == fails[1] and "could not capture" in fails[0][1]
    # off: each rank its own export (of a width no run above used, so no warm rank holds
    # its graph in the capture memo)
    monkeypatch.setenv("AUTOHYBRID_CAPTURE_SHARE", "0")
    own = pool_launch(_share_rank, 2, args=("own",), timeout_s=120)
    assert [origin for origin, _ in own] == ["export", "export"] and own[0][1] == own[1][1]


def test_a_memoized_graph_keeps_no_parameter_of_its_model_alive():
    """The capture memo keeps each graph's exported program (what rank 0 sends); it
    holds meta tensors, so a model dropped by its user is freed."""
    import gc
    import weakref

    model, inputs, loss_fn, targets = _zoo("gpt-tiny")
    cap = capture(model, inputs, loss_fn, targets)
    assert all(t.device.type == "meta" for t in cap.exported.state_dict.values())
    weight = weakref.ref(model.lm_head.weight)
    del model
    gc.collect()
    assert weight() is None
    assert capture_wire.dumps(cap)     # still sendable
