"""Bad input gets a clear error that names the problem and the fix: a run length that cannot be (grad_accum=0 was a
ZeroDivisionError in the plan), and labels outside the model's classes (torch says only "Target 6 is out of
bounds"). Nothing is timed."""

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.train.config import TrainConfig


def _loader(y_shift=0):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 6, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + y_shift), batch_size=8)


@pytest.mark.parametrize("bad", [{"grad_accum": 0}, {"epochs": -1}, {"max_steps": 0}, {"log_every": 0},
                                 {"grad_accum": 1.5}])
def test_a_run_length_that_cannot_be_is_a_clear_error(bad):
    (name, value), = bad.items()
    with pytest.raises(ValueError, match=f"{name} must be an int"):
        torchspeed.fit(nn.Linear(6, 2), _loader(), progress=False, **bad)


def test_integer_counts_of_any_integer_type_are_taken():
    assert TrainConfig(epochs=np.int64(3), max_steps=np.int32(7)).epochs == 3


def test_labels_outside_the_models_classes_name_both_and_the_fix():
    with pytest.raises(IndexError, match=r"class indices from 5 to 6, but the model outputs 2 classes .*at least 7"):
        torchspeed.fit(nn.Linear(6, 2), _loader(y_shift=5), progress=False, trial=False, compile=False)
