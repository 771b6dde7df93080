"""Each model-surgery function keeps the function the model computes (or how it trains)."""

import copy

import pytest
import torch
from torch import nn

from torchspeed.model import (CheckpointWrapper, apply_activation_checkpointing, apply_channels_last,
                              find_conv_bn_pairs, freeze_batchnorm, pad_to_multiple, remove_conv_bias)
from torchspeed.train.trial.memory_format import apply_channels_last as train_apply_channels_last


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv_a = nn.Conv2d(3, 6, 3, padding=1, bias=True)
        self.bn_a = nn.BatchNorm2d(6)
        self.conv_b = nn.Conv2d(6, 6, 3, padding=1, bias=True)  # followed by ReLU, not BN
        self.head = nn.Linear(6, 4)

    def forward(self, x):
        x = torch.relu(self.bn_a(self.conv_a(x)))
        x = torch.relu(self.conv_b(x))
        return self.head(x.mean((2, 3)))


def _train_steps(model, x, y, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        return model(x)


def test_remove_conv_bias_traced_pairs_exact():
    torch.manual_seed(0)
    m = Block()
    x = torch.randn(4, 3, 8, 8)
    m.train()
    m(x)  # give the BN running stats something non-trivial
    ref = copy.deepcopy(m)
    pairs = remove_conv_bias(m, example_input=x)
    assert [(p.conv, p.bn) for p in pairs] == [("conv_a", "bn_a")]
    assert m.conv_a.bias is None and m.conv_b.bias is not None
    for mode in (True, False):
        ref.train(mode)
        m.train(mode)
        r, o = ref(x), m(x)
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)


def test_remove_conv_bias_sequential_trains_equivalently():
    torch.manual_seed(1)
    seq = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    ref = copy.deepcopy(seq)
    assert [p.conv for p in find_conv_bn_pairs(seq)] == ["0"]
    remove_conv_bias(seq)
    x, y = torch.randn(8, 3, 6, 6), torch.randint(0, 3, (8,))
    # SGD with weight decay moves the bias of ref, but BN cancels it: outputs stay equal.
    torch.testing.assert_close(_train_steps(seq, x, y), _train_steps(ref, x, y), rtol=1e-4, atol=1e-4)


def test_channels_last_is_reexported_and_exact():
    assert apply_channels_last is train_apply_channels_last
    torch.manual_seed(0)
    m = Block().eval()
    x = torch.randn(2, 3, 8, 8)
    ref = m(x)
    apply_channels_last(m)
    assert m.conv_a.weight.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(m(x.contiguous(memory_format=torch.channels_last)), ref, rtol=1e-5, atol=1e-5)


def test_pad_to_multiple_exact_and_trains_equivalently():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(20, 100), nn.BatchNorm1d(100), nn.GELU(), nn.Dropout(0.0),
                        nn.Linear(100, 30), nn.ReLU(), nn.Linear(30, 5))
    ref = copy.deepcopy(mlp)
    result = pad_to_multiple(mlp, multiple=8)
    assert result.padded == (("0", 100, 104), ("4", 30, 32))
    assert mlp[0].out_features == 104 and mlp[4].in_features == 104 and mlp[6].out_features == 5
    x, y = torch.randn(16, 20), torch.randint(0, 5, (16,))
    mlp.eval(), ref.eval()
    torch.testing.assert_close(mlp(x), ref(x), rtol=1e-5, atol=1e-5)
    mlp.train(), ref.train()
    torch.testing.assert_close(_train_steps(mlp, x, y), _train_steps(ref, x, y), rtol=1e-4, atol=1e-4)


def test_pad_to_multiple_skips_inexact_chains():
    # LayerNorm mixes features: padding there would change the function, so it is left alone.
    mlp = nn.Sequential(nn.Linear(4, 10), nn.LayerNorm(10), nn.Linear(10, 3))
    assert pad_to_multiple(mlp).padded == ()
    conv = nn.Sequential(nn.Conv2d(3, 12, 3), nn.ReLU(), nn.Conv2d(12, 12, 3))
    ref = copy.deepcopy(conv)
    # the last conv is the model's output layer: its out size must not change
    assert pad_to_multiple(conv).padded == (("0", 12, 16),)
    x = torch.randn(1, 3, 9, 9)
    torch.testing.assert_close(conv(x), ref(x), rtol=1e-5, atol=1e-5)


def test_freeze_batchnorm_keeps_statistics():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    m.train()
    m(torch.randn(4, 3, 6, 6) * 3 + 1)
    stats = m[1].running_mean.clone()
    names = freeze_batchnorm(m)
    assert names == ["1"]
    m.train()
    x = torch.randn(4, 3, 6, 6)
    out = m(x)
    assert torch.equal(m[1].running_mean, stats)
    assert not m[1].weight.requires_grad and m[0].weight.requires_grad
    m.eval()
    torch.testing.assert_close(out, m(x))


@pytest.mark.parametrize("use_types", [False, True])
def test_activation_checkpointing_same_gradients(use_types):
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.2)) for _ in range(3)]
    m = nn.Sequential(*blocks, nn.Linear(16, 2))
    ref = copy.deepcopy(m)
    names = apply_activation_checkpointing(m, block_types=(nn.Sequential,) if use_types else None)
    assert len(names) == (3 if use_types else 4)
    assert isinstance(m[0], CheckpointWrapper)
    x = torch.randn(8, 16)
    torch.manual_seed(5)
    ref(x).square().sum().backward()
    torch.manual_seed(5)
    m(x).square().sum().backward()
    for p, q in zip(ref.parameters(), m.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


def test_public_exports():
    import torchspeed
    for name in ("remove_conv_bias", "find_conv_bn_pairs", "pad_to_multiple", "freeze_batchnorm",
                 "apply_activation_checkpointing", "apply_channels_last", "diagnose"):
        assert name in torchspeed.__all__ and callable(getattr(torchspeed, name))
