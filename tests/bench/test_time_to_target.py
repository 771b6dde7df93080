"""Time to target in `torchspeed bench` (bench/time_to_target.py): behaviour only, never wall-clock speed."""

import importlib.util
import json

import pytest

from torchspeed.bench.runner import BenchResult, BenchRow
from torchspeed.bench.time_to_target import (DEFAULT_TARGETS, attach_time_to_target, resolve_targets,
                                             run_time_to_target, shortest_budget)
from torchspeed.cli.main import main

# A tiny workload: an MLP on a small synthetic set learns past 0.3 accuracy within a few steps.
TINY = dict(model="mlp", data="synthetic", batch_size=32, train_size=256, val_size=128, device="cpu", progress=False,
            busy=False, budgets=(4, 8, 16, 32))


def _fake_bench() -> BenchResult:
    rows = [BenchRow(name, 100.0, 1.0, 2.3, 0.1) for name in ("naive", "set_to_none", "all")]
    return BenchResult(device="cpu: test", torch="x", workload="mlp", rows=rows, meta={})


# ------------------------------------------------------------------ the search, as a pure function
@pytest.mark.parametrize("needed, start", [(48, 80), (96, 80), (8, 80), (400, 80), (56, 16), (80, 80)])
def test_shortest_budget_finds_the_first_passing_budget_asking_each_once(needed, start):
    from torchspeed.bench.time_to_target import BUDGETS

    asked = []

    def passes(b):
        asked.append(b)
        return b >= needed

    assert shortest_budget(passes, BUDGETS, start=start) == needed
    assert len(asked) == len(set(asked)) <= 6  # a search, not a sweep of all 18 budgets


def test_shortest_budget_is_none_when_no_budget_passes():
    asked = []
    assert shortest_budget(lambda b: asked.append(b) or False, (8, 16, 32, 64), start=16) is None
    assert 64 in asked and len(asked) == len(set(asked))


def test_a_budget_fails_as_soon_as_one_seed_misses_and_that_seed_goes_first_next_time():
    from torchspeed.bench.time_to_target import TTARun, _Search

    calls = []

    def run_seeds(name, seeds, budget, target, metric):  # as the worker: in turn, stopping at the first miss
        runs = []
        for seed in seeds:
            calls.append((seed, budget))
            ok = budget >= (64 if seed == 2 else 16)
            runs.append(TTARun(name, seed, budget, 0.99 if ok else 0.5, 0.1, 1.0, budget * 8))
            if not ok:
                break
        return runs

    s = _Search("all", [0, 1, 2], run_seeds)
    assert not s.passes(32, 0.97, "val_acc")
    assert calls == [(0, 32), (1, 32), (2, 32)]
    assert not s.passes(48, 0.97, "val_acc") and calls[-1] == (2, 48) and len(calls) == 4  # seed 2 first: 1 run
    assert s.passes(64, 0.97, "val_acc") and len(calls) == 7


# ------------------------------------------------------------------ end to end on a tiny workload
@pytest.fixture(scope="module")
def tiny():
    """naive, all, auto (cold cache) and auto_warm on two seeds to a low target."""
    return run_time_to_target(targets=(0.3,), seeds=2, configs=("naive", "all", "auto", "auto_warm"), **TINY)


def test_the_schedule_free_row_trains_schedule_free_adamw_at_its_defaults():
    pytest.importorskip("schedulefree")
    res = run_time_to_target(targets=(0.3,), seeds=1, configs=("schedulefree",), **TINY)
    runs = [r for r in res.runs if r.config == "schedulefree"]
    assert runs and all("AdamWScheduleFree" in r.decisions["optimizer"] and "warm-up" in r.decisions["schedule"]
                        for r in runs)
    assert res.targets[0]["configs"]["schedulefree"]["budgets_tried"]


