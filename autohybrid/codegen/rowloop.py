"""Looped reductions: the Triton source of a row-reducing program for rows longer than
one tile holds (`triton.MAX_ROW`).

The one-tile kernel (triton.py `source`) holds a whole row; this one walks each row in
chunks of BLOCK_N columns, once per *stage*. A reduction's stage is one more than the
latest stage of the row values its operand reads (log_softmax: the max is stage 1, the
sum of exp(x - max) stage 2); every reduction of a stage accumulates in the same walk
(sums add the chunks' sums, maxima take the maximum of the chunks' maxima), the full
values it needs recomputed from the loads in that walk. Row values are computed between
the walks, once their operands are; row outputs are stored after the last stage and full
outputs in a final walk. The chunk width is the same for every launch of a shape (only
the rows per program are tuned), so each row is summed the same way whatever is chosen.

    >>> text = loop_source(program, "fr_ab12_loop", rank=2, doc="Fused: ...")
"""
from __future__ import annotations

from .ir import FULL, REDUCTIONS, ROW, Program, Value
from .printer import Emitter, head, masked, row_lines, store, store_partial

_ACC = {"sum_row": ("tl.zeros([BLOCK_M, 1], CDT)", "{acc} + tl.sum({x}, axis=1)[:, None].to(CDT)",
                    "tl.where(mask, {0}, 0.0)"),
        "amax_row": ("tl.full([BLOCK_M, 1], float('-inf'), CDT)",
                     "tl.maximum({acc}, tl.max({x}, axis=1)[:, None].to(CDT), "
                     "propagate_nan=tl.PropagateNan.ALL)",
                     "tl.where(mask, {0}, float('-inf'))")}
_COLS = "cols = (start + tl.arange(0, BLOCK_N)).to(tl.int64)[None, :]"


def stages(program: Program) -> dict[int, int]:
    """Value uid → the walk after which it is known (0: before the first walk; a full
    value: the latest stage of the row values it reads)."""
    stage: dict[int, int] = {}
    for v in program.schedule():
        args = [stage[a.uid] for a in v.args if isinstance(a, Value)]
        stage[v.uid] = max(args, default=0) + (1 if v.op in REDUCTIONS else 0)
    return stage


def _full_deps(roots: list[Value]) -> list[Value]:
    """The full values `roots` need, in schedule order (row values are known outside)."""
    seen: dict[int, Value] = {}
    stack = [r for r in roots if r.kind == FULL]
    while stack:
        v = stack.pop()
        if v.uid in seen:
            continue
        seen[v.uid] = v
        stack.extend(a for a in v.args if isinstance(a, Value) and a.kind == FULL)
    return sorted(seen.values(), key=lambda v: v.uid)


def loop_source(program: Program, name: str, rank: int, doc: str) -> str:
    """The looped Triton source of `program` (which reduces along rows) as `name`."""
    lines = head(program, name, rank, doc) + row_lines(rank, "    ")
    schedule = program.schedule()
    stage = stages(program)
    emitter = Emitter(program, rank)
    outer = emitter.scope()

    def rows_known(s: int) -> None:   # the row and scalar values of stage s
        values = [v for v in schedule if v.kind != FULL and v.op not in REDUCTIONS
                  and stage[v.uid] == s]
        outer.emit(values, lines, "    ")
        outer.keep(values)

    rows_known(0)
    for s in range(1, max(stage.values(), default=0) + 1):
        reductions = [v for v in schedule if v.op in REDUCTIONS and stage[v.uid] == s]
        accs = {}
        for v in reductions:
            accs[v.uid] = f"acc{len(emitter.names) + len(accs)}"
            lines.append(f"    {accs[v.uid]} = {_ACC[v.op][0]}")
        lines += ["    for start in range(0, N, BLOCK_N):", f"        {_COLS}",
                  "        mask = row_mask & (cols < N)"]
        body = emitter.scope()
        body.emit(_full_deps([v.args[0] for v in reductions]), lines, "        ")
        for v in reductions:
            x = _ACC[v.op][2].format(body.names[v.args[0].uid])
            lines.append(f"        {accs[v.uid]} = " + _ACC[v.op][1].format(acc=accs[v.uid], x=x))
            emitter.names[v.uid] = outer.names[v.uid] = accs[v.uid]
        rows_known(s)
    full = [(j, v) for j, v in enumerate(program.outputs) if v.kind == FULL]
    for j, v in enumerate(program.outputs):
        if v.kind != FULL:
            value = outer.names[v.uid]
            if program.fold(j) is None:
                lines.append(store(j, v, value, rank, "    "))
            else:  # a row value summed along the row: N copies of it
                full.append((j, v))
    if not full:
        return "\n".join(lines) + "\n"
    sums = [j for j, _ in full if program.fold(j) in ("cols", "both")]
    lines += [f"    part{j} = tl.zeros([BLOCK_M, 1], CDT)" for j in sums]
    lines += ["    for start in range(0, N, BLOCK_N):", f"        {_COLS}",
              "        mask = row_mask & (cols < N)"]
    body = emitter.scope()
    body.emit(_full_deps([v for _, v in full]), lines, "        ")
    for j, v in full:
        value = body.names[v.uid]
        if v.kind != FULL:
            value = f"tl.broadcast_to({value}, [BLOCK_M, BLOCK_N])"
        fold = program.fold(j)
        if fold is None:
            lines.append(store(j, v, value, rank, "        "))
        elif fold == "rows":   # one partial row per row program (no grid-stride here)
            lines.append(store_partial(j, f"tl.sum({masked(value)}, axis=0)[None, :]",
                                       "row program", "        "))
        else:
            lines.append(f"        part{j} += tl.sum({masked(value)}, axis=1)[:, None]")
    for j in sums:
        if program.fold(j) == "cols":
            lines.append(store_partial(j, f"part{j}", "rows", "    ", col="0"))
        else:
            lines.append(store_partial(j, f"tl.sum(part{j}, axis=0)[None, :]", "program", "    ",
                                       col="0"))
    return "\n".join(lines) + "\n"
