"""The in-process capture memo (autohybrid/capture_cache.py): a hit only when nothing the
graph depends on changed, and never another model instance's tensors."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import pytest

import autohybrid as ah
from autohybrid import capture_cache
from autohybrid.capture import capture

pytestmark = pytest.mark.timeout(300)

SCALE = 2.0   # a global the model's code reads


def helper(x: torch.Tensor) -> torch.Tensor:
    return x * SCALE


class Block(nn.Module):
    def __init__(self, width: int, p: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.p = p
        self.offset = torch.full((width,), 0.5)   # a tensor attribute: a graph constant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return helper(F.dropout(self.fc(x), self.p, self.training)) + self.offset


class Net(nn.Module):
    def __init__(self, width: int = 8, layers: int = 2, p: float = 0.0):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, p) for _ in range(layers))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.fixture(autouse=True)
def empty_memo():
    capture_cache.clear()
    yield
    capture_cache.clear()


def cap_of(model: nn.Module, loss_fn=F.cross_entropy, batch: int = 4, **kw):
    x, y = torch.randn(batch, 8), torch.randint(0, 3, (batch,))
    return capture(model, (x,), loss_fn, y, **kw), x, y


def test_a_new_instance_of_the_same_model_hits_and_runs_on_its_own_tensors():
    first, _, _ = cap_of(Net())
    model = Net()
    with torch.no_grad():
        model.blocks[1].offset.fill_(-3.0)   # another value of the constant
    second, x, y = cap_of(model)
    assert second.gm is first.gm and second.hash == first.hash
    assert second is not first
    [const] = [t for t in second.constants.values() if t.shape == (8,) and t[0] == -3.0]
    assert const is model.blocks[1].offset
    loss = second.run(second.default_state(model), (x,), (y,))
    torch.testing.assert_close(loss, F.cross_entropy(model(x), y))


class MadeConstant(nn.Module):
    """A forward that makes a tensor while it runs: export lifts it as a constant."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + torch.tensor([1.0, 2.0, 3.0])


def test_a_constant_the_trace_made_is_shared_and_an_attribute_is_the_new_models():
    first, _, _ = cap_of(MadeConstant())
    model = MadeConstant()
    second, x, y = cap_of(model)
    assert second.gm is first.gm
    assert list(second.constants) == list(first.constants) == ["model.lifted_tensor_0"]
    loss = second.run(second.default_state(model), (x,), (y,))
    torch.testing.assert_close(loss, F.cross_entropy(model(x), y))


def test_shapes_attributes_mode_and_inputs_change_the_key():
    base, _, _ = cap_of(Net())
    for other in (cap_of(Net(width=8, layers=3))[0],      # one more layer
                  cap_of(Net(p=0.1))[0],                   # an attribute the trace reads
                  cap_of(Net().eval())[0],                 # training flag
                  cap_of(Net(), batch=6)[0],               # example shapes
                  cap_of(Net().double().float().to(torch.float64))[0]):
        assert other.gm is not base.gm


def test_changed_code_misses(monkeypatch):
    base, _, _ = cap_of(Net())
    monkeypatch.setattr(Block, "forward", lambda self, x: self.fc(x) * 3 + self.offset)
    patched_method, _, _ = cap_of(Net())
    assert patched_method.gm is not base.gm
    monkeypatch.undo()
    assert cap_of(Net())[0].gm is base.gm                  # back as it was: a hit again
    monkeypatch.setattr(__import__(__name__), "helper", lambda x: x - 1)
    patched_helper, _, _ = cap_of(Net())
    assert patched_helper.gm is not base.gm
    monkeypatch.undo()
    monkeypatch.setattr(__import__(__name__), "SCALE", 5.0)
    assert cap_of(Net())[0].gm is not base.gm              # a global value it reads


def test_a_class_defined_again_with_other_code_misses():
    base, _, _ = cap_of(Net())

    class Block(nn.Module):   # same name, same parameters, other code  # noqa: F811
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.fc(x))

    model = Net()
    model.blocks = nn.ModuleList(Block() for _ in range(2))
    assert cap_of(model)[0].gm is not base.gm


def test_loss_function_code_and_closure_are_part_of_the_key():
    def make(weight: float):
        return lambda out, y: F.cross_entropy(out, y) * weight

    one = cap_of(Net(), loss_fn=make(1.0))[0]
    assert cap_of(Net(), loss_fn=make(1.0))[0].gm is one.gm   # a fresh lambda, same code
    assert cap_of(Net(), loss_fn=make(2.0))[0].gm is not one.gm
    assert cap_of(Net(), loss_fn=lambda out, y: F.mse_loss(out.sum(1), y.double().float())
                  )[0].gm is not one.gm
    assert cap_of(Net(), with_loss=False)[0].gm is not one.gm


