"""Every automatic switch measured on the user's model (train/switches.py, train/autoswitch.py).

The decisions are tested with injected device capabilities and injected measurements: nothing
here depends on this machine's CPU, its load or the wall clock.
"""

import copy

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.env import DeviceCaps
from torchspeed.train.autoswitch import decide_switches, first_batches
from torchspeed.train.decision import Decision, TrialCache
from torchspeed.train.precision import resolve_precision
from torchspeed.train.switches import Switches, SwitchTrial, candidate_grid, choose, numerics_ok

AVX2 = DeviceCaps("cpu", cpu_bf16=False, cores=2)
BF16_CPU = DeviceCaps("cpu", cpu_bf16=True, cores=2)
SM80 = DeviceCaps("cuda", cuda_capability=(8, 0))
SM70 = DeviceCaps("cuda", cuda_capability=(7, 0))


def _loader(n=64, batch=16, size=8, classes=4):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 3, size, size, generator=g), torch.randint(0, classes, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(1))


def _fake(seconds: dict[str, float], losses: dict[str, float] | None = None):
    """A measure_fn: fixed seconds per step (and first-step loss) per candidate label; records the calls."""
    calls = []

    def measure(s: Switches):
        calls.append(s.label())
        return seconds[s.label()], (losses or {}).get(s.precision, 1.0)
    measure.calls = calls
    return measure


def test_candidates_are_a_pure_function_of_the_capabilities():
    labels = lambda caps, conv: [s.label() for s in candidate_grid(caps=caps, has_conv=conv)]  # noqa: E731
    assert labels(AVX2, True) == ["fp32", "fp32+channels_last"]  # emulated bf16 is never tried
    assert labels(BF16_CPU, True) == ["fp32", "fp32+channels_last", "bf16", "bf16+channels_last"]
    assert labels(BF16_CPU, False) == ["fp32", "bf16"]  # no convolutions: no layout to choose
    assert labels(SM80, False) == ["fp32", "bf16"]
    assert labels(SM70, False) == ["fp32", "fp16"]
    assert [s.label() for s in candidate_grid(caps=BF16_CPU, has_conv=True, precision="fp32")] == \
        ["fp32", "fp32+channels_last"]  # a precision the user fixed is not searched


def test_rules_prior_by_capability_including_cuda():
    assert resolve_precision("auto", device="cpu", caps=AVX2).name == "fp32"
    assert resolve_precision("auto", device="cpu", caps=BF16_CPU).name == "bf16"
    p70 = resolve_precision("auto", device="cpu", caps=SM70)
    assert p70.name == "fp16" and p70.needs_scaler and p70.device_type == "cuda"
    p80 = resolve_precision("auto", device="cpu", caps=SM80)
    assert p80.name == "bf16" and not p80.needs_scaler


def test_choose_takes_the_fastest_but_not_a_change_within_noise():
    plain = Switches("fp32", False)
    t = {plain: [1.0, 1.0], Switches("fp32", True): [0.8, 0.8], Switches("bf16", True): [1.3, 1.2]}
    assert choose(t, plain=plain)[0] == Switches("fp32", True)
    t[Switches("fp32", True)] = [0.99, 0.99]  # 1% faster: within min_gain, keep the plain settings
    pick, why = choose(t, plain=plain)
    assert pick == plain and "not worth a change" in why
    assert choose(t, plain=plain, rejected={plain: "x"})[0] == Switches("fp32", True)


def test_numerics_guard():
    assert numerics_ok(2.30, 2.31, tol=0.05)
    assert not numerics_ok(2.30, 3.0, tol=0.05)
    assert not numerics_ok(2.30, float("nan"), tol=0.05)


def test_bf16_cpu_where_bf16_loses_keeps_fp32(tiny_cnn):
    model = tiny_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    fake = _fake({"fp32+fused": 1.0, "fp32+channels_last+fused": 0.9, "bf16+fused": 1.1,
                  "bf16+channels_last+fused": 1.4, "fp32+channels_last+foreach": 0.95})
    sw, d = decide_switches(model, opt, _loader(), device=torch.device("cpu"), caps=BF16_CPU, measure_fn=fake)
    assert sw == Switches("fp32", True, True)
    assert isinstance(d["precision"], Decision) and d["precision"].value == "fp32"
    assert d["channels_last"].value is True and d["fused_optimizer"].value is True
    assert d["switch_trial"].value == "measured" and d["switch_trial"].measured["stages"][0]["chosen"] == \
        "fp32+channels_last+fused"
    from torchspeed.train.autoswitch import TRIAL_SETTINGS
    assert fake.calls.count("bf16+channels_last+fused") == TRIAL_SETTINGS["rounds"]  # interleaved rounds


def test_a_half_precision_that_moves_the_loss_is_not_taken(tiny_cnn):
    fake = _fake({"fp32": 1.0, "fp32+channels_last": 1.0, "bf16": 0.5, "bf16+channels_last": 0.5},
                 losses={"fp32": 2.3, "bf16": 2.9})
    sw, d = decide_switches(tiny_cnn(), None, _loader(), device=torch.device("cpu"), caps=BF16_CPU,
                            fused=False, measure_fn=fake)
    assert sw.precision == "fp32" and "bf16" in d["switch_trial"].measured["rejected"]


