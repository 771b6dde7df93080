"""The switch trial's turns timed apart (train/shadow.py): paced so that at any moment of the run they have cost
at most SHADOW_SHARE of its seconds, never so late that the trial cannot finish, the run's numerics untouched; a
trial cut short by the run's end is not cached.

Seconds come from an injected clock that a forward pass advances by one second: nothing here reads the wall clock.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchspeed.env import DeviceCaps
from torchspeed.train import shadow as shadow_mod
from torchspeed.train.callbacks import Callback
from torchspeed.train.config import TrainConfig
from torchspeed.train.shadow import ShadowTurns
from torchspeed.train.trainer import Trainer

BF16_CPU = DeviceCaps("cpu", cpu_bf16=True, cores=2)


class Tick(nn.Module):
    """Advances the clock by one second per forward: a plain step, or a candidate's forward, costs 1 s."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    def forward(self, x):
        if self.clock is not None:
            self.clock.advance(1.0)
        return x


def _model(clock):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4),
                         Tick(clock))


def _loader(steps):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16 * steps, 8, generator=g), torch.randint(0, 4, (16 * steps,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(2))


def _trainer(clock, *, trial=True, callbacks=None):
    cfg = dict(epochs=1, progress=False, compile=False, fused_optimizer=False, trial=trial,
               precision="auto" if trial else "fp32")
    t = Trainer(_model(clock), optimizer="sgd", lr=0.05, config=TrainConfig(**cfg), caps=BF16_CPU,
                callbacks=callbacks)
    if trial:  # fp32 wins (median 1.2 against 1.25): the run keeps the plain numerics; the two overlap, so every
        seconds = {"fp32": [1.0, 1.4], "bf16": [1.3, 1.2]}  # bf16 turn is taken (none is beaten on all its steps)
        count = {"fp32": 0, "bf16": 0}

        def measure(s, sec):
            p = s.label().split("+")[0]
            count[p] += 1
            return seconds[p][count[p] % 2]
        t.switcher.measure_fn = measure
    return t


def _spy_turns(monkeypatch, clock):
    """Each timed-apart turn's (turn number, seconds since the trial began) as it starts."""
    seen, real = [], ShadowTurns.step

    def step(self, batch, run_step, cand):
        seen.append((len(seen) + 1, clock.now - self.started))
        return real(self, batch, run_step, cand)

    monkeypatch.setattr(ShadowTurns, "step", step)
    return seen


@pytest.mark.paced
def test_turns_timed_apart_are_paced_and_the_run_is_the_plain_runs(monkeypatch, fake_clock):
    """Each turn (1 s of thrown-away forward) starts only once the turns so far and it are within 5% of the seconds
    since the trial began; the steps between them train in the plain settings, so the run ends as the run with no
    trial, bit for bit; the trial still decides within the run."""
    for mod in ("torchspeed.train.shadow", "torchspeed.train.autoswitch"):
        monkeypatch.setattr(f"{mod}.time", fake_clock)
    seen = _spy_turns(monkeypatch, fake_clock)
    paced = _trainer(fake_clock)
    torch.manual_seed(3)
    res = paced.fit(_loader(300))
    plain = _trainer(None, trial=False)
    torch.manual_seed(3)
    plain.fit(_loader(300))

    trial = res.decisions["switch_trial"]
    assert trial.value == "measured" and res.decisions["precision"].value == "fp32"
    assert trial.measured["shadow_steps"] == len(seen) == 7  # bf16's warm-up and 3 rounds x 2 timed turns
    assert trial.measured["paced_steps"] > 100 and "paced over" in trial.reason
    for k, elapsed in seen:  # k turns of 1 s, each within SHADOW_SHARE of the run's seconds when it started
        assert k * 1.0 <= shadow_mod.SHADOW_SHARE * elapsed + 1e-9, (k, elapsed)
    assert seen[0][1] >= 1.0 / shadow_mod.SHADOW_SHARE  # the first waits too: a plain step's cost is its estimate
    for k, v in plain.module.state_dict().items():
        assert torch.equal(paced.module.state_dict()[k], v), k


@pytest.mark.paced
def test_a_run_too_short_to_wait_runs_its_turns_in_time_to_decide(monkeypatch, fake_clock):
    """A run of known length waits only while its remaining steps exceed the trial's remaining turns: a 24-step
    run's trial finishes (every bf16 turn taken), however far behind the 5% its turns fall."""
    for mod in ("torchspeed.train.shadow", "torchspeed.train.autoswitch"):
        monkeypatch.setattr(f"{mod}.time", fake_clock)
    seen = _spy_turns(monkeypatch, fake_clock)
    res = _trainer(fake_clock).fit(_loader(24))
    trial = res.decisions["switch_trial"]
    assert trial.value == "measured" and len(seen) == trial.measured["shadow_steps"] >= 2
    first = trial.measured["stages"][0]
    assert any(k.startswith("bf16") for k in first["seconds_per_step"])  # timed: the run did not end the trial first
    assert any(k * 1.0 > shadow_mod.SHADOW_SHARE * elapsed for k, elapsed in seen)  # late turns did not wait


@pytest.mark.paced
def test_unpaced_turns_run_back_to_back(monkeypatch, fake_clock):
    """The control: with pacing off (an infinite share) the same run takes its turns in its first steps."""
    for mod in ("torchspeed.train.shadow", "torchspeed.train.autoswitch"):
        monkeypatch.setattr(f"{mod}.time", fake_clock)
    monkeypatch.setattr(shadow_mod, "SHADOW_SHARE", float("inf"))
    seen = _spy_turns(monkeypatch, fake_clock)
    res = _trainer(fake_clock).fit(_loader(300))
    assert len(seen) == 7 and "paced_steps" not in res.decisions["switch_trial"].measured
    assert seen[-1][1] < 40  # all within the trial's first 14 turns (plus their forwards)


class StopAt(Callback):
    def __init__(self, step):
        self.at = step

    def on_step_end(self, trainer):
        if trainer.step >= self.at:
            trainer.request_stop("test")


def test_a_trial_cut_short_by_the_runs_end_is_not_cached(tmp_path, monkeypatch):
    """A callback that stops the run inside the trial: the run decides on what was measured, and the next run
    measures again instead of reading a half-measured trial."""
    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    values = []
    for stop in (3, None):  # real timings (an injected one bypasses the cache): only what is cached is asserted
        t = Trainer(_model(None), optimizer="sgd", lr=0.05, caps=BF16_CPU,
                    config=TrainConfig(epochs=1, progress=False, compile=False, fused_optimizer=False, trial=True),
                    callbacks=[StopAt(stop)] if stop else None)
        values.append(t.fit(_loader(300)).decisions["switch_trial"].value)
    assert values == ["measured", "measured"]  # the second run measured: nothing was cached by the first
