"""Checkpoint benchmark: save and load wall time and GB/s of autohybrid's sharded
checkpoints against torch.save of the gathered state and against DCP on FSDP2.

In one `ah.launch` on 4 local ranks (gloo, fp32, one thread per rank), one GPT (untied
head, so every tensor is stored once by every method; size set by the options) with
AdamW state after one training step is checkpointed four ways:

- autohybrid save / load: `ah.compile(..., constraints=dp2×tp2 ZeRO-1)`, one
  `train_step`, then `compiled.save(dir)` and `compiled.load(path)` on every rank (DCP
  underneath: each rank writes its own boxes in parallel, SHA-256 of every file in the
  manifest; a load checks every file's size and SHA-256 first, the ranks sharing them);
- autohybrid resharding load: the same checkpoint loaded by the same model compiled
  under another plan (`RESHARD_PLANS`: dp4 ZeRO-3, pp2×dp2), before any step; then
  its gathered parameters are compared with the saved ones (`same` in the table);
- torch.save (rank 0): save = `compiled.full_state_dict()` on every rank (the model's
  parameters gathered from the tp group; ZeRO-1 keeps them whole after a step) and, on
  rank 0, `torch.save({"model": that, "optimizer": eager_adamw.state_dict()})` into one
  file (flushed and fsynced, as DCP's writer syncs its files). The optimizer state in the
  file is that of an eager AdamW over a single-process copy of the model stepped once on
  the same batch on rank 0: the same tensors and bytes as the compiled model's, whose
  ZeRO / tp shards autohybrid offers no gather for, so that gather is not timed;
  load = on rank 0, `torch.load(weights_only=True)` + the eager model's and optimizer's
  `load_state_dict` (the state is not sent on to the other ranks). Both make torch.save's
  times a lower bound for a gathered checkpoint of a parallel job;
- DCP + FSDP2: the same model `fully_shard`-ed per block and at the root over the 4
  ranks (autohybrid/baselines.py `torch_dp(3, ...)`), AdamW, one step; save =
  `get_state_dict(model, optim)` + `dcp.save`; load = `get_state_dict` + `dcp.load` +
  `set_state_dict` (DCP's default FileSystemWriter: one file per rank, fsynced).

Each operation starts after a barrier on every rank; its time is the slowest rank's, the
table gives the median over `--reps` repetitions (min–max below each row), GB/s = the
bytes of model + optimizer state (the same figure for every row; GB = 1e9 bytes) / that
time, × torch.save = torch.save's median / this row's (above 1: faster), and the files'
total size. Every save goes to a fresh directory under a temporary one (removed at the
end); loads read the last save's files, which are then in the page cache (no root to
drop it): they measure the read path, not the disk. Four processes on a 2-core machine:
the figures time the scheduler as much as the I/O.

    PYTHONPATH=. python benchmarks/checkpoint.py [--layers 6 --hidden 640 --heads 10
        --vocab 16384 --seq 64] [--reps 5] [--dir /tmp]
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autohybrid as ah
from autohybrid.baselines import Optim, TorchDataParallel

WORLD = 4
BATCH = 4
#: about 50M parameters: 202 MB of fp32 weights, 606 MB with AdamW's two moments
DEFAULT = dict(layers=6, hidden=640, heads=10, vocab=16384, seq=64)
SAVE_PLAN = ("dp2×tp2 zero1", ah.Constraints(dp=2, tp=2, pp=1, zero=1, sp=False))
RESHARD_PLANS = [("dp4 zero3", ah.Constraints(dp=4, tp=1, pp=1, zero=3)),
                 ("pp2×dp2 1f1b", ah.Constraints(dp=2, tp=1, pp=2, schedule="1f1b"))]
ADAMW = Optim(torch.optim.AdamW, {"lr": 1e-3})


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _model(config: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    return ah.models.gpt(**config, tie_embeddings=False)


def _batch(config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (BATCH, config["seq"])
    return (torch.randint(0, config["vocab"], shape, generator=g),
            torch.randint(0, config["vocab"], shape, generator=g))


def _timed(fn: Callable[[], Any]) -> float:
    """Seconds `fn()` takes on this rank, started after a barrier."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _fresh(path: Path) -> Path:
    """`path` removed on rank 0 (untimed), seen by every rank."""
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    return path


