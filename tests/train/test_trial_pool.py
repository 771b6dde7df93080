"""A close cached switch choice measured again by the next runs and pooled (train/trial/pool.py). Injected timings
and cache entries: nothing here depends on this machine's speed."""
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from torchspeed.env import DeviceCaps
from torchspeed.train.decision import TrialCache
from torchspeed.train.trial.pool import CLOSE, POOL_RUNS, close_rivals, measure_again, pooled
from torchspeed.train.trial.switch_choice import Switches
from torchspeed.train.trial.switches import LiveTrial

pytestmark = pytest.mark.pooled  # (conftest makes other tests' cached choices final)

BF16_CPU = DeviceCaps("cpu", cpu_bf16=True, cores=2)
FP32, CL, BF16, BF16_CL = (Switches("fp32", False), Switches("fp32", True), Switches("bf16", False),
                           Switches("bf16", True))


def _loader(n: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(1))


def _trainer(model, caps):
    from torchspeed.train.config import TrainConfig
    from torchspeed.train.loop.trainer import Trainer
    return Trainer(model, optimizer="sgd", lr=0.05, caps=caps,
                   config=TrainConfig(epochs=1, progress=False, compile=False, trial=True, fused_optimizer=False))


def _entry(times: dict, chosen: str, runs: int = 1, run_steps: int | None = 400, **extra) -> dict:
    return {"switches": {"precision": chosen.split("+")[0], "channels_last": "channels_last" in chosen,
                         "fused": None, "threads": None}, "steps": 28, "rounds": 3, "steps_per_round": 2,
            "stages": [], "extra_s": 0.1,
            "pool": {"runs": runs, "chosen": chosen, "times": times, "run_steps": run_steps}} | extra


def test_a_rival_within_the_margin_or_faster_is_close_and_a_far_one_is_not():
    times = {"fp32": [1.0] * 6, "fp32+channels_last": [0.80] * 6, "bf16": [0.85] * 6, "bf16+channels_last": [1.3] * 6}
    assert close_rivals(_entry(times, "fp32+channels_last"), 400) == ["bf16"]  # within 10%; 1.0 and 1.3 are not
    times["fp32"] = [0.75] * 6  # the plain settings faster than the choice (a change was kept: not sure)
    assert close_rivals(_entry(times, "fp32+channels_last"), 400) == ["bf16", "fp32"]
    far = {"fp32": [1.0] * 6, "fp32+channels_last": [0.6] * 6}
    assert close_rivals(_entry(far, "fp32+channels_last"), 400) == []


def test_an_entry_is_final_after_its_pooled_runs_or_without_a_pool_or_for_a_shorter_run():
    times = {"fp32": [1.0] * 6, "fp32+channels_last": [0.97] * 6}
    assert close_rivals(_entry(times, "fp32+channels_last", runs=POOL_RUNS - 1), 400) == ["fp32"]
    assert close_rivals(_entry(times, "fp32+channels_last", runs=POOL_RUNS), 400) == []
    assert close_rivals({"switches": {}, "steps": 9}, 400) == []  # cached before pooling: read as it is
    assert close_rivals(_entry(times, "fp32+channels_last"), 100) == []  # a shorter run may not afford the turns
    assert close_rivals(_entry(times, "fp32+channels_last"), None) == ["fp32"]
    refused = _entry({"fp32": [1.0] * 6, "bf16": [0.95] * 6}, "fp32", rejected={"bf16": "loss moved"})
    assert close_rivals(refused, 400) == []  # the numerics guard refused it: no rival


def test_pooled_steps_are_ratios_to_the_runs_own_plain_median_and_change_the_choice():
    """This run's steps favour channels_last 1.11x; two earlier runs' pooled steps put it 1.3x slower: the pooled
    choice keeps the plain settings, and the pool to cache holds all three runs' ratios. Without the prior the same
    steps take channels_last."""
    times = {FP32: [2.0] * 6, CL: [1.8] * 6}  # a run at twice the pace of the earlier ones: ratios cancel it
    basis, pool = pooled(times, FP32, None)
    assert basis is times and pool["runs"] == 1 and pool["times"]["fp32+channels_last"] == [0.9] * 6
    prior = {"runs": 2, "chosen": "fp32", "times": {"fp32": [1.0] * 12, "fp32+channels_last": [1.3] * 12}}
    basis, pool = pooled(times, FP32, prior)
    assert pool["runs"] == 3 and len(pool["times"]["fp32"]) == 18 and basis[CL].count(1.3) == 12

    def run(prior):
        trial = LiveTrial([FP32, CL], rounds=3, steps=2, warmup=1, race=False)
        if prior:
            trial.pool_with(prior, ["fp32+channels_last"])
        while not trial.done:
            trial.record({FP32: 2.0, CL: 1.8}[trial.current()])
        return trial
    assert run(None).best == CL
    pooled_trial = run(prior)
    assert pooled_trial.best == FP32 and pooled_trial.report["pool"]["runs"] == 3
    assert "pooled with the timed steps of 2 earlier run(s)" in pooled_trial.report["stages"][0]["why"]


