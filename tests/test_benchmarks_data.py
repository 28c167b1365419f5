"""benchmarks/data_efficiency.py runs (a smoke test of 2 epochs on 400 digits; its
figures are not checked beyond their shape): hiding trains no more samples than its
baseline, the shuffles send what Q says, distillation forwards every sample each epoch,
every run reports an accuracy."""
from __future__ import annotations

import re

import pytest

from _scripts import run_script


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_data_efficiency_quick():
    out = run_script("benchmarks/data_efficiency.py", "--epochs", "2", "--dataset", "digits",
                     "--train", "400", timeout_s=230)
    rows = {m.group(1).strip(): m.group(2).split()
            for m in re.finditer(r"^  (all samples|hiding F=0.3|global Q=1|partial Q=0.1|"
                                 r"local Q=0 \+ distill|local Q=0 \+ impact|local Q=0)"
                                 r"\s+(.*)$", out, re.M)}
    assert len(rows) == 7, out
    assert int(rows["hiding F=0.3"][0]) <= int(rows["all samples"][0]), out
    # 2 epochs, one exchange between them, 4 workers of 100: Q = 1 sends each worker's
    # 100, Q = 0.1 its 10
    assert [int(rows[k][5]) for k in ("global Q=1", "partial Q=0.1", "local Q=0")] == \
        [4 * 100, 4 * 10, 0], out
    assert int(rows["local Q=0 + distill"][2]) == 2 * 400, out   # the teacher's forward
    for values in rows.values():
        assert 0.0 < float(values[7].rstrip("%")) <= 100.0, out
