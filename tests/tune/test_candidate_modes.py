"""One home for stepping a candidate optimizer: an optimizer with modes (Schedule-Free's train()/eval()) is put in
train mode by every tuner that steps it, whoever built it and whatever evaluated it last."""

import pytest
import torch
from torch.utils.data import TensorDataset

from torchspeed.train.optim import create_optimizer
from torchspeed.tune._common import TrainStep
from torchspeed.tune.batch import find_batch_size

pytest.importorskip("schedulefree")


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _batch(n=16):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_train_step_puts_a_schedule_free_optimizer_in_train_mode_before_stepping():
    model = _mlp()
    opt = create_optimizer("schedulefree", model, lr=1e-2)
    opt.eval()  # as an evaluation (or a fresh build) leaves it
    step = TrainStep(model, opt)
    losses = [float(step(_batch())) for _ in range(5)]
    assert opt.param_groups[0]["train_mode"] and losses[-1] < losses[0]
    opt.eval()  # evaluated half-way through a trial: the next step goes back by itself
    step(_batch())
    assert opt.param_groups[0]["train_mode"]


def test_the_batch_tuner_steps_a_schedule_free_optimizer_built_in_eval_mode():
    model = _mlp()
    opt = create_optimizer("schedulefree", model, lr=1e-2)
    opt.eval()
    x, y = _batch(256)
    res = find_batch_size(model, TensorDataset(x, y), optimizer=opt, precision="fp32", min_batch=8, max_batch=32,
                          steps=1, rounds=1, min_time=0.0, progress=False)
    assert res.largest >= 8
