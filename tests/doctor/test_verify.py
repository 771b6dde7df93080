"""--verify: each fix is measured on the script's own model, and the numbers reach the findings."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from torchspeed.doctor import DoctorJob, diagnose_many
from torchspeed.doctor._capture import Captured
from torchspeed.doctor._job import outermost_autocast_off
from torchspeed.doctor.undeclared import undeclared_keys
from torchspeed.doctor.registry import severity_for_interval
from torchspeed.doctor import verify as verify_mod
from torchspeed.doctor._candidate import _Trainer
from torchspeed.doctor.verify import _interleave, applicable_fixes, verify_fixes
from torchspeed.env import detect

SCRIPTS = Path(__file__).parent / "scripts"


def _finding(report, rule):
    """`rule`'s finding, also when folded into another of the same cause: no-amp goes into cpu-bf16-math's
    `also` (both point at fp32 math) whenever autocast measures below bf16 math's estimate."""
    return next((g for f in report.findings for g in (f, *f.also) if g.rule == rule), None)


@pytest.fixture(scope="module")
def verified():
    job = DoctorJob(script=str(SCRIPTS / "slow_dataset.py"), steps=6, warmup=2, verify=True,
                    fixes=("autocast", "channels_last", "workers"), rounds=3, time_limit=120, env_rounds=0)
    return diagnose_many([job], quiet=True, threads=1)[0]


def test_verify_reports_measured_speedups_for_autocast_channels_last_workers(verified):
    r = verified
    assert r.status == "stopped", r.notes
    assert set(r.verify) == {"autocast", "channels_last", "workers"}, r.notes
    for fix, v in r.verify.items():
        assert "error" not in v, v
        # 3 rounds a side, more (up to 15) while the interval is too wide to rank
        assert v["speedup"] > 0 and v["baseline_ms"] > 0 and v["candidate_ms"] > 0
        assert len(v["ratios"]) == v["rounds"] and 3 <= v["rounds"] <= 15 and len(v["samples_ms"][0]) == v["rounds"]
        assert v["iqr"][0] <= v["speedup"] <= v["iqr"][1]
    # fit's plan for the captured model, measured against the script's settings (values: test_fit_plan)
    plan = r.observation["fit_plan"]
    assert "error" not in plan and plan["chosen"] in plan["grid"] + [plan["script"]]
    # a plan that keeps the script's settings has no ratio of its own: the script is the reference
    # (--verify's own rounds where it reuses them: 3, more while an interval was too wide to rank)
    assert len(plan["ratios"]) >= 3 if plan["chosen"] != plan["script"] else "ratios" not in plan
    rule_of = {"autocast": "no-amp", "channels_last": "channels-last", "workers": "dataloader-workers"}
    for fix, rule in rule_of.items():
        f = _finding(r, rule)
        assert f is not None, rule
        assert f.measured_gain == r.verify[fix]["speedup"]
        # severity follows the measurement: the lower bound of its interval; one that holds 1.0 is low, listed apart
        lo, hi = r.verify[fix]["interval"]
        expected = severity_for_interval(min(lo, f.measured_gain), max(hi, f.measured_gain))
        assert f.severity == ("low" if expected == "inconclusive" else expected)
        assert (f.inconclusive is not None) == (expected == "inconclusive")
        assert "--verify measured" in f.evidence
    # the candidate really loads in workers; whether that is faster here is measured, not asserted
    # (benchmarks/bench_doctor.py records it), and the finding follows whatever was measured (above)
    assert r.verify["workers"]["candidate"].startswith("num_workers=")
    assert int(r.verify["workers"]["candidate"].split("=")[1]) >= 1
    if not detect().bf16_supported and r.verify["autocast"]["speedup"] < 0.97:
        f = _finding(r, "no-amp")
        assert "slow-down" in f.evidence and f.fix.startswith("keep fp32") and f.severity == "low"
    d = r.to_dict()
    assert {v["fix"] for v in d["verify"]} == {"autocast", "channels_last", "workers"}
    assert undeclared_keys(r.observation) == []  # the schema declares every key --verify and fit's plan write


