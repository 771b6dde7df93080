"""The hand-written ceiling (bench/hand.py) and the MFU column (bench/flops.py)."""

import json
import os

import pytest
import torch
from torch.utils.data import DataLoader

from torchspeed.bench.flops import mfu, peak_bf16_flops, train_flops_per_sample
from torchspeed.bench.hand import HandLoop, HandSettings, hand_precisions, search_hand_settings
from torchspeed.bench.runner import bench_configs, run_bench
from torchspeed.bench.workloads import SyntheticImages, create_model
from torchspeed.env import GLIBC_MALLOC_ENV, detect


def _tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
                               torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(8, 10))


def test_hand_search_tries_the_whole_eager_grid_and_returns_the_fastest(monkeypatch):
    import torchspeed.bench.hand as hand

    # Fixed, fake timings (no wall clock): channels_last + fused is the fastest combination.
    fake = {HandSettings("fp32", False, False): 4.0, HandSettings("fp32", True, False): 3.0,
            HandSettings("fp32", False, True): 3.5, HandSettings("fp32", True, True): 2.0,
            HandSettings("fp32", True, True, True): 2.5}
    seen = []
    monkeypatch.setattr(hand, "hand_precisions", lambda device: ["fp32"])
    monkeypatch.setattr(hand, "_time_candidate", lambda mk, loader, dev, s, steps, warm: seen.append(s) or fake[s])
    loader = DataLoader(SyntheticImages(32, size=8), batch_size=8)
    best, log = search_hand_settings(_tiny, loader, torch.device("cpu"))
    assert best == HandSettings("fp32", True, True)  # compile measured slower: not kept
    assert set(log["tried"]) == {"fp32", "fp32+channels_last", "fp32+fused", "fp32+channels_last+fused",
                                 "fp32+channels_last+fused+compile"}
    assert len(seen) == 4 * 2 + 1  # two interleaved passes over the grid, then compile on the winner
    fake[HandSettings("fp32", True, True, True)] = 1.0
    assert search_hand_settings(_tiny, loader, torch.device("cpu"))[0].compile


def test_hand_loop_trains_and_channels_last_is_applied():
    loader = DataLoader(SyntheticImages(64, size=8), batch_size=16, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    loop = HandLoop(_tiny(), loader, torch.device("cpu"), settings=HandSettings("fp32", True, True), lr=0.1)
    assert loop.model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert loop.opt.defaults.get("fused") is True
    loop.run(1)
    first = loop.train_loss()
    loop.restart()
    loop.run(12)
    assert loop.train_loss() < first
    assert 0.0 <= loop.evaluate(loader) <= 1.0


@pytest.mark.capability
def test_bench_has_a_hand_row_and_reports_all_over_hand(tmp_path, cpu_profile, monkeypatch):
    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path / "cache"))  # all's trial measures, not reads a cache
    names = [c.name for c in bench_configs(torch.device("cpu"))]
    assert names[-2:] == ["hand", "all"] and "omp_passive" in names
    res = run_bench(model="mlp", batch_size=32, steps=2, rounds=2, warmup=1, device="cpu", configs=["hand", "all"],
                    eval_batches=1, train_size=256, compile=False, progress=False)
    assert [r.config for r in res.rows] == ["naive", "hand", "all"]
    hand_row = res.rows[1]
    search = json.loads(hand_row.decisions["search"])
    # fused or not, for fp32 and (on a CPU with native bf16) bf16: an MLP has no layout to try
    precisions = ["fp32", "bf16"] if cpu_profile in ("avx512_bf16", "amx") else ["fp32"]
    assert hand_precisions(torch.device("cpu")) == precisions
    assert search["chosen"] == hand_row.decisions["hand_settings"] and len(search["tried"]) == 2 * len(precisions)
    assert {k.split("+")[0] for k in search["tried"]} == set(precisions)
    assert res.meta["all_over_hand"] > 0 and len(res.meta["all_over_hand_runs"]) == 2
    from torchspeed.bench.compare import compare_ratios
    assert res.meta["all_over_hand_verdict"] == compare_ratios(res.meta["all_over_hand_runs"])["verdict"]
    assert res.meta["all_over_hand_interval"]["low"] <= res.meta["all_over_hand"] <= res.meta["all_over_hand_interval"]["high"]
    # the hand row trains the same steps from the same weights: its loss is close to naive's
    assert hand_row.train_loss == pytest.approx(res.rows[0].train_loss, rel=0.05)
    # all measured its switches on this model (fit's trial) and reports the cost in its decisions
    trial = res.rows[2].decisions["switch_trial"]
    assert trial["value"] == "measured" and trial["measured"]["steps"] > 0 and trial["measured"]["trial_s"] > 0
    assert all(r.mfu is None for r in res.rows)  # no MFU on a CPU


