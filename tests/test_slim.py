"""torchspeed.slim (T38): structured pruning keeps the output shape, the classifier and the ignored layers,
rounds widths to 8, trains under fit, round-trips through a narrowed state_dict; bad input names the fix.
Nothing here reads a clock's verdict: the target search is tested with injected measurements."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.model.prune import (channel_widths, is_channels_last, load_narrowed_state_dict, narrowed_state_dict,
                                    prune_channels)
from torchspeed.slimming import _search, finetune, slim


class Net(nn.Module):
    """A residual CNN: the pruner must keep the two convs around the sum at one width."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                                  nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32))
        self.wide = nn.Sequential(nn.Conv2d(32, 48, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(48),
                                  nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(48, classes))

    def forward(self, x):
        x = self.stem(x)
        x = torch.relu(x + self.body(x))
        return self.head(self.wide(x))


def _data(n=128, classes=10):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 8, 8, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return x, y


def test_slim_keeps_the_output_shape_rounds_to_8_and_keeps_the_classifier():
    torch.manual_seed(0)
    model, (x, y) = Net(), _data()
    before = channel_widths(model)
    res = slim(model, x[:16], ratio=0.5, batches=[(x[:32], y[:32])], rounds=1)
    after = channel_widths(res.model)
    assert res.model(x[:4]).shape == model(x[:4]).shape == (4, 10)
    assert after["head.2"] == 10 and res.model.head[2].out_features == 10          # the classifier is whole
    assert after["stem.0"] == after["body.3"] == 16 and after["wide.0"] == 24      # half, to multiples of 8
    assert all(w % 8 == 0 for n, w in after.items() if n != "head.2")
    assert channel_widths(model) == before                                         # the original is untouched
    r = res.report
    assert r.params[1] < r.params[0] and r.macs[1] < r.macs[0] and r.ratio == 0.5 and r.met
    assert r.step_s[0] > 0 and r.latency_s[1] > 0 and len(r.candidates) == 1


def test_round_to_keeps_widths_on_multiples_of_8_at_an_odd_ratio():
    torch.manual_seed(0)
    model, (x, _) = Net(), _data()
    pruned = prune_channels(model, x[:4], ratio=0.3)
    widths = {n: w for n, w in channel_widths(pruned).items() if n != "head.2"}
    assert all(w % 8 == 0 for w in widths.values()) and widths["wide.0"] < 48, widths
    unrounded = prune_channels(model, x[:4], ratio=0.3, round_to=None)
    assert any(w % 8 for n, w in channel_widths(unrounded).items() if n != "head.2")  # the rounding did it


def test_ignored_layers_keep_their_width_by_module_or_name():
    torch.manual_seed(0)
    model, (x, _) = Net(), _data()
    for ignored in ([model.wide[0]], ["wide.0"]):
        pruned = prune_channels(model, x[:4], ratio=0.5, ignored_layers=ignored)
        widths = channel_widths(pruned)
        assert widths["wide.0"] == 48 and widths["stem.0"] == 16, widths
    assert channel_widths(prune_channels(model, x[:4], ratio=0.5))["wide.0"] == 24  # not ignored: pruned


def test_taylor_importance_takes_gradients_on_real_batches():
    torch.manual_seed(0)
    model, (x, y) = Net(), _data()
    pruned = prune_channels(model, x[:4], ratio=0.5, importance="taylor", batches=[(x[:32], y[:32])])
    magnitude = prune_channels(model, x[:4], ratio=0.5)
    assert channel_widths(pruned) == channel_widths(magnitude)
    assert all(p.grad is None for p in pruned.parameters())
    # Taylor keeps other channels than magnitude does: the kept stem filters differ
    assert not torch.equal(pruned.stem[0].weight, magnitude.stem[0].weight)
    with pytest.raises(ValueError, match="needs a few real batches.*batches="):
        prune_channels(model, x[:4], ratio=0.5, importance="taylor")


def test_the_pruned_model_trains_under_fit_and_round_trips_through_its_state_dict(tmp_path):
    torch.manual_seed(0)
    model, (x, y) = Net(), _data()
    res = slim(model, x[:16], ratio=0.5, rounds=1, val_loader=DataLoader(TensorDataset(x, y), batch_size=64))
    w0 = res.model.stem[0].weight.detach().clone()
    fr = finetune(res, DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True), epochs=1, device="cpu",
                  progress=False, val_loader=DataLoader(TensorDataset(x, y), batch_size=64))
    assert fr.steps == 4 and not torch.equal(res.model.stem[0].weight, w0)
    assert set(res.report.accuracy) == {"before", "pruned", "finetuned"}
    path = tmp_path / "slim.pt"
    torch.save(narrowed_state_dict(res.model), path)
    fresh = load_narrowed_state_dict(Net(), torch.load(path, weights_only=True))
    res.model.eval(), fresh.eval()
    assert channel_widths(fresh) == channel_widths(res.model)
    torch.testing.assert_close(fresh(x[:8]), res.model(x[:8]), rtol=0, atol=0)
    with pytest.raises(ValueError, match="narrowed_state_dict"):
        load_narrowed_state_dict(Net(), res.model.state_dict())


