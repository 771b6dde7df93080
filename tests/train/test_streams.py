"""A loader without len() (an IterableDataset, a stream) is bounded by max_steps: the schedule spans those steps,
so the stream is read again, pass after pass, until they are taken; an iterator read once that runs out first
ends the run with a warning that says so. Nothing is timed."""

import logging

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import torchspeed


class Stream(IterableDataset):
    def __init__(self, n=400):
        self.n = n

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(self.n):
            x = torch.randn(8, generator=g)
            yield x, (x.sum() > 0).long()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _quiet(**kw):
    return dict(progress=False, trial=False, compile=False, precision="fp32", **kw)


def test_a_stream_is_read_again_until_max_steps_and_its_schedule_ends():
    res = torchspeed.fit(_model(), DataLoader(Stream(), batch_size=20), max_steps=50, optimizer="sgd", **_quiet())
    assert res.steps == 50  # 20 batches a pass: 20 + 20 + 10
    assert [row["step"] for row in res.history] == [20, 40, 50]
    assert res.decisions["schedule"].value == "onecycle"
    assert res.history[-1]["lr"] < 0.01 * max(row["lr"] for row in res.history)  # the cycle ran to its end


def test_a_generator_that_runs_out_before_max_steps_ends_the_run_and_says_so(caplog):
    def batches():
        g = torch.Generator().manual_seed(0)
        for _ in range(12):
            x = torch.randn(20, 8, generator=g)
            yield x, (x.sum(1) > 0).long()

    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        res = torchspeed.fit(_model(), batches(), max_steps=30, optimizer="adamw", lr=1e-2, **_quiet())
    assert res.steps == 12 and len(res.history) == 1
    assert any("ran out after 12 optimizer steps, before max_steps=30" in r.getMessage() for r in caplog.records)