def test_measuring_again_times_only_the_plain_settings_the_choice_and_its_close_rivals():
    times = {"fp32": [1.0] * 6, "fp32+channels_last": [0.80] * 6, "bf16": [1.5] * 6, "bf16+channels_last": [0.84] * 6}
    trial = LiveTrial([FP32, CL, BF16, BF16_CL], rounds=3, steps=2, warmup=1, run_steps=400)
    why = measure_again(_entry(times, "fp32+channels_last"), trial, depth=6)
    assert why and f"within {CLOSE:.0%} of bf16+channels_last" in why
    turns = set()
    while not trial.done:
        turns.add(trial.current())
        trial.record(1.0)
    assert turns == {FP32, CL, BF16_CL}  # bf16, 1.5x in the cached trial, takes no turn
    assert "not measured again" in trial.report["dropped"]["bf16"]
    settled = LiveTrial([FP32, CL, BF16, BF16_CL], rounds=3, steps=2, warmup=1, run_steps=400)
    far = {"fp32": [1.0] * 6, "fp32+channels_last": [0.6] * 6}
    assert measure_again(_entry(far, "fp32+channels_last"), settled, depth=6) is None and settled.prior is None


@pytest.mark.parametrize("runs, how", [(1, "measured"), (POOL_RUNS, "cached")])
def test_a_run_measures_a_close_cached_choice_again_and_caches_the_pool(tiny_cnn, monkeypatch, runs, how):
    """Through the trainer: a cached entry whose choice had a close rival is measured again (its far candidate
    takes no turn) and the entry written back pools one more run; an entry that pooled POOL_RUNS runs is read."""
    times = {"fp32+foreach": [1.0] * 6, "fp32+channels_last+foreach": [0.95] * 6, "bf16+foreach": [2.0] * 6,
             "bf16+channels_last+foreach": [1.8] * 6}
    entry = _entry(times, "fp32+channels_last+foreach", runs=runs, run_steps=None)
    put = {}
    monkeypatch.setattr(TrialCache, "get", lambda self, key: entry)
    monkeypatch.setattr(TrialCache, "put", lambda self, key, report: put.update(report))
    res = _trainer(tiny_cnn(), BF16_CPU).fit(_loader(n=16 * 60))
    trial = res.decisions["switch_trial"]
    assert trial.value == how
    if how == "measured":
        assert put["pool"]["runs"] == 2 and len(put["pool"]["times"]["fp32+foreach"]) > 6
        assert set(put["dropped"]) >= {"bf16+foreach", "bf16+channels_last+foreach"}
    else:
        assert not put and trial.measured["steps"] == 0


def test_a_close_choice_measured_again_by_a_run_that_cannot_afford_it_keeps_the_cached_choice():
    """The run measuring a close cached choice again is priced out after the plain settings' first steps (a slow
    machine): it trains in the cached choice, not the plain settings, and caches nothing (a stopped trial)."""
    times = {"fp32": [1.0] * 6, "fp32+channels_last": [0.8] * 6, "bf16+channels_last": [0.84] * 6}
    trial = LiveTrial([FP32, CL, BF16, BF16_CL], rounds=3, steps=2, warmup=1, run_steps=400, share=1e-6)
    assert measure_again(_entry(times, "fp32+channels_last"), trial, depth=6)
    while not trial.done:
        trial.record(1.0)
    assert "stopped" in trial.report and trial.best == CL
    assert "kept the cached choice" in trial.report["stages"][0]["why"]
    cold = LiveTrial([FP32, CL, BF16, BF16_CL], rounds=3, steps=2, warmup=1, run_steps=400, share=1e-6)
    while not cold.done:
        cold.record(1.0)
    assert "stopped" in cold.report and cold.best == FP32  # no cached choice: the plain settings, as before