def test_omp_passive_row_starts_its_process_with_the_wait_policy():
    cfg = next(c for c in bench_configs(torch.device("cpu")) if c.name == "omp_passive")
    assert dict(cfg.env) == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_training_flops_and_gpu_peaks():
    # ResNet-50 at 224 px: 4.1 GMACs forward, so about 3 x 8.2 GFLOPs for forward + backward
    assert 23e9 < train_flops_per_sample("resnet50", image_size=224) < 26e9
    # the CIFAR ResNet-18 forward is 0.56 GMACs
    assert train_flops_per_sample("resnet18") == pytest.approx(3 * 2 * 0.556e9, rel=0.01)
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_bf16_flops("NVIDIA H200") == 989.4e12
    assert peak_bf16_flops("AMD EPYC") is None
    assert mfu(samples_per_s=1000, flops_per_sample=24.3e9, device_name="NVIDIA H100 80GB HBM3") == pytest.approx(
        24.3e12 / 989.4e12)


def test_resnets_take_the_imagenet_stem_from_64_px():
    small, big = create_model("resnet50", image_size=32), create_model("resnet50", image_size=224)
    assert small.conv1.kernel_size == (3, 3) and isinstance(small.maxpool, torch.nn.Identity)
    assert big.conv1.kernel_size == (7, 7) and isinstance(big.maxpool, torch.nn.MaxPool2d)
    r20 = create_model("resnet20")
    assert sum(p.numel() for p in r20.parameters()) == pytest.approx(0.27e6, rel=0.03)


def test_all_sleeps_its_openmp_threads_only_when_the_cores_are_shared(monkeypatch):
    def env_of_all(busy):
        return dict(next(c for c in bench_configs(torch.device("cpu"), busy=busy) if c.name == "all").env)

    malloc = {} if detect().tcmalloc_path else dict(GLIBC_MALLOC_ENV)  # glibc tuned where tcmalloc is not there
    assert env_of_all(True) == {"OMP_WAIT_POLICY": "PASSIVE", **malloc}
    assert env_of_all(False) == malloc
    import torchspeed.env as env
    from torchspeed.bench import runner

    monkeypatch.setattr(env, "usable_cores", lambda: 2)
    # The run queue decides where the kernel reports one; the timing probe is only recorded.
    monkeypatch.setattr(env, "parallel_speedup", lambda: 1.95)
    monkeypatch.setattr(env, "other_runnable", lambda: 1.2)  # a hog beside us (no timing here)
    busy, evidence = runner.machine_busy()
    assert busy and evidence["other_runnable"] == 1.2 and evidence["parallel_speedup_2proc"] == 1.95
    monkeypatch.setattr(env, "parallel_speedup", lambda: 1.1)  # a jittery probe on idle cores
    monkeypatch.setattr(env, "other_runnable", lambda: 0.05)
    assert runner.machine_busy()[0] is False
    # No run queue (not Linux): the probe decides.
    monkeypatch.setattr(env, "other_runnable", lambda: None)
    assert runner.machine_busy()[0] is True
    monkeypatch.setattr(env, "parallel_speedup", lambda: 1.95)
    assert runner.machine_busy()[0] is False


