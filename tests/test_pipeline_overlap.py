"""A pipeline rank's dp gradient buckets are launched while its schedule still runs.

runtime/reducer.py (`arm_pipeline`) counts, in the first step under a schedule, how many
accumulations complete each parameter's gradient on a rank (hooks, and the zero-bubble
schedules' weight-gradient steps that runtime/pipeline.py reports), launching after the
schedule; from the second step on, each bucket is launched as soon as its parameters
reached their counts, in the recorded order. On 4 gloo ranks, pp 2 × dp 2, gpt-tiny
(tied embedding and output weights) with small buckets (several per rank):

- training matches single-process eager (losses, gathered gradients and parameters every
  step; tests/_equiv.py) under 1F1B (AdamW), interleaved 1F1B (SGD) and ZBV with ZeRO-2
  (AdamW: weight-gradient steps, tied weights read by two stages of one rank, ZeRO with
  pp), and with the overlap switched off;
- structure (the reducer's launch events): the first step launches every bucket after the
  schedule (it counts); later steps launch them during the schedule: under 1F1B during
  the last backward with gradients still to come, under interleaved 1F1B on pp rank 0 while
  backward steps of later microbatches remain; every bucket once per step, in the same
  order on both ranks of a dp group; `AUTOHYBRID_DISABLE_PASSES=overlap` launches all of
  them after the schedule;
- profiler (runtime/profile.py, `compiled.profile`): with overlap on, an all-reduce is
  issued before the end of the step's last backward compute on every rank; off, none is.

Then the reducer alone in one process: counts with a tied parameter, a weight-gradient
step (no hook) and a frozen parameter, launches at the counts in the recorded order, a
new schedule key counted again, an accumulation beyond the count refused.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

import autohybrid as ah
from _limits import guard
from _pool import launch as pool_launch
from autohybrid.errors import RuntimeFailure
from autohybrid.runtime.reducer import GradReducer
from _equiv import (OPTIMIZERS, Failures, compare_training, default_eager_loss, report,
                    zoo_batches, zoo_loss, zoo_model)

LAUNCH_TIMEOUT_S = guard(150)
NAME = "gpt-tiny"
BUCKET_MB = 0.01  # several buckets per rank

#: case, schedule, virtual stages, microbatches per dp rank, ZeRO stage, optimizer, overlap
CASES = [("1f1b", "1f1b", 1, 4, 0, "adamw", True),
         ("interleaved", "interleaved", 2, 4, 0, "sgd", True),
         ("zbv-zero2", "zbv", 2, 4, 2, "adamw", True),
         ("1f1b-off", "1f1b", 1, 4, 0, "sgd", False)]


def _events(compiled) -> list[tuple]:
    return [(e.bucket, e.pending_grads, e.backward_done, e.backward_left)
            for e in compiled.reducer_events]


def _last_backward_end(timeline, rank: int, step: int) -> float:
    return max(iv.end_s for iv in timeline.intervals(rank, "compute", step, "backward"))


def _first_all_reduce(timeline, rank: int, step: int) -> float:
    return min(iv.start_s for iv in timeline.intervals(rank, "communication", step)
               if iv.name == "all_reduce")


def _overlap_rank(rank: int, world: int) -> tuple[list[str], dict]:
    fails = Failures()
    info: dict[str, dict] = {}
    for case, schedule, v, m, zero, optimizer, overlap in CASES:
        os.environ["AUTOHYBRID_DISABLE_PASSES"] = "" if overlap else "overlap"
        model = zoo_model(NAME)
        ref = copy.deepcopy(model)
        batches = zoo_batches(NAME, 2 * m * 2, steps=3)
        compiled = ah.compile(
            model, ah.Cluster.local(world), batches[0][0], loss_fn=zoo_loss(NAME),
            example_targets=batches[0][1], optimizer=OPTIMIZERS[optimizer],
            constraints=ah.Constraints(pp=2, dp=2, tp=1, schedule=schedule, virtual_stages=v,
                                       num_microbatches=m, zero=zero, bucket_mb=BUCKET_MB))
        os.environ["AUTOHYBRID_DISABLE_PASSES"] = ""
        ref_opt = OPTIMIZERS[optimizer](list(ref.parameters()))
        steps = []
        for batch in batches:  # one step at a time, to read each step's launch events
            compare_training(fails, case, compiled, ref, ref_opt, [batch],
                             default_eager_loss(zoo_loss(NAME)))
            steps.append(_events(compiled))
        buckets = len(compiled.executor.reducer.buckets)
        for k, events in enumerate(steps):
            fails.check(f"{case} step {k}: buckets launched {[e[0] for e in events]}, not each "
                        f"of {buckets} once", sorted(e[0] for e in events) == list(range(buckets)))
        during = [e for events in steps[1:] for e in events if e[3] > 0]
        fails.check(f"{case} step 0 (counting) launched during the schedule: {steps[0]}",
                    all(e[3] == 0 for e in steps[0]))
        info[case] = {"pp_rank": compiled.coords[0], "buckets": buckets, "steps": steps}
        if not overlap:
            fails.check(f"{case}: launched during the schedule with overlap off: {during}",
                        not during)
        elif schedule == "1f1b":  # during the last backward, gradients still to come
            first = steps[-1][0]
            fails.check(f"{case}: first launch {first} not during the last backward",
                        first[3] >= 1 and first[1] > 0)
        elif schedule == "interleaved" and compiled.coords[0] == 0:
            fails.check(f"{case}: no launch before later microbatches' backward: {steps[-1]}",
                        any(e[3] >= 2 for e in steps[-1]))
        if schedule in ("interleaved", "1f1b") and not (overlap and schedule == "1f1b"):
            timeline = compiled.profile(batches[:1], steps=1, warmup=0)
            issued, end = _first_all_reduce(timeline, rank, 0), _last_backward_end(timeline,
                                                                                  rank, 0)
            fails.check(f"{case}: profiler: first all-reduce at {issued:.6f} s, last backward "
                        f"compute ends {end:.6f} s", (issued < end) == overlap)
    return list(fails), info


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_pipeline_dp_buckets_launch_during_the_schedule_and_match_eager():
    results = pool_launch(_overlap_rank, 4, args=(4,),
                        timeout_s=LAUNCH_TIMEOUT_S)
    fails = [f for f, _ in results]
    assert not any(fails), report(fails)
    infos = [i for _, i in results]
    for case, *_ in CASES:
        by_pp: dict[int, list] = {}
        for info in infos:
            by_pp.setdefault(info[case]["pp_rank"], []).append(info[case]["steps"])
        for pp_rank, (a, b) in by_pp.items():  # the two dp ranks of each pp rank
            assert [[e[0] for e in s] for s in a] == [[e[0] for e in s] for s in b], (
                f"{case} pp rank {pp_rank}: dp ranks launched buckets in different orders")


# ---------------------------------------------------------------------------- the reducer
def test_reducer_counts_accumulations_then_launches_when_they_are_reached():
    """One process (no dp group): a parameter read twice per microbatch (tied), one
    accumulated by a weight-gradient step (autograd.grad + `+=`, no hook), a frozen one.
    The first step counts and launches after the schedule; the second launches each
    bucket at its last accumulation, in the recorded order; a new schedule key counts
    again; an extra accumulation beyond the count is refused."""
    torch.manual_seed(0)
    tied, w, frozen = (torch.nn.Parameter(torch.randn(3)) for _ in range(3))
    frozen.requires_grad_(False)
    reducer = GradReducer([tied, w, frozen], None, bucket_bytes=1)  # a bucket each
    done = [0]

    def microbatch(x: torch.Tensor) -> None:
        (tied * x).sum().backward()                   # stage A's backward: a hook
        done[0] += 1
        ((tied * w).sum() * 2).backward(inputs=[tied])  # stage B's input step: a hook
        done[0] += 1
        with reducer.weight_step([w]):                # B's weight step: no hook
            (g,) = torch.autograd.grad((tied * w).sum() * 2, [w])
            w.grad = g if w.grad is None else w.grad + g
            done[0] += 1

    def step(key, x_values, check=None):
        for p in (tied, w):
            p.grad = None
        done[0] = 0
        reducer.arm_pipeline(key, lambda: done[0])
        for k, x in enumerate(x_values):
            microbatch(torch.full((3,), float(x)))
            if check:
                check(k)
        reducer.schedule_done()
        events = list(reducer.events)
        reducer.finish(1.0)
        return events

    def check_grads():
        torch.testing.assert_close(tied.grad, 2 + 4 * w.detach())
        torch.testing.assert_close(w.grad, 4 * tied.detach())
        assert frozen.grad is None

    bucket = {name: reducer._bucket_of[id(p)] for name, p in
              (("tied", tied), ("w", w), ("frozen", frozen))}
    events = step("k", [1, 1])
    assert [(e.bucket, e.backward_left) for e in events] == [(0, 0), (1, 0), (2, 0)]
    check_grads()
    counts = reducer.pipeline_counts["k"].counts
    assert (counts[id(tied)], counts[id(w)], counts[id(frozen)]) == (4, 2, 0)
    order = reducer.pipeline_counts["k"].order
    assert order == [bucket["tied"], bucket["w"], bucket["frozen"]]

    seen: list[list[int]] = []
    events = step("k", [1, 1], check=lambda k: seen.append([e.bucket for e in reducer.events]))
    assert seen[0] == []  # nothing final after the first microbatch
    # `tied` at its 4th accumulation (microbatch 1's input step), 2 backward steps left;
    # `w` after the last weight step; `frozen` (no gradient) right after it, its turn
    assert [(e.bucket, e.backward_done, e.backward_left) for e in events] == [
        (bucket["tied"], 4, 2), (bucket["w"], 6, 0), (bucket["frozen"], 6, 0)]
    assert events[0].pending_grads == 1  # w's last accumulation still to come
    check_grads()

    events = step("other shape", [1, 1])  # a new schedule: counted again
    assert all(e.backward_left == 0 for e in events) and "other shape" in reducer.pipeline_counts
    with pytest.raises(RuntimeFailure, match="more often"):
        step("k", [1, 1, 1])
    events = step(None, [1, 1])  # overlap off: after the schedule, nothing counted
    assert all(e.backward_left == 0 for e in events) and None not in reducer.pipeline_counts
