"""The gradient noise scale (train/noise.py) on a problem whose noise is known exactly."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from torchspeed.train.noise import NoiseScaleEstimator, measure_noise_scale, split_batch_in_two


def _known_noise(d=32, sigma=2.0, n=64 * 400, seed=0):
    """Loss = mean_i w . x_i with x_i = mu + sigma * eps_i: per-sample gradient x_i, so G = mu and
    tr(Sigma) = d sigma^2; B_simple = d sigma^2 / |mu|^2 (here 32 * 4 / 16 = 8)."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.full((d,), 4.0 / d ** 0.5)  # |mu|^2 = 16
    x = mu + sigma * torch.randn(n, d, generator=g)
    model = torch.nn.Linear(d, 1, bias=False)
    true = d * sigma ** 2 / float(mu.pow(2).sum())
    return model, DataLoader(TensorDataset(x), batch_size=64), true


def _step(model, batch):
    return model(batch[0]).mean()


def test_estimate_is_within_25_percent_of_the_known_noise_scale():
    model, loader, true = _known_noise()
    before = model.weight.detach().clone()
    res = measure_noise_scale(model, loader, batches=400, step_fn=_step, ema=0.99)
    assert res.noise_scale == pytest.approx(true, rel=0.25), (res.noise_scale, true)
    assert res.trace == pytest.approx(32 * 4.0, rel=0.25) and res.grad_sq == pytest.approx(16.0, rel=0.25)
    assert torch.equal(model.weight, before) and model.weight.grad is None  # nothing trained, grads restored
    assert res.critical_batch_size == round(res.noise_scale) and "critical batch size" in res.suggestion


def test_more_noise_gives_a_larger_noise_scale():
    low = measure_noise_scale(*_known_noise(sigma=1.0)[:2], batches=200, step_fn=_step, ema=0.98).noise_scale
    high = measure_noise_scale(*_known_noise(sigma=4.0)[:2], batches=200, step_fn=_step, ema=0.98).noise_scale
    assert high > 8 * low  # tr(Sigma) grows with sigma^2: 16x


def test_estimator_formulas_and_bad_input():
    est = NoiseScaleEstimator()
    # |g_b|^2 = |G|^2 + tr/b, |g_B|^2 = |G|^2 + tr/B with |G|^2 = 2, tr = 40, b = 10, B = 40
    est.update(2 + 40 / 10, 2 + 40 / 40, 10, 40)
    assert est.g2 == pytest.approx(2.0) and est.trace == pytest.approx(40.0) and est.value == pytest.approx(20.0)
    with pytest.raises(ValueError, match="two batch sizes"):
        est.update(1.0, 1.0, 8, 8)
    a, b = split_batch_in_two({"x": torch.arange(6), "y": (torch.arange(6), torch.arange(6))})
    assert a["x"].tolist() == [0, 1, 2] and b["y"][1].tolist() == [3, 4, 5]


def test_fit_logs_the_noise_scale_and_trains_exactly_as_without_it(tiny_cnn):
    import torchspeed

    def data():
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(128, 3, 8, 8, generator=g), torch.randint(0, 4, (128,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(1))

    # trial=False: the switch trial's kernel choice depends on the clock, and fused and foreach round differently
    kw = dict(epochs=2, progress=False, compile=False, seed=0, precision="fp32", channels_last=False, lr=0.05,
              trial=False)
    plain = torchspeed.fit(tiny_cnn(), data(), val_loader=data(), **kw)
    logged = torchspeed.fit(tiny_cnn(), data(), val_loader=data(), noise_scale_every=2, **kw)
    assert all(r["noise_scale"] is not None and r["noise_scale"] == r["noise_scale"] for r in logged.history)
    assert "noise_scale" not in plain.history[0]
    # measuring touches no weight, gradient, BatchNorm statistic or RNG: the losses are the same
    for key in ("train_loss", "val_loss"):  # val_loss reads the BatchNorm running statistics
        assert [r[key] for r in logged.history] == [r[key] for r in plain.history]
