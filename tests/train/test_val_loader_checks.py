"""A validation loader with no batches is an error before any work; one read only once (a generator) is said so
at the start, and an evaluation that saw no batches says why its val_loss is NaN. Nothing is timed."""

import logging

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed


def _data(n):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def test_an_empty_val_loader_is_an_error_before_training():
    model = nn.Linear(4, 2)
    before = model.weight.detach().clone()
    with pytest.raises(ValueError, match="val_loader has no batches"):
        torchspeed.fit(model, DataLoader(_data(64), batch_size=16), epochs=1, progress=False,
                       val_loader=DataLoader(_data(0), batch_size=16))
    assert torch.equal(model.weight, before)


def test_a_one_shot_val_loader_is_warned_about_and_the_empty_evaluations_say_why(caplog):
    val = (b for b in DataLoader(_data(32), batch_size=16))
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        res = torchspeed.fit(nn.Linear(4, 2), DataLoader(_data(64), batch_size=16), epochs=3, progress=False,
                             val_loader=val, optimizer="adamw", lr=1e-2)
    text = caplog.text
    assert "val_loader is a one-shot iterator" in text
    assert "the validation loader gave no batches at step 8" in text and "at step 12" in text
    assert res.history[0]["val_acc"] is not None and res.history[1]["val_acc"] is None
