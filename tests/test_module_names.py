"""No module of the repository's script folders shadows a package.

The tests put tests/ and benchmarks/ on `sys.path` (they import the benchmarks as
modules), so a file there named like a package is found in its place by every later
import in that process. transformers probes optional packages by name and imports from
them when found: transformers 5.25 does `from kernels import CUDAProperties` (Hugging
Face's kernel hub) when a `kernels` module exists, which made every Hugging Face test
fail while benchmarks/kernels.py (now fused_kernels.py) was on the path.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("benchmarks", "tests", "tests/scripts", "examples")


def _probed_by_transformers() -> set[str]:
    """The optional packages transformers looks for by name (none if not installed)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        return set()
    source = Path(spec.origin).parent / "utils" / "import_utils.py"
    text = source.read_text() if source.exists() else ""
    return set(re.findall(r'_is_package_available\(\s*"([A-Za-z0-9_]+)"', text))


def test_no_script_module_shadows_a_package():
    stems = {p.stem for folder in FOLDERS for p in (ROOT / folder).glob("*.py")}
    probed = _probed_by_transformers()
    assert "kernels" in probed or not probed    # the probe list is read as intended
    packages = (set(importlib.metadata.packages_distributions()) | probed
                | set(sys.stdlib_module_names))
    clashes = sorted(stems & packages)
    assert not clashes, (f"{clashes}: modules in {FOLDERS} named like packages (installed, "
                         "standard library or probed by transformers); rename them")
