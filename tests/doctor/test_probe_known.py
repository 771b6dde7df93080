"""The probe's measurements on workloads whose costs are known by construction (the scripts in known/).

Each script runs under the real probe in this process (`diagnose(..., isolate=False)`: the doctor's own
`run_job`), and each test checks a measurement one of the time-dependent rules reads against the value
built into the workload: sleeps in `Dataset.__getitem__`, in the model's forward and in the optimizer's
step (shares of the step), `.item()` calls per step (host reads), fresh pages written per step (page
faults), models made of one kind of kernel only (kernel shares), JPEGs whose decoding is all or none of
`__getitem__`, and DataLoader workers that keep the one usable core busy (the model's slow-down). A
sleep never returns early and a loaded machine adds time to every part of a step, so the checks are
lower bounds, wide bands around the constructed value and orderings against a control run, never a
time; each fails when the probe reports 0. Which CPU can run bf16 is injected, not read from this one.
"""

import mmap
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from torchspeed.doctor import RULES, diagnose
from torchspeed.doctor._kernels import fastest_op_times, kernel_kind, step_op_times
from torchspeed.doctor.rules import (allocator, cpu_bf16_math, cpu_oversubscribed, data_bound, dataloader_workers,
                                     elementwise_bound, layout_copies, optimizer_kernel, slow_jpeg_decode)
from torchspeed.doctor.rules._common import frac, robust_frac

KNOWN = Path(__file__).parent / "known"
STEPS, WARMUP = 6, 2
# costs.py with every cost on: per step 4 samples x 5 ms of sleep in __getitem__, 20 ms in the forward,
# 20 ms in the optimizer's step, 3 .item() calls, 8 MiB of fresh pages; element-wise operators only
DATA_MS, BATCH, FORWARD_MS, OPTIM_MS, ITEMS, FAULT_MIB = 5.0, 4, 20.0, 20.0, 3, 8
SLEPT_MS = DATA_MS * BATCH + FORWARD_MS + OPTIM_MS
PAGES = (FAULT_MIB << 20) // mmap.PAGESIZE


def _run(script: str, *args: str):
    r = diagnose(str(KNOWN / script), args=[str(a) for a in args], steps=STEPS, warmup=WARMUP, isolate=False)
    assert r.status == "stopped", (r.status, r.traceback, r.notes)
    return r


def _within(value: float, expected: float, low: float = 0.45, high: float = 1.6) -> bool:
    """A generous band around a constructed value: a loaded machine dilutes a share, never zeroes it."""
    return low * expected <= value <= high * expected


@pytest.fixture(scope="module")
def known():
    return _run("costs.py", "--model", "elementwise", "--data-ms", DATA_MS, "--batch", BATCH, "--forward-ms",
                FORWARD_MS, "--optim-ms", OPTIM_MS, "--items", ITEMS, "--fault-mib", FAULT_MIB,
                "--dataset-items", 2)  # and 2 host reads a sample in __getitem__: data loading's, not counted


@pytest.fixture(scope="module")
def control():
    # the same loop with a longer forward sleep and none of the other costs; matrix products only
    return _run("costs.py", "--model", "matmul", "--forward-ms", 50)


def test_data_wait_is_the_sleep_in_getitem(known, control):
    b = known.breakdown
    assert b["data_wait_ms"] >= 0.95 * DATA_MS * BATCH, b  # a sleep never returns early
    expected = DATA_MS * BATCH / SLEPT_MS  # 1/3 of the slept time
    assert _within(frac(known.observation, "data_wait"), expected), b["fractions"]
    assert _within(robust_frac(known.observation, "data_wait"), expected), b["fractions_median"]
    assert {"data-bound", "dataloader-workers"} <= known.rules
    # the forward's sleep is not data wait
    assert robust_frac(control.observation, "data_wait") < data_bound.THRESHOLD / 2
    assert frac(control.observation, "data_wait") < dataloader_workers.THRESHOLD
    assert not {"data-bound", "dataloader-workers"} & control.rules


