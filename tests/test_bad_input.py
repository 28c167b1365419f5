"""The bad-input catalogue: every kind of bad input a user can give, refused with a typed
error (an `ah.AutohybridError` subclass) whose message names the culprit and a fix,
before anything wrong runs, with no hang and no partial output.

Table-driven and mostly process-free (tiny zoo models on `Cluster.local(1)` or on fake
process groups; the CLI through `autohybrid.cli.main` in this process): `API_CASES`
(ah.plan, ah.compile, train_step, compiled(...), Plan files, Constraints),
`CLI_CASES` (`autohybrid plan | inspect | train | bench | calibrate`: exit status 2,
the reason on stderr, no traceback, no file left where an output was asked). The few
cases that need ranks (different batches on two ranks, a batch breaking the condition a
split was proven on, a failed run's exit status, a traceback that must not be printed)
start processes and are marked `procs`.
tests/test_errors.py holds the older cases; none is repeated here.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autohybrid as ah
from _limits import guard
from _pool import launch
from autohybrid import cli, models, planning
from autohybrid.capture import capture

LAUNCH_TIMEOUT_S = guard(90)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), target.flatten())


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@functools.lru_cache(maxsize=None)
def _gpt() -> tuple:
    torch.manual_seed(0)
    model = models.preset("gpt-tiny")
    (x,), y = models.example_batch("gpt-tiny", 4)
    compiled = ah.compile(model, ah.Cluster.local(1), (x,), loss_fn=_loss, example_targets=y,
                          optimizer=_sgd)
    return compiled, x, y


def _mlp(loss_fn: Callable = F.cross_entropy) -> tuple:
    torch.manual_seed(0)
    model = models.preset("mlp-tiny")  # 16 features in, 8 classes
    x, y = torch.randn(4, 16), torch.randint(0, 8, (4,))
    compiled = ah.compile(model, ah.Cluster.local(1), (x,), loss_fn=loss_fn,
                          example_targets=y, optimizer=_sgd)
    return compiled, x, y


@functools.lru_cache(maxsize=None)
def _gpt_plan(world: int = 1, **constraints: Any) -> ah.Plan:
    model = models.preset("gpt-tiny")
    (x,), y = models.example_batch("gpt-tiny", 4)
    return ah.plan(model, ah.Cluster.local(world), (x,), loss_fn=_loss, example_targets=y,
                   constraints=ah.Constraints(**constraints) if constraints else None)


def _tiny_memory_cluster() -> ah.Cluster:
    """One CPU rank with 64 KiB of memory: no plan of gpt-tiny fits."""
    data = ah.Cluster.local(1).to_dict()
    return ah.Cluster.from_dict({**data, "device": {**data["device"], "memory_bytes": 2**16}})


def _edited(plan: ah.Plan, **fields: Any) -> ah.Plan:
    data = json.loads(plan.to_json())
    data.update(fields)
    return ah.Plan.from_dict(data)


# --------------------------------------------------------------------------- API cases
def _plan_gpt(**kwargs: Any) -> None:
    model = kwargs.pop("model", None) or models.preset("gpt-tiny")
    (x,), y = models.example_batch("gpt-tiny", kwargs.pop("batch", 4))
    ah.plan(model, kwargs.pop("cluster", ah.Cluster.local(1)), (x,), loss_fn=_loss,
            example_targets=y, **kwargs)


def _compile_gpt(**kwargs: Any) -> None:
    model = kwargs.pop("model", None) or models.preset("gpt-tiny")
    (x,), y = models.example_batch("gpt-tiny", 4)
    ah.compile(model, ah.Cluster.local(1), (x,), loss_fn=kwargs.pop("loss_fn", _loss),
               example_targets=y, **kwargs)


def _not_captured(monkeypatch) -> None:
    """Fail the case if compile gets as far as capturing (the check must come first)."""
    import autohybrid.compiled as compiled_module

    def refuse(*_a, **_k):
        raise AssertionError("captured before the plan was checked")
    monkeypatch.setattr(compiled_module, "capture_once", refuse)
    monkeypatch.setattr(compiled_module, "capture", refuse)


def _step(which: Callable, change: Callable) -> None:
    compiled, x, y = which()
    inputs, targets = change(x, y)
    compiled.train_step(inputs, targets)


def _nan_step() -> None:
    compiled, x, y = _mlp()
    before = {n: p.detach().clone() for n, p in compiled.model.named_parameters()}
    compiled.train_step(x, y)  # step 0 trains
    trained = {n: p.detach().clone() for n, p in compiled.model.named_parameters()}
    assert any(not torch.equal(before[n], trained[n]) for n in before)
    bad = x.clone()
    bad[0, 0] = float("nan")
    try:
        compiled.train_step(bad, y)
    finally:  # the refused step left the parameters as they were
        for n, p in compiled.model.named_parameters():
            assert torch.equal(p, trained[n])


def _inf_loss() -> None:
    compiled, x, y = _mlp(lambda out, t: F.cross_entropy(out, t) / (t.sum() * 0))
    compiled.train_step(x, y)


class _NoParams(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def _loss_that_raises(out, target):
    raise RuntimeError("the loss went wrong")


def _factory_that_raises(params):
    raise ValueError("lr must be positive")


def _scheduler_factory(params):
    return torch.optim.lr_scheduler.StepLR(torch.optim.SGD(params, lr=0.1), 1)


def _sharding_not_in_graph() -> None:
    model = models.preset("gpt-tiny")
    (x,), y = models.example_batch("gpt-tiny", 4)
    plan = _gpt_plan(2, tp=2)
    data = json.loads(plan.to_json())
    data["shardings"][0]["node"] = "invented_linear"
    edited = ah.Plan.from_dict(data)  # well formed: only the graph says it is foreign
    planning.check_plan_fits_model(edited, capture(model, (x,), _loss, y), ah.Cluster.local(2))


def _bad_placement() -> None:
    data = json.loads(_gpt_plan(2, tp=2).to_json())
    data["shardings"][0]["placement"] = "shard(x)"
    ah.Plan.from_dict(data)


@dataclass(frozen=True)
class Case:
    id: str
    error: type
    needles: tuple[str, ...]  # the culprit, and a word of the fix
    run: Callable[..., None]
    monkeypatched: bool = False  # run(monkeypatch)


API_CASES = [
    # planning inputs
    Case("global_batch=0 (plan)", ah.PlanError, ("global_batch", "got 0", "leave it None"),
         lambda: _plan_gpt(global_batch=0)),
    Case("global_batch=0 (compile)", ah.PlanError, ("global_batch", "got 0"),
         lambda: _compile_gpt(global_batch=0)),
    Case("global_batch=2.5", ah.PlanError, ("global_batch", "2.5"),
         lambda: _plan_gpt(global_batch=2.5)),
    Case("tp does not divide the heads", ah.PlanError, ("tp=3", "4 attention heads"),
         lambda: _plan_gpt(cluster=ah.Cluster.local(3), constraints=ah.Constraints(tp=3))),
    Case("heads do not divide hidden", ah.ModelError, ("hidden=30", "heads=4"),
         lambda: models.gpt(layers=1, hidden=30, heads=4, vocab=32, seq=8)),
    Case("more stages than layers", ah.PlanError, ("pp=8", "layers"),
         lambda: _plan_gpt(batch=8, cluster=ah.Cluster.local(8),
                           constraints=ah.Constraints(pp=8))),
    Case("batch does not split into microbatches", ah.PlanError, ("num_microbatches=8",),
         lambda: _plan_gpt(constraints=ah.Constraints(num_microbatches=8))),
    Case("unknown schedule", ah.PlanError, ("Constraints.schedule", "'1f1b'", "'bogus'"),
         lambda: ah.Constraints(schedule="bogus")),
    Case("ZeRO stage 4", ah.PlanError, ("Constraints.zero", "0, 1, 2 or 3"),
         lambda: ah.Constraints(zero=4)),
    Case("negative bucket size constraint", ah.PlanError, ("Constraints.bucket_mb", "> 0"),
         lambda: ah.Constraints(bucket_mb=-1.0)),
    Case("impossible memory limit", ah.NoPlanFitsError, ("GiB per rank", "Use more devices"),
         lambda: _plan_gpt(cluster=_tiny_memory_cluster())),
    # compile arguments
    Case("model without parameters", ah.ModelError, ("no parameters", "nothing to train"),
         lambda: ah.compile(_NoParams(), ah.Cluster.local(1), (torch.randn(4, 3),),
                            loss_fn=F.mse_loss, example_targets=torch.randn(4, 3))),
    Case("optimizer object, not a factory", ah.UserFunctionError,
         ("optimizer must be a function", "lambda params"),
         lambda: _compile_gpt(optimizer=torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1))),
    Case("optimizer factory raises", ah.UserFunctionError,
         ("_factory_that_raises", "lr must be positive"),
         lambda: _compile_gpt(optimizer=_factory_that_raises)),
    Case("optimizer factory returns a scheduler", ah.UserFunctionError,
         ("_scheduler_factory", "StepLR", "not a torch.optim.Optimizer"),
         lambda: _compile_gpt(optimizer=_scheduler_factory)),
    Case("loss_fn raises", ah.CaptureError, ("loss_fn _loss_that_raises",
                                             "the loss went wrong", "check it in eager"),
         lambda: _compile_gpt(loss_fn=_loss_that_raises)),
    # plans: edited, foreign
    Case("plan for another world size", ah.PlanError, ("2 ranks", "cluster has 1"),
         lambda mp: (_not_captured(mp), _compile_gpt(plan=_gpt_plan(2, pp=2))),
         monkeypatched=True),
    Case("plan for another model", ah.PlanError, ("another model", "parameter names"),
         lambda mp: (_not_captured(mp),
                     _compile_gpt(model=models.preset("gpt-tiny", layers=3),
                                  plan=_gpt_plan())), monkeypatched=True),
    Case("plan JSON: negative bucket_mb", ah.PlanError, ("plan.bucket_mb", "-5", "again"),
         lambda: _edited(_gpt_plan(), bucket_mb=-5)),
    Case("plan JSON: shardings without tp", ah.PlanError, ("plan.shardings", "no tp axis"),
         lambda: _edited(_gpt_plan(), shardings=[{"node": "linear",
                                                  "placement": "shard(0)"}])),
    Case("plan JSON: invented sharding node", ah.PlanError, ("invented_linear", "again"),
         _sharding_not_in_graph),
    Case("plan JSON: malformed placement", ah.PlanError, ("shard(x)", "'shard(d)'"),
         _bad_placement),
    Case("plan JSON: unknown field", ah.PlanError, ("unknown field plan.turbo",),
         lambda: _edited(_gpt_plan(), turbo=True)),
    Case("plan JSON: a list, not an object", ah.PlanError, ("JSON object",),
         lambda: ah.Plan.from_dict([1, 2])),
    # train_step / compiled(...) with another batch than compiled
    Case("token id >= vocabulary", ah.InputError, ("inputs[0]", "id 96", "model.tok_emb",
                                                   "below 96"),
         lambda: _step(_gpt, lambda x, y: (torch.full_like(x, 96), y))),
    Case("negative token id", ah.InputError, ("id -1", "model.tok_emb"),
         lambda: _step(_gpt, lambda x, y: (x - x - 1, y))),
    Case("sequence longer than the positions", ah.InputError,
         ("sequence length 24", "16 positions", "model.pos_emb"),
         lambda: _step(_gpt, lambda x, y: (torch.zeros(4, 24, dtype=torch.long),
                                           torch.zeros(4, 24, dtype=torch.long)))),
    Case("targets of another dtype", ah.InputError, ("targets[0]", "float32", "int64"),
         lambda: _step(_mlp, lambda x, y: (x, y.float()))),
    Case("float token ids", ah.InputError, ("inputs[0]", "float32", "int64", ".to(torch.int64)"),
         lambda: _step(_gpt, lambda x, y: (x.float(), y))),
    Case("targets of another rank", ah.InputError, ("targets[0]", "1 dims", "2 dims"),
         lambda: _step(_gpt, lambda x, y: (x, y[:, 0]))),
    Case("targets of another length", ah.InputError,
         ("targets[0] has size 15 in dim 1", "dim 1 of inputs[0], 16"),
         lambda: _step(_gpt, lambda x, y: (x, y[:, :-1]))),
    Case("targets of another batch size", ah.InputError,
         ("targets[0] has size 2 in dim 0", "dim 0 of inputs[0], 4", "the batch"),
         lambda: _step(_gpt, lambda x, y: (x, y[:2]))),
    Case("features of another size", ah.InputError, ("inputs[0]", "size 17 in dim 1", "16"),
         lambda: _step(_mlp, lambda x, y: (torch.randn(4, 17), y))),
    Case("forward with float token ids", ah.InputError, ("inputs[0]", "float32"),
         lambda: _gpt()[0](_gpt()[1].float())),
    Case("NaN in the batch: non-finite loss", ah.NumericsError,
         ("train_step 1", "nan", "did not step"), _nan_step),
    Case("infinite loss", ah.NumericsError, ("train_step 0", "inf", "lower the learning rate"),
         _inf_loss),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", API_CASES, ids=[c.id for c in API_CASES])
def test_api_bad_input(case: Case, monkeypatch) -> None:
    with pytest.raises(case.error) as err:
        case.run(monkeypatch) if case.monkeypatched else case.run()
    assert isinstance(err.value, ah.AutohybridError)
    for needle in case.needles:
        assert needle in str(err.value), f"{needle!r} not in: {err.value}"


@pytest.mark.timeout(60)
def test_a_refused_batch_leaves_the_model_usable() -> None:
    compiled, x, y = _gpt()
    with pytest.raises(ah.InputError):
        compiled.train_step(torch.full_like(x, 96), y)
    assert torch.isfinite(compiled.train_step(x, y))


# --------------------------------------------------------------------------- CLI cases
@dataclass(frozen=True)
class CliCase:
    id: str
    argv: Callable[[Path], list[str]]
    needles: tuple[str, ...]
    outputs: tuple[str, ...] = ()  # files (under tmp) that must not exist afterwards


def _plan_file(tmp: Path, world: int = 1, dtype: str = "float32", model: str = "gpt-tiny"
               ) -> str:
    path = tmp / f"plan_{world}_{dtype}.json"
    assert cli.main(["plan", model, "--cluster", f"local:{world}", "--dtype", dtype,
                     "--out", str(path), "--json"]) == 0
    return str(path)


def _code_plan(tmp: Path) -> str:
    """A plan whose MODEL is a Python file that leaves a marker when it runs."""
    factory = tmp / "factory.py"
    factory.write_text("import pathlib\npathlib.Path(__file__).with_name('ran').touch()\n"
                       "from autohybrid import models\n"
                       "def build(**kw):\n    return models.preset('gpt-tiny')\n")
    plan = _gpt_plan()
    path = tmp / "code_plan.json"
    _edited(plan, model_ref=f"{factory}:build").to_json(path)
    (tmp / "ran").unlink(missing_ok=True)
    return str(path)


def _cluster_file(tmp: Path, text: str) -> str:
    path = tmp / "cluster.json"
    path.write_text(text)
    return str(path)


CLI_CASES = [
    CliCase("MODEL argument not a number", lambda t: ["plan", "gpt-tiny?layers=abc"],
            ("layers='abc' must be a number", "arguments of 'gpt-tiny'")),
    CliCase("MODEL unknown argument", lambda t: ["plan", "gpt-tiny?colour=1"],
            ("unknown argument", "'colour'", "heads, hidden")),
    CliCase("MODEL argument without a value", lambda t: ["plan", "gpt-tiny?layers"],
            ("'layers' is not key=value",)),
    CliCase("MODEL batch=0", lambda t: ["plan", "gpt-tiny?batch=0"],
            ("batch must be a positive integer",)),
    CliCase("--seq 0", lambda t: ["plan", "gpt-tiny", "--seq", "0"],
            ("seq must be a positive integer",)),
    CliCase("MODEL factory raises", lambda t: ["plan", _factory(t, "raise KeyError('x')")],
            ("the factory 'build' raised KeyError",)),
    CliCase("--out into a missing directory",
            lambda t: ["plan", "gpt-tiny", "--out", str(t / "no" / "plan.json")],
            ("--out", "no directory", "create it")),
    CliCase("--out is not written when planning fails",
            lambda t: ["plan", "gpt-tiny", "--cluster", "local:3", "--constrain", "tp=3",
                       "--out", str(t / "plan.json")],
            ("no candidate plan: tp=3 does not divide",), outputs=("plan.json",)),
    CliCase("--global-batch 0", lambda t: ["plan", "gpt-tiny", "--global-batch", "0",
                                           "--out", str(t / "plan.json")],
            ("global_batch must be a positive integer",), outputs=("plan.json",)),
    CliCase("--constrain unknown schedule", lambda t: ["plan", "gpt-tiny", "--constrain",
                                                       "schedule=fast"],
            ("Constraints.schedule", "'fast'")),
    CliCase("cluster file not JSON", lambda t: ["plan", "gpt-tiny", "--cluster",
                                                _cluster_file(t, '{"nodes": 2')],
            ("not valid JSON",)),
    CliCase("cluster file with a bad field",
            lambda t: ["plan", "gpt-tiny", "--cluster", _cluster_file(
                t, json.dumps({**ah.Cluster.preset("cpu").to_dict(), "nodes": "two"}))],
            ("'nodes'",)),
    CliCase("cluster too small for the model",
            lambda t: ["plan", "gpt-tiny", "--cluster", _cluster_file(t, json.dumps(
                _tiny_memory_cluster().to_dict())), "--out", str(t / "p.json")],
            ("no plan fits", "GiB"), outputs=("p.json",)),
    CliCase("calibration file missing", lambda t: ["plan", "gpt-tiny", "--calibration",
                                                   str(t / "none.json")],
            ("calibration profile", "none.json")),
    CliCase("inspect a truncated plan",
            lambda t: ["inspect", _truncated(t)], ("not valid JSON",)),
    CliCase("inspect a plan whose model is code",
            lambda t: ["inspect", _code_plan(t)],
            ("names a Python file", "--trust-model-code"), outputs=("ran",)),
    CliCase("train a plan for another world size",
            lambda t: ["train", "gpt-tiny", "--cluster", "local:2", "--plan", _plan_file(t)],
            ("1 ranks but the cluster has 2",)),
    CliCase("train a plan for another model",
            lambda t: ["train", "gpt-tiny?layers=3", "--cluster", "local:1",
                       "--plan", _plan_file(t)],
            ("another model (gpt-tiny)", "parameter names")),
    CliCase("train a bfloat16 plan without --dtype",
            lambda t: ["train", "gpt-tiny", "--cluster", "local:1",
                       "--plan", _plan_file(t, dtype="bfloat16")],
            ("trains in bfloat16", "--dtype bfloat16")),
    CliCase("bench a bfloat16 plan", lambda t: ["bench", "gpt-tiny", "--cluster", "local:1",
                                                "--plan", _plan_file(t, dtype="bfloat16")],
            ("trains in bfloat16",)),
    CliCase("train with a bad MODEL", lambda t: ["train", "gpt-tiny?hidden=x",
                                                 "--cluster", "local:1"],
            ("hidden='x' must be a number",)),
    CliCase("train --save into a missing directory",
            lambda t: ["train", "gpt-tiny", "--cluster", "local:1",
                       "--save", str(t / "no" / "state.pt")], ("--save", "no directory")),
    CliCase("calibrate --out into a missing directory",
            lambda t: ["calibrate", "--world-size", "1", "--out", str(t / "no" / "c.json")],
            ("--out", "no directory")),
]


def _factory(tmp: Path, body: str) -> str:
    path = tmp / "bad_factory.py"
    path.write_text(f"def build(**kw):\n    {body}\n")
    return f"{path}:build"


def _truncated(tmp: Path) -> str:
    path = tmp / "truncated.json"
    path.write_text(_gpt_plan().to_json()[:200])
    return str(path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CLI_CASES, ids=[c.id for c in CLI_CASES])
def test_cli_bad_input(case: CliCase, tmp_path: Path, capsys) -> None:
    argv = case.argv(tmp_path)
    capsys.readouterr()
    assert cli.main(argv) == cli.EXIT_NO_PLAN
    err = capsys.readouterr().err
    for needle in case.needles:
        assert needle in err, f"{needle!r} not in: {err}"
    assert "Traceback" not in err
    for name in case.outputs:
        assert not (tmp_path / name).exists(), f"{name} left behind"


# --------------------------------------------------------------------------- with ranks
def _different_batches(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = models.preset("mlp-tiny")
    x, y = torch.randn(8, 16), torch.randint(0, 8, (8,))
    compiled = ah.compile(model, ah.Cluster.local(2), (x,), loss_fn=F.cross_entropy,
                          example_targets=y, optimizer=_sgd, constraints=ah.Constraints(dp=2))
    out: dict[str, Any] = {}

    def bad_batches(suffix: str) -> None:
        """A step with another batch on each rank, then one rank 1 refuses: the error."""
        for what, batch in (("different", (x + rank, y)),
                            ("refused", (torch.randn(8, 17) if rank else x, y))):
            try:
                compiled.train_step(*batch)
                out[what + suffix] = None
            except ah.InputError as exc:
                out[what + suffix] = str(exc)

    bad_batches("")
    # each rank's own shard by design: local=True skips the agreement
    shard = compiled.local_slice((x + rank, y))
    out["local"] = repr(float(compiled.train_step(*shard, local=True)))
    out["same"] = repr(float(compiled.train_step(x, y)))
    # from here the check runs during the first forward (dp alone: deferred), and still
    # every rank raises, before any gradient is summed or anything steps
    out["deferred"] = compiled._deferrable()
    before = {k: v.clone() for k, v in compiled.full_state_dict().items()}
    bad_batches(" later")
    out["unchanged"] = all(torch.equal(before[k], v)
                           for k, v in compiled.full_state_dict().items())
    out["same later"] = repr(float(compiled.train_step(x, y)))
    return out


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_ranks_passing_different_batches_all_raise() -> None:
    results = launch(_different_batches, 2, timeout_s=LAUNCH_TIMEOUT_S)
    for out in results:
        assert "different batches" in out["different"]
        assert "ranks 0; ranks 1" in out["different"] and "local=True" in out["different"]
        assert out["local"] is not None and out["same"] is not None
    assert "size 17 in dim 1" in results[1]["refused"]
    assert "another rank refused its batch" in results[0]["refused"]
    assert results[0]["same"] == results[1]["same"]
    for out in results:   # the deferred check: the same errors, nothing stepped
        assert out["deferred"] is True
        assert "different batches" in out["different later"]
        assert "ranks 0; ranks 1" in out["different later"]
        assert out["unchanged"] is True
    assert "size 17 in dim 1" in results[1]["refused later"]
    assert "another rank refused its batch" in results[0]["refused later"]
    assert results[0]["same later"] == results[1]["same later"]


def _choices_differ(rank: int) -> list:
    """BertForMultipleChoice under dp2, compiled without example targets (the training
    graph captured at the first step): a batch whose mask has 3 choices and ids 2, then
    the right batch, then that bad batch again (checked before the step)."""
    from autohybrid.models import coverage

    torch.manual_seed(0)
    case = coverage.build("bert_mc")
    (ids, mask), targets = case.batches[0]
    compiled = ah.compile(case.model, ah.Cluster.local(2), (ids, mask), loss_fn=None,
                          optimizer=_sgd, constraints=ah.Constraints(dp=2, tp=1, pp=1))
    three = torch.cat([mask, mask[:, :1]], dim=1)
    out = []
    for batch in ((ids, three), (ids, mask), (ids, three)):
        try:
            out.append(float(compiled.train_step(batch, targets)))
        except ah.InputError as exc:
            out.append(str(exc))
    return out


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_a_batch_breaking_the_condition_of_the_split_is_refused_on_every_rank() -> None:
    """The split of a multiple-choice batch is proven for ids and mask of as many
    choices (passes/batch_flow.py `assume_eq`): a batch where they differ is refused on
    every rank, at the step that captures the training graph and at a later one, naming
    both dims; the right batch trains in between."""
    pytest.importorskip("transformers")
    results = launch(_choices_differ, 2, timeout_s=LAUNCH_TIMEOUT_S)
    for first, good, later in results:
        for refused in (first, later):
            assert "dim 1 of inputs[0] and dim 1 of inputs[1]) are 2 and 3" in refused
        assert isinstance(good, float) and good == results[0][1]


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_a_failed_run_exits_1(tmp_path: Path, capsys) -> None:
    """A run whose first loss is NaN (a factory's model with a NaN weight) fails in its
    ranks: `train` exits 1, naming the step, as its docstring says (was 2)."""
    factory = tmp_path / "nan_model.py"
    factory.write_text(
        "import torch\nfrom autohybrid import models\n"
        "def build(**kw):\n    model = models.preset('mlp-tiny')\n"
        "    with torch.no_grad():\n        model.layers[0].weight[0, 0] = float('nan')\n"
        "    return model, (torch.randn(4, 16),), torch.randint(0, 8, (4,))\n")
    code = cli.main(["train", f"{factory}:build", "--cluster", "local:1", "--steps", "2"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_FAILED, err
    assert "train_step 0" in err and "not finite" in err


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_cli_prints_no_traceback_for_bad_input(tmp_path: Path) -> None:
    """In a fresh process, as users run it: exit status 2 and one line, no traceback."""
    for argv in (["plan", "gpt-tiny?layers=abc"],
                 ["plan", "gpt-tiny", "--out", str(tmp_path / "no" / "plan.json")]):
        proc = subprocess.run([sys.executable, "-m", "autohybrid.cli", *argv],
                              capture_output=True, text=True, timeout=guard(60))
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr and "autohybrid plan:" in proc.stderr


def test_catalogue_size() -> None:
    assert len({c.id for c in API_CASES}) + len({c.id for c in CLI_CASES}) >= 30


@pytest.mark.timeout(120)
def test_the_batch_check_is_deferred_only_where_the_forward_issues_no_collective() -> None:
    """dp alone: the forward issues no collective, so the check may run during it; tp,
    ZeRO-3 and SyncBatchNorm graphs communicate in their forward (the check must settle
    first). Rewritten on fake process groups (rewrite.py), as the planner's trial does."""
    from autohybrid.rewrite import rewrite
    from autohybrid.runtime.batch_agreement import runs_no_collective

    model = models.preset("gpt-tiny")
    inputs, targets = models.example_batch("gpt-tiny", 8)
    loss = lambda out, t: F.cross_entropy(out.flatten(0, -2), t.flatten())  # noqa: E731
    train = capture(model, inputs, loss, targets)
    cases = {"dp2": (ah.Constraints(dp=2, tp=1, pp=1, zero=0), True),
             "dp2 zero3": (ah.Constraints(dp=2, tp=1, pp=1, zero=3), False),
             "tp2": (ah.Constraints(dp=1, tp=2, pp=1), False)}
    for name, (constraints, expected) in cases.items():
        plan = ah.plan(model, ah.Cluster.local(2), inputs, loss_fn=loss,
                       example_targets=targets, constraints=constraints)
        program = rewrite(train, plan, 0, fake_groups=True)
        assert runs_no_collective([program.runnable.gm]) is expected, name
