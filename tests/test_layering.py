"""autohybrid's modules import only downward, in the layer order of README "Layout".

Every module's imports are read with `ast` (module-level and function-level ones alike,
relative and absolute `autohybrid.` ones; nothing is imported, so this needs no torch):
an import of a module in a higher layer fails, and so does any import circle, naming
the file, the line and the import.
"""
from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "autohybrid"

#: Lowest first; a module belongs to the first layer whose entry is the module or a
#: package above it. A module may import its own layer and those below.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("errors", "logs", "graph", "hardware", "plan", "init", "blame",
                    "device_facts", "cluster", "features")),
    # ops with no autohybrid dependency beyond errors, which models and capture call
    ("model ops", ("ops.groups", "ops.partition", "ops.moe")),
    ("models", ("models",)),
    ("capture", ("capture", "capture_cache", "capture_blocks", "capture_probe",
                 "capture_splice", "capture_wire", "capture_moe", "capture_moe_loop",
                 "capture_functions", "batch_spec",
                 "sample_stats")),
    ("cost", ("cost",)),
    ("search", ("search",)),
    ("codegen", ("codegen",)),
    ("ops", ("ops",)),
    ("program", ("program",)),
    ("passes", ("passes",)),
    ("rewrite", ("rewrite", "trial", "spatial_costs")),
    ("planning", ("planning", "checks")),
    ("report", ("report",)),
    ("runtime", ("runtime",)),
    ("data", ("data",)),
    ("compiled", ("compiled", "calibrate")),
    ("api", ("api",)),
    ("entry points", ("", "bench", "baselines", "cli", "cli_checks")),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer_of(module: str) -> int:
    for index, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            if module == entry or (entry and module.startswith(entry + ".")):
                return index
    raise AssertionError(f"autohybrid/{module.replace('.', '/')}: in no layer of "
                         "tests/test_layering.py LAYERS (add it where README 'Layout' puts it)")


@lru_cache(maxsize=None)
def imports(module: str, path: Path | None = None) -> list[tuple[str, int, str]]:
    """(imported autohybrid module, line, source text) for every import in `module`
    (read from `path`, by default its own file)."""
    path = path or MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "autohybrid":
                target = node.module.removeprefix("autohybrid").lstrip(".")
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                found = sub if sub in MODULES else target
                out.append((found, node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "autohybrid":
                    out.append((alias.name.removeprefix("autohybrid").lstrip("."),
                                node.lineno, ast.unparse(node)))
    return [(t, line, text) for t, line, text in out if t != module and t in MODULES]


def where(module: str) -> str:
    return str(MODULES[module].relative_to(ROOT.parent))


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


def test_no_import_goes_up_a_layer():
    bad = []
    for module in MODULES:
        mine = layer_of(module)
        for target, line, text in imports(module):
            theirs = layer_of(target)
            if theirs > mine:
                bad.append(f"{where(module)}:{line} `{text}`: layer {LAYERS[mine][0]!r} "
                           f"imports layer {LAYERS[theirs][0]!r} above it")
    bad = list(dict.fromkeys(bad))
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_circle():
    graph = {m: sorted({t for t, _, _ in imports(m)}) for m in MODULES}
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []
    circles = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in graph[module]:
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                steps = []
                for a, b in zip(cycle, cycle[1:]):
                    line, text = next((ln, tx) for t, ln, tx in imports(a) if t == b)
                    steps.append(f"{where(a)}:{line} `{text}`")
                circles.append(" → ".join(steps))
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_walker_reads_function_level_relative_and_absolute_imports(tmp_path):
    source = tmp_path / "executor.py"
    source.write_text("from ..errors import AutohybridError\n"
                      "def f():\n    from ..api import compile\n"
                      "    import autohybrid.cli\n    from autohybrid.passes import manager\n")
    found = {t: layer_of(t) for t, _, _ in imports("runtime.executor", source)}
    assert set(found) == {"errors", "api", "cli", "passes.manager"}
    assert found["api"] > layer_of("runtime.executor") > found["passes.manager"]


def test_readme_layout_lists_every_module():
    """README "Layout" names every top-level module and subpackage, and every file of the
    subpackages it describes file by file."""
    readme = (ROOT.parent / "README.md").read_text()
    layout = readme.split("## Layout\n", 1)[1].split("\n## ", 1)[0]
    missing = [f"autohybrid/{p.name}" for p in ROOT.iterdir()
               if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))
               and (p.name if p.suffix else f"{p.name}/") not in layout]
    for package in ("cost", "search", "runtime", "report"):
        missing += [f"autohybrid/{package}/{p.name}" for p in (ROOT / package).glob("*.py")
                    if p.name != "__init__.py" and p.name not in layout]
    assert not missing, f"README 'Layout' does not mention {missing}"