def test_optimizer_share_is_the_sleep_in_its_step(known, control):
    def share(r):
        return r.breakdown["compute_detail_ms"]["optimizer"] / r.breakdown["step_ms"]

    assert known.breakdown["compute_detail_ms"]["optimizer"] >= 0.95 * OPTIM_MS, known.breakdown
    assert known.breakdown["compute_detail_ms"]["forward"] >= 0.95 * FORWARD_MS, known.breakdown
    assert _within(share(known), OPTIM_MS / SLEPT_MS), known.breakdown
    assert share(known) >= optimizer_kernel.SHARE and known.observation["optimizer"]["fused_available"]
    assert "optimizer-kernel" in known.rules
    assert share(control) < 0.1, control.breakdown  # SGD on one 1024x1024 weight, next to a 50 ms forward


def test_host_reads_are_counted_per_step(known, control):
    """The loop's `.item()` calls, and not the Dataset's (`torch.rand(1).item()` per sample: host tensors, in the
    loader's workers on an accelerator machine)."""
    s = known.observation["syncs"]
    assert s["calls_per_step"] == ITEMS and s["by_kind"] == {"item": ITEMS * known.observation["steps_observed"]}, s
    assert "costs.py" in s["sites"][0]
    assert "host-sync" in known.rules
    assert control.observation["syncs"]["calls"] == 0 and "host-sync" not in control.rules


def test_page_faults_per_step_are_the_pages_written(known, control):
    faults = known.breakdown["minor_faults_per_step"]
    assert 0.95 * PAGES <= faults <= 1.5 * PAGES, faults  # one fault per 4 KiB page, huge pages off
    quiet = control.breakdown["minor_faults_per_step"]
    # the control's own faults (its activations, the allocator's bookkeeping: up to ~500 a step seen) are not the
    # known run's baseline, so the difference is a wide band too, not the exact page count
    assert not allocator.churn(control.observation) and faults - quiet >= 0.5 * PAGES, (faults, quiet)
    glibc = known.observation["env"]["allocator"] == "glibc"  # how this process was started, not a measurement
    assert ("allocator" in known.rules) == glibc and "allocator" not in control.rules


def test_kernel_shares_follow_the_kind_of_operator(known, control):
    ew, mm = known.observation["kernels"], control.observation["kernels"]
    assert ew["matmul_share"] == 0.0 and ew["elementwise_share"] >= 0.85, ew  # no matrix product at all
    assert mm["matmul_share"] >= 0.8 and mm["elementwise_share"] <= 0.1, mm  # views and one fill_ besides the products
    assert ew["elementwise_share"] >= elementwise_bound.SHARE and mm["matmul_share"] >= cpu_bf16_math.SHARE
    assert "elementwise-bound" in known.rules and "elementwise-bound" not in control.rules
    for bf16 in (True, False):  # bf16 math: only on a CPU that runs bf16 natively (injected)
        def check(r):
            o = r.observation
            return RULES["cpu-bf16-math"].check({**o, "env": {**o["env"], "bf16_supported": bf16}})
        assert (check(control) is not None) == bf16 and check(known) is None


def test_layout_copies_are_the_copies_of_swapped_axes(known, control):
    """Linear layers over alternating axes with each swap made contiguous: the copies (about a quarter of the
    aten time here, by construction never none) are counted and found; the matrix products alone (the control)
    and the element-wise model make no copy under a contiguous/reshape/flatten call, and no finding."""
    r = _run("costs.py", "--model", "layout")
    share = r.observation["kernels"]["layout_share"]
    assert share >= layout_copies.SHARE and r.observation["kernels"]["matmul_share"] >= 0.5, r.observation["kernels"]
    assert "layout-copies" in r.rules and "layout-copies" not in control.rules and "layout-copies" not in known.rules
    assert control.observation["kernels"]["layout_share"] == 0.0 == known.observation["kernels"]["layout_share"]
    f = r.finding("layout-copies")
    assert f.basis == "estimated" and "contiguous" in f.fix and "torch.compile" in f.fix


