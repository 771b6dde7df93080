"""cpu-oversubscribed ranks on spreads, not single readings: the script's per-step compute quartiles against
the quartiles of the steps timed alone, timed once the workers went idle. Observations are injected."""

import copy

from torchspeed.doctor import RULES, run_rules
from torchspeed.doctor._contention import children_cpu_s, quartiles, wait_children_idle
from torchspeed.doctor.registry import settle
from torchspeed.doctor.report import Finding

from test_rules import CLEAN, _set

OVER = {"workers": 2, "threads": 2, "cores": 2, "compute_ms_in_script": 9.0, "compute_ms_alone": 6.0,
        "worker_ms_per_batch": 4.0, "workers_busy_during_alone": 0.0}


def _obs(cpu: dict) -> dict:
    o = copy.deepcopy(CLEAN)
    _set("cpu", cpu)(o)
    return o


def _check(cpu):
    return RULES["cpu-oversubscribed"].check(_obs(cpu))


def test_tight_spreads_fire_and_rank_on_the_low_end():
    f = _check({**OVER, "compute_ms_in_script_iqr": [8.8, 9.2], "compute_ms_alone_iqr": [5.9, 6.1]})
    assert f is not None and f.basis == "timed"
    lo, hi = f.interval
    # low end: 8.8 - 6.1 = 2.7 ms saved of a 10 ms step; high end: 9.2 - 5.9 = 3.3 ms
    assert abs(lo - 10 / 7.3) < 1e-3 and abs(hi - 10 / 6.7) < 1e-3 and lo <= f.est_gain <= hi
    assert f.severity == "high"  # 1.37x on the low end
    assert "middle half of the steps 8.80-9.20" in f.evidence


def test_overlapping_spreads_do_not_fire_on_the_median_alone():
    # the medians are 1.5x apart, but a quarter of the script's steps are no slower than the slow steps alone
    wide = {**OVER, "compute_ms_in_script_iqr": [6.5, 12.0], "compute_ms_alone_iqr": [5.8, 6.6]}
    assert _check(wide) is None
    # one reading each (an old observation): the rule reads the medians as before
    assert _check(OVER) is not None


def test_severity_follows_the_low_end_so_a_noisy_reading_cannot_flip_it():
    # median gain 10/7 = 1.43x (high), but the low end only 10/8.9 = 1.12x: medium, run after run
    f = _check({**OVER, "compute_ms_in_script_iqr": [7.9, 10.0], "compute_ms_alone_iqr": [5.5, 6.8]})
    assert f is not None and f.est_gain > 1.25 and f.severity == "medium"


def test_alone_timed_while_the_workers_were_busy_is_no_evidence():
    busy = {**OVER, "compute_ms_in_script_iqr": [8.8, 9.2], "compute_ms_alone_iqr": [5.9, 6.1],
            "workers_busy_during_alone": 0.9}
    assert _check(busy) is None
    # ... unless the thread-count fix itself was measured on the script (the environment re-run)
    o = _obs(busy)
    o["env_fixes"] = {"threads": {"fix": "threads", "rule": "cpu-oversubscribed", "env": {"OMP_NUM_THREADS": "1"},
                                  "steps": 6, "speedup": 1.3, "ratios": [1.28, 1.32], "iqr": [1.29, 1.31],
                                  "within_noise": False, "rounds": 2, "baseline_ms": 13.0, "candidate_ms": 10.0}}
    f = next(g for f in run_rules(o) for g in (f, *f.also) if g.rule == "cpu-oversubscribed")
    assert f.basis == "measured" and f.severity == "high"


def test_settle_ranks_a_timed_finding_on_its_interval():
    f = Finding(rule="x", severity="high", evidence="e", fix="f", est_gain=1.4, basis="timed", interval=(1.1, 1.6))
    assert settle(f).severity == "medium"
    assert settle(Finding(rule="x", severity="high", evidence="e", fix="f", est_gain=1.4, basis="timed")).severity \
        == "high"


def test_waits_until_the_workers_stop_using_cpu():
    cpu = iter([0.0, 0.5, 0.9, 1.0, 1.0, 1.0, 1.0])  # busy for three polls, then flat
    clock = iter(range(100))
    got = wait_children_idle(timeout=50, poll=1, read=lambda: next(cpu), clock=lambda: next(clock),
                             sleep=lambda s: None)
    assert got["idle"] is True and got["waited_s"] == 5
    busy = iter(range(100))
    got = wait_children_idle(timeout=5, poll=1, read=lambda: float(next(busy)), clock=iter(range(100)).__next__,
                             sleep=lambda s: None)
    assert got["idle"] is False
    assert wait_children_idle(read=lambda: None)["idle"] is None


def test_children_cpu_time_is_read_from_proc(tmp_path):
    def stat(pid, ppid, ut, st):
        d = tmp_path / str(pid)
        d.mkdir()
        rest = ["S", str(ppid)] + ["0"] * 9 + [str(ut), str(st)] + ["0"] * 5
        (d / "stat").write_text(f"{pid} (python worker) " + " ".join(rest))
    stat(11, 7, 150, 50)
    stat(12, 7, 100, 0)
    stat(13, 8, 999, 999)  # another process's child
    (tmp_path / "self").mkdir()
    import torchspeed.doctor._contention as c
    assert children_cpu_s(7, proc=str(tmp_path)) == (150 + 50 + 100) / c._TICK
    assert children_cpu_s(7, proc=str(tmp_path / "missing")) is None


def test_quartiles():
    assert quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == [2.0, 4.0] and quartiles([3.0]) == [3.0, 3.0]


def test_the_model_is_timed_alone_only_after_the_workers_went_idle(monkeypatch):
    from types import SimpleNamespace

    import torch
    from torch import nn

    import torchspeed.doctor._contention as contention
    from torchspeed.doctor.verify import measure_contention

    calls = []
    monkeypatch.setattr(contention, "wait_children_idle", lambda **kw: calls.append("wait") or {"idle": True})
    cpu = iter([10.0, 10.5])  # the workers' CPU seconds before and after the timing

    def read():
        calls.append("read")
        return next(cpu)
    monkeypatch.setattr(contention, "children_cpu_s", read)
    model = nn.Linear(4, 2)
    cap = SimpleNamespace(model=model, args=(torch.zeros(3, 4),), kwargs={}, set_to_none=True, loss_module=None,
                          target=None, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    obs = {"loaders": [{"num_workers": 2}], "threads": 2, "cpu_cores": 2, "datasets": [],
           "breakdown": {"compute_ms": 5.0, "compute_ms_iqr": [4.0, 6.0]}}
    measure_contention(cap, obs)
    c = obs["cpu"]
    assert calls == ["wait", "read", "read"]  # waited before reading and timing
    assert c["compute_ms_in_script_iqr"] == [4.0, 6.0] and c["compute_ms_alone"] is not None
    lo, hi = c["compute_ms_alone_iqr"]
    assert lo <= c["compute_ms_alone"] <= hi
    assert c["workers_busy_during_alone"] > 0  # 0.5 CPU s over the timing's wall time