def test_every_config_reaches_the_target_and_the_json_has_the_issue_schema(tiny):
    res = tiny
    assert res.seeds == [0, 1] and len(res.targets) == 1
    e = res.targets[0]
    assert e["workload"] == "mlp on synthetic" and e["target"] == 0.3 and e["metric"] == "val_acc"
    for name in ("naive", "all", "auto", "auto_warm"):
        c = e["configs"][name]
        for key in ("budget_steps", "samples_to_target", "train_time_s", "tuning_time_s", "total_time_s",
                    "tuning_share", "reached", "seeds", "val_acc"):
            assert key in c
        assert c["budget_steps"] in TINY["budgets"] and c["reached"] == c["seeds"] == 2 and e[name] is c
        assert c["samples_to_target"] == c["budget_steps"] * 32
        assert all(v >= 0.3 for v in c["val_acc"])  # every seed ends at the target at that budget
        shorter = [b for b in TINY["budgets"] if b < c["budget_steps"]]
        if shorter:  # the budget below was tried and missed on some seed (or the search proved it)
            below = max(shorter)
            runs = [r for r in res.runs if r.config == name and r.budget == below]
            assert runs and any(r.val_acc < 0.3 for r in runs)
    assert e["configs"]["auto"]["tuning_time_s"] > 0 == e["configs"]["all"]["tuning_time_s"]  # counted, cold
    for key in ("auto_vs_all", "auto_vs_naive", "auto_warm_vs_all"):
        assert e[key]["samples"] > 0 and e[key]["tuning_included"] > 0 and 0 <= e[key]["tuning_share"] < 1
    # cold: a run's recipe cannot afford an optimizer trial or the range test in a budget of at most 32 steps: the
    # optimizer prior (Schedule-Free AdamW at its default LR when installed, else the given LR's prior)
    cold = [r for r in res.runs if r.config == "auto"]
    sf = importlib.util.find_spec("schedulefree") is not None
    assert cold and all(r.tuning_steps == 0 and ("Schedule-Free" if sf else "prior") in r.decisions["lr"]
                        for r in cold)
    assert not sf or all("(prior: Schedule-Free" in r.decisions["optimizer"] for r in cold)
    warm = [r for r in res.runs if r.config == "auto_warm"]  # the earlier run's measurement, 0 steps now
    assert warm and all(r.tuning_steps == 0 and "cached" in r.decisions["optimizer" if sf else "lr"] for r in warm)
    assert all("cached" in r.decisions["switch_trial"] for r in warm)
    # final quality at equal length: auto trained for naive's budget on every seed, beside naive's own runs
    sb, nb = e["auto_at_naive_budget"], e["configs"]["naive"]["budget_steps"]
    assert sb["budget_steps"] == nb and len(sb["auto"]) == len(sb["naive"]) == 2
    assert sb["auto"] == [r.val_acc for r in sorted((r for r in res.runs if r.config == "auto" and r.budget == nb),
                                                     key=lambda r: r.seed)]
    assert sb["not_worse"] == (sb["auto_mean"] >= sb["naive_mean"])
    # the warm cache holds the recipe measured with no budget: the range test's LR and label smoothing, per seed
    for s in ("0", "1"):
        rec = res.recipes[s]["recipe"]
        assert rec["lr"] > 0 and rec["label_smoothing"] == 0.1 and rec["bn_stats"] is False  # an MLP: no BatchNorm
    auto_runs = [r for r in res.runs if r.config == "auto"]
    assert auto_runs and all("tta" in r.decisions for r in auto_runs)
    naive = next(r for r in res.runs if r.config == "naive")
    assert naive.decisions["compile"].startswith("False")


def test_rows_and_json_carry_the_targets(tiny, tmp_path):
    from torchspeed.bench.runner import write_results

    bench = _fake_bench()
    attach_time_to_target(bench, tiny)
    write_results(bench, tmp_path / "b.json", None)
    data = json.loads((tmp_path / "b.json").read_text())
    rows = {r["config"]: r for r in data["rows"]}
    assert rows["all"]["steps_to_target"] == tiny.targets[0]["configs"]["all"]["budget_steps"]
    assert rows["set_to_none"]["time_to_target_s"] is None
    tta = data["tta"]
    assert isinstance(tta["targets"], list) and tta["targets"][0]["configs"]["auto"]["seeds"] == 2
    assert "commit" in tta["meta"] and tta["runs"]


def test_the_recipe_is_chosen_without_reading_the_validation_split(monkeypatch, tmp_path):
    """auto's choice runs on training batches alone: a different validation set changes nothing."""
    import torchspeed.bench._worker as worker
    from torchspeed.bench.runner import bench_configs
    from torchspeed.bench.time_to_target_worker import warm

    import torch
    cfg = next(c for c in bench_configs(torch.device("cpu"), compile=False, hand=False) if c.name == "all")
    from dataclasses import asdict, replace
    spec = {"model": "mlp", "data": "synthetic", "batch_size": 32, "train_size": 256, "val_size": 128, "lr": 0.1,
            "optimizer": "sgd", "data_seed": 0, "seed": 0, "device": "cpu", "image_size": 32, "num_workers": 0,
            "train": asdict(replace(cfg.train, schedule="onecycle", trial=False))}
    first = warm(spec | {"cache_dir": str(tmp_path / "a")})["recipe"]
    real = worker._data

    def other_validation(s):
        loader, val, dev = real(s)
        bad = torch.utils.data.TensorDataset(torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,)))
        return loader, torch.utils.data.DataLoader(bad, batch_size=16), dev

    monkeypatch.setattr(worker, "_data", other_validation)
    second = warm(spec | {"cache_dir": str(tmp_path / "b")})["recipe"]
    for key in ("lr", "label_smoothing", "bn_stats", "ema", "optimizer", "on"):
        assert first[key] == second[key]


