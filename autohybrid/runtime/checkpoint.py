"""Checkpoints on disk: sharded, parallel, atomic, verified, any plan to any plan.

`save` writes one rank state (runtime/checkpoint_state.py: every tensor this rank holds,
as boxes of the whole tensor, checkpoint_layout.py) with torch.distributed.checkpoint
(DCP): every rank writes its own file, in parallel, and a box that several ranks hold
(a replicated parameter) is written once. `load` reads into every box this rank holds the
overlap of every saved box (DCP's resharding), so a checkpoint of one plan loads under
any other (dp, tp, pp, schedule, ZeRO stage, world size) without gathering a tensor.

On disk, under the save directory:

    step-00000003/      a complete checkpoint: DCP's files and manifest.json
    .step-00000006.partial/   a save in progress (or one that crashed): never loaded

Its collectives run on a group of their own, bounded by AUTOHYBRID_CHECKPOINT_TIMEOUT_S
(ranks write and hash files of different sizes). A save writes into the `.partial`
directory and rank 0 renames it to `step-N` only after every rank's files are written
and the manifest (JSON: the Plan, the graph hash, the versions, every tensor's shape and
dtype, the non-tensor state, each file's size and SHA-256) is on disk; so a crash leaves
the previous checkpoint the latest. `keep_last` prunes older ones. A load checks every
file against the manifest first (the ranks share the files) and refuses a missing,
truncated or altered one by name; DCP's metadata file (a pickle) is read with an
unpickler that admits only DCP's metadata classes, tensors are read with
`torch.load(weights_only=True)`, and no pickled object is ever loaded.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner,
                                                          DefaultSavePlanner)
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, ReadItem, SavePlan,
                                                  TensorWriteData, WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from torch.distributed.checkpoint.api import CheckpointException

from ..errors import AutohybridError, CheckpointError
from .checkpoint_layout import Box
from .timeouts import checkpoint_timeout, new_group

FORMAT = "autohybrid-checkpoint/1"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


@dataclass
class Entry:
    """One tensor of this rank's state: its name in the checkpoint, whole shape and dtype,
    this rank's local tensor and the boxes of the whole tensor that it holds (empty: this
    rank holds none of it, e.g. another pipeline stage's parameter)."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    local: torch.Tensor
    boxes: list[Box]


# ---------------------------------------------------------------------- directories
def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def complete(directory: str | Path) -> list[Path]:
    """The complete checkpoints under `directory`, oldest first (by step)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / MANIFEST).is_file()]
    return [p for _, p in sorted(found)]


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under a save directory (None: there is none)."""
    found = complete(directory)
    return found[-1] if found else None