def _captured():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return Captured(model=model, optimizer=opt, args=(torch.randn(4, 3, 8, 8),), loss_module=nn.CrossEntropyLoss(),
                    target=torch.tensor([0, 1, 2, 3]), set_to_none=False)


def test_candidates_apply_their_fix_to_a_copy():
    cap = _captured()
    ref = {k: v.clone() for k, v in cap.model.state_dict().items()}
    cl = _Trainer(cap, channels_last=True)
    assert cl.model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert cl.args[0].is_contiguous(memory_format=torch.channels_last)
    nb = _Trainer(cap, conv_bias=True)
    assert nb.model[0].bias is None and cap.model[0].bias is not None
    amp = _Trainer(cap, amp_dtype=torch.bfloat16)
    with amp.ctx():
        assert amp.model(*amp.args).dtype == torch.bfloat16
    for t in (cl, nb, amp):
        t.step()
        assert type(t.opt) is torch.optim.SGD and t.opt.param_groups[0]["momentum"] == 0.9
    # the user's model is untouched: every candidate trains a copy
    for k, v in cap.model.state_dict().items():
        assert torch.equal(v, ref[k])


def test_autocast_candidate_inside_the_scripts_own_autocast_block_trains_as_a_top_level_step_would():
    """The analysis runs inside the script's last optimizer step, which may sit in the script's autocast block.
    Nested there, a candidate's autocast never cleared its cache of cast weights: its later steps reused the first
    step's bf16 weights (fast, and the loss check read a regression on a plain fp32 -> bf16 fix)."""
    cap = _captured()
    ref = _Trainer(cap, amp_dtype=torch.bfloat16)  # at the top level: each step's autocast exit clears the cache
    for _ in range(3):
        ref.step()
    obs = {"model": {"autocast": False}, "notes": []}
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the script's block, around its optimizer step
        with outermost_autocast_off():
            assert not torch.is_autocast_enabled("cpu")
            res = verify_fixes(cap, obs, fixes=("autocast",), rounds=2)
        assert torch.is_autocast_enabled("cpu")  # the script's state back
        assert cap.model(*cap.args).dtype == torch.bfloat16
    lc = res["autocast"]["loss_check"]
    assert lc["candidate"] == [round(x, 6) for x in ref.losses] and lc["ok"], lc
    assert len(set(lc["candidate"])) == 3  # the candidate trains: its losses move step to step


def test_verify_fixes_direct():
    cap = _captured()
    obs = {"model": {"autocast": False, "has_conv2d": True, "channels_last_weights": False,
                     "conv_bias_before_bn": ["0 -> 1"]}, "notes": []}
    assert set(applicable_fixes(cap, obs)) >= {"autocast", "channels_last", "set_to_none", "conv_bias"}
    res = verify_fixes(cap, obs, fixes=("set_to_none", "conv_bias"), rounds=2)
    assert set(res) == {"set_to_none", "conv_bias"}
    for v in res.values():
        assert "error" not in v and v["speedup"] > 0 and v["rule"] in ("zero-grad-memset", "conv-bias-before-bn")


def test_verify_with_keyword_only_model_returning_its_loss():
    class KW(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, *, x):
            return {"loss": self.fc(x).square().mean()}

    m = KW()
    cap = Captured(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), args=(), kwargs={"x": torch.randn(4, 8)})
    obs = {"model": {"autocast": False}, "notes": []}
    res = verify_fixes(cap, obs, fixes=("autocast",), rounds=2)
    assert "error" not in res["autocast"] and res["autocast"]["speedup"] > 0


