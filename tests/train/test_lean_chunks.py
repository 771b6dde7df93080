"""The lean Adam step a piece at a time (`lean_kernels.adam_chunked`) gives torch's for-loop numbers bit for bit,
and the lean step follows a layout switch's new optimizer state (`lean_step.forget_lists`)."""

import pytest
import torch
from torch import nn

from torchspeed.train import lean_schedulefree
from torchspeed.train.loop.lean_step import lean_step_for
from torchspeed.train.state import flat_state
from torchspeed.train.trial.memory_format import apply_channels_last, state_follows_layout
from test_lean_step import _same, _train


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(16 * 6 * 6, 10))


def _batches(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(n)]


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 256 numbers, so that this small model's group is cut (its conv weights across pieces too)."""
    if not flat_state.lean_chunks_agree():
        pytest.skip("this CPU's kernels give a number another value at another position: no chunked update here")
    monkeypatch.setattr(lean_schedulefree, "CHUNK", 256)
    monkeypatch.setattr(flat_state, "MEAN_NUMEL", 1)  # the flat buffers are another path: off for these groups


@pytest.mark.parametrize("kind,kw", [
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05)),
    (torch.optim.Adam, dict(lr=3e-3, weight_decay=1e-3, betas=(0.8, 0.95), eps=1e-6)),
    (torch.optim.Adam, dict(lr=1e-2, maximize=True)),
])
def test_the_chunked_update_is_torchs_for_loop_update_bit_for_bit(small_pieces, kind, kw):
    ref, mine = _model(), _model()
    o_ref, o_mine = kind(ref.parameters(), foreach=False, **kw), kind(mine.parameters(), **kw)
    batches = _batches()
    _train(ref, o_ref, batches, ours=False)
    _train(mine, o_mine, batches, ours=True)
    _same(ref, mine, o_ref, o_mine)
    lean = lean_step_for(o_mine)
    assert lean.chunk_steps == lean.steps == len(batches) - 1  # torch's first step makes the state
    assert len(lean._groups[0][-1].pieces) > 10


def test_without_agreeing_kernels_or_for_a_small_group_the_update_takes_the_whole_lists(monkeypatch):
    monkeypatch.setattr(flat_state, "MEAN_NUMEL", 1)
    for agree, chunk in ((False, 256), (True, 1 << 19)):  # the kernels disagree; the group fits in two pieces
        monkeypatch.setattr(lean_schedulefree, "CHUNK", chunk)
        monkeypatch.setattr("torchspeed.train.lean_kernels.lean_chunks_agree", lambda a=agree: a)
        ref, mine = _model(), _model()
        o_ref, o_mine = (torch.optim.AdamW(m.parameters(), lr=1e-2, **k) for m, k in ((ref, dict(foreach=False)),
                                                                                     (mine, {})))
        _train(ref, o_ref, _batches(4), ours=False)
        _train(mine, o_mine, _batches(4), ours=True)
        _same(ref, mine, o_ref, o_mine)
        assert lean_step_for(o_mine).chunk_steps == 0 and lean_step_for(o_mine).steps == 3


def _after(step, change, model, opt):
    """`_train`'s `between`: `change(model, opt)` after step `step`."""
    return lambda i: change(model, opt) if i == step else None


def _to_channels_last(model, opt):
    apply_channels_last(model, True)
    state_follows_layout(opt)


@pytest.mark.parametrize("pieces", [False, True])
@pytest.mark.parametrize("kind,kw", [(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05)),
                                     (torch.optim.SGD, dict(lr=0.1, momentum=0.9))])
def test_a_layout_switch_midway_leaves_the_lean_step_on_the_optimizers_new_state(monkeypatch, kind, kw, pieces):
    """The switch trial's layout switch replaces the optimizer's 4D moments with channels_last copies
    (`state_follows_layout`). The lean step had kept the old tensors and went on updating them: `optimizer.state`,
    what a checkpoint saves, stayed as the switch left it. Now it reads the new state, and its update is torch's."""
    if pieces:
        if not flat_state.lean_chunks_agree():
            pytest.skip("no chunked update on this CPU")
        monkeypatch.setattr(lean_schedulefree, "CHUNK", 256)
    monkeypatch.setattr(flat_state, "MEAN_NUMEL", 1)
    ref, mine = _model(), _model()
    o_ref, o_mine = kind(ref.parameters(), foreach=False, **kw), kind(mine.parameters(), **kw)
    batches = _batches()
    _train(ref, o_ref, batches, ours=False, between=_after(2, _to_channels_last, ref, o_ref))
    _train(mine, o_mine, batches, ours=True, between=_after(2, _to_channels_last, mine, o_mine))
    _same(ref, mine, o_ref, o_mine)
    lean = lean_step_for(o_mine)
    key = "momentum_buffer" if kind is torch.optim.SGD else "exp_avg"
    w = mine[0].weight
    assert w.is_contiguous(memory_format=torch.channels_last) and o_mine.state[w][key] in lean._groups[0][3]
    assert lean.steps == len(batches) - 1
    assert lean.chunk_steps == (lean.steps if pieces and kind is not torch.optim.SGD else 0)


def test_a_parameter_given_new_memory_is_stepped_on_the_whole_lists_that_step(small_pieces):
    ref, mine = _model(), _model()
    o_ref, o_mine = (torch.optim.AdamW(m.parameters(), lr=1e-2, **k) for m, k in ((ref, dict(foreach=False)),
                                                                                 (mine, {})))

    def new_memory(model, opt):
        w = model[2].weight
        w.data = w.data.clone()  # the same numbers, other memory: the pieces' views are of the old

    batches = _batches()
    _train(ref, o_ref, batches, ours=False, between=_after(3, new_memory, ref, o_ref))
    _train(mine, o_mine, batches, ours=True, between=_after(3, new_memory, mine, o_mine))
    _same(ref, mine, o_ref, o_mine)
    lean = lean_step_for(o_mine)
    assert lean.steps == len(batches) - 1 and lean.chunk_steps == 3  # steps 1-3 in pieces, then the whole lists
