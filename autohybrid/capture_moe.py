"""Capture Hugging Face MoE experts as `autohybrid::moe_experts`, the block EP rewrites.

Owns recognizing a Hugging Face MoE layer's experts and routing them, for the length of
an export, through the op autohybrid's expert parallelism knows (ops/moe.py). Hugging
Face's `*Experts` modules (Mixtral, Qwen2/3-MoE, DeepSeek-V3, OLMoE, ...) all dispatch
their forward through `transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`, chosen by
`config._experts_implementation`; this module registers its implementation there as
"autohybrid" and sets it on the experts' configs inside `routed_experts(model)`,
restoring what was set on exit (also on errors). The captured graph then holds one
`autohybrid::moe_experts` node per MoE layer whatever implementation ("eager",
"grouped_mm", "batched_mm") the model was built with — the same function, computed
without dropping tokens, as every one of them.

Only experts whose layout the op computes are routed: gated (`gate_up_proj` (E, 2I, H),
gate rows first), not transposed, without biases, without a post-expert norm, with
Hugging Face's default gate (`act(gate) * up`) and an activation of `ops.moe.ACTIVATIONS`.
Others (gpt-oss's clamped gate, ...) are captured as their own implementation computes
them, and `skipped(model)` says why; the planner offers no expert parallelism for them.
Models without Hugging Face experts are untouched.

    with routed_experts(model):
        ep = torch.export.export(model, args)
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch.nn as nn

from .ops.moe import moe_experts

NAME = "autohybrid"
#: Hugging Face activation modules (transformers.activations) → ops.moe's names
_ACTIVATIONS = {"SiLUActivation": "silu", "SiLU": "silu", "GELUActivation": "gelu",
                "GELU": "gelu", "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh",
                "ReLU": "relu"}


def _interface():
    if "transformers" not in sys.modules:   # no Hugging Face model can exist (importing
        return None, None                   # transformers costs seconds)
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _default_apply_gate
    except ImportError:   # a transformers without the experts interface
        return None, None
    return ALL_EXPERTS_FUNCTIONS, _default_apply_gate


def hf_experts_forward(module: nn.Module, hidden_states, top_k_index, top_k_weights):
    """Hugging Face's experts forward signature, computed by `autohybrid::moe_experts`."""
    return moe_experts(hidden_states, top_k_index, top_k_weights, module.gate_up_proj,
                       module.down_proj, module.gate_up_proj.shape[0],
                       _ACTIVATIONS[type(module.act_fn).__name__], "")


def hf_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The Hugging Face experts modules of `model` (those dispatched by config)."""
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "is_concatenated") and hasattr(m, "gate_up_proj")
            and hasattr(getattr(m, "config", None), "_experts_implementation")]


def why_not(module: nn.Module) -> str | None:
    """Why `module` (Hugging Face experts) cannot be routed to the op; None if it can."""
    _, default_gate = _interface()
    checks = (
        (getattr(module, "has_gate", False), "it has no gate projection"),
        (not getattr(module, "has_bias", True), "its projections have biases"),
        (not getattr(module, "is_transposed", True), "its weights are stored transposed"),
        (getattr(module, "is_concatenated", False), "its gate and up rows are interleaved"),
        (not getattr(module, "has_post_expert_norm", False), "it norms each expert's output"),
        (getattr(type(module), "_apply_gate", None) is default_gate,
         f"{type(module).__name__} has its own gate function"),
        (type(getattr(module, "act_fn", None)).__name__ in _ACTIVATIONS,
         f"activation {type(getattr(module, 'act_fn', None)).__name__}"),
        (getattr(module, "gate_up_proj", None) is not None
         and getattr(module, "down_proj", None) is not None
         and module.gate_up_proj.dim() == 3 and module.down_proj.dim() == 3
         and module.gate_up_proj.shape[1] == 2 * module.down_proj.shape[2],
         "weights not shaped (E, 2I, H) and (E, H, I)"),
        (not getattr(module, "_is_expert_parallel", False), "it is expert-parallel already"),
    )
    for ok, why in checks:
        if not ok:
            return why
    return None


def skipped(model: nn.Module) -> dict[str, str]:
    """Module path → why its Hugging Face experts are not captured as the op."""
    return {name: why for name, m in hf_experts(model) if (why := why_not(m)) is not None}


@contextlib.contextmanager
def routed_experts(model: nn.Module) -> Iterator[int]:
    """Inside: `model`'s routable Hugging Face experts compute through the op; yields how
    many modules were routed."""
    interface, _ = _interface()
    found = hf_experts(model) if interface else []
    # a config is switched only when every experts module reading it can be routed
    configs = {id(m.config): m.config for _, m in found}
    for _, m in found:
        if why_not(m) is not None:
            configs.pop(id(m.config), None)
    routed = sum(id(m.config) in configs for _, m in found)
    if not routed:
        yield 0
        return
    if NAME not in interface:
        type(interface).register(NAME, hf_experts_forward)
    before = {key: c.__dict__.get("_experts_implementation_internal")
              for key, c in configs.items()}
    try:
        for c in configs.values():
            c._experts_implementation_internal = NAME
        yield routed
    finally:
        for key, c in configs.items():
            c._experts_implementation_internal = before[key]