def test_interleave_reports_the_median_ratio_of_fixed_step_times(monkeypatch, fake_clock):
    clock = fake_clock  # perf_counter only moves when a step calls `advance` (conftest.py)
    monkeypatch.setattr(verify_mod, "time", clock)
    # warm-up (2 calls), a discarded warm-up round of 20 steps (9 ms: never counted), then the timed rounds
    cand_ms = iter([1.0, 1.0] + [9.0] * 20 + [1.0] * 20 + [0.5] * 20 + [1.25] * 20)

    def base():
        clock.advance(2e-3)

    def cand():
        clock.advance(next(cand_ms) * 1e-3)

    v = _interleave(base, cand, torch.device("cpu"), rounds=3)
    assert v["steps_per_round"] == 20  # a 0.25 s budget at 2 ms per baseline step, capped at 20
    assert v["baseline_ms"] == 2.0 and v["ratios"] == [2.0, 4.0, 1.6] and v["speedup"] == 2.0
    assert v["candidate_ms"] == 1.0 and v["iqr"] == [1.8, 3.0] and not v["within_noise"]
    assert v["samples_ms"] == [[2.0] * 3, [1.0, 0.5, 1.25]] and v["rounds"] == 3
    lo, hi = v["interval"]  # the bootstrap interval of the ratio of the medians holds every resample's ratio
    assert 1.6 <= lo <= 2.0 <= hi <= 4.0 and v["verdict"] == "faster"
    same = _interleave(base, base, torch.device("cpu"), rounds=3)
    assert same["speedup"] == 1.0 and same["within_noise"]  # no difference: inside the noise


def test_a_loader_side_takes_its_workers_queue_before_each_timed_round(monkeypatch, fake_clock):
    """Workers fill their queue while the other side of a round runs; timed from a full queue, a 2.3x fix read 6x.
    Each side's `settle` runs before each of its measurements (the discarded warm-up round's too), untimed."""
    clock = fake_clock
    monkeypatch.setattr(verify_mod, "time", clock)
    calls = {"base": 0, "cand": 0}

    def settle(side):
        def run():
            calls[side] += 1
            clock.advance(1.0)  # untimed: a settle that took the clock's time would show in the ratios
        return run

    v = _interleave(lambda: clock.advance(2e-3), lambda: clock.advance(1e-3), torch.device("cpu"), rounds=3,
                    settle=(settle("base"), settle("cand")))
    assert calls["base"] == calls["cand"] == v["rounds"] + 1 and v["speedup"] == 2.0
    # a loader with workers settles by the batches they load ahead: workers x prefetch factor
    steps = []
    trainer = SimpleNamespace(device=torch.device("cpu"), step=lambda: steps.append(1))
    ds = torch.utils.data.TensorDataset(torch.randn(64, 2))
    two = verify_mod._LoaderStep(trainer, torch.utils.data.DataLoader(ds, batch_size=4), num_workers=2, pin_memory=False)
    try:
        assert two.depth == 8
        two.settle()
        assert len(steps) == 8
    finally:
        two.close()
    assert verify_mod._LoaderStep(trainer, torch.utils.data.DataLoader(ds, batch_size=4), num_workers=0,
                                  pin_memory=False).depth == 0


def test_the_fused_optimizer_candidate_keeps_the_scripts_hyper_parameters():
    from torchspeed.doctor._model_checks import optimizer_info

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "weight_decay": 0.1},
                             {"params": model[2].parameters(), "weight_decay": 0.0}], lr=3e-4, betas=(0.9, 0.95))
    cap = Captured(model=model, optimizer=opt, args=(torch.randn(4, 8),))
    obs = {"model": {"autocast": True}, "notes": [], "optimizer": optimizer_info(opt)}
    assert obs["optimizer"]["fused_available"] and obs["optimizer"]["fused"] is None
    assert "fused_optimizer" in applicable_fixes(cap, obs)
    t = _Trainer(cap, fused_optimizer=True)
    t.step()
    assert all(g["fused"] for g in t.opt.param_groups) and [g["weight_decay"] for g in t.opt.param_groups] == [0.1, 0.0]
    assert t.opt.param_groups[0]["betas"] == (0.9, 0.95) and t.opt.param_groups[0]["lr"] == 3e-4
    assert not _Trainer(cap).opt.param_groups[0]["fused"]  # the baseline runs as the script does
    res = verify_fixes(cap, obs, fixes=("fused_optimizer",), rounds=2)["fused_optimizer"]
    assert "error" not in res and res["rule"] == "optimizer-kernel" and res["speedup"] > 0
    obs["optimizer"]["fused"] = True  # a script that already passes fused=True: nothing to measure
    assert "fused_optimizer" not in applicable_fixes(cap, obs)


