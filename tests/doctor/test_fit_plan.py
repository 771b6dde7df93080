"""--verify explains the gap to fit: fit's plan (precision x channels_last x fused kernel) for the script's model,
its measured ratio against the script as it runs, and a finding for each switch it changes.

Capabilities and measurements are injected; nothing asserts on the clock."""

import copy
from types import SimpleNamespace

import torch
from rich.console import Console
from torch import nn

from torchspeed.doctor import render_report, report_from_observation, run_rules
from torchspeed.doctor._fit_plan import fit_plan
from torchspeed.doctor.undeclared import undeclared_keys
from torchspeed.env import DeviceCaps

from test_rules import BF16_CPU, CLEAN, _set

BF16 = DeviceCaps(device_type="cpu", cpu_bf16=True, cores=2)


def _cap():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(2))
    model(torch.zeros(1, 3, 8, 8))
    return SimpleNamespace(model=model, args=(torch.zeros(2, 3, 8, 8),), kwargs={}, set_to_none=True,
                           optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))


PLAN_OBS = {"model": {"has_conv2d": True, "autocast": False, "channels_last_weights": False},
            "optimizer": {"class": "AdamW", "fused": None, "fused_available": True},
            "verify": {"fused_optimizer": {"fix": "fused_optimizer", "ratios": [1.04, 1.05, 1.06], "speedup": 1.05}}}


def _measure(by_label):
    asked = []

    def measure(cand, script):
        asked.append((cand.label(), script.label()))
        return by_label[cand.label()]
    measure.asked = asked
    return measure


def test_plan_is_fits_choice_measured_against_the_script():
    m = _measure({"fp32+channels_last+fused": [1.1] * 3, "bf16+fused": [1.5] * 3,
                  "bf16+channels_last+fused": [1.6, 1.62, 1.58]})
    p = fit_plan(_cap(), copy.deepcopy(PLAN_OBS), rounds=3, caps=BF16, measure=m, ported=False)
    assert p["grid"] == ["fp32+fused", "fp32+channels_last+fused", "bf16+fused", "bf16+channels_last+fused"]
    assert p["script"] == "fp32+foreach" and p["chosen"] == "bf16+channels_last+fused"
    assert p["speedup"] == 1.6 and not p["within_noise"]
    assert p["fixes"] == ["autocast", "channels_last", "fused_optimizer"]
    assert p["candidates"]["fp32+fused"] == 1.05  # the one-switch candidate reuses --verify's measurement
    assert ("fp32+fused", "fp32+foreach") not in m.asked and len(m.asked) == 3
    assert undeclared_keys({"fit_plan": p}) == []  # the schema declares every key the plan writes


def test_plan_prefers_fewer_changes_within_two_percent_and_can_keep_the_script():
    m = _measure({"fp32+channels_last+fused": [1.1] * 3, "bf16+fused": [1.5] * 3, "bf16+channels_last+fused": [1.52] * 3})
    p = fit_plan(_cap(), copy.deepcopy(PLAN_OBS), rounds=3, caps=BF16, measure=m, ported=False)
    assert p["chosen"] == "bf16+fused" and p["fixes"] == ["autocast", "fused_optimizer"]
    # nothing beats the script: the plan keeps it, with no fix to report
    slow = {k: [0.8] * 3 for k in ("fp32+channels_last+fused", "bf16+fused", "bf16+channels_last+fused")}
    obs = copy.deepcopy(PLAN_OBS)
    obs["verify"]["fused_optimizer"]["ratios"] = [0.9] * 3
    p = fit_plan(_cap(), obs, rounds=3, caps=BF16, measure=_measure(slow), ported=False)
    assert p["chosen"] == "fp32+foreach" and p["fixes"] == []
    assert "speedup" not in p and "ratios" not in p  # the script is the reference: no ratio of it was measured


