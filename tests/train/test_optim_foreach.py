"""torch's RMSprop, Adagrad, Adamax, Adadelta and Rprop step on their foreach kernels inside `fit`'s optimizer step
where those give the for-loop's numbers (train/optim_foreach.py), and nowhere else."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchspeed.train.optim_foreach import foreach_groups
from torchspeed.train.loop.step import optimizer_step
from torchspeed.train.optim_kernel import zero_grad

CASES = [
    (torch.optim.RMSprop, dict(lr=1e-3)),
    (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.9, centered=True, weight_decay=1e-4)),
    (torch.optim.RMSprop, dict(lr=1e-3, alpha=0.9, maximize=True)),
    (torch.optim.Adagrad, dict(lr=1e-2)),
    (torch.optim.Adagrad, dict(lr=1e-2, lr_decay=1e-3, weight_decay=1e-4, initial_accumulator_value=0.1)),
    (torch.optim.Adamax, dict(lr=2e-3, weight_decay=1e-2)),
    (torch.optim.Adadelta, dict(lr=1.0, rho=0.95, weight_decay=1e-4)),
    (torch.optim.Rprop, dict(lr=1e-2, etas=(0.4, 1.3))),
]


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)).to(dtype)


def _train(model, opt, *, ours: bool, dtype=torch.float32, steps=15):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=g).to(dtype), torch.randint(0, 3, (16,), generator=g)
        F.cross_entropy(model(x), y).backward()
        if ours:
            optimizer_step(opt)
            zero_grad(opt)
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)


def _multi_tensor_calls(monkeypatch, kind) -> list:
    """Count calls of the kind's foreach implementation (`torch.optim.<module>._multi_tensor_<name>`)."""
    module = __import__(kind.__module__, fromlist=["_"])
    name = "_multi_tensor_" + kind.__module__.rsplit(".", 1)[-1]
    real, calls = getattr(module, name), []

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind,kw", CASES)
def test_the_foreach_kernels_step_and_give_the_for_loops_numbers_bit_for_bit(kind, kw, dtype, monkeypatch):
    ref, mine = _model(dtype), _model(dtype)
    o_ref, o_mine = kind(ref.parameters(), **kw), kind(mine.parameters(), **kw)
    _train(ref, o_ref, ours=False, dtype=dtype)
    calls = _multi_tensor_calls(monkeypatch, kind)
    _train(mine, o_mine, ours=True, dtype=dtype)
    assert len(calls) == 15  # every step on the foreach kernels
    for a, b in zip(ref.parameters(), mine.parameters()):
        assert torch.equal(a, b)
        for k, v in o_ref.state[a].items():
            assert torch.equal(v, o_mine.state[b][k]), k
    assert o_mine.param_groups[0]["foreach"] is None  # the user's optimizer as it was made
    assert o_mine.state_dict()["param_groups"][0]["foreach"] is None


@pytest.mark.parametrize("make", [
    lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3, foreach=False),  # the group names its kernel
    lambda m: torch.optim.NAdam(m.parameters(), lr=1e-3),  # its foreach path rounds otherwise (1 ulp in fp32)
    lambda m: torch.optim.RMSprop(m.to(torch.bfloat16).parameters(), lr=1e-3),  # bf16: rounds otherwise
    lambda m: torch.optim.RMSprop(m.parameters(), lr=torch.tensor(1e-3)),
])
def test_groups_that_name_their_kernel_or_would_round_otherwise_keep_the_for_loop(make):
    assert foreach_groups(make(_model())) == []


def test_only_the_groups_that_qualify_are_named_and_a_grown_group_is_checked_again():
    m = _model()
    first, rest = list(m[0].parameters()), list(m[2].parameters()) + list(m[4].parameters())
    opt = torch.optim.Adagrad([{"params": first}, {"params": rest, "foreach": False}], lr=1e-2)
    assert foreach_groups(opt) == [opt.param_groups[0]]
    opt.param_groups[0]["params"].append(torch.zeros(3, dtype=torch.bfloat16, requires_grad=True))
    assert foreach_groups(opt) == []  # a bf16 parameter joined the group in place
    opt = torch.optim.RMSprop(m.parameters(), lr=1e-3)
    assert foreach_groups(opt) == opt.param_groups
    m.to(torch.bfloat16)  # cast in place: the same parameter objects, another dtype
    assert foreach_groups(opt) == []


def test_a_sparse_gradient_under_adagrad_steps_as_torchs_for_loop():
    """Adagrad's foreach path hands a group with a sparse gradient to its for-loop: the numbers stay torch's."""
    def emb():
        torch.manual_seed(0)
        return nn.Embedding(50, 4, sparse=True)
    ref, mine = emb(), emb()
    o_ref, o_mine = torch.optim.Adagrad(ref.parameters(), lr=0.1), torch.optim.Adagrad(mine.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        idx = torch.randint(0, 50, (16,), generator=g)
        ref(idx).sum().backward()
        mine(idx).sum().backward()
        o_ref.step()
        o_ref.zero_grad()
        optimizer_step(o_mine)
        zero_grad(o_mine)
    assert torch.equal(ref.weight, mine.weight)