def test_hooks_are_not_cached_and_the_switch_turns_it_off(monkeypatch):
    model = Net()
    model.head.register_forward_hook(lambda m, i, o: o * 2)
    assert cap_of(model)[0].gm is not cap_of(model)[0].gm
    monkeypatch.setenv("AUTOHYBRID_CAPTURE_CACHE", "0")
    assert cap_of(Net())[0].gm is not cap_of(Net())[0].gm


def test_edits_of_a_returned_graph_record_do_not_reach_the_memo():
    first, _, _ = cap_of(Net())
    first.param_fqns.append("bogus")
    first.dim_roles.clear()
    first.hash = "changed"
    second, _, _ = cap_of(Net())
    assert "bogus" not in second.param_fqns and second.dim_roles
    assert second.hash != "changed"


@pytest.mark.slow
def test_zoo_and_hugging_face_models_hit_and_equal_a_fresh_export(monkeypatch):
    """The memo's graph is the one a fresh export gives (same hash) for models the
    project did not write as well as its own."""
    from autohybrid.models.coverage import build, lm_loss
    cases = [("gpt-tiny", lambda: (ah.models.preset("gpt-tiny"), lm_loss))]
    cases += [(name, lambda name=name: (build(name).model, build(name).loss_fn))
              for name in ("llama",)]
    for name, make in cases:
        model, loss_fn = make()
        (x,), y = ah.models.example_batch("gpt-tiny", 2) if name == "gpt-tiny" else \
            build(name).batches[0]
        first = capture(model, (x,), loss_fn, y)
        hit = capture(make()[0], (x,), make()[1], y)
        assert hit.gm is first.gm, f"{name}: no hit"
        monkeypatch.setenv("AUTOHYBRID_CAPTURE_CACHE", "0")
        fresh = capture(make()[0], (x,), make()[1], y)
        monkeypatch.delenv("AUTOHYBRID_CAPTURE_CACHE")
        assert fresh.gm is not first.gm and fresh.hash == hit.hash, name


class _Scale(nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


class _HoldsAModule(nn.Module):
    """As transformers 5.25's attention holds kernel wrappers in `_kernel_funcs`: modules
    in a plain attribute, outside the module tree."""

    def __init__(self, factor: float = 2.0):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self._kernel_funcs = {"scale": _Scale(factor)}

    def forward(self, x):
        return self._kernel_funcs["scale"](self.lin(x))


def test_a_module_held_outside_the_tree_is_keyed_by_its_class_and_attributes():
    x, y = torch.randn(3, 4), torch.randint(0, 4, (3,))

    def key(model):
        return capture_cache.capture_key(model, (x,), (y,), F.cross_entropy,
                                         with_loss=True, autocast=None)[0]

    assert key(_HoldsAModule()) == key(_HoldsAModule())          # memoized, and hits
    assert key(_HoldsAModule(3.0)) != key(_HoldsAModule())       # its attribute counts
    held = _HoldsAModule()
    held._kernel_funcs["scale"].register_forward_hook(lambda *a: None)
    assert capture_cache.capture_key(held, (x,), (y,), F.cross_entropy, with_loss=True,
                                     autocast=None) is None       # hooks: no fingerprint


def test_the_memo_keeps_the_graphs_used_last_up_to_its_size(monkeypatch):
    """At most `AUTOHYBRID_CAPTURE_CACHE_SIZE` graphs (default 16): the least recently
    used is dropped and exported again; a bad size is refused with what to set."""
    monkeypatch.delenv(capture_cache.SIZE_ENV, raising=False)
    assert capture_cache.max_entries() == capture_cache.MAX_ENTRIES == 16
    monkeypatch.setenv(capture_cache.SIZE_ENV, "2")
    a, b, c = (cap_of(Net(layers=n))[0] for n in (1, 2, 3))
    assert cap_of(Net(layers=3))[0].gm is c.gm          # kept
    assert cap_of(Net(layers=2))[0].gm is b.gm          # kept, and now used last
    assert cap_of(Net(layers=1))[0].gm is not a.gm      # dropped: exported again
    assert len(capture_cache._memo) == 2
    assert cap_of(Net(layers=3))[0].gm is not c.gm      # dropped by that export
    for bad in ("0", "-3", "many"):
        monkeypatch.setenv(capture_cache.SIZE_ENV, bad)
        with pytest.raises(ah.CaptureError, match="AUTOHYBRID_CAPTURE_CACHE_SIZE"):
            cap_of(Net(layers=4))
        assert len(capture_cache._memo) == 2                # refused before storing
