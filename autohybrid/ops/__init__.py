"""Ops that rewritten graphs call: autograd-aware collectives and fused kernels.

Passes import this package to insert the ops; the runtime imports it to bind the process
groups the ops use (`groups.bind`). Graph nodes name a mesh axis ("dp", "tp", "pp"), never
a process group, so one graph is valid on every rank.
"""
from . import batch_norm, groups  # noqa: F401  (registers the autohybrid:: custom ops)
from . import tensor_parallel, vocab_parallel  # noqa: F401  (tensor/sequence/vocab-parallel ops)
from . import dropout  # noqa: F401  (eager-exact dropout on tensor-parallel shards)
from . import fused  # noqa: F401  (autohybrid::fused_region: generated kernels)
from . import spatial  # noqa: F401  (halo exchange and tiles: spatial parallelism)
from . import moe  # noqa: F401  (autohybrid::moe_experts: MoE experts, expert parallelism)
from . import batch_sum  # noqa: F401  (autohybrid::batch_sum: whole-batch statistics)
