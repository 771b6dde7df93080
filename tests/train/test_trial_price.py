"""The switch trial's price (switches.LiveTrial._price, shadow.ShadowTurns): what a trial that finds nothing costs,
all of it counted, and a run given its own LR (a ported loop) that spends at most `PORTED_TRIAL_SHARE` of its
seconds on it, so that `fit` as ported is never much slower than the loop it replaces.

Step times are injected (`measure_fn`): nothing here depends on the wall clock or the machine's load.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.env import DeviceCaps
from torchspeed.plan import planner
from torchspeed.train.trial.autoswitch import SwitchStage
from torchspeed.train.config import TrainConfig
from torchspeed.train.trial.switch_choice import Switches
from torchspeed.train.trial.switches import LiveTrial
from torchspeed.train.loop.trainer import Trainer

BF16_CPU = DeviceCaps("cpu", cpu_bf16=True, cores=2)
GRID = [Switches("fp32", False, None), Switches("fp32", True, None), Switches("bf16", False, None),
        Switches("bf16", True, None)]


def _first_look(apart: bool, run_steps: int) -> dict:
    """A trial of the 4-setting grid whose plain settings' first two steps took 10 ms each (a warm process)."""
    trial = LiveTrial(GRID, rounds=1, steps=2, warmup=1, run_steps=run_steps, share=0.25, apart=apart)
    for _ in range(2):  # the plain settings' warm-up, then their timed step (the price is set then)
        assert trial.current() == GRID[0]
        trial.record(0.010)
    return trial.report


def test_a_candidate_timed_apart_is_priced_with_the_passes_it_throws_away():
    """3 other settings, each a switch (>= a step) and, timed apart, 2 timed passes thrown away: 9 steps of 10 ms,
    over 25% of a 30-step run's 0.3 s; 2 of them (6 steps) fit, and the third is left untried. On a 10-step run not
    even one fits (3 steps against 0.025 s): not measured. Trained (a trial on a copy: none thrown away) the three
    cost 3 steps, within 25% of 30."""
    partial = _first_look(apart=True, run_steps=30)
    assert "stopped" not in partial and list(partial["untried"]) == ["bf16+channels_last"]
    assert "2 setting(s) ahead of it in the rules' order cost about 0.06 s" in partial["untried"]["bf16+channels_last"]
    none = _first_look(apart=True, run_steps=10)
    assert "not measured: 3 other setting(s) would cost about 0.09 s" in none["stopped"]
    assert "stopped" not in _first_look(apart=False, run_steps=30)
    assert "untried" not in _first_look(apart=False, run_steps=30)
    assert "untried" not in _first_look(apart=True, run_steps=40)  # 0.09 s within 25% of 0.4 s


def test_a_switchs_first_use_is_priced_at_least_at_first_switch_s():
    """A tiny model in a warm process: the plain settings' first step (0.5 ms) is no dearer than the next, so a new
    precision's one-off work would be priced at one 0.5 ms step; its kernels' first use costs far more (a bf16 MLP's
    first step 9.4 ms, measured). bf16 on a 400-step run of 0.5 ms steps at the ported 2% (4 ms): at the floor it
    does not fit and is not measured; a 4,000-step run (40 ms) tries it."""
    from torchspeed.train.trial.switches import FIRST_SWITCH_S
    grid = [Switches("fp32", False, None), Switches("bf16", False, None)]

    def first_look(run_steps):
        trial = LiveTrial(grid, rounds=1, steps=2, warmup=1, run_steps=run_steps, share=0.02, apart=True)
        for _ in range(2):
            trial.record(0.0005)
        return trial.report

    short = first_look(400)
    assert "not measured: 1 other setting(s)" in short["stopped"]
    assert f"a switch's first step {FIRST_SWITCH_S:.3f} s" in short["stopped"]
    assert "stopped" not in first_look(4000) and "untried" not in first_look(4000)
    assert FIRST_SWITCH_S >= 0.005  # priced at one 0.5 ms step (2 ms with its thrown passes) bf16 would fit in 4 ms