def test_cuda_sm80_device_decision_is_measured_too(tiny_cnn):
    fake = _fake({"fp32": 2.0, "bf16": 1.0})
    sw, d = decide_switches(tiny_cnn(), None, _loader(), device=torch.device("cpu"), caps=SM80,
                            channels_last=False, fused=False, measure_fn=fake)
    assert sw.precision == "bf16" and "2.00x" in d["precision"].reason


def test_short_runs_keep_the_rules_and_say_so(tiny_cnn):
    fake = _fake({})
    sw, d = decide_switches(tiny_cnn(), None, _loader(), device=torch.device("cpu"), caps=BF16_CPU, fused=False,
                            remaining_steps=20, measure_fn=fake)
    assert sw == Switches("bf16", True) and fake.calls == []
    assert d["switch_trial"].value == "skipped" and "too short" in d["switch_trial"].reason
    assert d["precision"].reason.startswith("rule")


def test_the_trial_leaves_model_rng_and_data_order_untouched(tiny_cnn):
    model = tiny_cnn()
    before = copy.deepcopy(model.state_dict())
    loader = _loader()
    order = [y.tolist() for _, y in _loader()]
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    decide_switches(model, None, loader, device=torch.device("cpu"), caps=AVX2, fused=False, trial=True,
                    cache=TrialCache(path=None))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert [y.tolist() for _, y in loader] == order
    again = _loader()
    assert len(first_batches(again, 2)) == 2 and [y.tolist() for _, y in again] == order