def test_the_plan_of_a_port_keeps_the_scripts_kernel_and_takes_a_change_only_ten_percent_faster():
    # the script has its own optimizer and LR: ported as-is, fit steps torch's own kernel (no fused candidate)
    # and its switch trial takes a precision or layout only 1.1x faster a step (plan.planner.PORTED_MIN_GAIN)
    m = _measure({"fp32+channels_last": [1.06] * 3, "bf16": [1.08] * 3, "bf16+channels_last": [1.05] * 3})
    p = fit_plan(_cap(), copy.deepcopy(PLAN_OBS), rounds=3, caps=BF16, measure=m)
    assert p["run"] == "ported" and p["grid"] == ["fp32", "fp32+channels_last", "bf16", "bf16+channels_last"]
    assert p["script"] == "fp32" and p["chosen"] == "fp32" and p["fixes"] == []  # 1.08x < 1.1x: kept
    assert p["why"].startswith("ported with the script's own optimizer and LR: fit keeps its optimizer kernel")
    m = _measure({"fp32+channels_last": [1.06] * 3, "bf16": [1.3] * 3, "bf16+channels_last": [1.05] * 3})
    p = fit_plan(_cap(), copy.deepcopy(PLAN_OBS), rounds=3, caps=BF16, measure=m)
    assert p["chosen"] == "bf16" and p["fixes"] == ["autocast"]
    assert undeclared_keys({"fit_plan": p}) == []
    # on a run that leaves the LR to fit, 2% buys a change of layout; another precision needs 10% on any run
    # (switch_choice.PRECISION_GAIN: it moves the results)
    m = _measure({"fp32+fused": [1.0] * 3, "fp32+channels_last+fused": [1.08] * 3, "bf16+fused": [1.08] * 3,
                  "bf16+channels_last+fused": [1.0] * 3})
    assert fit_plan(_cap(), copy.deepcopy(PLAN_OBS), rounds=3, caps=BF16, measure=m,
                    ported=False)["chosen"] == "fp32+channels_last+fused"
    m = _measure({"fp32+fused": [1.0] * 3, "fp32+channels_last+fused": [1.0] * 3, "bf16+fused": [1.2] * 3,
                  "bf16+channels_last+fused": [1.0] * 3})
    assert fit_plan(_cap(), copy.deepcopy(PLAN_OBS), rounds=3, caps=BF16, measure=m,
                    ported=False)["chosen"] == "bf16+fused"


def _script_obs(plan=None):
    o = copy.deepcopy(CLEAN)
    for m in (_set("env", BF16_CPU), _set("model.autocast", False), _set("model.channels_last_weights", False),
              _set("optimizer", {"class": "AdamW", "fused": None, "foreach": None, "device": "cpu",
                                 "fused_available": True, "param_tensors": 4}),
              _set("breakdown.compute_detail_ms", {"forward": 4.0, "backward": 4.9, "optimizer": 0.1})):
        m(o)
    if plan:
        o["fit_plan"] = plan
    return o


PLAN = {"grid": ["fp32+fused", "bf16+channels_last+fused"], "script": "fp32+foreach",
        "chosen": "bf16+channels_last+fused", "why": "1.60x the plain settings (fp32+fused)", "speedup": 1.6,
        "ratios": [1.6, 1.62, 1.58], "iqr": [1.59, 1.61], "within_noise": False, "candidates": {},
        "fixes": ["autocast", "channels_last", "fused_optimizer"], "errors": {}}


def test_each_switch_of_the_plan_is_a_finding_that_names_it():
    # the optimizer is 1% of the step: without the plan, no optimizer-kernel finding
    assert "optimizer-kernel" not in {f.rule for f in run_rules(_script_obs())}
    found = run_rules(_script_obs(PLAN))
    every = {f.rule: f for f in found} | {a.rule: a for f in found for a in f.also}
    for rule in ("no-amp", "channels-last", "optimizer-kernel"):
        assert rule in every and "fit's plan for this model chooses it (bf16+channels_last+fused" in \
            every[rule].evidence, rule
    assert "fit's plan" not in every["cpu-bf16-math"].evidence  # not a switch the plan changes


def test_report_prints_the_plan():
    console = Console(record=True, width=200)
    render_report(report_from_observation({**_script_obs(PLAN), "script": "train.py"}), console)
    text = console.export_text()
    assert "fit's plan for this model: bf16+channels_last+fused" in text
    assert "measured 1.60x per step against the script's own fp32+foreach" in text


def _threads_entry(ratios):
    import statistics
    return {"fix": "threads", "rule": "cpu-oversubscribed", "env": {"OMP_NUM_THREADS": "1"}, "steps": 6,
            "speedup": statistics.median(ratios), "ratios": ratios, "iqr": [min(ratios), max(ratios)],
            "within_noise": min(ratios) <= 1.0 <= max(ratios), "rounds": len(ratios), "baseline_ms": 12.0,
            "candidate_ms": 10.0}


