"""LeanScheduleFree: Schedule-Free AdamW's update on kept lists, its moments in flat buffers, bit for bit the
package's, and every case it does not mirror handed back to the package's `step()`."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.train import lean_schedulefree
from torchspeed.train.state import flat_state
from torchspeed.train.lean_schedulefree import LeanScheduleFree
from torchspeed.train.loop.lean_step import lean_step_for, step_with_torch

from test_lean_step import _batches, _model, _resume_and_freeze, _train as lean_train

schedulefree = pytest.importorskip("schedulefree")


def _train(model, opt, batches, *, ours: bool, between=None):
    opt.train()  # Schedule-Free's training weights
    lean_train(model, opt, batches, ours=ours, between=between)


def _same(a, b, oa, ob):
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
        for k in ("z", "exp_avg_sq"):
            assert torch.equal(oa.state[pa][k], ob.state[pb][k]), k
    for ga, gb in zip(oa.param_groups, ob.param_groups):
        assert {k: v for k, v in ga.items() if k not in ("params", "foreach")} == \
            {k: v for k, v in gb.items() if k not in ("params", "foreach")}


def _evaluate_at(i, opt):
    if i in (3, 7):  # an evaluation: the averaged weights in, then the training weights back
        opt.eval()
        opt.train()


@pytest.mark.parametrize("kw", [
    dict(lr=0.01),
    dict(lr=0.04, weight_decay=0.05, warmup_steps=4, betas=(0.8, 0.99), eps=1e-6),
    dict(lr=0.02, warmup_steps=20, r=1.0, weight_lr_power=1.0),
])
@pytest.mark.parametrize("foreach", [True, False])
def test_the_lean_update_is_the_packages_bit_for_bit(kw, foreach):
    """Parameters, z, exp_avg_sq and the group's bookkeeping equal the package's own step after every step (its
    foreach path and its for-loop give the same numbers on the CPU), evaluations in between."""
    ref, mine = _model(), _model()
    o_ref = schedulefree.AdamWScheduleFree(ref.parameters(), foreach=foreach, **kw)
    o_mine = schedulefree.AdamWScheduleFree(mine.parameters(), **kw)
    batches = _batches()
    _train(ref, o_ref, batches, ours=False, between=lambda i: _evaluate_at(i, o_ref))
    _train(mine, o_mine, batches, ours=True, between=lambda i: _evaluate_at(i, o_mine))
    lean = lean_step_for(o_mine)
    assert isinstance(lean, LeanScheduleFree) and lean.steps == len(batches) - 1  # the first: the package's
    _same(ref, mine, o_ref, o_mine)
    if flat_state.schedule_free_kernels_agree():
        assert lean.flat_steps == lean.steps
        ptrs = {o_mine.state[p]["z"].untyped_storage().data_ptr() for p in mine.parameters()}
        assert len(ptrs) == 1 and all(o_mine.state[p]["z"].shape == p.shape for p in mine.parameters())


def test_kept_lists_without_flat_buffers_are_the_packages_too(monkeypatch):
    monkeypatch.setattr(lean_schedulefree, "schedule_free_kernels_agree", lambda: False)
    ref, mine = _model(), _model()
    o_ref = schedulefree.AdamWScheduleFree(ref.parameters(), lr=0.02, weight_decay=0.01)
    o_mine = schedulefree.AdamWScheduleFree(mine.parameters(), lr=0.02, weight_decay=0.01)
    _train(ref, o_ref, _batches(), ours=False)
    _train(mine, o_mine, _batches(), ours=True)
    lean = lean_step_for(o_mine)
    assert lean.steps == 11 and lean.flat_steps == 0
    _same(ref, mine, o_ref, o_mine)


class _Big(nn.Module):
    """Tensors larger than a (patched, small) piece, one in channels_last, and small ones shared into pieces."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1).to(memory_format=torch.channels_last)
        self.fc, self.head = nn.Linear(8 * 4 * 4, 40), nn.Linear(40, 3)

    def forward(self, x):
        return self.head(torch.relu(self.fc(torch.relu(self.conv(x)).flatten(1))))


@pytest.mark.parametrize("decay", [0.0, 0.05])
def test_a_chunked_update_of_large_tensors_is_the_packages_bit_for_bit(monkeypatch, decay):
    """Every op over one piece, then the next (the working set in cache): each number the same ops in the same
    order, so the same numbers, a channels_last weight cut in its memory order included."""
    if not flat_state.schedule_free_chunks_agree():
        pytest.skip("this CPU's kernels give a number another value at another position: no chunked update here")
    monkeypatch.setattr(lean_schedulefree, "CHUNK", 100)  # the fc weight (5,120) in 52 pieces; the rest shared
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 3, 4, 4, generator=g).contiguous(memory_format=torch.channels_last),
                torch.randint(0, 3, (4,), generator=g)) for _ in range(8)]
    ref, mine = _Big(), _Big()
    o_ref = schedulefree.AdamWScheduleFree(ref.parameters(), lr=0.02, weight_decay=decay, warmup_steps=3)
    o_mine = schedulefree.AdamWScheduleFree(mine.parameters(), lr=0.02, weight_decay=decay, warmup_steps=3)
    def between(i, model, opt):
        _evaluate_at(i, opt)
        if i == 5:  # new memory for a weight (a layout switched mid-run): the pieces' views are of the old
            with torch.no_grad():
                model.fc.weight.data = model.fc.weight.data.clone()
    _train(ref, o_ref, batches, ours=False, between=lambda i: between(i, ref, o_ref))
    _train(mine, o_mine, batches, ours=True, between=lambda i: between(i, mine, o_mine))
    lean = lean_step_for(o_mine)
    assert lean.steps == 7 and lean.chunk_steps == 7 and lean.flat_steps == 0
    chunks = lean._groups[0][6]
    assert len(chunks.pieces) > 52 and any(len(piece) > 1 for piece in chunks.pieces)
    _same(ref, mine, o_ref, o_mine)