def test_real_measurement_runs_each_candidate_and_the_second_fit_reads_the_cache(tiny_cnn, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    steps = []
    real = SwitchTrial._measure
    monkeypatch.setattr(SwitchTrial, "_measure", lambda self, s: steps.append(s) or real(self, s))
    kw = dict(epochs=1, trial=True, progress=False, compile=False, lr=0.05)
    r1 = torchspeed.fit(tiny_cnn(), _loader(), **kw)
    first = len(steps)
    from torchspeed.train.autoswitch import TRIAL_SETTINGS
    per = TRIAL_SETTINGS["warmup"] + TRIAL_SETTINGS["steps"]  # warm-up + timed steps per measurement
    assert first >= 2 * TRIAL_SETTINGS["rounds"] and r1.decisions["switch_trial"].value == "measured"
    assert r1.decisions["switch_trial"].measured["steps"] == first * per
    r2 = torchspeed.fit(tiny_cnn(), _loader(), **kw)
    assert len(steps) == first  # no trial step the second time
    assert r2.decisions["switch_trial"].value == "cached"
    assert r2.decisions["precision"].value == r1.decisions["precision"].value
    assert r2.decisions["channels_last"].value == r1.decisions["channels_last"].value


def test_fit_and_the_bench_all_row_make_the_same_decisions(monkeypatch):
    """The bench's `all` row runs what fit does: the same trial, so the same choice (injected timings)."""
    from torchspeed.bench import _worker
    from torchspeed.bench.runner import bench_configs
    from torchspeed.bench.workloads import create_model

    seconds = {"fp32+fused": 1.0, "fp32+channels_last+fused": 0.7, "bf16+fused": 0.9,
               "bf16+channels_last+fused": 0.8, "fp32+channels_last+foreach": 0.75}
    monkeypatch.setenv("TORCHSPEED_CPU_PROFILE", "avx512_bf16")
    monkeypatch.setattr(SwitchTrial, "_measure", lambda self, s: (seconds[s.label()], 1.0))
    all_cfg = next(c for c in bench_configs(torch.device("cpu"), compile=False) if c.name == "all").train
    from dataclasses import asdict
    spec = {"data": "synthetic", "train_size": 64, "val_size": 32, "seed": 0, "device": "cpu", "num_workers": 0,
            "batch_size": 16, "model": "resnet20", "lr": 0.05, "train": asdict(all_cfg), "image_size": 16}
    state = _worker._TrainerState(spec)
    state.warm_up(1)
    torch.manual_seed(0)
    res = torchspeed.fit(create_model("resnet20", image_size=16), state.loader, epochs=1, max_steps=1, trial=True,
                         progress=False, compile=False, lr=0.05, schedule=None)
    keys = ("precision", "channels_last", "fused_optimizer")
    assert {k: state.trainer.decisions[k].value for k in keys} == {k: res.decisions[k].value for k in keys} == \
        {"precision": "fp32", "channels_last": True, "fused_optimizer": True}


def test_in_process_malloc_settings_cut_page_faults():
    """Page faults per training step in one process, before and after `tune_malloc` (no timing)."""
    import subprocess
    import sys

    code = r"""
import os, resource, torch
for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"): assert k not in os.environ
torch.set_num_threads(1)
from torchspeed.bench.workloads import create_model
from torchspeed.train.backends import tune_malloc
m = create_model("resnet20"); opt = torch.optim.SGD(m.parameters(), lr=0.1)
x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
def faults(n=4):
    for _ in range(2):
        torch.nn.functional.cross_entropy(m(x), y).backward(); opt.step(); opt.zero_grad()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        torch.nn.functional.cross_entropy(m(x), y).backward(); opt.step(); opt.zero_grad()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / n
before = faults()
d = tune_malloc()
print(before, faults(), d.value)
"""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    before, after, applied = out.stdout.split()
    if applied != "True":
        pytest.skip("not glibc malloc here: nothing to tune")
    assert float(after) < 0.3 * float(before), (before, after)


def test_tune_malloc_calls_mallopt_with_the_bench_settings(monkeypatch):
    import torchspeed.train.backends as backends

    monkeypatch.setattr(backends, "allocator_in_use", lambda: "glibc")
    for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(k, raising=False)
    calls = []
    d = backends.tune_malloc(mallopt=lambda param, value: calls.append((param, value)) or 1)
    assert d.value is True and calls == [(-3, 32 << 20), (-1, 1 << 30)]
    monkeypatch.setattr(backends, "allocator_in_use", lambda: "tcmalloc")
    assert backends.tune_malloc(mallopt=lambda *a: 1).value is False


def test_decisions_are_decision_objects_and_json_ready(tiny_cnn, tmp_path):
    res = torchspeed.fit(tiny_cnn(), _loader(), epochs=1, progress=False, compile=False, out_dir=str(tmp_path))
    for k in ("precision", "channels_last", "compile", "optimizer"):
        assert isinstance(res.decisions[k], Decision), k
    import json
    written = json.loads((tmp_path / "metrics.json").read_text())["decisions"]
    assert written["channels_last"]["value"] in (True, False) and "reason" in written["precision"]


def test_a_trial_that_cannot_run_leaves_the_rules_in_charge(tiny_cnn, monkeypatch):
    def boom(self, grid, **kw):
        raise RuntimeError("out of memory copying the model")
    monkeypatch.setattr(SwitchTrial, "run", boom)
    sw, d = decide_switches(tiny_cnn(), None, _loader(), device=torch.device("cpu"), caps=BF16_CPU, fused=False,
                            trial=True, cache=TrialCache(path=None))
    assert sw == Switches("bf16", True) and d["switch_trial"].value == "failed" and "out of memory" in \
        d["switch_trial"].reason


def test_threads_are_measured_only_when_loader_workers_share_the_cores(tiny_cnn):
    from torchspeed.train.autoswitch import _thread_choices

    ds = _loader().dataset
    assert _thread_choices(DataLoader(ds, num_workers=1), torch.device("cpu"), AVX2) == (2, 1)
    assert _thread_choices(DataLoader(ds), torch.device("cpu"), AVX2) == ()  # no workers: all cores
    assert _thread_choices(DataLoader(ds, num_workers=1), torch.device("cpu"), DeviceCaps("cpu", cores=1)) == ()
    fake = _fake({"fp32": 1.0, "fp32+channels_last": 0.8, "fp32+channels_last+2 threads": 0.8,
                  "fp32+channels_last+1 threads": 0.6})
    loader = DataLoader(ds, batch_size=16, num_workers=1)
    sw, d = decide_switches(tiny_cnn(), None, loader, device=torch.device("cpu"), caps=AVX2, fused=False,
                            measure_fn=fake)
    assert sw == Switches("fp32", True, None, 1) and d["threads"].value == 1


def test_decisions_dump_to_json_as_they_are():
    import json
    d = Decision("bf16", "measured", {"x": 1.0})
    assert json.loads(json.dumps({"precision": d})) == {"precision": {"value": "bf16", "reason": "measured",
                                                                      "measured": {"x": 1.0}}}
    assert d.value == "bf16" and str(d) == "bf16 (measured)" and Decision(True, "r").measured is None


def test_a_trial_measured_under_other_kernels_is_not_reused(tiny_cnn, tmp_path, monkeypatch):
    """ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA change which kernels run (bf16 measured 12x slower with AVX2
    kernels on a bf16 CPU): the cache key holds them, so a run under other kernels measures afresh."""
    from torchspeed.train import autoswitch

    cache = TrialCache(path=tmp_path / "trials.json")
    fake = _fake({"fp32": 1.0, "bf16": 0.5})
    kw = dict(device=torch.device("cpu"), caps=BF16_CPU, channels_last=False, fused=False, trial=True, cache=cache)
    monkeypatch.setattr(autoswitch, "kernel_isa", lambda: {"aten": "AVX512", "onednn": None})
    monkeypatch.setattr(SwitchTrial, "_measure", lambda self, s: fake(s))
    _, d1 = decide_switches(tiny_cnn(), None, _loader(), **kw)
    _, d2 = decide_switches(tiny_cnn(), None, _loader(), **kw)
    assert d1["switch_trial"].value == "measured" and d2["switch_trial"].value == "cached"
    monkeypatch.setattr(autoswitch, "kernel_isa", lambda: {"aten": "AVX2", "onednn": "AVX2"})
    _, d3 = decide_switches(tiny_cnn(), None, _loader(), **kw)
    assert d3["switch_trial"].value == "measured"