def test_the_sparse_momentum_candidate_takes_momentum_off_the_sparse_weights_only():
    """The fix of rule sparse-momentum: the SGD group's sparse-gradient weight moves to a group of its own without
    momentum, the rest keeps the script's hyper-parameters; the fix applies only where an SGD group with momentum
    holds a sparse weight."""
    from torchspeed.doctor._model_checks import optimizer_info

    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(200, 8, mode="mean", sparse=True), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    cap = Captured(model=model, optimizer=opt, args=(torch.randint(0, 200, (16, 5)),),
                   loss_module=nn.CrossEntropyLoss(), target=torch.randint(0, 3, (16,)))
    obs = {"model": {"autocast": True}, "notes": [], "optimizer": optimizer_info(opt, model)}
    assert "sparse_momentum" in applicable_fixes(cap, obs)
    t, base = _Trainer(cap, sparse_momentum=True), _Trainer(cap)
    kept, moved = t.opt.param_groups
    assert kept["params"] == [t.model[1].weight, t.model[1].bias] and kept["momentum"] == 0.9 and kept["nesterov"]
    assert moved["params"] == [t.model[0].weight] and moved["momentum"] == 0.0 and not moved["nesterov"]
    assert kept["lr"] == moved["lr"] == 0.1 and len(base.opt.param_groups) == 1  # the baseline runs as the script
    for _ in range(3):
        t.step()
        base.step()
    assert t.opt.state[t.model[0].weight].get("momentum_buffer") is None
    assert base.opt.state[base.model[0].weight]["momentum_buffer"].is_sparse  # the script's buffer, which grows
    res = verify_fixes(cap, obs, fixes=("sparse_momentum",), rounds=2)["sparse_momentum"]
    assert "error" not in res and res["rule"] == "sparse-momentum" and res["speedup"] > 0, res
    assert res["loss_check"]["steps"] == 3 and res["loss_check"]["ok"]
    obs["optimizer"] = optimizer_info(torch.optim.SGD(model.parameters(), lr=0.1), model)  # no momentum: no fix
    assert "sparse_momentum" not in applicable_fixes(cap, obs)


def _lbfgs_captured():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    return Captured(model=model, optimizer=torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=4),
                    args=(torch.randn(16, 6),), loss_module=nn.MSELoss(), target=torch.randn(16, 1))


def test_an_optimizer_whose_step_needs_a_closure_is_stepped_with_one():
    # LBFGS.step(closure) re-evaluates the loss on the captured batch; a step without one raised TypeError
    cap = _lbfgs_captured()
    t = _Trainer(cap)
    assert type(t.opt) is torch.optim.LBFGS and t.opt.param_groups[0]["max_iter"] == 4
    before = [p.detach().clone() for p in t.model.parameters()]
    t.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, t.model.parameters()))  # the copy was trained
    assert verify_mod.time_model_alone(cap, reps=2) is not None
    res = verify_fixes(cap, {"model": {"autocast": False}, "notes": []}, fixes=("autocast",), rounds=2)
    assert "error" not in res["autocast"], res["autocast"]
    # 2 rounds a side, more (up to 15) while the interval is too wide to rank: how many is the clock's to say
    assert res["autocast"]["speedup"] > 0 and 2 <= len(res["autocast"]["ratios"]) == res["autocast"]["rounds"] <= 15


def test_rounds_that_disagree_wildly_are_inconclusive(monkeypatch, fake_clock):
    clock = fake_clock
    monkeypatch.setattr(verify_mod, "time", clock)
    # 2 rounds of 20 steps: one candidate round 66x faster (a busy machine slowed its baseline), one 4% slower
    # warm-up 2 calls + the budget probe, a discarded round, then the rounds
    base_ms = iter([1.0] * 3 + [1.0] * 20 + [66.58] * 20 + [1.0] * 20)
    cand_ms = iter([1.0] * 2 + [1.0] * 20 + [1.0] * 20 + [1.0 / 0.96] * 20)

    def base():
        clock.advance(next(base_ms) * 1e-3)

    def cand():
        clock.advance(next(cand_ms) * 1e-3)

    v = _interleave(base, cand, torch.device("cpu"), rounds=2)
    assert v["steps_per_round"] == 20 and v["ratios"] == [66.58, 0.96]
    assert v["inconclusive"] and v["within_noise"]  # one round faster, one slower: no speed-up either way