def test_no_chunks_where_the_kernels_disagree_or_the_group_is_small(monkeypatch):
    m = _Big()
    params = list(m.parameters())
    like = [torch.zeros_like(p) for p in params]
    assert lean_schedulefree.Chunks.of(params, like, like) is None  # 5,507 numbers in all: under two pieces of 2^19
    monkeypatch.setattr(lean_schedulefree, "CHUNK", 100)
    assert lean_schedulefree.Chunks.of(params[2:], like[2:], like[2:]) is not None  # no tensor cut: fc and head
    monkeypatch.setattr(lean_schedulefree, "CHUNK", 3000)
    assert lean_schedulefree.Chunks.of(params, like, like) is None  # under two pieces in all
    monkeypatch.setattr(lean_schedulefree, "CHUNK", 100)
    assert lean_schedulefree.Chunks.of(params, like, [t.contiguous() for t in like]) is None  # laid out otherwise
    monkeypatch.setattr(lean_schedulefree, "schedule_free_chunks_agree", lambda: False)
    assert lean_schedulefree.Chunks.of(params, like, like) is None


def test_a_state_loaded_midway_and_a_frozen_step_stay_the_packages(monkeypatch):
    """A resume replaces the state (new buffers hold the loaded numbers); a step with a frozen bias goes through
    the package (it steps only the parameters with gradients)."""
    exact = flat_state.schedule_free_kernels_agree()
    monkeypatch.setattr(lean_schedulefree, "schedule_free_kernels_agree", lambda: True)  # the path, on any CPU
    ref, mine = _model(), _model()
    o_ref = schedulefree.AdamWScheduleFree(ref.parameters(), lr=0.02)
    o_mine = schedulefree.AdamWScheduleFree(mine.parameters(), lr=0.02)
    batches = _batches(14)
    _train(ref, o_ref, batches, ours=False, between=_resume_and_freeze(o_ref, ref))
    _train(mine, o_mine, batches, ours=True, between=_resume_and_freeze(o_mine, mine))
    lean = lean_step_for(o_mine)
    assert lean.steps == len(batches) - 2 and lean.flat_steps == lean.steps  # all but the first and the frozen one
    if exact:
        _same(ref, mine, o_ref, o_mine)


def test_every_case_it_does_not_mirror_goes_through_the_packages_step(monkeypatch):
    model = _model()
    opt = schedulefree.AdamWScheduleFree(model.parameters(), lr=0.01)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append(1))
    _train(model, opt, _batches(3), ours=True)
    assert len(calls) == 3 and lean_step_for(opt).steps == 0  # a hook: the package steps

    class Mine(schedulefree.AdamWScheduleFree):
        pass
    assert lean_step_for(Mine(_model().parameters(), lr=0.01)) is None  # a subclass may step otherwise

    monkeypatch.setattr(lean_schedulefree, "_replicated", lambda: False)  # a release whose step is not replicated
    model = _model()
    opt = schedulefree.AdamWScheduleFree(model.parameters(), lr=0.01)
    _train(model, opt, _batches(3), ours=True)
    assert lean_step_for(opt).steps == 0

    opt = schedulefree.AdamWScheduleFree(_model().parameters(), lr=0.01)
    step_with_torch(opt)  # the bench's naive loop
    assert lean_step_for(opt) is None


def test_fit_trains_schedule_free_through_the_lean_step(monkeypatch):
    """`fit(optimizer="schedulefree")` steps the package's optimizer for its first update only (this fails with the
    lean step switched off)."""
    calls = []
    original = schedulefree.AdamWScheduleFree.step
    monkeypatch.setattr(schedulefree.AdamWScheduleFree, "step",
                        lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    torch.manual_seed(0)
    x, y = torch.randn(200, 6), torch.randint(0, 2, (200,))
    res = torchspeed.fit(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)),
                         DataLoader(TensorDataset(x, y), batch_size=20), epochs=2, optimizer="schedulefree",
                         lr=1e-2, precision="fp32", trial=False, progress=False,
                         val_loader=DataLoader(TensorDataset(x, y), batch_size=100))
    assert res.steps == 20 and len(calls) == 1


def test_schedule_free_modes_have_one_home():
    """train_mode / eval_mode / averaged_weights (train/optim.py) are the only places Schedule-Free's modes switch:
    no other module of the package calls an optimizer's .train() or .eval()."""
    import ast
    import pathlib

    import torchspeed

    root = pathlib.Path(torchspeed.__file__).parent
    found = []
    for f in root.rglob("*.py"):
        if f.name == "optim.py" and f.parent.name == "train":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            if call and node.func.attr in ("train", "eval") and isinstance(node.func.value, (ast.Name, ast.Attribute)):
                name = node.func.value.id if isinstance(node.func.value, ast.Name) else node.func.value.attr
                if "opt" in name:
                    found.append(f"{f.relative_to(root)}:{node.lineno}")
    assert found == []
