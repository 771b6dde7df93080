import copy

import pytest

import torch

from torchspeed.train import Trainer, TrainConfig
from torchspeed.train.optim_kernel import zero_grad
from torchspeed.train.trial.precision import resolve_precision
from torchspeed.train.loop.step import backward, optimizer_step


def _data(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def test_zero_grad_set_to_none():
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = _data()
    torch.nn.functional.cross_entropy(m(x), y).backward()
    zero_grad(opt)
    assert all(p.grad is None for p in m.parameters())
    torch.nn.functional.cross_entropy(m(x), y).backward()
    zero_grad(opt, set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in m.parameters())


def test_torchs_other_optimizers_clear_their_gradients_without_torchs_zero_grad(monkeypatch):
    """RMSprop (no `LeanStep`): the gradients are set to None as `zero_grad(set_to_none=True)` would, without its
    wrapper; the naive loop (`step_with_torch`), a replaced `zero_grad` and set_to_none=False still call torch's."""
    from torchspeed.train.loop.lean_step import step_with_torch

    calls = []
    torchs = torch.optim.Optimizer.zero_grad
    monkeypatch.setattr(torch.optim.Optimizer, "zero_grad", lambda self, set_to_none=True: (
        calls.append(set_to_none), torchs(self, set_to_none=set_to_none)))
    m = _mlp()
    x, y = _data()

    def grads_then_clear(opt, **kw):
        torch.nn.functional.cross_entropy(m(x), y).backward()
        zero_grad(opt, **kw)

    opt = torch.optim.RMSprop(m.parameters(), lr=0.1)
    grads_then_clear(opt)
    assert all(p.grad is None for p in m.parameters()) and calls == []
    grads_then_clear(opt, set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in m.parameters()) and calls == [False]
    naive = torch.optim.RMSprop(m.parameters(), lr=0.1)
    step_with_torch(naive)
    grads_then_clear(naive)
    assert all(p.grad is None for p in m.parameters()) and calls == [False, True]
    own = torch.optim.RMSprop(m.parameters(), lr=0.1)
    own.zero_grad = lambda set_to_none=True: calls.append("own")
    grads_then_clear(own)
    assert calls[-1] == "own"


def test_accumulation_over_k_micro_batches_equals_one_big_batch():
    x, y = _data(16)
    big = _mlp()
    torch.nn.functional.cross_entropy(big(x), y).backward()
    acc = _mlp()
    for xs, ys in zip(x.chunk(4), y.chunk(4)):
        backward(torch.nn.functional.cross_entropy(acc(xs), ys), accum_steps=4)
    for a, b in zip(acc.parameters(), big.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_trainer_accumulation_matches_big_batch_update():
    x, y = _data(16)
    cfg = dict(precision="fp32", compile=False, schedule=None, progress=False, fused_optimizer=False)
    big = Trainer(_mlp(), optimizer="sgd", lr=0.1, weight_decay=0, device="cpu", config=TrainConfig(**cfg))
    big.train_step((x, y))
    acc = Trainer(_mlp(), optimizer="sgd", lr=0.1, weight_decay=0, device="cpu",
                  config=TrainConfig(grad_accum=4, **cfg))
    for xs, ys in zip(x.chunk(4), y.chunk(4)):
        assert acc.step == 0
        acc.train_step((xs, ys))
    assert acc.step == 1 and big.step == 1
    for a, b in zip(acc.model.parameters(), big.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fp16_scaler_unscales_before_clipping_against_reference():
    x, y = _data(16)
    clip = 0.05
    ref = _mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    ref_opt.step()

    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    backward(torch.nn.functional.cross_entropy(m(x), y), scaler=scaler)
    skipped = optimizer_step(opt, scaler=scaler, clip_grad_norm=clip, parameters=m.parameters())
    assert int(skipped) == 0
    # Had we clipped the *scaled* gradients, the update would be 1024x too small.
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_scaler_skips_overflowing_step_and_counts_it():
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    before = copy.deepcopy(m.state_dict())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    x, y = _data()
    loss = torch.nn.functional.cross_entropy(m(x), y) * float("inf")
    backward(loss, scaler=scaler)
    skipped = optimizer_step(opt, scaler=scaler, clip_grad_norm=1.0, parameters=m.parameters())
    assert int(skipped) == 1
    for k, v in m.state_dict().items():
        torch.testing.assert_close(v, before[k])
    assert scaler.get_scale() < 2.0 ** 10


def test_clipping_bounds_the_gradient_norm_in_the_trainer():
    x, y = _data(16)
    seen = {}

    class Spy(torch.optim.SGD):
        def step(self, closure=None):
            seen["norm"] = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad) for g in self.param_groups for p in g["params"]]))
            return super().step(closure)

    model = _mlp()
    t = Trainer(model, optimizer=Spy(model.parameters(), lr=0.1), device="cpu",
                config=TrainConfig(precision="fp32", compile=False, schedule=None, progress=False, clip_grad_norm=0.01))
    t.train_step((x * 100, y))
    assert float(seen["norm"]) <= 0.01 + 1e-6


def test_accumulation_window_closes_every_k_and_skips_ddp_sync_until_the_last():
    from torchspeed.train.loop.step import AccumulationWindow

    class FakeDDP:
        def __init__(self):
            self.no_sync_calls = 0

        def no_sync(self):
            self.no_sync_calls += 1
            import contextlib
            return contextlib.nullcontext()

    win, ddp = AccumulationWindow(3), FakeDDP()
    closed = []
    for _ in range(6):
        with win.sync(ddp):
            pass
        closed.append(win.advance())
    assert closed == [False, False, True, False, False, True] and ddp.no_sync_calls == 4 and win.at_boundary
    win.advance()
    win.reset()
    assert win.at_boundary
    with pytest.raises(ValueError, match="grad_accum"):
        AccumulationWindow(0)


def test_mixed_precision_owns_its_scaler_and_state():
    from torchspeed.train.trial.precision import MixedPrecision

    fp16 = MixedPrecision(resolve_precision("fp16", device="cpu"))
    assert fp16.scaler is not None and fp16.name == "fp16"
    state = fp16.state_dict()
    state["scale"] = 1024.0
    fp16.load_state_dict(state)
    assert fp16.scaler.get_scale() == 1024.0
    bf16 = MixedPrecision(resolve_precision("bf16", device="cpu"))
    assert bf16.scaler is None and bf16.state_dict() is None
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bf16.autocast():
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    bf16.backward(loss)
    before = model.weight.detach().clone()
    assert int(bf16.step(opt, clip_grad_norm=1.0, parameters=model.parameters())) == 0
    assert not torch.equal(before, model.weight)