def test_decode_share_is_all_or_none_of_getitem():
    r = _run("jpegs.py")
    ds = {d["dataset"]: d for d in r.observation["datasets"]}
    whole, little = ds["DecodeOnly"], ds["DecodeThenSleep"]
    assert whole["decoders"].get("PIL JPEG", 0) >= 12 and little["decoders"].get("PIL JPEG", 0) >= 12, ds
    assert whole["decode_share"] >= 0.8, whole  # open + decode is all DecodeOnly does
    assert little["getitem_ms"] >= 5.0 and little["decode_share"] <= 0.2, little  # an 8x8 JPEG, then 5 ms asleep
    assert whole["decode_ms"] > little["decode_ms"] > 0
    f = r.finding("slow-jpeg-decode")
    assert f is not None and "DecodeOnly[i]" in f.evidence and whole["decode_share"] >= slow_jpeg_decode.SHARE


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins the process to one core (Linux)")
@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3 workers on one core, on purpose
def test_busy_workers_on_the_one_core_slow_the_model_down():
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(saved)})  # one usable core, whatever this machine has; the workers inherit it
    try:
        r = _run("contention.py")
    finally:
        os.sched_setaffinity(0, saved)
    c = r.observation["cpu"]
    assert (c["workers"], c["threads"], c["cores"]) == (3, 1, 1), c
    assert c["worker_ms_per_batch"] >= 95.0, c  # each worker spins 100 ms per sample, batch 1
    assert c["workers_busy_during_alone"] is not None and c["workers_busy_during_alone"] < cpu_oversubscribed.BUSY
    s = cpu_oversubscribed.slow_down(c)
    assert s is not None, c  # the model was timed alone
    low, median = s["ratio"]
    # four busy processes on one core: about 4x; a loaded core moves it either way between the two timings
    assert low >= cpu_oversubscribed.RATIO and 1.3 <= median <= 16.0, c
    assert "cpu-oversubscribed" in r.rules


def _event(name: str, start: float, us: float):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=start + us), self_cpu_time_total=us)


def test_a_preempted_step_does_not_move_the_kernel_shares():
    # three steps of 2 ms of matrix products, a 0.1 ms ReLU and a 0.02 ms fill; in the second step a 4 ms
    # scheduler tick lands on the fill, in the third on the ReLU
    events = []
    for i, (relu, fill) in enumerate([(100, 20), (100, 4020), (4100, 20)]):
        t = i * 10_000.0
        events.append(_event("torchspeed::kernel_step", t, 9_000))
        events += [_event("aten::mm", t + 10, 2000), _event("aten::relu", t + 2100, relu),
                   _event("aten::fill_", t + 6500, fill)]
    events.append(_event("aten::mm", 50_000, 2000))  # outside every step: not counted
    per_step = step_op_times(events)
    assert [round(sum(s.values())) for s in per_step] == [2120, 6120, 6120]
    ops = fastest_op_times(per_step)
    assert ops == {"aten::mm": 2000, "aten::relu": 100, "aten::fill_": 20}
    matmul = sum(t for n, t in ops.items() if kernel_kind(n) == "matmul") / sum(ops.values())
    assert matmul == pytest.approx(2000 / 2120)
    # without step marks every event is one step
    assert step_op_times([_event("aten::mm", 0, 5)]) == [{"aten::mm": 5}]


def test_a_loop_that_updates_its_weights_by_hand_has_its_steps_counted_at_each_backward():
    r = _run("by_hand.py")  # stopped after warmup + steps: without a torch optimizer it used to run to its end
    obs = r.observation
    assert obs["step_boundary"] == "backward" and obs["steps_observed"] == STEPS + WARMUP
    assert obs["syncs"]["calls_per_step"] == pytest.approx(2.0, abs=0.5)  # the two .item() reads a step
    assert obs["breakdown"]["compute_ms"] > 0  # the forward and backward fall inside the counted steps


def test_a_script_that_spawns_its_training_processes_is_stopped_before_they_start_and_told_why():
    r = _run("spawns.py")  # stopped (not "exited": the processes never ran)
    assert r.observation["processes_spawned"] == 2 and r.observation["steps_observed"] == 0
    assert any("torch.multiprocessing.spawn of train" in n and "train(0, 1)" in n for n in r.notes), r.notes


def test_an_optimizer_that_is_never_stepped_leaves_nothing_to_measure_and_says_so():
    r = diagnose(str(KNOWN / "never_steps.py"), steps=STEPS, warmup=WARMUP, isolate=False)
    obs = r.observation
    assert r.status == "finished" and obs["steps_observed"] == 0 and obs["optimizers_made"] == 1
    assert any("an optimizer was made but step() was never called: no training step, nothing to measure" in n
               for n in r.notes), r.notes
    assert all(not RULES[f.rule].per_step for f in r.findings), [f.rule for f in r.findings]
    assert r.finding("no-amp") is None  # its "0% of the step is compute" read an empty breakdown