@pytest.mark.parametrize("ratio", [0, 0.0, 1, 1.5, -0.2])
def test_a_ratio_outside_0_1_names_the_fix(ratio):
    model, (x, _) = Net(), _data()
    with pytest.raises(ValueError, match=r"above 0 and below 1 \(ratio=0.5 halves"):
        slim(model, x[:4], ratio=ratio)


def test_example_inputs_of_the_wrong_shape_name_the_fix():
    model = Net()
    with pytest.raises(ValueError, match=r"example_inputs of shape \(4, 1, 8, 8\).*takes 3 input channels.*"
                                         r"next\(iter\(loader\)\)\[0\]"):
        slim(model, torch.randn(4, 1, 8, 8), ratio=0.5)
    with pytest.raises(ValueError, match="one target, not 2"):
        slim(model, torch.randn(4, 3, 8, 8), ratio=0.5, speedup=1.5)
    with pytest.raises(ValueError, match="above 1"):
        slim(model, torch.randn(4, 3, 8, 8), speedup=0.9)


def test_a_speedup_target_takes_the_smallest_ratio_that_meets_it_by_bisection():
    """Injected measurements (the step's speed-up grows with the ratio): no clock decides."""
    speedups = {0.125: 1.1, 0.25: 1.3, 0.375: 1.45, 0.5: 1.7, 0.625: 2.0, 0.75: 2.4}
    asked = []

    def measure_at(r):
        asked.append(r)
        return f"model@{r}", {"ratio": r, "step_speedup": speedups[r], "latency_s": 0.01 / speedups[r]}

    ratio, model, row, rows, met = _search({"speedup": 1.5}, measure_at, tuple(speedups))
    assert (ratio, model, met) == (0.5, "model@0.5", True) and len(asked) <= 3 and 0.5 in asked
    asked.clear()
    ratio, *_, met = _search({"latency_ms": 7.0}, measure_at, tuple(speedups))  # 10 ms / 1.45 = 6.9 ms
    assert (ratio, met) == (0.375, True)
    ratio, *_, met = _search({"speedup": 5.0}, measure_at, tuple(speedups))
    assert (ratio, met) == (0.75, False)  # nothing meets it: the largest measured, said so


def test_slim_is_the_package_face():
    assert torchspeed.slim is slim and torchspeed.finetune is finetune


def test_a_channels_last_model_is_pruned_into_channels_last_weights():
    """fit may leave a conv net channels_last: the pruned copy keeps that layout, or it would be timed (and
    trained) in another one than the original."""
    torch.manual_seed(0)
    model, (x, _) = Net().to(memory_format=torch.channels_last), _data()
    pruned = prune_channels(model, x[:4], ratio=0.5)
    assert is_channels_last(model) and is_channels_last(pruned) and not is_channels_last(Net())
    assert pruned.wide[0].weight.is_contiguous(memory_format=torch.channels_last)


def test_a_fine_tune_given_no_lr_starts_low_and_constant(monkeypatch):
    """The pruned model starts from trained weights: `finetune` without an LR trains at a tenth of the optimizer's
    default (SGD 0.01), held constant, not fit's from-scratch one-cycle to 0.1; an LR or a recipe given stands."""
    import torchspeed.slimming as slimming

    torch.manual_seed(0)
    model, (x, y) = Net(), _data()
    res = slim(model, x[:16], ratio=0.5, rounds=1)
    seen = []
    real = slimming.fit
    monkeypatch.setattr(slimming, "fit", lambda m, loader, **kw: seen.append(kw) or real(m, loader, **kw))
    loader = DataLoader(TensorDataset(x, y), batch_size=32)
    fr = finetune(res, loader, epochs=1, device="cpu", progress=False, compile=False, trial=False)
    assert seen[-1]["lr"] == pytest.approx(0.01) and fr.history[-1]["lr"] == pytest.approx(0.01)  # constant
    finetune(res, loader, epochs=1, device="cpu", progress=False, optimizer="adamw", compile=False, trial=False)
    assert seen[-1]["lr"] == pytest.approx(1e-4)
    finetune(res, loader, epochs=1, device="cpu", progress=False, lr=0.05, compile=False, trial=False)
    assert seen[-1]["lr"] == 0.05
