"""The switch trial's turns timed apart (train/trial/shadow.py): paced in steps so that at any moment of the run they have
cost about SHADOW_SHARE of its steps, never so late that the trial cannot finish, not once a candidate measures
faster (then its turns train), the run's numerics untouched; a trial cut short by the run's end is not cached.

Step times are injected (`measure_fn`): nothing here depends on the wall clock or the machine's load.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchspeed.env import DeviceCaps
from torchspeed.train.trial import shadow as shadow_mod
from torchspeed.train.loop.callbacks import Callback
from torchspeed.train.config import TrainConfig
from torchspeed.train.trial.shadow import ShadowTurns
from torchspeed.train.loop.trainer import Trainer

BF16_CPU = DeviceCaps("cpu", cpu_bf16=True, cores=2)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))


def _loader(steps):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16 * steps, 8, generator=g), torch.randint(0, 4, (16 * steps,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(2))


def _trainer(*, trial=True, bf16=(1.3, 1.2)):
    cfg = dict(epochs=1, progress=False, compile=False, fused_optimizer=False, trial=trial,
               precision="auto" if trial else "fp32")
    t = Trainer(_model(), optimizer="sgd", lr=0.05, config=TrainConfig(**cfg), caps=BF16_CPU)
    if trial:  # by default fp32 wins (median 1.2 against 1.25): the run keeps the plain numerics; the two overlap,
        seconds = {"fp32": [1.0, 1.4], "bf16": list(bf16)}  # so every bf16 turn is taken (none beaten on all)
        count = {"fp32": 0, "bf16": 0}

        def measure(s, sec):
            p = s.label().split("+")[0]
            count[p] += 1
            return seconds[p][count[p] % 2]
        t.switcher.measure_fn = measure
    return t


def _spy_turns(monkeypatch):
    """Each timed-apart turn's (turn number, the run's steps since the trial began) as it starts."""
    seen, real = [], ShadowTurns.step

    def step(self, batch, run_step, cand, **kw):
        seen.append((len(seen) + 1, self.seen))
        return real(self, batch, run_step, cand, **kw)

    monkeypatch.setattr(ShadowTurns, "step", step)
    return seen


@pytest.mark.paced
def test_turns_timed_apart_are_paced_and_the_run_is_the_plain_runs(monkeypatch):
    """After the first look, the k-th turn (a forward and backward thrown away) waits until the run has trained
    k / SHADOW_SHARE steps since the trial began; the steps between train in the plain settings, so the run ends as
    the run with no trial, bit for bit; the trial still decides within the run."""
    seen = _spy_turns(monkeypatch)
    paced = _trainer()
    torch.manual_seed(3)
    res = paced.fit(_loader(300))
    plain = _trainer(trial=False)
    torch.manual_seed(3)
    plain.fit(_loader(300))

    trial = res.decisions["switch_trial"]
    assert trial.value == "measured" and res.decisions["precision"].value == "fp32"
    assert trial.measured["shadow_steps"] == len(seen) == 7  # bf16's warm-up and 3 rounds x 2 timed turns
    assert trial.measured["paced_steps"] > 100 and "paced over" in trial.reason
    assert seen[1][1] <= 6  # the first look (bf16's warm-up and first timed turn) in the run's first steps
    for k, steps in seen[2:]:  # then the k-th at 20k steps (SHADOW_SHARE 5%), not earlier
        assert k <= shadow_mod.SHADOW_SHARE * steps + 1e-9 and steps >= 3 / shadow_mod.SHADOW_SHARE, (k, steps)
    for k, v in plain.module.state_dict().items():
        assert torch.equal(paced.module.state_dict()[k], v), k


@pytest.mark.paced
def test_a_run_too_short_to_wait_runs_its_turns_in_time_to_decide(monkeypatch):
    """A run of known length waits only while its remaining steps exceed the trial's remaining turns: a 24-step
    run's trial finishes (every bf16 turn taken), its last turns taken without waiting."""
    seen = _spy_turns(monkeypatch)
    res = _trainer().fit(_loader(24))
    trial = res.decisions["switch_trial"]
    assert trial.value == "measured" and len(seen) == trial.measured["shadow_steps"] >= 2
    first = trial.measured["stages"][0]
    assert any(k.startswith("bf16") for k in first["seconds_per_step"])  # timed: the run did not end the trial first
    assert any(k > shadow_mod.SHADOW_SHARE * steps for k, steps in seen)  # late turns did not wait


