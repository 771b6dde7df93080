"""The model a Schedule-Free run hands back is the one it evaluated and saved (T14's alternative, restore_best).

Schedule-Free AdamW trains one sequence of weights (y) and is judged by another (its average x, reached with
`optimizer.eval()`). `fit` evaluates and saves x; these tests check that the model left in the user's hands after
`fit` is x too (the last epoch's, or the best epoch's with `restore_best`), and that a second `fit` on the same
Trainer trains y again.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchspeed import Trainer, TrainConfig
from torchspeed.train.loop.callbacks import Callback
from torchspeed.train.evaluate import evaluate

pytest.importorskip("schedulefree")


def _data(seed=0, n=256):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :2].sum(1) > 0).long() + (x[:, 2] > 1).long()
    return x, y


def _model(bn=False):
    torch.manual_seed(0)
    layers = [nn.Linear(8, 32)] + ([nn.BatchNorm1d(32)] if bn else []) + [nn.ReLU(), nn.Linear(32, 3)]
    return nn.Sequential(*layers)


def _trainer(model, **cfg):
    config = TrainConfig(progress=False, compile=False, precision="fp32", channels_last=False, **cfg)
    return Trainer(model, optimizer="schedulefree", lr=0.05, config=config)


def _loaders():
    x, y = _data()
    vx, vy = _data(seed=1, n=128)
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=g), \
        DataLoader(TensorDataset(vx, vy), batch_size=64)


def _val_loss(model, val):
    return evaluate(model, val, device="cpu")["val_loss"]


@pytest.mark.parametrize("bn", [False, True])
def test_the_model_after_fit_holds_the_weights_its_last_evaluation_scored(bn):
    model = _model(bn)
    train, val = _loaders()
    res = _trainer(model, restore_best=False).fit(train, epochs=3, val_loader=val)
    assert not res.decisions.get("restored_best")
    # the training iterate y scores differently: the model must hold the averaged weights x the run evaluated
    assert _val_loss(model, val) == pytest.approx(res.history[-1]["val_loss"], rel=1e-5, abs=1e-6)


def test_restore_best_gives_back_the_best_epochs_evaluated_weights():
    model = _model()
    train, val = _loaders()
    res = _trainer(model, restore_best=True, best_metric="val_loss").fit(train, epochs=4, val_loader=val)
    best = min(res.history, key=lambda r: r["val_loss"])
    assert res.decisions["restored_best"].value.startswith(f"epoch {best['epoch']} of 4")
    # before: the best epoch's training iterate was copied, and it scored worse than the epoch's evaluation
    assert _val_loss(model, val) == pytest.approx(best["val_loss"], rel=1e-5, abs=1e-6)


class _Modes(Callback):
    """Schedule-Free's mode at every optimizer step: True when it trains its training iterate."""

    def __init__(self):
        self.modes = []

    def on_step_end(self, trainer):
        self.modes.append(trainer.optimizer.param_groups[0]["train_mode"])


def test_a_second_fit_trains_the_training_iterate_again():
    model = _model()
    train, val = _loaders()
    modes = _Modes()
    config = TrainConfig(progress=False, compile=False, precision="fp32", channels_last=False, restore_best=False)
    t = Trainer(model, optimizer="schedulefree", lr=0.05, config=config, callbacks=[modes])
    first = t.fit(train, epochs=1, val_loader=val).history[-1]["val_loss"]
    assert t.optimizer.param_groups[0]["train_mode"] is False  # the averaged weights, in the user's hands
    res = t.fit(train, epochs=2, val_loader=val)
    assert len(modes.modes) == 3 * 8 and all(modes.modes)  # every step of both fits trained in train mode
    assert t.optimizer.param_groups[0]["train_mode"] is False
    assert _val_loss(model, val) == pytest.approx(res.history[-1]["val_loss"], rel=1e-5, abs=1e-6)
    assert res.history[-1]["val_loss"] < first  # it trained on from where it was


def test_the_end_of_fit_recalibrates_only_when_a_step_came_after_the_last_evaluation(monkeypatch):
    """An evaluation at the run's last step left the averaged weights' BatchNorm statistics in place: the end of
    `fit` does not recompute them (before, every run with BatchNorm paid one more pass at the end). A run with no
    evaluation at its last step recalibrates once, at the end."""
    import torchspeed.train.eval_view as eval_view

    calls = []
    real = eval_view.recalibrate_bn
    monkeypatch.setattr(eval_view, "recalibrate_bn", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = _model(bn=True)
    train, val = _loaders()
    res = _trainer(model, restore_best=False).fit(train, epochs=3, val_loader=val)
    assert len(calls) == 3  # one per evaluation, none at the end
    assert _val_loss(model, val) == pytest.approx(res.history[-1]["val_loss"], rel=1e-5, abs=1e-6)
    calls.clear()
    _trainer(_model(bn=True), restore_best=False).fit(train, epochs=2)
    assert len(calls) == 1  # no evaluation: the end of fit


def test_a_step_fn_that_steps_its_own_optimizer_inside_keeps_its_trained_statistics_and_the_run_finishes(caplog):
    """A GAN's step_fn steps the discriminator itself (backward inside): it cannot run as the gradient-free
    forward that recalibrates Schedule-Free's BatchNorm statistics. The statistics from training stay (put back
    whole, not half reset), the step_fn's own state is as the run left it, and the run finishes, said once."""
    pytest.importorskip("schedulefree")
    import torchspeed

    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8))
    disc = nn.Linear(8, 1)
    state = {"d_steps": 0}
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.01)

    def step_fn(model, batch):
        fake = model(batch[0])
        opt_d.zero_grad()
        disc(fake.detach()).mean().backward()
        opt_d.step()
        state["d_steps"] += 1
        return -disc(fake).mean()

    batches = [(torch.randn(16, 4),) for _ in range(6)]
    with caplog.at_level("WARNING", logger="torchspeed"):
        res = torchspeed.fit(gen, batches, step_fn=step_fn, optimizer="schedulefree", lr=1e-3, epochs=1,
                             progress=False, compile=False, precision="fp32")
    assert res.steps == 6 and state["d_steps"] == 6
    bn = gen[1]
    assert int(bn.num_batches_tracked) == 6 and torch.isfinite(bn.running_var).all()
    assert any("kept from training" in r.getMessage() for r in caplog.records)
