"""Code generation for fused regions: fx region → kernel program → Triton source.

    lower.py     region GraphModule (ATen ops) → `Program` (ir.py), shapes, structure key
    autodiff.py  forward `Program` → backward `Program` (vjp per primitive, recomputes)
    printer.py   `Program` → `@triton.jit` source of the one-tile kernel
    rowloop.py   `Program` → the looped kernel (a reduction over rows over MAX_ROW)
    triton.py    cache files; block sizes; launch; AOT

`ops/fused.py` ties them together behind `register_region` and the
`autohybrid::fused_region` op. Nothing here imports from ops, passes or runtime.
"""
from .lower import UnsupportedRegion, is_reduction, lower, structure, supported  # noqa: F401