@pytest.mark.paced
def test_a_candidate_measured_faster_trains_its_turns_without_waiting(monkeypatch):
    """Once bf16 measures faster than fp32 (its first look) the run is likely to switch, and its numerics with it:
    its later turns train (none thrown away) and none waits."""
    seen = _spy_turns(monkeypatch)
    res = _trainer(bf16=(0.7, 0.6)).fit(_loader(300))
    trial = res.decisions["switch_trial"].measured
    assert res.decisions["precision"].value == "bf16"
    assert len(seen) == trial["shadow_steps"] == 2  # the first look: bf16's warm-up and first timed turn
    assert trial["steps"] <= 14 and "paced_steps" not in trial  # every turn within the trial's first 14 steps


def test_unpaced_turns_run_back_to_back(monkeypatch):
    """The control (the conftest leaves unmarked tests unpaced): the same run takes its turns in its first steps."""
    seen = _spy_turns(monkeypatch)
    res = _trainer().fit(_loader(300))
    assert len(seen) == 7 and "paced_steps" not in res.decisions["switch_trial"].measured
    assert seen[-1][1] <= 14  # all within the trial's 14 turns


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
        t = Trainer(_model(), optimizer="sgd", lr=0.05, caps=BF16_CPU,
                    config=TrainConfig(epochs=1, progress=False, compile=False, fused_optimizer=False, trial=True),
                    callbacks=[StopAt(stop)] if stop else None)
        values.append(t.fit(_loader(300)).decisions["switch_trial"].value)
    assert values == ["measured", "measured"]  # the second run measured: nothing was cached by the first


class _Computed(torch.utils.data.Dataset):
    """Samples computed per index (not sliced: the loader keeps its worker, so the trial has thread counts to try)."""

    def __len__(self):
        return 16 * 40

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), int(torch.randint(0, 4, (), generator=g))


