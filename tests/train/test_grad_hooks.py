"""What runs between the backward and the optimizer's step: `clip_grad_value` and a callback's
`on_before_optimizer_step` (a script that calls `clip_grad_value_`, logs a gradient norm or changes the
gradients before `opt.step()` ports to `fit` with them)."""
import pytest
import torch
from torch import nn

import torchspeed
from torchspeed.train import Callback, Trainer, TrainConfig
from torchspeed.train.loop.step import backward, optimizer_step


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batches(n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g) * 50, torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def _plain(model, batches, *, value=None, norm=None, lr=0.1):
    """The script's own loop: forward, loss, backward, clip, step, zero_grad."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        nn.functional.cross_entropy(model(x), y).backward()
        if value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), value)
        if norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), norm)
        opt.step()
        opt.zero_grad()
    return model


def _fit(model, batches, lr=0.1, **kw):
    opts = dict(precision="fp32", channels_last=False, compile=False, progress=False)
    torchspeed.fit(model, batches, optimizer=torch.optim.SGD(model.parameters(), lr=lr), **{**opts, **kw})
    return model


def _same(a, b):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_clip_grad_value_in_fit_equals_the_scripts_clip_grad_value():
    batches = _batches()
    ref = _plain(_mlp(), batches, value=0.05)
    _same(_fit(_mlp(), batches, clip_grad_value=0.05), ref)
    unclipped = _plain(_mlp(), batches)  # the inputs are large: clipping changes the weights
    assert any(not torch.equal(p, q) for p, q in zip(ref.parameters(), unclipped.parameters()))


def test_value_then_norm_as_a_script_writes_them():
    batches = _batches()
    ref = _plain(_mlp(), batches, value=0.05, norm=0.1)
    _same(_fit(_mlp(), batches, clip_grad_value=0.05, clip_grad_norm=0.1), ref)


def test_clip_grad_value_under_the_fp16_scaler_clips_the_unscaled_gradients():
    x, y = _batches(1)[0]
    ref = _mlp()
    nn.functional.cross_entropy(ref(x), y).backward()
    torch.nn.utils.clip_grad_value_(ref.parameters(), 0.01)
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    backward(nn.functional.cross_entropy(m(x), y), scaler=scaler)
    assert int(optimizer_step(opt, scaler=scaler, clip_grad_value=0.01)) == 0
    for a, b in zip(m.parameters(), ref.parameters()):  # clipped scaled values would be 1024x too small a step
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class GradNoiseAndNorms(Callback):
    """Reads the gradients (a norm to log) and changes them in place, before the step and its clipping."""

    def __init__(self):
        self.norms, self.optimizers = [], []

    def on_before_optimizer_step(self, trainer, optimizer):
        self.optimizers.append(optimizer)
        grads = [p.grad for p in trainer.module.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        for g in grads:
            g.mul_(0.5)


def test_on_before_optimizer_step_sees_the_gradients_before_clipping_and_its_changes_train():
    batches = _batches()
    ref, norms = _mlp(), []
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches:
        nn.functional.cross_entropy(ref(x), y).backward()
        norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()]))))
        for p in ref.parameters():
            p.grad.mul_(0.5)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.2)
        opt.step()
        opt.zero_grad()
    cb = GradNoiseAndNorms()
    model = _fit(_mlp(), batches, clip_grad_norm=0.2, callbacks=[cb])
    _same(model, ref)
    assert cb.norms == pytest.approx(norms, rel=1e-6) and max(cb.norms) > 0.4  # unclipped: the hook runs first
    assert len(cb.optimizers) == len(batches)


def test_on_before_optimizer_step_runs_once_per_accumulation_window():
    cb = GradNoiseAndNorms()
    model = _mlp()
    t = Trainer(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), device="cpu", callbacks=[cb],
                config=TrainConfig(precision="fp32", compile=False, schedule=None, progress=False, grad_accum=3))
    for b in _batches(6):
        t.train_step(b)
    assert len(cb.norms) == 2 and t.step == 2
    assert cb.optimizers[0] is t.optimizer


def test_no_hook_and_no_clipping_pass_nothing_to_the_step():
    model = _mlp()
    t = Trainer(model, device="cpu", config=TrainConfig(precision="fp32", compile=False, progress=False))
    assert t.step_options() == {}
    t.config.clip_grad_value = 1.0
    assert set(t.step_options()) == {"clip_grad_norm", "clip_grad_value", "parameters"}


@pytest.mark.parametrize("bad", [0, -1.0, "1", True])
def test_a_clip_that_cannot_be_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="clip_grad_value must be a number > 0"):
        _fit(_mlp(), _batches(1), clip_grad_value=bad)


def test_other_trainers_names_point_to_the_option():
    with pytest.raises(TypeError, match=r"gradient_clip_algorithm -> clip_grad_value=V \(value\)"):
        _fit(_mlp(), _batches(1), gradient_clip_algorithm="value")  # Lightning's
    with pytest.raises(TypeError, match="clipvalue -> clip_grad_value"):
        _fit(_mlp(), _batches(1), clipvalue=1.0)  # Keras's
