"""benchmarks/gpu_check.py, the script a GPU lease runs, proven on the CPU with --tiny: every part ends with a result
or a recorded reason, the rows, ratios, MFU fields and provenance are in the JSON, and a part past its time limit
is recorded as timed out while the later parts still run. Structure and behaviour only, never a speed."""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
STATUSES = {"ok", "skipped", "error", "timed_out"}


def _run_check(out: Path, *args: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--out", str(out), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    return out, _run_check(out)


def _provenance_ok(p: dict) -> bool:
    return bool(p) and {"commit", "torch", "device", "python"} <= set(p) and p["device"].startswith("cpu")


def test_every_part_ends_with_a_result_or_a_reason_and_carries_provenance(tiny):
    out, report = tiny
    assert report["finished"] and report["tiny"] and report["order"] == ["tests", "resnet", "gpt", "tta"]
    assert _provenance_ok(report["provenance"])
    assert sum(report["limits_s"].values()) <= 8 * 60
    for name, part in report["parts"].items():
        assert part["status"] in STATUSES, name
        assert part["status"] == "ok" or part.get("error") or part.get("reason"), name
        assert part["limit_s"] > 0 and _provenance_ok(part["provenance"]), name
    assert report["parts"]["tests"] == report["parts"]["tests"] | {"status": "skipped", "reason": "skipped: no CUDA"}
    assert [f.name for f in out.glob("*.json")] == ["gpu_check.json"]  # at most 2 JSON files, here the one


def test_seconds_a_part_leaves_unused_go_to_the_next_part(tiny):
    """The tests part is skipped at once on the CPU: the resnet part may spend its seconds too."""
    parts, limits = tiny[1]["parts"], tiny[1]["limits_s"]
    assert parts["tests"]["banked_s"] == 0 and parts["resnet"]["banked_s"] > limits["tests"] - 30
    assert parts["resnet"]["limit_s"] == pytest.approx(limits["resnet"] + parts["resnet"]["banked_s"], abs=0.2)


def test_resnet_rows_ratios_and_mfu(tiny):
    part = tiny[1]["parts"]["resnet"]
    assert part["status"] == "ok", part.get("error")
    res = part["result"]
    assert res["batch"] in res["batch_tried"] and res["flops_per_sample"] > 0 and "peak_flops" in res
    assert res["rounds_done"] >= 1
    for name in ("naive", "all", "all_eager", "hand"):
        row = res["rows"][name]
        assert row["status"] == "ok" and row["img_per_s"] > 0 and len(row["img_per_s_rounds"]) >= 1, name
        assert "mfu" in row and row["mfu"] is None  # no datasheet peak for a CPU
    assert res["rows"]["all"]["decisions"]["precision"] and res["rows"]["hand"]["settings"]["channels_last"]
    light = res["rows"]["lightning"]
    if importlib.util.find_spec("lightning") is None:
        assert light["status"] == "unavailable" and light["reason"]
        assert res["ratios"]["all/lightning"] is None
    else:
        assert light["status"] == "ok" and light["img_per_s"] > 0 and light["settings"]["channels_last"]
        assert res["ratios"]["all/lightning"]["speedup"] > 0
    assert {"all/hand", "all/lightning", "all/naive"} <= set(res["ratios"])
    assert res["ratios"]["all/hand"]["speedup"] > 0 and len(res["ratios"]["all/hand"]["iqr"]) == 2
    assert res["ratios"]["all_eager/hand"]["speedup"] > 0 and res["rows"]["all_eager"]["decisions"]["compile"]
    first, last = res["stages"][0], res["stages"][res["stage"]]  # the rows timed before fit's compile trial warms up,
    assert "all" not in first["timed"] and first["rows"]["hand"]["img_per_s"] > 0  # kept should it run out of time
    assert first["ratios"]["all/hand"] is None
    assert "all" in last["timed"] and res["stage"] >= 1 and res["rounds_done"] == last["rounds_done"] >= 1
    # the compiled hand loop comes last, and only where it may compile (here: off, and said why)
    assert res["rows"]["hand_compile"]["status"] == "skipped" and res["rows"]["hand_compile"]["reason"]
    assert res["best_hand"] == "hand" and res["ratios"]["all/best_hand"] == res["ratios"]["all/hand"]


def test_gpt_rows_mfu_and_measured_peak(tiny):
    part = tiny[1]["parts"]["gpt"]
    assert part["status"] == "ok", part.get("error")
    res = part["result"]
    assert res["measured_matmul_peak"]["flops_per_s"] > 0 and res["flops_per_token"] > 0
    for name in ("hand", "all_eager", "all"):
        row = res["rows"][name]
        assert row["status"] == "ok" and row["tokens_per_s"] > 0, name
        assert row["mfu"] is None and row["mfu_vs_measured_peak"] > 0, name
    assert res["rows"]["hand"]["optimizer"] == "AdamW" and res["rows"]["hand"]["settings"]["fused"]
    assert res["rows"]["hand_compile"]["status"] == "skipped" and res["rows"]["hand_compile"]["reason"]
    assert res["ratios"]["all/hand"]["speedup"] > 0 and res["best_hand"] == "hand"
    assert res["ratios"]["all/best_hand"] == res["ratios"]["all/hand"] and res["ratios"]["all/hand_compile"] is None
    prof = res["profile"]  # where fit's step and the best hand loop's spend their time, for the next lease to read
    assert set(prof) == {"all", "hand"}, prof
    for name, p in prof.items():
        assert p["timed_on"] == "cpu" and p["ops"] and all(op["ms_per_step"] > 0 for op in p["ops"]), name
        assert p["launches_per_step"] == 0 and isinstance(p["syncs_per_step"], dict), name


def test_time_to_target_at_the_budgets_given(tiny):
    part = tiny[1]["parts"]["tta"]
    assert part["status"] == "ok", part.get("error")
    res = part["result"]
    assert (ROOT / res["source"]).exists() and res["target"] == 0.97 and res["budgets_overridden"]
    assert set(res["configs"]) == {"naive", "all", "auto"} and "schedulefree_installed" in res
    for name, c in res["configs"].items():
        assert c["status"] == "ok" and c["budget_steps"] == 2, name
        assert len(c["val_acc"]) == len(c["reached"]) == len(res["seeds"]) and c["mean_total_s"] > 0, name
        assert [p["steps"] for p in c["phases"]] == [2] * len(res["seeds"]), name  # each seed's seconds in parts
        assert len(c["switch_trial"]) == len(res["seeds"]), name
    assert set(res["sooner"]) == {"auto_vs_naive", "auto_vs_all"}


def test_a_part_past_its_limit_is_recorded_as_timed_out_and_the_next_part_still_runs(tmp_path):
    report = _run_check(tmp_path, "--parts", "resnet,gpt", "--limit", "resnet=0.5")
    assert list(report["parts"]) == ["resnet", "gpt"] and report["finished"]
    resnet = report["parts"]["resnet"]
    assert resnet["status"] == "timed_out" and resnet["limit_s"] == 0.5 and "timed out" in resnet["error"]
    assert resnet["banked_s"] == 0 and report["parts"]["gpt"]["banked_s"] == 0  # a part at its limit leaves none
    assert _provenance_ok(resnet["provenance"])  # the driver's, when the part had none of its own yet
    gpt = report["parts"]["gpt"]
    assert gpt["status"] == "ok" and gpt["result"]["rows"]["all"]["tokens_per_s"] > 0


def test_pytest_counts_read_the_last_summary_line():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    text = "....F\nFAILED tests/x.py::test_y\n16 passed, 42 deselected, 14 warnings, 1 error in 155.70s (0:02:35)\n"
    assert gpu_check.pytest_counts(text) | {"summary_line": None} == {
        "passed": 16, "failed": 0, "error": 1, "deselected": 42, "summary_line": None}
    assert gpu_check.pytest_counts("= 3 failed, 14 passed in 9.1s =")["failed"] == 3
    assert gpu_check.pytest_counts("collecting ...")["summary_line"] is None


class _FakeRow:
    """A row of fixed step times; `fail_at`: the turn whose steps raise, `skip`: its warm-up skips it."""

    def __init__(self, seconds: float, fail_at: int | None = None, skip: bool = False):
        self.seconds, self.fail_at, self.skip, self.turns, self.benchmark = seconds, fail_at, skip, 0, False

    def activate(self):
        pass

    def warm(self):
        if self.skip:
            raise rows_module().SkipRow("no time for it")
        return {"seconds": 0.0, "steps": 1}

    def steps(self, n):
        self.turns += 1
        if self.turns == self.fail_at:
            raise RuntimeError("a kernel failed")
        return self.seconds * n

    def describe(self):
        return {}


def rows_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check_rows

    return gpu_check_rows


def test_rows_that_fail_or_skip_are_recorded_and_the_others_keep_their_rounds():
    m = rows_module()
    rows = {"naive": _FakeRow(0.2), "broken": _FakeRow(0.1, fail_at=2), "all": _FakeRow(0.1),
            "extra": _FakeRow(0.1, skip=True)}
    res, saves = {}, []
    timing = m.Timing(steps=2, rounds=3, items_per_step=10, unit="img_per_s", flops_per_item=1e9,
                      peaks={"mfu": 1e12}, pairs=(("all", "naive"), ("all", "broken")), early_rounds=1)
    m.measure_rows(rows, res, lambda: saves.append(1), m.Clock(time.time() + 600), timing,
                   stages=[("naive", "broken"), ("all", "extra")])
    assert res["rows"]["broken"]["status"] == "error" and "a kernel failed" in res["rows"]["broken"]["error"]
    assert res["rows"]["extra"] == {"status": "skipped", "reason": "no time for it"}
    assert res["stage"] == 1 and res["rounds_done"] == 3 and res["rows"]["all"]["img_per_s"] == pytest.approx(100.0)
    assert res["rows"]["naive"]["mfu"] == pytest.approx(50.0 * 1e9 / 1e12)
    assert res["ratios"]["all/naive"]["speedup"] == pytest.approx(2.0) and res["ratios"]["all/broken"] is None
    first, last = res["stages"]
    assert first["rows"]["broken"]["img_per_s"] == pytest.approx(100.0)  # it failed in the next stage's first turn
    assert "broken" in last["timed"] and "broken" not in last["rows"]
    assert len(saves) > 6  # written after every turn


def test_rounds_stop_cleanly_when_the_next_would_not_fit():
    m = rows_module()
    res = {}
    timing = m.Timing(steps=1, rounds=50, items_per_step=1, unit="img_per_s", flops_per_item=None, peaks={},
                      pairs=(("a", "b"),), early_rounds=0)
    slow = _FakeRow(0.0)
    slow.steps = lambda n: time.sleep(0.05) or 0.05  # each round takes about 0.05 s of the clock's 0.3 s
    m.measure_rows({"a": slow, "b": _FakeRow(0.05)}, res, lambda: None, m.Clock(time.time() + 0.3), timing,
                   stages=[("a", "b")])
    assert 1 <= res["rounds_done"] < 50 and "too short" in res["stages"][0]["stopped_early"]