def test_digits_turn_both_targets_on_by_default():
    assert resolve_targets("digits", None) == DEFAULT_TARGETS["digits"] == (0.97, 0.90)
    assert resolve_targets("synthetic", None) == ()
    assert resolve_targets("synthetic", 0.5) == (0.5,)
    assert resolve_targets("digits", 0.0) == () and resolve_targets("digits", None, off=True) == ()


def test_bench_cli_runs_time_to_target_for_digits_unless_switched_off(tiny, monkeypatch, tmp_path):
    import torchspeed.bench.runner as runner
    import torchspeed.bench.time_to_target as tta

    calls = []
    monkeypatch.setattr(runner, "run_bench", lambda **kw: _fake_bench())
    monkeypatch.setattr(runner, "plot_results", lambda *a, **k: None)

    def fake_tta(**kw):
        calls.append(kw)
        return tiny

    monkeypatch.setattr(tta, "run_time_to_target", fake_tta)
    out = tmp_path / "b.json"
    assert main(["bench", "--data", "digits", "--json", str(out)]) == 0
    assert len(calls) == 1 and calls[0]["targets"] == (0.97, 0.90) and calls[0]["data"] == "digits"
    assert calls[0]["model"] == "resnet20" and calls[0]["configs"] == ("naive", "all", "auto", "auto_warm", "schedulefree")
    assert "tta" in json.loads(out.read_text())
    for off in (["--no-tta"], ["--target-acc", "0"]):
        assert main(["bench", "--data", "digits", "--model", "resnet20", "--json", str(out), *off]) == 0
    assert main(["bench", "--data", "synthetic", "--model", "mlp", "--json", str(out)]) == 0
    assert len(calls) == 1 and "tta" not in json.loads(out.read_text())
    real_find = importlib.util.find_spec  # without the schedulefree extra, a bench with no time to target runs
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "schedulefree" else real_find(n, *a))
    assert main(["bench", "--data", "digits", "--model", "resnet20", "--json", str(out), "--no-tta"]) == 0
    assert main(["bench", "--data", "digits", "--json", str(out)]) == 2  # its schedulefree row needs the extra
    monkeypatch.setattr(importlib.util, "find_spec", real_find)
    assert main(["bench", "--model", "mlp", "--target-acc", "0.5", "--seeds", "2", "--ablation",
                 "--json", str(out)]) == 0
    assert len(calls) == 2 and calls[1]["targets"] == (0.5,) and calls[1]["seeds"] == 2 and calls[1]["ablation"]
    assert main(["bench", "--model", "gpt", "--target-loss", "all", "--tta-configs", "all,auto",
                 "--json", str(out)]) == 0
    assert calls[2]["metric"] == "val_loss" and calls[2]["target_from"] == "all" and calls[2]["targets"] == ()
    assert calls[2]["configs"] == ("all", "auto")
    assert main(["bench", "--model", "gpt", "--target-loss", "naive", "--tta-configs", "naive,auto",
                 "--json", str(out)]) == 0  # the plain loop's final loss is the target
    assert calls[3]["target_from"] == "naive" and calls[3]["targets"] == ()


