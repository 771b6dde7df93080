"""Batch-size warm-up (train/batch_ramp.py, T17): growing batches, their LR, and fit's schedule over them."""

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler, TensorDataset

import torchspeed
from torchspeed.train import BatchRamp, BatchRampLR, Callback, ResumableSampler
from torchspeed.train.schedule import lr_rule


def _ramp(n=1000, **kw):
    opts = {"start": 16, "end": 64, "ramp_samples": 1000} | kw
    return BatchRamp(SequentialSampler(range(n)), **opts)


def test_batches_grow_from_start_to_end_and_cover_every_sample_once_per_pass():
    ramp = _ramp(n=1000, ramp_samples=1500)
    first = list(ramp)
    sizes = [len(b) for b in first]
    assert sizes[0] == 16 and sizes == sorted(sizes[:-1]) + sizes[-1:]  # non-decreasing (the last is the remainder)
    assert all(s % 8 == 0 for s in sizes[:-1])
    assert sorted(i for b in first for i in b) == list(range(1000))
    assert len(first) == len(_ramp(n=1000, ramp_samples=1500))  # len() is the pass's true count
    second = [len(b) for b in ramp]  # the next pass continues the ramp (samples 1000..1999): it reaches 64
    assert second[0] > sizes[-2] and second[-2] == 64
    assert ramp.batches_in(2) == len(first) + len(second)


def test_sizes_are_a_function_of_the_epoch_so_a_resumed_run_sees_the_same_batches():
    a, b = _ramp(ramp_samples=2500), _ramp(ramp_samples=2500)
    list(a), list(a)  # two passes
    b.set_epoch(2)
    assert a.sizes() == b.sizes() == a.sizes(2)
    assert [len(x) for x in a] == [len(x) for x in b]


def test_set_epoch_reaches_the_inner_sampler_so_a_shuffled_order_is_reproducible():
    ds = range(200)
    a = BatchRamp(ResumableSampler(ds, seed=3), start=8, end=32, ramp_samples=100)
    b = BatchRamp(ResumableSampler(ds, seed=3), start=8, end=32, ramp_samples=100)
    a.set_epoch(1), b.set_epoch(1)
    assert list(a) == list(b)
    b.set_epoch(2)
    assert list(b) != list(BatchRamp(ResumableSampler(ds, seed=3), start=8, end=32, ramp_samples=100))


def test_drop_last_drops_the_short_final_batch():
    ramp = _ramp(n=100, start=16, end=16, ramp_samples=0, drop_last=True)
    assert [len(b) for b in ramp] == [16] * 6


def test_lr_factor_follows_the_batch_linear_for_sgd_and_square_root_for_adam():
    ramp = _ramp(n=1000, start=16, end=64, ramp_samples=10_000)
    assert ramp.lr_factor(0, "linear") == pytest.approx(16 / 64)
    assert ramp.lr_factor(0, "sqrt") == pytest.approx(math.sqrt(16 / 64))
    late = ramp.batches_in(20)  # well past the ramp
    assert ramp.lr_factor(late, "linear") == 1.0
    w = [nn.Parameter(torch.zeros(2))]
    assert lr_rule(torch.optim.SGD(w, lr=0.1)) == "linear" and lr_rule(torch.optim.AdamW(w)) == "sqrt"
    with pytest.raises(ValueError, match="rule"):
        ramp.lr_factor(0, "cubic")


def test_from_noise_scale_ends_at_the_critical_batch_within_limits():
    s = SequentialSampler(range(100))
    assert BatchRamp.from_noise_scale(s, 203.7, start=32, max_batch=512, ramp_samples=10).end == 200
    assert BatchRamp.from_noise_scale(s, 5000.0, start=32, max_batch=512, ramp_samples=10).end == 512
    assert BatchRamp.from_noise_scale(s, 3.0, start=32, max_batch=512, ramp_samples=10).end == 32
    assert BatchRamp.from_noise_scale(s, float("inf"), start=32, max_batch=512, ramp_samples=10).end == 32


@pytest.mark.parametrize("kw, match", [({"start": 0}, "start"), ({"start": 65}, "start"),
                                       ({"ramp_samples": -1}, "ramp_samples")])
