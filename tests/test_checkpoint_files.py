"""Checkpoint files on one process (runtime/checkpoint.py): atomic saves, pruning,
damaged and foreign checkpoints refused by name, no pickled object ever loaded."""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import autohybrid as ah
from autohybrid.runtime import checkpoint
from _equiv import OPTIMIZERS, lm_loss, zoo_batches, zoo_model


def _compiled(model=None, loss_fn=lm_loss):
    model = model if model is not None else zoo_model("gpt-tiny")
    batches = zoo_batches("gpt-tiny", 4, steps=3)
    compiled = ah.compile(model, ah.Cluster.local(1), batches[0][0], loss_fn=loss_fn,
                          example_targets=batches[0][1], optimizer=OPTIMIZERS["adamw"])
    return compiled, batches


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model trained 2 steps with a checkpoint after each, and its values at step 1."""
    root = tmp_path_factory.mktemp("ckpt")
    compiled, batches = _compiled()
    compiled.train_step(*batches[0])
    compiled.save(root / "run")
    at_one = {k: v.clone() for k, v in compiled.full_state_dict().items()}
    compiled.train_step(*batches[1])
    compiled.save(root / "run")
    return compiled, batches, root, at_one


def _copy(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


def test_a_save_is_visible_only_when_complete(trained, tmp_path, monkeypatch):
    compiled, batches, root, at_one = trained
    run = _copy(root / "run", tmp_path / "run")
    before = checkpoint.latest(run)
    assert before.name == "step-00000002"
    compiled.step = 5

    def crash(*args, **kwargs):  # the process dies after the data, before the manifest
        raise OSError("injected crash")
    monkeypatch.setattr(checkpoint, "_write_json", crash)
    with pytest.raises(OSError, match="injected crash"):
        compiled.save(run)
    monkeypatch.undo()
    assert (run / ".step-00000005.partial").is_dir()      # the crashed save's files
    assert checkpoint.latest(run) == before               # ... are no checkpoint
    compiled.load(run)
    assert compiled.step == 2
    with pytest.raises(ah.CheckpointError, match="incomplete"):
        compiled.load(run / ".step-00000005.partial")

    real_write = dcp.FileSystemWriter.write_data

    def crash_in_data(self, plan, planner):  # dies while DCP writes the tensors
        real_write(self, plan, planner)
        raise OSError("injected crash while writing")
    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", crash_in_data)
    compiled.step = 6
    with pytest.raises(ah.CheckpointError, match="injected crash while writing"):
        compiled.save(run)
    monkeypatch.undo()
    assert checkpoint.latest(run) == before
    compiled.save(run)                                    # the next save cleans up
    assert [p.name for p in checkpoint.complete(run)] == [
        "step-00000001", "step-00000002", "step-00000006"]
    assert not list(run.glob(".step-*"))


def test_keep_last_prunes_the_oldest(trained, tmp_path):
    compiled, batches, root, _ = trained
    run = _copy(root / "run", tmp_path / "run")
    compiled.step = 9
    compiled.save(run, keep_last=2)
    assert [p.name for p in checkpoint.complete(run)] == ["step-00000002", "step-00000009"]
    with pytest.raises(ah.CheckpointError, match="keep_last"):
        compiled.save(run, keep_last=0)


def test_load_restores_the_state_of_its_step(trained, tmp_path):
    compiled, batches, root, at_one = trained
    compiled.load(root / "run" / "step-00000001")
    assert compiled.step == 1
    state = compiled.full_state_dict()
    for key, value in at_one.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)
    compiled.load(root / "run")  # the save directory: its latest
    assert compiled.step == 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_file_is_refused_by_name(trained, tmp_path, damage):
    compiled, _, root, _ = trained
    ckpt = _copy(root / "run" / "step-00000002", tmp_path / "step-00000002")
    shard = next(ckpt.glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(bytes(data[: len(data) - 100]))
    else:
        shard.unlink()
    with pytest.raises(ah.CheckpointError, match=shard.name) as info:
        compiled.load(ckpt)
    assert {"flip": "SHA-256", "truncate": "truncated", "delete": "missing"}[damage] in str(info.value)


def test_another_model_is_refused_naming_the_first_tensor(trained, tmp_path):
    _, _, root, _ = trained
    torch.manual_seed(0)
    other = ah.models.gpt(layers=2, hidden=32, heads=4, vocab=96, seq=16,
                          ffn_hidden=64).double()   # gpt-tiny's MLP is 4×32 = 128 wide
    compiled, _ = _compiled(other)
    with pytest.raises(ah.CheckpointError, match=r"another model: 'model\.blocks\.0\.mlp"):
        compiled.load(root / "run")


def test_another_graph_is_refused_unless_not_strict(trained):
    _, _, root, _ = trained
    summed = lambda logits, t: lm_loss(logits, t, reduction="sum")  # noqa: E731
    compiled, _ = _compiled(loss_fn=summed)
    with pytest.raises(ah.CheckpointError, match="another graph"):
        compiled.load(root / "run")
    compiled.load(root / "run", strict=False)
    assert compiled.step == 2


def test_another_optimizer_is_refused(trained):
    _, _, root, _ = trained
    batches = zoo_batches("gpt-tiny", 4, steps=1)
    compiled = ah.compile(zoo_model("gpt-tiny"), ah.Cluster.local(1), batches[0][0],
                          loss_fn=lm_loss, example_targets=batches[0][1],
                          optimizer=OPTIMIZERS["sgd"])
    with pytest.raises(ah.CheckpointError, match="optimizer is AdamW.*SGD"):
        compiled.load(root / "run")


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_no_pickled_object_is_loaded(trained, tmp_path):
    """Even with the manifest's checksum updated to match (an attacker who edits both),
    the metadata's unpickler admits DCP's metadata classes only."""
    compiled, _, root, _ = trained
    ckpt = _copy(root / "run" / "step-00000002", tmp_path / "step-00000002")
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Evil()))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][".metadata"] = checkpoint._file_record(ckpt / ".metadata")
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ah.CheckpointError, match="system.*never needs"):
        compiled.load(ckpt)


def test_not_a_checkpoint(tmp_path, trained):
    compiled = trained[0]
    with pytest.raises(ah.CheckpointError, match="no checkpoint at"):
        compiled.load(tmp_path / "nothing-here")
    (tmp_path / "bad" ).mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{not json")
    with pytest.raises(ah.CheckpointError, match="cannot be read as JSON"):
        compiled.load(tmp_path / "bad")
