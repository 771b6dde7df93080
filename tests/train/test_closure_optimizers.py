"""An optimizer whose `step` needs a closure (`torch.optim.LBFGS`; SAM, an optimizer of the script's own) trains under
`fit` as it does in its own loop: the closure returns the loss already computed on the batch while the weights are
those it was computed at, else re-evaluates the same batch. Nothing is timed."""

import importlib.util

import torch
from torch import nn

import torchspeed
from torchspeed.train.loop.step import closure_for, needs_closure


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 3, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([[1.5], [-2.0], [0.5]], dtype=torch.float64) + 0.1
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    return model, x, y


def test_which_optimizers_need_a_closure():
    p = [nn.Parameter(torch.zeros(2))]
    assert needs_closure(torch.optim.LBFGS(p))
    assert not any(needs_closure(o) for o in (torch.optim.SGD(p, lr=0.1), torch.optim.AdamW(p)))
    assert closure_for(torch.optim.SGD(p, lr=0.1), torch.zeros(()), lambda: torch.zeros(())) is None


def test_the_closure_returns_the_batchs_loss_first_then_recomputes_it():
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.LBFGS([p])
    calls = []
    closure = closure_for(opt, torch.tensor(3.0), lambda: calls.append(1) or (p ** 2).sum())
    assert closure().item() == 3.0 and calls == []
    p.grad = torch.ones(2)
    assert closure().item() == 2.0 and calls == [1] and p.grad is None  # the gradients zeroed first


def test_fit_with_lbfgs_follows_its_own_closure_loop():
    model, x, y = _problem()
    hand = _problem()[0]
    opt = torch.optim.LBFGS(hand.parameters(), lr=0.8)
    for _ in range(4):
        def closure():
            opt.zero_grad()
            loss = nn.functional.mse_loss(hand(x), y)
            loss.backward()
            return loss
        opt.step(closure)
    res = torchspeed.fit(model, [(x, y)], optimizer=torch.optim.LBFGS(model.parameters(), lr=0.8),
                         loss_fn=nn.MSELoss(), epochs=4, progress=False, trial=False, compile=False, precision="fp32")
    assert res.steps == 4
    for a, b in zip(model.parameters(), hand.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    start = nn.functional.mse_loss(_problem()[0](x), y).item()
    assert nn.functional.mse_loss(model(x), y).item() < 0.1 * start  # it learned, as LBFGS does on this


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation, as its reference implementation writes it: the gradient at a nearby point."""

    def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is not None, "Sharpness Aware Minimization requires closure, but it was not provided"
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.norm(torch.stack([p.grad.norm(2) for p in params]), 2)
        moved = [p.grad * (self.param_groups[0]["rho"] / (norm + 1e-12)) for p in params]
        for p, e in zip(params, moved):
            p.add_(e)
        self.zero_grad()
        torch.enable_grad()(closure)()
        for p, e in zip(params, moved):
            p.sub_(e)
        self.base_optimizer.step()


def test_an_optimizer_of_the_scripts_own_that_takes_a_closure_gets_one_that_recomputes_after_it_moved():
    """SAM's step asserts it is given a closure (fit called `step()` bare: AssertionError on the first step), and
    the closure's gradient must be the one at the point SAM moved to (a cached first call would hand it the
    gradient it had zeroed). fit ends with the weights of SAM's own loop; torch's, Schedule-Free's and timm's
    optimizers still step without one (their lean steps stay)."""
    p = [nn.Parameter(torch.zeros(2))]
    assert needs_closure(SAM(p, torch.optim.SGD, lr=0.1))

    class Renamed(torch.optim.SGD):  # the script's own class, torch's step: steps on its gradients as before
        pass
    assert not needs_closure(Renamed(p, lr=0.1))
    if importlib.util.find_spec("schedulefree") is not None:  # the [schedulefree] extra: its lean step stays
        import schedulefree
        assert not needs_closure(schedulefree.AdamWScheduleFree(p))
    model, x, y = _problem()
    hand = _problem()[0]
    opt = SAM(hand.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
    for _ in range(5):
        def closure():
            loss = nn.functional.mse_loss(hand(x), y)
            loss.backward()
            return loss
        closure()
        opt.step(closure)
        opt.zero_grad()
    res = torchspeed.fit(model, [(x, y)], optimizer=SAM(model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9),
                         loss_fn=nn.MSELoss(), epochs=5, progress=False, trial=False, compile=False, precision="fp32")
    assert res.steps == 5
    for a, b in zip(model.parameters(), hand.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_the_first_call_recomputes_once_a_weight_was_written():
    p = nn.Parameter(torch.ones(2))
    closure = closure_for(torch.optim.LBFGS([p]), torch.tensor(3.0), lambda: (p ** 2).sum())
    with torch.no_grad():
        p.mul_(2.0)  # the step moved the weights before its first evaluation
    assert closure().item() == 8.0