def test_bad_settings_are_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        _ramp(**kw)


class _Record(Callback):
    def __init__(self):
        self.lrs, self.sizes = [], []

    def on_step_end(self, trainer):
        self.lrs.append(trainer.optimizer.param_groups[0]["lr"])


def _data(n=384, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return TensorDataset(x, y)


def _fit(loader, *, schedule, callbacks=(), epochs=2, seed=0, lr=0.2):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    res = torchspeed.fit(model, loader, epochs=epochs, lr=lr, schedule=schedule, callbacks=list(callbacks),
                         progress=False, precision="fp32", compile=False, channels_last=False)
    return model, res


def test_fit_scales_each_steps_lr_to_its_batch_and_counts_the_ramps_true_steps():
    ds = _data()
    ramp = BatchRamp(SequentialSampler(ds), start=16, end=64, ramp_samples=384)
    rec = _Record()
    _, res = _fit(DataLoader(ds, batch_sampler=ramp), schedule="constant", callbacks=[rec])
    assert res.steps == ramp.batches_in(2) == len(rec.lrs)
    # the recorder runs before the ramp's callback: it sees the LR step i trained with, base LR x the size of
    # batch i / end (SGD: the linear rule)
    expected = [0.2 * ramp.size_of_batch(i) / 64 for i in range(res.steps)]
    assert rec.lrs == pytest.approx(expected)
    assert rec.lrs[0] < rec.lrs[-1] == pytest.approx(0.2)
    assert res.decisions["batch_ramp"]["value"] == "16->64" and "linear" in res.decisions["batch_ramp"]["reason"]


def test_with_a_schedule_the_factor_multiplies_the_scheduled_lr_over_the_ramps_length():
    ds = _data()
    ramp = BatchRamp(SequentialSampler(ds), start=16, end=64, ramp_samples=384)
    rec, own = _Record(), BatchRampLR(ramp)
    _, res = _fit(DataLoader(ds, batch_sampler=ramp), schedule="cosine", callbacks=[own, rec])
    total = ramp.batches_in(2)
    assert res.steps == total
    # the user's own BatchRampLR is the one used (not a second one); the recorder runs after it and sees the
    # LR of step i + 1: the schedule's value over the ramp's own number of steps x batch i + 1's factor
    from torchspeed.train.schedule import warmup_cosine_factor
    warm = max(1, total // 20)
    sched = [0.2 * warmup_cosine_factor(i + 1, total_steps=total, warmup_steps=warm) for i in range(total)]
    pairs = [(lr / s, ramp.lr_factor(i + 1)) for i, (lr, s) in enumerate(zip(rec.lrs, sched)) if s > 1e-9]
    assert len(pairs) >= total - 2
    assert [p[0] for p in pairs] == pytest.approx([p[1] for p in pairs])


def test_training_with_a_ramp_still_converges_as_a_fixed_batch_does():
    ds, val = _data(seed=0), _data(n=512, seed=1)
    ramp = BatchRamp(RandomSampler(ds, generator=torch.Generator().manual_seed(0)), start=16, end=64,
                     ramp_samples=384)
    m_ramp, _ = _fit(DataLoader(ds, batch_sampler=ramp), schedule="onecycle", epochs=6)
    m_fixed, _ = _fit(DataLoader(ds, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0)),
                      schedule="onecycle", epochs=6)
    x, y = val.tensors

    def acc(m):
        with torch.no_grad():
            return (m(x).argmax(1) == y).float().mean().item()

    assert acc(m_fixed) > 0.9
    assert acc(m_ramp) >= acc(m_fixed) - 0.03


def test_an_own_loop_uses_the_ramp_and_its_factor_without_the_trainer():
    ds = _data(n=200)
    ramp = BatchRamp(SequentialSampler(ds), start=8, end=32, ramp_samples=200)
    loader = DataLoader(ds, batch_sampler=ramp)
    seen = [len(y) for _, y in loader] + [len(y) for _, y in loader]
    assert seen == [ramp.size_of_batch(i) for i in range(len(seen))]
    assert isinstance(BatchRampLR(ramp), Callback)
