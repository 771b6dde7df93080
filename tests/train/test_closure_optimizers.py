"""An optimizer whose `step` needs a closure (`torch.optim.LBFGS`) trains under `fit` as it does in its own loop:
the closure returns the loss already computed on the batch, then re-evaluates the same batch. Nothing is timed."""

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