@pytest.mark.parametrize("argv, message", [
    (["--target-acc", "1.5"], "between 0 and 1"),
    (["--target-acc", "-0.2"], "between 0 and 1"),
    (["--target-acc", "0.9", "--seeds", "0"], "--seeds must be positive"),
    (["--target-loss", "x"], "--target-loss takes a number"),
    (["--target-loss", "naive", "--tta-configs", "all,auto"], "add naive to --tta-configs"),
    (["--target-acc", "0.9", "--tta-configs", "naive,fast"], "--tta-configs"),
])
def test_bench_cli_refuses_out_of_range_tta_options(argv, message, capsys):
    assert main(["bench", "--model", "mlp", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_weights_a_run_is_judged_by_are_prepared_on_its_clock(monkeypatch, fake_clock):
    """Schedule-Free's averaged weights need their BatchNorm statistics recalibrated before they are usable: that
    counts in the run's seconds (once, at the end of `fit`, which returns holding them), evaluation does not."""
    pytest.importorskip("schedulefree")
    from dataclasses import asdict, replace

    import torch
    import torchspeed.bench.time_to_target_worker as worker
    import torchspeed.train.eval_view as eval_view
    from torchspeed.bench.runner import bench_configs

    real = eval_view.recalibrate_bn
    calls = []

    def slow_recalibration(*a, **k):  # 100 s on the worker's clock per recalibration
        calls.append(fake_clock.now)
        fake_clock.advance(100.0)
        return real(*a, **k)

    monkeypatch.setattr(worker, "time", fake_clock)
    monkeypatch.setattr(eval_view, "recalibrate_bn", slow_recalibration)
    cfg = next(c for c in bench_configs(torch.device("cpu"), compile=False, hand=False) if c.name == "all")
    spec = {"model": "resnet20", "data": "synthetic", "batch_size": 16, "train_size": 64, "val_size": 32,
            "lr": 0.1, "optimizer": "sgd", "data_seed": 0, "seed": 0, "device": "cpu", "image_size": 16,
            "num_workers": 0, "config": "schedulefree", "budget": 4,
            "train": asdict(replace(cfg.train, schedule="onecycle", trial=False))}
    run = worker.train_budget(spec)
    assert len(calls) == 1  # once, on the clock, by fit; the evaluation after it uses those statistics
    assert 100.0 <= run.train_s < 200.0
    ph = run.phases  # where the seconds went: the recalibration is the end of fit's, the steps' are not
    assert ph["steps"] == 4 and 100.0 <= ph["after_steps_s"] < 200.0 and ph["next_3_steps_s"] < 100.0
    assert ph["judged_weights_s"] < 100.0  # fit handed them over ready
    assert set(ph) == {"before_steps_s", "first_step_s", "next_3_steps_s", "rest_steps_s", "steps", "after_steps_s",
                       "judged_weights_s"}


def test_every_time_to_target_row_is_a_fit_call_and_auto_decides_as_fit_does(monkeypatch, tmp_path):
    """No second composition: the bench's run is `torchspeed.fit` with the run's budget, and auto's decisions are
    the ones `fit(recipe="auto")` makes on the same model, data and budget."""
    from dataclasses import asdict, replace

    import torch
    import torchspeed.fitting as fitting
    import torchspeed.bench.time_to_target_worker as worker
    from torchspeed.bench._worker import _data, _model
    from torchspeed.bench.runner import bench_configs

    calls = []
    real_fit = fitting.fit

    def spy(*a, **k):
        calls.append(k)
        return real_fit(*a, **k)

    monkeypatch.setattr(fitting, "fit", spy)
    cfg = next(c for c in bench_configs(torch.device("cpu"), compile=False, hand=False) if c.name == "all")
    spec = {"model": "mlp", "data": "synthetic", "batch_size": 16, "train_size": 128, "val_size": 32, "lr": 0.1,
            "optimizer": "sgd", "data_seed": 0, "seed": 0, "device": "cpu", "image_size": 16, "num_workers": 0,
            "budget": 6, "train": asdict(replace(cfg.train, trial=False, precision="fp32"))}
    runs = {}
    for config in ("all", "auto"):
        runs[config] = worker.train_budget(spec | {"config": config, "cache_dir": str(tmp_path / config)})
    assert [c["recipe"] for c in calls] == [None, "auto"] and all(c["max_steps"] == 6 for c in calls)
    assert [c["lr"] for c in calls] == [0.1, None]  # auto as a user calls it: no LR of its own
    assert runs["auto"].decisions["recipe_on"] is not None and runs["all"].budget == 6

    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path / "direct"))
    loader, _, device = _data(spec)
    direct = real_fit(_model(spec), loader, optimizer="sgd", device=device, epochs=6, max_steps=6,
                      schedule="onecycle", recipe="auto",
                      config=replace(cfg.train, trial=False, precision="fp32", progress=False, grad_accum=1))
    timed = {"tuning", "evaluation", "recipe_cost"}
    bench = {k: v for k, v in runs["auto"].decisions.items() if k in direct.decisions and k not in timed}
    assert bench and bench == {k: str(v) for k, v in direct.decisions.items() if k in bench}
