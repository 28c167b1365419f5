"""Kernel tuning before the first step (runtime/pretune.py, codegen/triton.py): frozen
tuning never times, choices travel between processes by a portable key, and the fused
regions a program will launch are found at the sizes of the rank's first microbatch.
The multi-process half (tuned before the step and never inside it, the same choice on
every rank though each rank's timer prefers other tiles) is in tests/test_fusion.py's
interpreted runs."""
from __future__ import annotations

import types

import pytest
import torch

from autohybrid.codegen import triton as tgen
from autohybrid.runtime.pretune import bind_sizes, fused_calls


def _probe_kernel(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOHYBRID_KERNEL_CACHE", str(tmp_path))
    path = tgen.write_source("pretune_probe", "def probe_kernel(x):\n    return x\n")
    ns: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    return types.SimpleNamespace(fn=ns["probe_kernel"])


def test_frozen_tuning_takes_the_default_untimed_and_choices_travel(monkeypatch, tmp_path):
    kernel = _probe_kernel(monkeypatch, tmp_path)
    monkeypatch.setattr(tgen, "_TUNED", {})
    monkeypatch.setattr(tgen, "_FROZEN", [False])
    timed: list = []

    def timer(fn, config):
        timed.append(config)
        return -config[0]                 # the most rows per program is the fastest

    fastest = max(tgen.configs(64, 300, True))
    assert tgen.tuned(kernel, 64, 300, True, lambda c: None, timer) == fastest
    assert len(timed) == len(tgen.configs(64, 300, True))
    tgen.freeze_tuning()                  # a step runs: a new shape class is not timed
    count = len(timed)
    assert tgen.tuned(kernel, 1000, 300, True, lambda c: None, timer) == \
        tgen.configs(1000, 300, True)[0]
    assert len(timed) == count
    assert tgen.tuned(kernel, 64, 300, True, lambda c: None, timer) == fastest  # kept
    # another process's choices (a string key per kernel source, device, shape class)
    choices = tgen.tuning_choices()
    assert len(choices) == 2 and all(k.count("|") == 4 for k in choices)
    other = {key: tgen.configs(64, 300, True)[1] if "|64|" in key else config
             for key, config in choices.items()}
    assert tgen.install_choices(other) == 1
    assert tgen.tuned(kernel, 64, 300, True, lambda c: None, timer) == \
        tgen.configs(64, 300, True)[1]
    monkeypatch.setattr(tgen, "_TUNED", {})      # a process that never tuned takes them
    assert tgen.install_choices(other) == 0
    assert tgen.tuned(kernel, 64, 300, True, lambda c: None, timer) == \
        tgen.configs(64, 300, True)[1] and len(timed) == count


def test_tuning_is_active_on_gpus_only_unless_switched_off(monkeypatch):
    monkeypatch.setattr(tgen, "TUNE_IN_INTERPRETER", False)
    assert not tgen.tuning_active(torch.device("cpu"))
    assert tgen.tuning_active(torch.device("cuda", 0))
    monkeypatch.setenv("AUTOHYBRID_AUTOTUNE", "0")
    assert not tgen.tuning_active(torch.device("cuda", 0))


@pytest.mark.timeout(120)
def test_fused_regions_are_found_at_the_first_microbatchs_sizes():
    """gpt-tiny's train graph after the passes: every fused region, its inputs' shapes
    with the batch symbol bound to the size of the rank's first microbatch (3, not the
    example batch's 8), in the graph and its checkpointed submodules alike."""
    import autohybrid as ah
    from test_fusion import _captured, _rewrite

    gm, _ = _rewrite("gpt-tiny")
    cap, _ = _captured("gpt-tiny", 1, None, "train")
    (ids,), targets = ah.models.example_batch("gpt-tiny", 8)
    seq = ids.shape[1]
    sizes = bind_sizes(cap, [ids[:3], targets[:3]])
    assert set(sizes.values()) <= {3, seq} and 3 in sizes.values()
    calls = fused_calls([gm], sizes)
    assert len({key for key, _ in calls}) >= 2
    for _, inputs in calls:
        assert all(t.device.type == "meta" for t in inputs)
        assert inputs[0].shape[0] in (3, 3 * seq) and 8 not in inputs[0].shape, inputs
    at_example = fused_calls([gm])               # no microbatch: the example sizes
    assert [k for k, _ in at_example] == [k for k, _ in calls]
    assert all(ts[0].shape[0] in (8, 8 * seq) for _, ts in at_example)