def _stat_file(path, running):
    path.write_text(f"cpu  1 2 3 4\nprocs_running {running}\nprocs_blocked 0\n")
    return str(path)


def test_other_runnable_reads_the_run_queue_without_counting_itself(tmp_path):
    from torchspeed.env import other_runnable

    assert other_runnable(samples=3, interval_s=0, stat_path=_stat_file(tmp_path / "idle", 1)) == 0.0
    assert other_runnable(samples=3, interval_s=0, stat_path=_stat_file(tmp_path / "hog", 3)) == 2.0
    (tmp_path / "odd").write_text("cpu 1 2 3\n")
    assert other_runnable(samples=2, interval_s=0, stat_path=str(tmp_path / "odd")) is None
    assert other_runnable(samples=2, interval_s=0, stat_path=str(tmp_path / "missing")) is None


def test_bench_cli_prints_all_over_hand_with_its_interval(tmp_path, capsys):
    from torchspeed.cli.main import main

    out = tmp_path / "out.json"
    assert main(["bench", "--quick", "--model", "mlp", "--configs", "hand,all", "--rounds", "3", "--json", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    meta = json.loads(out.read_text())["meta"]
    cmp = meta["all_over_hand_interval"]
    assert cmp["pairs"] == 3 and meta["all_over_hand_verdict"] == cmp["verdict"]
    assert f"all/hand: {meta['all_over_hand']:.2f}x" in printed
    assert f"interval {cmp['low']:.2f}-{cmp['high']:.2f} over 3 pairs" in printed


def test_malloc_tuned_row_and_its_process_environment(monkeypatch):
    from torchspeed.bench.config_process import config_env

    configs = {c.name: c for c in bench_configs(torch.device("cpu"))}
    if detect().tcmalloc_path:
        assert "malloc_tuned" not in configs and configs["all"].allocator == "tcmalloc"
        return
    assert dict(configs["malloc_tuned"].env) == dict(GLIBC_MALLOC_ENV)
    # the settings reach the row's process, and only that row's (naive does not inherit them from the shell)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "12345")
    assert config_env(configs["malloc_tuned"])["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20)
    assert "MALLOC_MMAP_THRESHOLD_" not in config_env(configs["naive"])
    assert "MALLOC_TRIM_THRESHOLD_" in config_env(configs["all"])


def test_malloc_settings_cut_page_faults_per_step():
    """The mechanism, counted rather than timed: fresh pages faulted in per ResNet-20 training step
    (about 9,000-16,000 with glibc's defaults, under 1,000 with the settings, on the development host).

    Transparent huge pages, where the host has them always on, fault 2 MiB at a time and shrink the
    default's count (3,800 against 900 on one CI host), so the measured process turns them off for
    itself (prctl PR_SET_THP_DISABLE) and the bound is a factor of 3, not a host's reading."""
    import subprocess
    import sys

    code = ("import ctypes, resource\n"
            "try: ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)\n"
            "except (OSError, AttributeError): pass\n"
            "import torch\n"
            "from torchspeed.bench.workloads import create_model\n"
            "m = create_model('resnet20').to(memory_format=torch.channels_last)\n"
            "x = torch.randn(64, 3, 32, 32).contiguous(memory_format=torch.channels_last)\n"
            "y = torch.randint(0, 10, (64,)); opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)\n"
            "def step():\n"
            "    torch.nn.functional.cross_entropy(m(x), y).backward(); opt.step(); opt.zero_grad()\n"
            "for _ in range(3): step()\n"
            "f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "for _ in range(4): step()\n"
            "print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f) / 4)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    default, tuned = (float(subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                                           check=True, timeout=300).stdout) for e in (env, env | dict(GLIBC_MALLOC_ENV)))
    assert default > 2000 and tuned < default / 3, (default, tuned)
