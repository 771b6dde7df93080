"""A model with lazy layers (`nn.LazyLinear`, `nn.LazyBatchNorm1d`) trains under `fit`'s defaults: its shapes come
from one eval-mode forward of the first batch before anything reads them. Nothing is timed."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed


def _data(n=256):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 10, generator=g)
    return TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long())


def test_fit_trains_a_lazy_model_with_the_default_trial_and_leaves_no_batchnorm_trace_of_the_shape_pass():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(32), nn.LazyBatchNorm1d(), nn.ReLU(), nn.LazyLinear(2))
    res = torchspeed.fit(model, DataLoader(_data(), batch_size=32, shuffle=True), epochs=4, progress=False,
                         val_loader=DataLoader(_data(128), batch_size=64), restore_best=False)  # the last weights
    assert model[0].weight.shape == (32, 10) and model[3].weight.shape == (2, 32)
    assert res.steps == 32 and res.final["val_acc"] > 0.8
    bn = model[1]
    assert bn.num_batches_tracked.item() == res.steps  # the shape pass ran in eval mode: no update of its own


def test_a_lazy_model_over_a_one_shot_iterator_gets_a_clear_error():
    model = nn.Sequential(nn.LazyLinear(2))
    with pytest.raises(ValueError, match="lazy layers"):
        torchspeed.fit(model, iter(DataLoader(_data(), batch_size=32)), epochs=1, progress=False, max_steps=4)