def resolve(path: str | Path) -> Path:
    """A checkpoint directory from `path`: itself when it holds a manifest, else the
    latest complete checkpoint under it."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        return p
    found = latest(p)
    if found is not None:
        return found
    if p.is_dir() and (p.name.endswith(".partial") or any(p.glob("*.distcp"))):
        raise CheckpointError(f"{p} is an incomplete checkpoint (no {MANIFEST}: its save did "
                              "not finish); load the save directory to get the latest "
                              "complete one")
    raise CheckpointError(f"no checkpoint at {p}: it is neither a checkpoint directory (with "
                          f"{MANIFEST}) nor a save directory holding step-N checkpoints")


# ---------------------------------------------------------------------- save
def save(directory: str | Path, entries: list[Entry], manifest: dict[str, Any], step: int,
         keep_last: int | None = None) -> Path:
    """Write `entries` (this rank's) and `manifest` (the same on every rank) as the
    checkpoint of `step` under `directory`; every rank calls it. Returns its directory."""
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointError(f"keep_last must be a positive int or None, got {keep_last!r}")
    root, rank = Path(directory), _rank()
    final = step_dir(root, step)
    partial = root / f".{final.name}.partial"
    _on_rank_zero(lambda: _fresh_dir(root, partial))
    writer = dcp.FileSystemWriter(str(partial), thread_count=1, sync_files=True)
    state = {e.fqn: e.local for e in entries}
    _dcp(lambda: dcp.save(state, storage_writer=writer, planner=_SavePlanner(entries),
                          process_group=_group(), no_dist=not dist.is_initialized()),
         f"writing checkpoint {final}")
    mine = {f.name: _file_record(f) for f in sorted(partial.glob(f"__{rank}_*"))}
    files = _gather_dicts(mine)

    def finish() -> Path:
        files.update({f.name: _file_record(f) for f in sorted(partial.iterdir())
                      if f.name == ".metadata"})
        _write_json(partial / MANIFEST, {**manifest, "format": FORMAT, "step": step,
                                         "files": dict(sorted(files.items()))})
        if final.exists():  # the same step saved again: the new one replaces it
            _remove(final)
        os.rename(partial, final)
        _fsync_dir(root)
        if keep_last is not None:
            for old in complete(root)[:-keep_last]:
                _remove(old)
        return final
    return _on_rank_zero(finish)


class _SavePlanner(DefaultSavePlanner):
    """DCP's default planner (deduplication of boxes several ranks hold, the global
    metadata, its validation that the boxes cover every tensor once) over our boxes."""

    def __init__(self, entries: list[Entry]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._boxes = {(e.fqn, b.offsets): (e, b) for e in entries for b in e.boxes}

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(e.fqn, torch.Size(b.offsets)),
                           type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(offsets=torch.Size(b.offsets),
                                                          sizes=torch.Size(b.sizes)),
                               properties=TensorProperties(dtype=e.dtype),
                               size=torch.Size(e.shape)))
                 for e, b in self._boxes.values()]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        e, b = self._boxes[(write_item.index.fqn, tuple(write_item.index.offset))]
        view = b.view(e.local).detach()
        whole = (view.is_contiguous() and view.storage_offset() == 0
                 and view.untyped_storage().nbytes() == view.numel() * view.element_size())
        return view if whole else view.clone()  # torch.save of a view writes its storage


# ---------------------------------------------------------------------- load
def read_manifest(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint directory `path` names (resolve) and its manifest."""
    where = resolve(path)
    try:
        manifest = json.loads((where / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{where / MANIFEST} cannot be read as JSON: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{where / MANIFEST} is not an autohybrid checkpoint manifest "
                              f"(format {manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                              f"expected {FORMAT!r})")
    return where, manifest


def verify(where: Path, manifest: dict[str, Any]) -> None:
    """Every file the manifest lists is there, of its size and SHA-256 (the ranks share
    the files: each checks every world-size-th one); raises on every rank, naming the
    first bad file."""
    names = sorted(manifest.get("files", {}))
    if ".metadata" not in names:
        raise CheckpointError(f"{where / MANIFEST} lists no .metadata file: the manifest is "
                              "damaged; use an earlier checkpoint")
    rank, world = _rank(), _world()
    problems = {}
    for name in names[rank::world]:
        problem = _check_file(where / name, manifest["files"][name])
        if problem:
            problems[name] = problem
    problems = _gather_dicts(problems)
    if problems:
        name = sorted(problems)[0]
        raise CheckpointError(f"checkpoint {where} is damaged: {where / name} {problems[name]}"
                              f"{f' (and {len(problems) - 1} more files)' if len(problems) > 1 else ''}"
                              "; it cannot be loaded: use an earlier checkpoint")


def load(where: Path, entries: list[Entry]) -> None:
    """Read into every box of `entries` its values from the checkpoint at `where` (already
    verified); every rank calls it."""
    state = {e.fqn: e.local for e in entries}
    _dcp(lambda: dcp.load(state, storage_reader=_SafeReader(str(where)),
                          planner=_LoadPlanner(entries), process_group=_group(),
                          no_dist=not dist.is_initialized()),
         f"reading checkpoint {where}")


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default planner over our boxes: each box reads the overlap of every saved box
    of its tensor (create_read_items_for_chunk_list, DCP's resharding)."""

    def __init__(self, entries: list[Entry]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._entries = {e.fqn: e for e in entries}
        self._boxes = {(e.fqn, b.offsets): (e, b) for e in entries for b in e.boxes}

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        requests: list[ReadItem] = []
        for fqn, e in self._entries.items():
            md = saved.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"the checkpoint holds no tensor {fqn!r}")
            if tuple(md.size) != tuple(e.shape):
                raise CheckpointError(f"the checkpoint's {fqn!r} has shape {tuple(md.size)}, "
                                      f"this model's {tuple(e.shape)}")
            chunks = [ChunkStorageMetadata(offsets=torch.Size(b.offsets),
                                           sizes=torch.Size(b.sizes)) for b in e.boxes]
            requests += create_read_items_for_chunk_list(fqn, md, chunks)
        self.plan = LoadPlan(requests)
        return self.plan

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        e, b = self._boxes[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        view = b.view(e.local.detach())
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor's view wrote into the local tensor

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(f"the checkpoint holds a pickled object at "
                              f"{read_item.dest_index.fqn!r}: autohybrid checkpoints never "
                              "load pickled objects")


class _SafeReader(dcp.FileSystemReader):
    """DCP's reader, whose metadata file is unpickled admitting DCP's metadata classes,
    torch.Size and dtypes only."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = Path(self.path) / ".metadata"
        with open(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(f"{path} cannot be read as DCP metadata: {exc}") from exc
        from torch.distributed.checkpoint.metadata import StorageMeta
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata",
                    "torch.distributed.checkpoint.filesystem",
                    "torch.distributed.checkpoint.planner")
_ALLOWED = {("torch", "Size"), ("collections", "OrderedDict"), ("builtins", "set"),
            ("builtins", "frozenset"), ("torch", "device"),
            ("torch.serialization", "_get_layout"),  # a layout by name (torch.strided)
            ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),  # the checkpoint's id
            ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = getattr(torch, name, None) if module == "torch" else None
        if (module in _ALLOWED_MODULES or (module, name) in _ALLOWED
                or isinstance(dtype, (torch.dtype, torch.memory_format, torch.layout))):
            return super().find_class(module, name)
        raise CheckpointError(f"DCP metadata refers to {module}.{name}, which a checkpoint "
                              "never needs: the file is not autohybrid's; not loaded")


# ---------------------------------------------------------------------- helpers
def _dcp(fn, what: str) -> Any:
    """`fn()`, a DCP call; its CheckpointException (a BaseException carrying every
    rank's failure) raised as the first rank's own AutohybridError, or as a
    CheckpointError naming the rank and the error."""
    try:
        return fn()
    except CheckpointException as exc:
        failures = sorted(exc.failures.items())
        for rank, (error, _) in failures:
            if isinstance(error, AutohybridError):
                raise error from None
        rank, (error, _) = failures[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {type(error).__name__}: "
                              f"{error}") from error


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _on_rank_zero(fn):
    """`fn()` on rank 0, its result (or what it raised) on every rank."""
    from .groups import from_rank_zero
    return from_rank_zero(fn)


_GROUP: list[Any] = [None, None]  # [the world group, this job's checkpoint group]


def _group() -> dist.ProcessGroup | None:
    """The whole world in a group of its own, bounded by AUTOHYBRID_CHECKPOINT_TIMEOUT_S
    (runtime/timeouts.py): ranks write and hash files of different sizes, longer than
    the collective bound of a step should wait. Made once per job, on every rank."""
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if _GROUP[0] is not world:
        _GROUP[:] = [world, new_group(range(dist.get_world_size()), checkpoint_timeout())]
    return _GROUP[1]


def _gather_dicts(mine: dict[str, Any]) -> dict[str, Any]:
    if _world() == 1:
        return dict(mine)
    parts: list[Any] = [None] * _world()
    dist.all_gather_object(parts, mine, group=_group())
    out: dict[str, Any] = {}
    for part in parts:
        out.update(part)
    return out


def _fresh_dir(root: Path, partial: Path) -> None:
    """`partial` empty and ready, under `root`; stale partial saves removed."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".step-*.partial"):
        _remove(stale)
    partial.mkdir()


def _remove(path: Path) -> None:
    """Remove a checkpoint directory so that no half-removed one looks complete: the
    manifest first, then the rest."""
    manifest = path / MANIFEST
    if manifest.exists():
        manifest.unlink()
    shutil.rmtree(path, ignore_errors=True)


def _file_record(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _check_file(path: Path, record: Any) -> str | None:
    if not isinstance(record, dict) or "bytes" not in record or "sha256" not in record:
        return "has no size and checksum in the manifest"
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != record["bytes"]:
        return f"has {size} bytes, the manifest says {record['bytes']} (truncated or altered)"
    if _sha256(path) != record["sha256"]:
        return "does not match its SHA-256 in the manifest (altered or corrupted)"
    return None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