def test_thread_count_turns_are_timed_apart_and_every_trained_step_runs_at_the_runs_threads():
    """With a loader's worker the trial tries fewer intra-op threads (the cores the worker leaves); another count
    sums a matmul otherwise, so its turns are timed apart: each trained step, theirs too, runs at the run's own
    count, and the run that keeps it ends as the run with no trial, bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def run(trial):
            cfg = TrainConfig(epochs=1, progress=False, compile=False, fused_optimizer=False, trial=trial,
                              precision="fp32", channels_last=False)
            t = Trainer(_model(), optimizer="sgd", lr=0.05, config=cfg, caps=BF16_CPU)
            t.switcher.measure_fn = lambda s, sec: 1.0 if s.threads in (None, 2) else 1.3  # 2 threads win
            at = []  # the intra-op threads of each optimizer step (a hook: the step goes through torch's own)
            t.optimizer.register_step_pre_hook(lambda opt, args, kwargs: at.append(torch.get_num_threads()))
            torch.manual_seed(3)
            loader = DataLoader(_Computed(), batch_size=16, shuffle=True, num_workers=1,
                                generator=torch.Generator().manual_seed(2))
            return t, t.fit(loader), at

        tried, res, threads_at_steps = run(True)
        plain, _, _ = run(False)
    finally:
        torch.set_num_threads(before)
    trial = res.decisions["switch_trial"]
    stages = [s["stage"] for s in trial.measured["stages"]]
    assert trial.value == "measured" and "threads" in stages
    assert threads_at_steps and set(threads_at_steps) == {2}, threads_at_steps  # never a step at 1 thread
    assert trial.measured["shadow_steps"] >= 2  # 1 thread's turns: timed apart
    for k, v in plain.module.state_dict().items():
        assert torch.equal(tried.module.state_dict()[k], v), k


class _Clock:
    """A fake `time` for shadow.py: it moves only when a forward and backward runs, by the seconds queued."""

    def __init__(self):
        self.now, self.queue = 0.0, []

    def perf_counter(self):
        return self.now


def test_a_timed_turn_times_the_candidates_second_pass_not_its_first_after_the_switch(monkeypatch):
    """A timed turn timed apart runs the candidate's forward and backward twice (the first pass after the run's own
    step is not its steady one: a layout's reorders, a precision's first casts) and returns the second's seconds;
    the first goes to the trial's cost. A warm-up turn runs it once. The run stays the plain run, bit for bit."""
    clock = _Clock()
    monkeypatch.setattr(shadow_mod, "time", clock)
    real_fb = Trainer.forward_backward
    passes = []

    def fb(self, batch):
        if clock.queue:
            clock.now += clock.queue.pop(0)
        passes.append(self.precision.name)
        return real_fb(self, batch)

    monkeypatch.setattr(Trainer, "forward_backward", fb)
    real_step, out = ShadowTurns.step, []

    def step(self, batch, run_step, cand, *, settle=False, **kw):
        # seconds per pass: the settling one (slow), the timed one, the trained one in the plain settings
        clock.queue = [9.0, 1.0, 2.0] if settle else [5.0, 2.0]
        before, extra = len(passes), self.stage.live.extra_seconds()
        sec = real_step(self, batch, run_step, cand, settle=settle, **kw)
        out.append((settle, sec, passes[before:], self.stage.live.extra_seconds() - extra))
        return sec

    monkeypatch.setattr(ShadowTurns, "step", step)
    t = _trainer()
    t.switcher.measure_fn = None  # the turns' own seconds, from the fake clock
    torch.manual_seed(3)
    t.fit(_loader(40))
    plain = _trainer(trial=False)
    torch.manual_seed(3)
    plain.fit(_loader(40))
    warm = [o for o in out if not o[0]]
    timed = [o for o in out if o[0]]
    assert warm and timed
    for _, sec, ran, extra in warm:
        assert ran == ["bf16", "fp32"] and sec == pytest.approx(5.0) and extra == pytest.approx(2.0)
    for _, sec, ran, extra in timed:
        assert ran == ["bf16", "bf16", "fp32"]  # settled, timed, trained
        assert sec == pytest.approx(1.0) and extra == pytest.approx(9.0 + 2.0)
    for k, v in plain.module.state_dict().items():
        assert torch.equal(t.module.state_dict()[k], v), k


@pytest.mark.paced
def test_a_paced_step_skips_the_trials_bookkeeping(monkeypatch):
    """The steps that wait for the next turn are counted ahead (`waits_ahead`) and train with no bookkeeping: the
    trial's own step (`_trial_step`, 35 us a step on a small MLP) runs on the turns and the steps around them, not
    on the hundreds between; the turns still start where `waits` says (the test above)."""
    from torchspeed.train.trial.autoswitch import SwitchStage

    calls, real = [], SwitchStage._trial_step
    monkeypatch.setattr(SwitchStage, "_trial_step", lambda self, *a: calls.append(1) or real(self, *a))
    res = _trainer().fit(_loader(300))
    paced = res.decisions["switch_trial"].measured["paced_steps"]
    assert paced > 100 and len(calls) < 40  # of the trial's paced + turns + plain steps, the few that decide


def test_waits_ahead_counts_the_steps_that_waits_would_say_wait():
    for share, seen, turns, left, turns_left in ((0.05, 10, 2, 300, 4), (0.05, 10, 2, 30, 4), (0.01, 3, 1, None, 2),
                                                 (0.05, 100, 2, 300, 4)):
        stage = type("S", (), {})()
        a, b = ShadowTurns(stage), ShadowTurns(stage)
        a.cap = b.cap = share
        a.seen = b.seen = seen
        a.turns = b.turns = turns
        n, step_left = 0, left
        while True:  # ask `waits` step by step, as the trial would
            b.tick()
            step_left = None if step_left is None else step_left - 1
            if not b.waits(steps_left=step_left, turns_left=turns_left):
                break
            n += 1
        assert a.waits_ahead(steps_left=left, turns_left=turns_left) == n, (share, seen, turns, left)