def test_the_rules_choice_goes_before_the_later_stages_where_both_do_not_fit():
    """A 10-step run of 10 ms steps affords 0.025 s at a quarter: the three other settings and the two thread
    counts cost 0.05 s, and not even one setting fits next to the thread stage (0.03 s); without it, two settings
    do (0.02 s). The thread stage is left untried, and the grid's last setting."""
    trial = LiveTrial(GRID, thread_choices=(2, 1), rounds=1, steps=2, warmup=1, run_steps=10, share=0.25, apart=False)
    for _ in range(2):
        trial.record(0.010)
    report = trial.report
    assert "stopped" not in report
    assert sorted(report["untried"]) == ["bf16+channels_last", "the threads stage"]
    assert not trial.thread_choices and "threads" not in [name for name in trial._stages]
    assert {c for c, _ in trial._queue} == set(GRID[:3])


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def _loader(steps):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16 * steps, 8, generator=g), torch.randint(0, 4, (16 * steps,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(2))


@pytest.fixture
def bf16_cpu(monkeypatch, tmp_path):
    """A CPU with native bf16, an empty trial cache, and every step 10 ms in either precision (nothing wins)."""
    monkeypatch.setenv("TORCHSPEED_CPU_PROFILE", "avx512_bf16")
    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(SwitchStage, "measure_fn", staticmethod(lambda s, sec: 0.010))


@pytest.mark.priced
def test_a_ported_run_prices_its_trial_at_the_ported_share(bf16_cpu):
    """A 60-step run, bf16 the one other setting: its first look (a switch and one pass thrown away, 20 ms) is 3% of
    the run's 0.6 s. `fit` with the loop's own optimizer (a ported loop) affords 2%: it keeps the plain settings
    without trying; `fit` choosing its own LR affords 25%: it measures."""
    assert planner.PORTED_TRIAL_SHARE == 0.02
    model = _mlp()
    ported = torchspeed.fit(model, _loader(60), optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                            schedule=None, compile=False, progress=False)
    trial = ported.decisions["switch_trial"]
    assert "over 2% of this 60-step run" in trial.measured["stopped"]
    assert ported.decisions["precision"].value == "fp32"
    own = torchspeed.fit(_mlp(), _loader(60), optimizer="sgd", compile=False, progress=False)
    assert "stopped" not in own.decisions["switch_trial"].measured
    assert own.decisions["switch_trial"].measured["steps"] > 2  # bf16 had its turns


@pytest.mark.priced
@pytest.mark.paced
@pytest.mark.parametrize("share, turns", [(None, 7), (0.02, 3)])
def test_a_ported_runs_later_turns_timed_apart_take_half_its_share(share, turns):
    """After the first look, the turns timed apart (forwards and backwards thrown away) take at most SHADOW_SHARE
    (5%) of the run's steps, and a run with a trial share of its own (a ported run's 2%) half that: on 300 steps
    where bf16 never leads by 10%, 7 turns (its warm-up and 3 rounds of 2) against 3 (1% of 300)."""
    cfg = TrainConfig(epochs=1, progress=False, compile=False, fused_optimizer=False, trial=True, trial_share=share)
    t = Trainer(_mlp(), optimizer="sgd", lr=0.05, config=cfg, caps=BF16_CPU)
    t.switcher.measure_fn = lambda s, sec: 0.010 if s.precision == "fp32" else 0.0099
    res = t.fit(_loader(300))
    trial = res.decisions["switch_trial"]
    assert trial.value == "measured" and "stopped" not in trial.measured
    assert trial.measured["shadow_steps"] == turns
    assert res.decisions["precision"].value == "fp32"  # 1% faster: under the 2% a change must buy (min_gain)


def test_the_share_bounds_the_whole_trial_not_each_look():
    """A 100-step run of 10 ms steps affords 0.25 s at a quarter. After the plain settings' steps the other three
    settings are priced at a step each and all fit. The first of them then takes 0.12 s (its one-off work): the two
    left are priced at 0.11 s each, 0.22 s, which the whole share would still hold; what is left of it after the
    0.11 s spent (0.14 s) holds one, so the last in the rules' order is left untried."""
    trial = LiveTrial(GRID, rounds=1, steps=2, warmup=1, run_steps=100, share=0.25, apart=False)
    for _ in range(2):
        trial.record(0.010)
    assert "untried" not in trial.report and "stopped" not in trial.report
    assert trial.current() == GRID[1] and not trial.timed_now()  # fp32 + channels_last's warm-up
    trial.record(0.120)
    untried = trial.report["untried"]
    assert list(untried) == ["bf16+channels_last"] and "0.11 s of it spent already" in untried["bf16+channels_last"]
    assert {c for c, _ in trial._queue} == set(GRID[:3])
