"""A half precision the run did not ask for gives way to fp32 when its gradients break (train/trial/half_fallback.py).

The model's backward overflows only under bf16 autocast (a custom Function whose gradient is inf for a bf16 input),
so its loss stays finite and the loss check alone never sees it. The bf16 CPU is injected (`DeviceCaps`): the
same path on every CPU. Nothing is timed."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchspeed.env import DeviceCaps
from torchspeed.train.config import TrainConfig
from torchspeed.train.decision import TrialCache
from torchspeed.train.trial import switch_choice
from torchspeed.train.trial.half_fallback import grads_nonfinite
from torchspeed.train.loop.trainer import Trainer

BF16_CPU = DeviceCaps("cpu", cpu_bf16=True, cores=2)


class OverflowsInBf16(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.half = x.dtype == torch.bfloat16
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf") if ctx.half else grad


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(OverflowsInBf16.apply(self.a(x))))


def _loader():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 8, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)


def _trainer(precision):
    return Trainer(Net(), optimizer="sgd", lr=0.05, caps=BF16_CPU,
                   config=TrainConfig(epochs=1, progress=False, compile=False, trial=False, precision=precision))


def test_chosen_bf16_whose_gradients_break_falls_back_to_fp32_and_the_weights_stay_finite(caplog, monkeypatch):
    monkeypatch.setattr(switch_choice, "SMALL_PRODUCTS", 0)  # the rule takes bf16 for this small net too
    t = _trainer("auto")
    assert t.decisions["precision"].value == "bf16"  # the rules' choice on a bf16 CPU: not asked for
    res = t.fit(_loader())
    assert all(torch.isfinite(p).all() for p in t.module.parameters())
    assert res.skipped_steps == 1 and res.steps == 6  # the first step's update skipped, the other 5 in fp32
    dec = res.decisions["precision"]
    assert dec.value == "fp32" and "non-finite gradients at step 1" in dec.reason and dec["refines"]["value"] == "bf16"
    assert "the run goes on in fp32" in caplog.text
    assert "had a NaN/inf loss" not in caplog.text  # the loss was finite: the end-of-run count is the loss's alone


@pytest.mark.parametrize("asked", ["bf16", "bf16-mixed"])
def test_bf16_asked_for_is_kept_and_only_the_loss_check_guards_it(asked):
    t = _trainer(asked)
    res = t.fit(_loader())
    assert res.decisions["precision"].value == "bf16" and t.precision.name == "bf16"
    assert not all(torch.isfinite(p).all() for p in t.module.parameters())  # the user's choice, as before


def test_grads_nonfinite_reads_dense_gradients():
    p, q = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p, q], lr=0.1)
    assert not grads_nonfinite(opt)  # no gradients yet
    p.grad, q.grad = torch.ones(3), torch.zeros(2)
    assert not grads_nonfinite(opt)
    q.grad[1] = float("nan")
    assert grads_nonfinite(opt)


def test_a_cached_bf16_choice_whose_gradients_broke_is_cached_as_fp32_so_the_next_run_loses_no_step(monkeypatch):
    """A trial cache hit chose bf16 (not asked for); its gradients break at the first step: the run falls back and
    rewrites the entry, so the next run of the same model starts in fp32, says why, and skips nothing."""
    hit = {"switches": {"precision": "bf16", "channels_last": False, "fused": None, "threads": None}, "steps": 9,
           "stages": [{"stage": "precision x layout", "chosen": "bf16", "why": "1.20x the plain settings"}],
           "extra_s": 0.1}
    store = {}
    monkeypatch.setattr(TrialCache, "get", lambda self, key: copy.deepcopy(store.get(key, hit)))
    monkeypatch.setattr(TrialCache, "put", lambda self, key, value: store.__setitem__(key, value))

    def run():
        t = Trainer(Net(), optimizer="sgd", lr=0.05, caps=BF16_CPU,
                    config=TrainConfig(epochs=1, progress=False, compile=False, precision="auto"))
        return t.fit(_loader())

    first = run()
    assert first.decisions["switch_trial"].value == "cached" and first.skipped_steps == 1
    (entry,) = store.values()
    assert entry["switches"]["precision"] == "fp32" and "non-finite gradients at step 1" in entry["half_broke"]
    second = run()
    assert second.decisions["switch_trial"].value == "cached" and second.skipped_steps == 0 and second.steps == 6
    dec = second.decisions["precision"]
    assert dec.value == "fp32" and "an earlier run's bf16" in dec.reason