def test_the_plan_says_what_its_figure_leaves_out_and_reads_what_was_measured_for_it():
    from torchspeed.doctor._fit_plan import beyond_grid

    o = _script_obs(PLAN)
    o["cpu"] = {"workers": 1, "threads": 2, "cores": 2, "compute_ms_in_script": 9.0, "compute_ms_alone": 8.9,
                "worker_ms_per_batch": 1.0}
    # nothing measured beyond the grid: each part is named as not measured, none is folded into the plan's figure
    b = beyond_grid(o)
    assert b["threads"]["choices"] == [1, 2] and b["threads"]["chosen"] is None
    assert not b["compile"]["measured"] and not b["allocator"]["measured"]
    assert b["not_covered"] == ["fit's thread stage (not measured)",
                                "torch.compile (fit measures it on top of the plan; not measured here)",
                                "fit's in-process malloc thresholds (not measured here)"]
    # the thread re-run, --verify's compile and the malloc re-run measured: each with its own figure
    o["env_fixes"] = {"threads": _threads_entry([1.08, 1.12]), "malloc": {**_threads_entry([1.03, 1.05]),
                                                                            "fix": "malloc"}}
    o["verify"] = {"compile": {"fix": "compile", "speedup": 1.3, "iqr": [1.28, 1.33], "compile_s": 9.0}}
    b = beyond_grid(o)
    assert b["threads"]["chosen"] == 1 and b["threads"]["speedup"] == 1.1  # fit's choose: >= 2% buys the change
    assert b["compile"] == {"measured": True, "speedup": 1.3, "iqr": [1.28, 1.33], "compile_s": 9.0,
                            "how": "--verify, alone on the script's model against the script's settings"}
    assert "1 threads measured 1.10x on the script, separately" in b["not_covered"][0]
    assert "--verify measured it alone at 1.30x" in b["not_covered"][1]
    assert "re-run measured 1.04x, separately" in b["not_covered"][2]
    assert undeclared_keys({"fit_plan": {"beyond_grid": b}}) == []
    # within fit's 2%: the stage keeps all the cores
    o["env_fixes"]["threads"] = _threads_entry([0.99, 1.02])
    assert beyond_grid(o)["threads"]["chosen"] == 2
    # no workers: fit has no thread stage
    o["cpu"]["workers"] = 0
    assert beyond_grid(o)["threads"] is None


def test_report_names_what_the_plan_leaves_out():
    console = Console(record=True, width=300)
    render_report(report_from_observation({**_script_obs(PLAN), "script": "train.py"}), console)
    text = console.export_text()
    assert "the plan's figure leaves out: fit's thread stage (not measured); torch.compile (fit measures it on top " \
        "of the plan; not measured here); fit's in-process malloc thresholds (not measured here)" in text


def test_a_plan_with_nothing_to_measure_claims_no_measured_ratio():
    # a CPU without native bf16 and a model without convolutions: the ported grid is the script's own fp32
    plain_cpu = DeviceCaps(device_type="cpu", cpu_bf16=False, cores=2)
    obs = {"model": {"has_conv2d": False, "autocast": False}, "optimizer": {"class": "LBFGS", "fused_available": False}}
    p = fit_plan(_cap(), obs, rounds=3, caps=plain_cpu, measure=_measure({}))
    assert p["grid"] == ["fp32"] and p["chosen"] == p["script"] == "fp32" and p["candidates"] == {}
    assert "speedup" not in p and "ratios" not in p and "within_noise" not in p  # no made-up [1.0]
    console = Console(record=True, width=300)
    render_report(report_from_observation({**_script_obs(p), "script": "train.py"}), console)
    text = console.export_text()
    assert "fit's plan for this model: fp32" in text and "measured 1.00x" not in text
    assert "fit's grid here holds only the script's own settings: nothing measured); the script's own fp32, kept" \
        in text and "measured fastest" not in text


def test_a_plan_whose_rounds_disagree_wildly_is_inconclusive_not_a_speed_up():
    # one round 66x (its baseline ran while the machine was busy), one 1.2x: fit's choice, on its medians
    m = _measure({"fp32+channels_last": [1.0, 1.0], "bf16": [66.58, 1.2], "bf16+channels_last": [0.9, 0.9]})
    p = fit_plan(_cap(), copy.deepcopy(PLAN_OBS), rounds=2, caps=BF16, measure=m)
    assert p["chosen"] == "bf16" and p["speedup"] == 33.89 and p["inconclusive"] and not p["within_noise"]
    assert undeclared_keys({"fit_plan": p}) == []
    o = _script_obs(p)
    console = Console(record=True, width=300)
    render_report(report_from_observation({**o, "script": "train.py"}), console)
    text = console.export_text()
    assert "measured 33.89x" not in text and "inconclusive: the 2 interleaved rounds disagree (ratios 66.58, 1.20x)" \
        in text
    f = next(g for f in run_rules(o) for g in (f, *f.also) if g.rule == "no-amp")
    assert "33.89" not in f.evidence and "its interleaved rounds disagree: inconclusive" in f.evidence
