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


@pytest.mark.parametrize("generator", [True, False])
def test_the_checks_leave_the_random_stream_so_a_dropout_port_trains_the_scripts_weights(generator):
    """PyTorch's MNIST example's shape: dropout, `DataLoader(shuffle=True)`, a DataLoader for validation. A
    DataLoader draws a seed from the global RNG each time it is iterated, so a check that called `iter(val_loader)`
    moved every later dropout mask: the port trained other weights than the script (0.06 apart after 3 epochs)."""
    data, val = _data(96), _data(40)

    def make():
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 2))
        g = torch.Generator().manual_seed(2) if generator else None
        return (model, torch.optim.SGD(model.parameters(), lr=0.1),
                DataLoader(data, batch_size=16, shuffle=True, generator=g), DataLoader(val, batch_size=20))

    model, opt, loader, val_loader = make()
    for _ in range(3):  # the script: train an epoch, then evaluate
        model.train()
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            for x, _ in val_loader:
                model(x)
    ported, opt2, loader2, val_loader2 = make()
    torchspeed.fit(ported, loader2, optimizer=opt2, epochs=3, val_loader=val_loader2, progress=False,
                   precision="fp32", compile=False, trial=False)
    for a, b in zip(model.state_dict().values(), ported.state_dict().values()):
        assert torch.equal(a, b)
