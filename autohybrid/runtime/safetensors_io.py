"""The whole model to and from safetensors, with Hugging Face names for transformers models.

`export_safetensors` gathers the model (compiled.full_state_dict: every rank takes part)
and rank 0 writes `model.safetensors` — for a model that is (or wraps) a Hugging Face
`PreTrainedModel`, under that model's own parameter names, without tied duplicates, next
to its `config.json`, so `AutoModel...from_pretrained(directory)` and inference tools read
it. `import_safetensors` reads a file (or a directory with `model.safetensors` or a
sharded `model.safetensors.index.json`, as `save_pretrained` writes them) into this rank's
shards: each rank reads only the slices of the whole tensors that its boxes cover
(checkpoint_layout.py), never the whole model.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import CheckpointError
from ..capture import canonical_names
from .checkpoint_state import param_entries, parameter_aliases

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


def hf_prefix(model: nn.Module) -> tuple[str, Any] | None:
    """(prefix of the outermost Hugging Face PreTrainedModel in `model`, it), or None."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    for name, module in model.named_modules():
        if isinstance(module, transformers.PreTrainedModel):
            return (f"{name}." if name else ""), module
    return None


def export_safetensors(c: Any, directory: str | Path) -> Path:
    """Write the whole model of compiled model `c` to `directory/model.safetensors`
    (every rank calls it; rank 0 writes). Returns the file's path."""
    from safetensors.torch import save_file
    state = c.full_state_dict()
    out = Path(directory) / WEIGHTS
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        found = hf_prefix(c.model)
        prefix, hf = found if found else ("", None)
        canonical = canonical_names(c.model)  # tied duplicates are left out, as HF does
        keep = set(canonical.values()) | {k for k in state if k not in canonical}
        tensors = {k[len(prefix):]: v.detach().cpu().contiguous() for k, v in state.items()
                   if k in keep and k.startswith(prefix)}
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out)
        if hf is not None:
            hf.config.to_json_file(str(out.parent / "config.json"))
    if dist.is_initialized():
        dist.barrier()
    return out


def import_safetensors(c: Any, path: str | Path, strict: bool = True) -> None:
    """Read every tensor this rank holds of compiled model `c` from safetensors at
    `path` (a file, or a directory as `save_pretrained` writes one); names are the Hugging
    Face model's own when `c.model` is or wraps one. Every rank calls it."""
    from safetensors import safe_open
    files = _files(Path(path))
    found = hf_prefix(c.model)
    prefix = found[0] if found else ""
    where: dict[str, Path] = {}
    for f in sorted(set(files.values())):
        with safe_open(str(f), framework="pt") as handle:
            where.update({key: f for key in handle.keys()})
    aliases = parameter_aliases(c.model)
    opened: dict[Path, Any] = {}

    def handle(f: Path):
        if f not in opened:
            opened[f] = safe_open(str(f), framework="pt")
        return opened[f]

    def stripped(key: str) -> str:
        return key[len(prefix):] if key.startswith(prefix) else key

    entries = param_entries(c.model, c.sharded, c.zero, c._owned)
    with torch.no_grad():
        for name in dict(c.model.named_parameters()):
            key = next((stripped(k) for k in aliases[name] if stripped(k) in where), None)
            if key is None:
                if strict:
                    raise CheckpointError(f"{path} holds no tensor {stripped(name)!r} of this "
                                          "model (another model's weights?); "
                                          "load_safetensors(..., strict=False) skips it")
                continue
            part = handle(where[key]).get_slice(key)
            shape = tuple(part.get_shape())
            whole = tuple(c.model.get_parameter(name).shape)
            if shape != whole:
                raise CheckpointError(f"{path}: {key!r} has shape {shape}, this model's "
                                      f"{whole}: the weights are of another model")
            read = ((lambda i, part=part: part[i]) if whole else
                    (lambda i, key=key: handle(where[key]).get_tensor(key)))
            entry = entries.get(name)
            for b in entry.boxes if entry is not None else ():
                b.view(entry.local).copy_(read(tuple(slice(o, o + s)
                                                     for o, s in zip(b.offsets, b.sizes))))
            if c.zero is not None and c.zero.stage < 3 and name in c.zero.params:
                local = c.zero.params[name]
                spec = c.sharded.specs.get(name) if c.sharded is not None else None
                local.copy_(spec.local_from(read, len(whole)) if spec is not None
                            else read(tuple(slice(None) for _ in whole)))
        persistent = set(c.model.state_dict(keep_vars=True))
        for name, b in c.model.named_buffers():
            key = stripped(name)
            if name in persistent and key in where and not b.is_meta:
                b.copy_(handle(where[key]).get_tensor(key))


def _files(path: Path) -> dict[str, Path]:
    """{tensor or "*": file} of a safetensors file or a directory holding one."""
    if path.is_file():
        return {"*": path}
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{path / INDEX} is not a safetensors index: {exc}") from exc
        return {k: path / v for k, v in weight_map.items()}
    if (path / WEIGHTS).is_file():
        return {"*": path / WEIGHTS}
    raise CheckpointError(f"no safetensors weights at {path}: expected a .safetensors file, "
                          f"or a directory with {WEIGHTS} or {INDEX}")
