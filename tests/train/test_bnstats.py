"""BatchNorm statistics of the final weights (train/bnstats.py, T47): behaviour, not speed."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchspeed.train.bnstats import FinalBatchNormStats, batchnorm_layers, recalibrate_bn, tail_steps


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 4))


def _loader(n=64, bs=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 8, 8, generator=g) * 3 + 1
    y = torch.randint(0, 4, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=bs, shuffle=True, generator=g)


def test_recalibrate_bn_gives_the_equal_weight_average_of_the_batches_and_changes_no_weight():
    model = _net().eval()
    bn = model[1]
    bn.running_mean.fill_(100.0)  # stale statistics
    weights = {k: v.clone() for k, v in model.state_dict().items() if "running" not in k and "num_batches" not in k}
    batches = [(torch.randn(16, 3, 8, 8) + i, torch.zeros(16, dtype=torch.long)) for i in range(4)]
    assert recalibrate_bn(model, batches) == 4
    with torch.no_grad():
        expected = torch.stack([model[0](x).mean(dim=(0, 2, 3)) for x, _ in batches]).mean(0)
    torch.testing.assert_close(bn.running_mean, expected, rtol=1e-4, atol=1e-4)
    assert bn.momentum == 0.1 and not model.training and int(bn.num_batches_tracked) == 4
    for k, v in model.state_dict().items():
        if k in weights:
            assert torch.equal(v, weights[k])


def test_recalibrate_bn_takes_dict_batches_and_refuses_none():
    class DictNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def forward(self, pixels, labels=None):
            return self.net(pixels)

    model = DictNet()
    assert recalibrate_bn(model, [{"pixels": torch.randn(8, 3, 8, 8), "labels": torch.zeros(8)}]) == 1
    with pytest.raises(ValueError, match="no batches"):
        recalibrate_bn(model, [])
    assert recalibrate_bn(nn.Linear(2, 2), []) == 0  # no BatchNorm: nothing to do


def test_tail_is_a_tenth_of_the_run_within_bounds():
    assert tail_steps(None) == 0 and tail_steps(40) == 4 and tail_steps(300) == 30 and tail_steps(10_000) == 50
    assert tail_steps(6) == 3 and tail_steps(1) == 1


def test_fit_averages_the_statistics_over_exactly_the_last_steps_then_restores_momentum():
    from torchspeed import fit

    model = _net()
    seen = []

    class Watch(FinalBatchNormStats):
        def on_step_end(self, trainer):
            super().on_step_end(trainer)
            seen.append((trainer.step, model[1].momentum))

    res = fit(model, _loader(), epochs=3, callbacks=[Watch(steps=5)], progress=False, compile=False, trial=False,
              precision="fp32", lr=0.05)
    bn = model[1]
    assert res.steps == 12
    # reset after step 7, then the 5 forwards of steps 8..12 averaged with equal weight (momentum None)
    assert int(bn.num_batches_tracked) == 5
    assert [m for s, m in seen if s < 7] == [0.1] * 6 and [m for s, m in seen if s >= 7] == [None] * 6
    assert bn.momentum == 0.1  # put back at the end
    assert "last 5 of 12 steps" in str(res.decisions["bn_stats"])


def test_without_the_callback_the_usual_running_average_stays():
    from torchspeed import fit

    model = _net()
    fit(model, _loader(), epochs=3, progress=False, compile=False, trial=False, precision="fp32", lr=0.05)
    assert int(model[1].num_batches_tracked) == 12 and model[1].momentum == 0.1
    assert batchnorm_layers(model) == [model[1]]


def test_final_statistics_keep_or_raise_accuracy_on_real_digits():
    """Numerics: a short one-cycle run of ResNet-20 on the digits evaluates at least as well with the tail averaging."""
    pytest.importorskip("sklearn")
    from torchspeed import fit
    from torchspeed.bench.workloads import create_model, make_datasets
    from torchspeed.train.evaluate import evaluate

    train, val = make_datasets("digits", image_size=32)
    accs = {}
    for on in (False, True):
        loader = DataLoader(train, batch_size=64, shuffle=True, drop_last=True,
                            generator=torch.Generator().manual_seed(2))
        torch.manual_seed(2)
        model = create_model("resnet20")
        fit(model, loader, epochs=2, max_steps=40, lr=0.1, schedule="onecycle", precision="fp32", channels_last=False,
            compile=False,
            trial=False, progress=False, callbacks=[FinalBatchNormStats()] if on else None)
        accs[on] = evaluate(model, DataLoader(val, batch_size=256))["val_acc"]
    assert accs[True] >= accs[False] - 0.01
    assert accs[True] >= 0.9  # measured 0.96 here; the stale statistics gave 0.74 on this seed


class _NeedsTargetsToTrain(nn.Module):
    """torchvision detection's contract: forward(images, targets=None) asserts targets in train mode."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))

    def forward(self, x, targets=None):
        assert not self.training or targets is not None, "targets should not be none when in training mode"
        out = self.body(x)
        return {"loss": nn.functional.mse_loss(out[:, 0], targets)} if self.training else out


def test_recalibration_hands_the_target_to_a_model_whose_forward_takes_it():
    """Schedule-Free's averaged weights get their BatchNorm statistics from training batches: a detection model
    asserts its targets in train mode, so they are passed as the batch contract passes them."""
    model = _NeedsTargetsToTrain()
    batches = [(torch.randn(6, 4), torch.randn(6)) for _ in range(3)]
    assert recalibrate_bn(model, batches) == 3
    assert model.body[1].num_batches_tracked == 3