def _files_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _fingerprint(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def _state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    tensors = list(model.state_dict().values())
    tensors += [v for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _compile(config: dict, constraints: ah.Constraints, batch: tuple):
    tokens, targets = batch
    return ah.compile(_model(config), ah.Cluster.local(WORLD), (tokens,), loss_fn=loss_fn,
                      example_targets=targets, optimizer=ADAMW, constraints=constraints)


def _eager(config: dict, batch: tuple):
    """Rank 0's single-process model and AdamW after one step on the whole batch."""
    model = _model(config)
    optimizer = ADAMW(model.parameters())
    loss_fn(model(batch[0]), batch[1]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def run_rank(rank: int, config: dict, reps: int, root: str) -> dict:
    torch.set_num_threads(1)
    root_dir, batch, out = Path(root), _batch(config), {}
    eager = _eager(config, batch) if rank == 0 else None
    if rank == 0:
        out["bytes"] = _state_bytes(*eager)
        out["params"] = sum(p.numel() for p in eager[0].parameters())

    # (1) autohybrid under the save plan
    compiled = _compile(config, SAVE_PLAN[1], batch)
    compiled.train_step(*batch)
    out["plan"] = compiled.plan.summary()
    out["ah save"], paths = [], []
    for i in range(reps):
        out["ah save"].append(_timed(lambda: paths.append(compiled.save(root_dir / f"ah{i}"))))
        if i:
            _fresh(paths[i - 1].parent)
    saved = paths[-1]
    out["ah load"] = [_timed(lambda: compiled.load(saved)) for _ in range(reps)]
    out["ah files"] = _files_bytes(saved)

    # (2) torch.save of the gathered state on rank 0
    def torch_save(path: Path) -> None:
        full = compiled.full_state_dict()
        if rank == 0:
            with open(path, "wb") as f:
                torch.save({"model": full, "optimizer": eager[1].state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())

    def torch_load(path: Path) -> None:
        if rank == 0:
            state = torch.load(path, weights_only=True)
            eager[0].load_state_dict(state["model"])
            eager[1].load_state_dict(state["optimizer"])

    files = [root_dir / f"torch{i}.pt" for i in range(reps)]
    out["torch save"] = []
    for i, path in enumerate(files):
        out["torch save"].append(_timed(lambda: torch_save(path)))
        if i and rank == 0:
            files[i - 1].unlink()
    out["torch load"] = [_timed(lambda: torch_load(files[-1])) for _ in range(reps)]
    out["torch files"] = files[-1].stat().st_size if rank == 0 else 0
    full = compiled.full_state_dict()  # what the resharded loads must give back (untimed)
    fingerprint = _fingerprint(full) if rank == 0 else None
    del compiled, eager, full
    gc.collect()

    # (1b) autohybrid's checkpoint loaded under other plans (resharding)
    for name, constraints in RESHARD_PLANS:
        other = _compile(config, constraints, batch)
        out[f"reshard {name} load"] = [_timed(lambda: other.load(saved)) for _ in range(reps)]
        out[f"reshard {name} plan"] = other.plan.summary()
        full = other.full_state_dict()
        if rank == 0:
            out[f"reshard {name} same"] = _fingerprint(full) == fingerprint
        del other, full
        gc.collect()
    _fresh(saved.parent)

    # (3) DCP on the equivalent FSDP2 model
    out.update(_dcp_rows(config, reps, root_dir, batch))
    return out


def _dcp_rows(config: dict, reps: int, root: Path, batch: tuple) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    fsdp = TorchDataParallel(3, _model(config), loss_fn, ADAMW)
    fsdp.train_step(*batch)
    model, optimizer = fsdp.model, fsdp.optimizer

    def save(path: Path) -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))

    def load(path: Path) -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    dirs = [root / f"dcp{i}" for i in range(reps)]
    out: dict[str, Any] = {"dcp save": []}
    for i, path in enumerate(dirs):
        out["dcp save"].append(_timed(lambda: save(path)))
        if i:
            _fresh(dirs[i - 1])
    out["dcp load"] = [_timed(lambda: load(dirs[-1])) for _ in range(reps)]
    out["dcp files"] = _files_bytes(dirs[-1])
    return out


# ---------------------------------------------------------------------- the table
def _slowest(results: list[dict], key: str) -> list[float]:
    """Per repetition, the slowest rank's seconds."""
    return [max(times) for times in zip(*(r[key] for r in results))]


def rows(results: list[dict]) -> list[dict]:
    """One dict per table row: method, layout, save / load seconds per repetition (None:
    not measured in this row), files' bytes."""
    r0 = results[0]
    out = [dict(method="autohybrid save / load", layout=f"{SAVE_PLAN[0]} → same",
                save=_slowest(results, "ah save"), load=_slowest(results, "ah load"),
                files=r0["ah files"])]
    for name, _ in RESHARD_PLANS:
        same = "same" if r0[f"reshard {name} same"] else "DIFFERENT"
        out.append(dict(method=f"autohybrid load, resharded ({same})",
                        layout=f"{SAVE_PLAN[0]} → {name}", save=None,
                        load=_slowest(results, f"reshard {name} load"), files=None))
    out.append(dict(method="torch.save / torch.load, rank 0", layout="gathered, one file",
                    save=_slowest(results, "torch save"), load=_slowest(results, "torch load"),
                    files=r0["torch files"]))
    out.append(dict(method="DCP + get/set_state_dict", layout="FSDP2 fully_shard ×4",
                    save=_slowest(results, "dcp save"), load=_slowest(results, "dcp load"),
                    files=results[0]["dcp files"]))
    return out


def report(results: list[dict]) -> str:
    r0 = results[0]
    table = rows(results)
    base = next(r for r in table if r["method"].startswith("torch.save"))
    ref = {k: statistics.median(base[k]) for k in ("save", "load")}
    lines = [f"{r0['params'] / 1e6:.1f}M parameters; model + AdamW state {r0['bytes'] / 1e6:.1f} "
             f"MB; {WORLD} ranks; save plan {r0['plan']}",
             *(f"resharding load under {r0[f'reshard {n} plan']}" for n, _ in RESHARD_PLANS),
             f"{'method':<40} {'layout':<30} {'save s':>7} {'GB/s':>6} {'×t.save':>7} "
             f"{'load s':>7} {'GB/s':>6} {'×t.save':>7} {'files MB':>9}"]
    for row in table:
        cells, spread = [], []
        for kind in ("save", "load"):
            if row[kind] is None:
                cells.append(f"{'—':>7} {'—':>6} {'—':>7}")
                continue
            t = statistics.median(row[kind])
            cells.append(f"{t:>7.3f} {r0['bytes'] / t / 1e9:>6.3g} {ref[kind] / t:>7.2f}")
            spread.append(f"{kind} {min(row[kind]):.3f}–{max(row[kind]):.3f} s")
        files = "—" if row["files"] is None else f"{row['files'] / 1e6:.1f}"
        lines.append(f"{row['method']:<40} {row['layout']:<30} {cells[0]} {cells[1]} "
                     f"{files:>9}")
        lines.append(f"{'':<71} {'min–max: ' + ', '.join(spread)}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for key, value in DEFAULT.items():
        parser.add_argument(f"--{key}", type=int, default=value)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the temporary directory goes")
    args = parser.parse_args()
    config = {k: getattr(args, k) for k in DEFAULT}
    # rank 0's eager step and its torch.save keep the others waiting in a barrier
    os.environ.setdefault("AUTOHYBRID_COLLECTIVE_TIMEOUT_S", "600")
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start; gpt "
          f"{config} untied, batch {BATCH}, AdamW after one step; median of {args.reps}",
          flush=True)
    root = tempfile.mkdtemp(prefix="autohybrid-ckptbench-", dir=args.dir)
    try:
        results = ah.launch(run_rank, ah.Cluster.local(WORLD), args=(config, args.reps, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(report(results))
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
