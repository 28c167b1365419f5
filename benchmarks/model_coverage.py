"""Model coverage sweep: models autohybrid did not write, under every kind of plan.

Each model of `autohybrid.models.coverage` (Hugging Face architectures from tiny
configs, torch-native LSTM / GRU / nn.Transformer / nn.MultiheadAttention models) is
compiled for 2 local ranks under the planner's unconstrained choice and pinned dp=2,
tp=2 and pp=2, and dp=2 and pp=2 with one sample per microbatch (dp2x2, pp2x4), trained
3 SGD steps beside an eager
copy, and compared: losses, gathered gradients and parameters after every step. A cell
is

- ``equal``: every step matched eager (torch.testing.assert_close defaults, float64);
- ``refused: <reason>``: `ah.compile` raised an AutohybridError before running;
- ``wrong: <first mismatch>``: it ran and differs from eager (a silent wrong result);
- ``failed: <error>``: anything else (an error at run time, a crash).

Only ``equal`` and ``refused`` are acceptable; the unconstrained column must be ``equal``.

    python benchmarks/model_coverage.py                  # every model, every plan
    python benchmarks/model_coverage.py llama t5 --plans tp2
    python benchmarks/model_coverage.py --out benchmarks/results/model_coverage.txt

Exit status 1 when a cell is ``wrong`` or ``failed`` or an unconstrained cell is not
``equal``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("AUTOHYBRID_COLLECTIVE_TIMEOUT_S", "30")

import torch  # noqa: E402

import autohybrid as ah  # noqa: E402
from autohybrid.errors import AutohybridError  # noqa: E402
from autohybrid.models import coverage  # noqa: E402

PLANS: dict[str, ah.Constraints | None] = {
    "auto": None,
    "dp2": ah.Constraints(dp=2, tp=1, pp=1),
    "tp2": ah.Constraints(dp=1, tp=2, pp=1),
    "pp2": ah.Constraints(dp=1, tp=1, pp=2),
    # microbatched: a sample per microbatch (the batches hold 4)
    "dp2x2": ah.Constraints(dp=2, tp=1, pp=1, num_microbatches=2),
    "pp2x4": ah.Constraints(dp=1, tp=1, pp=2, num_microbatches=4),
}
STEPS = 3


def _first_mismatch(what: str, actual, expected) -> str | None:
    if isinstance(expected, dict):
        if set(actual) != set(expected):
            return f"{what}: keys differ ({sorted(set(actual) ^ set(expected))[:3]})"
        for key in expected:
            if (actual[key] is None) != (expected[key] is None):
                return f"{what}[{key}]: one side has no gradient"
            if expected[key] is not None:
                problem = _first_mismatch(f"{what}[{key}]", actual[key], expected[key])
                if problem:
                    return problem
        return None
    try:
        torch.testing.assert_close(actual, expected)
    except AssertionError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return f"{what}: {'; '.join(lines[:3])}"
    return None


def run_case(rank: int, name: str, plan_name: str, steps: int = STEPS,
             dtype: str = "float64") -> tuple[str, str]:
    """On every rank: compile `name` under the plan, train beside eager; (status, detail)."""
    import copy

    torch.manual_seed(0)
    case = coverage.build(name, dtype=getattr(torch, dtype))
    ref = copy.deepcopy(case.model)
    inputs0, targets0 = case.batches[0]
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    try:
        compiled = ah.compile(case.model, ah.Cluster.local(2), inputs0, loss_fn=case.loss_fn,
                              example_targets=targets0, optimizer=sgd,
                              constraints=PLANS[plan_name])
    except AutohybridError as exc:
        return "refused", f"{type(exc).__name__}: {exc}"
    ref_opt = sgd(list(ref.parameters()))
    plan = compiled.plan.mesh.describe()
    try:
        for step, (inputs, targets) in enumerate(case.batches[:steps]):
            loss = compiled.train_step(inputs, targets)
            for p in ref.parameters():
                p.grad = None
            expected = case.eager_loss(ref, inputs, targets)
            expected.backward()
            for what, actual, want in (
                    ("loss", loss, expected.detach()),
                    ("grad", compiled.full_grads(),
                     {n: p.grad for n, p in ref.named_parameters()})):
                problem = _first_mismatch(f"step {step} {what}", actual, want)
                if problem:
                    return "wrong", f"{plan}: {problem}"
            ref_opt.step()
            problem = _first_mismatch(f"step {step} state", compiled.full_state_dict(),
                                      {k: v.detach() for k, v in ref.state_dict().items()})
            if problem:
                return "wrong", f"{plan}: {problem}"
    except Exception as exc:  # noqa: BLE001 - the sweep records every failure
        return "failed", f"{plan}: {type(exc).__name__}: {str(exc).strip()[:300]}"
    return "equal", plan


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Timed out")


def _culprit(per_rank: list[tuple[str, str]]) -> tuple[str, str]:
    """The worst rank's outcome; of failures, one that is not a peer's lost connection."""
    order = {"failed": 0, "wrong": 1, "refused": 2, "equal": 3}
    worst = min(per_rank, key=lambda r: (order[r[0]], any(p in r[1] for p in _PEER_GONE)))
    rank = per_rank.index(worst)
    return worst[0], (f"rank {rank}: {worst[1]}" if worst[0] != "equal" else worst[1])


def _launch_two(fn, args: tuple) -> list:
    return ah.launch(fn, ah.Cluster.local(2), args=args, timeout_s=600)


def sweep(names: list[str], plans: list[str], steps: int = STEPS, dtype: str = "float64",
          log=print, launch=_launch_two) -> dict:
    """{(model, plan): (status, detail, seconds)} for every model and plan asked for.
    `launch(fn, args)` runs `fn(rank, *args)` on 2 ranks (ah.launch; the tests pass
    their warm ranks' launcher)."""
    results = {}
    for name in names:
        for plan_name in plans:
            start = time.perf_counter()
            try:
                status, detail = _culprit(launch(run_case, (name, plan_name, steps, dtype)))
            except Exception as exc:  # noqa: BLE001 - a rank crashed or hung
                status, detail = "failed", f"{type(exc).__name__}: {str(exc).strip()[-400:]}"
            seconds = time.perf_counter() - start
            results[name, plan_name] = (status, detail, seconds)
            log(f"{name:16s} {plan_name:5s} {status:8s} {seconds:6.1f}s  {detail[:160]}")
    return results


def table(results: dict, plans: list[str]) -> str:
    names = list(dict.fromkeys(name for name, _ in results))
    width = max(len(n) for n in names)
    lines = [f"{'model':{width}s} | " + " | ".join(f"{p:8s}" for p in plans),
             "-" * (width + 11 * len(plans) + 2)]
    for name in names:
        cells = [results.get((name, p), ("-", "", 0))[0] for p in plans]
        lines.append(f"{name:{width}s} | " + " | ".join(f"{c:8s}" for c in cells))
    lines.append("")
    for (name, plan_name), (status, detail, _) in results.items():
        if status not in ("equal",):
            lines.append(f"{name} {plan_name}: {status}: {detail}")
    return "\n".join(lines)


def bad_cells(results: dict) -> list[str]:
    """Cells that break the rule: wrong or failed anywhere, or unconstrained not equal."""
    return [f"{n} {p}: {s}" for (n, p), (s, _, _) in results.items()
            if s in ("wrong", "failed") or (p == "auto" and s != "equal")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(coverage.ALL))
    parser.add_argument("--plans", default=",".join(PLANS))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    plans = args.plans.split(",")
    if not coverage.have_transformers():
        print("transformers is not installed: only the torch-native models run")
    start = time.perf_counter()
    results = sweep(args.models, plans, args.steps, args.dtype)
    text = table(results, plans)
    text += f"\n\n{len(results)} cells in {time.perf_counter() - start:.0f} s " \
            f"(torch {torch.__version__}, 2 gloo ranks on CPU, {args.dtype}, SGD, {args.steps} steps)"
    print("\n" + text)
    if args.out:
        args.out.write_text(text + "\n")
    bad = bad_cells(results)
    if bad:
        print("\nbreaks the rule: " + "; ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
