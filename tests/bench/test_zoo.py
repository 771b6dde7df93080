"""The model zoo sweep (benchmarks/bench_zoo.py): the harness on tiny hand-written models (fast), and a sampled
subset of the zoo under `fit` on the host CPU and an emulated AVX2 one (slow): no run of `fit` or
`fit(recipe="auto")` ends in an error where the plain loop trains, and where the switch trial kept the plain
settings, fit's K-step loss is the plain loop's. Nothing here asserts a time."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_zoo  # noqa: E402
import zoo_report  # noqa: E402
import zoo_run  # noqa: E402
from zoo_cases import Case, sgd, xy_logits, xy_own  # noqa: E402


class OwnLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x, targets=None):
        logits = self.fc(x)
        return {"logits": logits, "loss": nn.functional.cross_entropy(logits, targets)}


def _vec(g):
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _gru_step():
    state = {}

    def step_fn(model, batch):
        x, y = batch
        out, h = model.rnn(x, state.get("h"))
        state["h"] = h.detach()
        return nn.functional.cross_entropy(model.head(out[:, -1]), y)
    return step_fn


class TinyGRU(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.GRU(6, 8, batch_first=True), nn.Linear(8, 3)


TINY = [
    Case("mlp", "hand", lambda: nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)), _vec, xy_logits, sgd(0.1)),
    Case("own_loss", "hand", OwnLoss, _vec, xy_own, sgd(0.1)),
    Case("code_around_the_step", "hand", lambda: nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)),
         lambda g: (torch.randn(8, 6, generator=g) * 30, torch.randint(0, 3, (8,), generator=g)), xy_logits, sgd(0.1),
         fit_kwargs={"clip_grad_value": 0.05}, before_step=lambda m: [p.grad.mul_(0.5) for p in m.parameters()],
         after_step=lambda m: m[0].weight.data.clamp_(-0.2, 0.2)),
    Case("gru_carried", "hand", TinyGRU, lambda g: (torch.randn(8, 5, 6, generator=g), torch.randint(0, 3, (8,), generator=g)),
         step_fn=_gru_step, optimizer=sgd(0.1)),
]


@pytest.mark.parametrize("case", TINY, ids=lambda c: c.name)
def test_each_way_gets_a_row_of_the_documented_shape(case, monkeypatch):
    monkeypatch.setenv("TORCHSPEED_CPU_PROFILE", "avx2")  # no half-precision candidate: the trial keeps fp32
    out = zoo_run.run_case(case, 4, ("plain", "fit"), warm=False)
    plain, fit = out["runs"]["plain"], out["runs"]["fit"]
    assert out["source"] == "hand" and plain["finished"] and plain["vs_plain"] == 1.0
    assert set(fit) >= {"finished", "error", "vs_plain", "loss", "settings", "kept_plain", "loss_equal"}, fit
    assert fit["finished"] and fit["error"] is None and fit["vs_plain"] > 0
    assert fit["settings"]["precision"] == "fp32" and fit["kept_plain"]
    assert fit["loss_equal"], (fit["loss"], plain["loss"])  # the harness's probe is the same for every way


def test_the_rounds_alternate_the_order_and_a_short_run_gets_more(monkeypatch):
    calls = []

    def timed(case, batches, way, target):  # the rounds after the first, with injected seconds
        calls.append(way)
        return {"plain": 0.010, "fit": 0.020}[way], None
    monkeypatch.setattr(zoo_run, "_timed_round", timed)
    monkeypatch.setenv("TORCHSPEED_CPU_PROFILE", "avx2")
    out = zoo_run.run_case(TINY[0], 2, ("plain", "fit"), warm=False, rounds=2, min_seconds=1e3, max_rounds=6)
    assert out["rounds"] == 6 and calls == ["fit", "plain", "plain", "fit"] * 2 + ["fit", "plain"]
    fit = out["runs"]["fit"]
    assert len(fit["round_seconds"]) == 6 and fit["seconds"] == 0.020 and fit["vs_plain"] == 0.5  # the medians
    calls.clear()
    out = zoo_run.run_case(TINY[0], 2, ("plain", "fit"), warm=False, rounds=3)  # no time asked: the rounds asked
    assert out["rounds"] == 3 and calls == ["fit", "plain", "plain", "fit"]


def test_a_way_that_fails_in_a_later_round_is_recorded_and_the_rounds_go_on(monkeypatch):
    def timed(case, batches, way, target):
        if way == "fit":
            raise RuntimeError("round two broke\nmore")
        return 0.01, None
    monkeypatch.setattr(zoo_run, "_timed_round", timed)
    monkeypatch.setenv("TORCHSPEED_CPU_PROFILE", "avx2")
    out = zoo_run.run_case(TINY[0], 2, ("plain", "fit"), warm=False, rounds=3)
    fit = out["runs"]["fit"]
    assert fit["finished"] is False and fit["error"] == "RuntimeError: round two broke" and fit["round"] == 1
    assert out["rounds"] == 3 and len(out["runs"]["plain"]["round_seconds"]) == 3


def test_auto_is_timed_to_the_plain_loops_loss_on_its_own_curve(monkeypatch):
    """The auto way records its loss at every step; reach: when its average over a tenth of the run (2 steps at
    least) first fell to the plain loop's last tenth's; the median over the rounds, a round that never got there
    counting as infinitely slow."""
    curve = [(0.1, 3.0), (0.2, 2.0), (0.3, 1.0), (0.4, 1.2), (0.5, 0.5)]
    assert zoo_run.window(12) == 2 and zoo_run.window(400) == 40
    assert zoo_run.reach_seconds(curve, 1.5, 2) == (0.3, 3)  # (2.0 + 1.0) / 2 <= 1.5 at step 3
    assert zoo_run.reach_seconds(curve, 0.9, 2) == (0.5, 5) and zoo_run.reach_seconds(curve, 0.1, 2) == (None, None)
    reach = iter([0.5, 0.7])  # the later rounds' auto reach, injected; the plain loop's rounds take 1 s
    monkeypatch.setattr(zoo_run, "_timed_round",
                        lambda case, batches, way, target: (1.0, None) if way == "plain" else (2.0, next(reach)))
    monkeypatch.setenv("TORCHSPEED_CPU_PROFILE", "avx2")
    out = zoo_run.run_case(TINY[0], 6, ("plain", "auto"), warm=False, rounds=3)
    plain, auto = out["runs"]["plain"], out["runs"]["auto"]
    assert auto["finished"] and len(auto["round_reach_seconds"]) == 3 and out["data"] == "noise"
    first = auto["round_reach_seconds"][0]  # the first round's: a real fit(recipe="auto") on its own curve
    assert (first is None) == (auto["reach_step"] is None) and plain["target_loss"] > 0
    at = sorted(math.inf if x is None else x for x in [first, 0.5, 0.7])[1]
    assert auto["reach_seconds"] == at and auto["reach_vs_plain"] == pytest.approx(1.0 / at)


def test_the_zoos_batches_can_be_learned_and_are_the_same_in_every_process():
    """A class prototype under noise: the nearest prototype names the label of nearly every image; token chains
    follow the fixed successor table but for their noise; the teacher is the same on every call."""
    from zoo_cases import images, lm_pairs, prototypes, successors, vectors
    g = torch.Generator().manual_seed(0)
    x, y = images(256, 16)(g)
    protos = prototypes(10, 3, 16, 16)
    nearest = torch.cdist(x.flatten(1), protos.flatten(1)).argmin(1)
    assert (nearest == y).float().mean() > 0.9 and images(4, 16).learnable and vectors().learnable
    x, y = lm_pairs(64, 32, 50)(g)
    follows = (successors(50)[x] == y).float().mean()
    assert 0.85 < follows < 0.95  # 10% of the tokens at random
    assert torch.equal(successors(50), successors(50)) and torch.equal(prototypes(10, 3, 16, 16), protos)


def test_a_short_run_trains_more_steps_up_to_the_cap(monkeypatch):
    """--min-run-s: a model whose K-step plain run is shorter than asked trains K scaled to about that long (the
    fixed costs a real run pays once then weigh what they weigh there), never more than --max-steps."""
    assert zoo_run.steps_for(12, 0.010, 0.5, 400) == 400 and zoo_run.steps_for(12, 0.1, 0.5, 400) == 60
    assert zoo_run.steps_for(12, 0.9, 0.5, 400) == 12 and zoo_run.steps_for(12, 0.010, 0.0, 400) == 12
    real = zoo_run._plain_row
    monkeypatch.setattr(zoo_run, "_plain_row", lambda case, b: dict(real(case, b), seconds=0.001 * len(b)))
    monkeypatch.setenv("TORCHSPEED_CPU_PROFILE", "avx2")
    out = zoo_run.run_case(TINY[0], 4, ("plain", "fit"), warm=False, min_run_s=0.02, max_steps=50)
    assert out["steps"] == 20 and out["runs"]["fit"]["steps"] == 20 and out["runs"]["fit"]["loss_equal"]
    assert zoo_run.run_case(TINY[0], 4, ("plain",), warm=False)["steps"] == 4


def test_the_plain_loop_and_its_probe_are_deterministic():
    case = TINY[2]
    batches = zoo_run.batches_for(case, 3)
    (_, m1, l1), (_, m2, l2) = zoo_run.plain_loop(case, batches), zoo_run.plain_loop(case, batches)
    assert l1 == l2 and zoo_run.probe(case, m1, batches[0]) == zoo_run.probe(case, m2, batches[0])


def test_a_failing_run_is_recorded_not_raised(monkeypatch):
    def boom(*a, **k):
        raise ValueError("could not create a primitive\nsecond line")
    monkeypatch.setattr(zoo_run, "fit_run", boom)
    out = zoo_run.run_case(TINY[0], 2, warm=False)
    for way in ("fit", "auto"):
        assert out["runs"][way]["finished"] is False
        assert out["runs"][way]["error"] == "ValueError: could not create a primitive"


def test_a_model_the_plain_loop_cannot_train_runs_no_other_way():
    bad = Case("bad", "hand", lambda: nn.Linear(5, 3), _vec, xy_logits)  # 6 features into Linear(5)
    out = zoo_run.run_case(bad, 2, warm=False)
    assert list(out["runs"]) == ["plain"] and out["runs"]["plain"]["error"].startswith("RuntimeError")


def _row(vs_fit, vs_auto, loss_fit=1.0, loss_auto=0.9, kept=True, source="hand"):
    plain = {"finished": True, "seconds": 1.0, "vs_plain": 1.0, "loss": 1.0}
    fit = {"finished": True, "vs_plain": vs_fit, "loss": loss_fit, "kept_plain": kept, "loss_equal": loss_fit == 1.0,
           "settings": {"precision": "fp32"}}
    auto = ({"finished": False, "error": "RuntimeError: x"} if vs_auto is None
            else {"finished": True, "vs_plain": vs_auto, "loss": loss_auto, "settings": {"precision": "bf16"}})
    return {"source": source, "runs": {"plain": plain, "fit": fit, "auto": auto}}


def test_the_summary_counts_as_the_issue_defines(tmp_path):
    models = {"a": _row(1.0, 1.2), "b": _row(0.5, 0.8), "c": _row(2.0, None, loss_fit=1.1, source="timm"),
              "d": _row(1.0, 1.1, loss_auto=1.5)}
    s = zoo_report.summarize(models, {"e": {"reason": "RuntimeError: too small"}})
    assert s["models"] == 5 and s["plain_trains"] == 4 and s["plain_fails"] == 1
    assert s["fit"]["errors"] == 0 and s["auto"]["errors"] == 1 and s["auto"]["error_models"] == ["c"]
    assert s["fit"]["share_at_least_0.97"] == 0.75 and abs(s["fit"]["geomean_vs_plain"] - 1.0) < 1e-9
    assert s["fit"]["kept_plain"] == 4 and s["fit"]["kept_plain_loss_differs"] == ["c"]
    assert s["auto"]["share_reaches_plain_loss_no_slower"] == 0.25  # a only: b slower, c failed, d worse loss
    data = dict(profile="host", K=4, command="python benchmarks/bench_zoo.py --x", commit="abc1234", cpu="a CPU",
                versions={"torch": "t", "torchvision": "v"}, models=models, plain_fails={"e": {"reason": "too small"}},
                summary=s)
    path = tmp_path / "zoo.json"
    path.write_text(json.dumps(data))
    zoo_report.write_docs([path], tmp_path / "zoo.md")
    doc = (tmp_path / "zoo.md").read_text()
    assert "python benchmarks/bench_zoo.py --x" in doc and "| host | 4 | 5 (4 / 1) | 0 | 1 | 75% |" in doc
    assert "| c | auto | `RuntimeError: x` |" in doc and "| host | e |" in doc
    later = dict(data, models={"a": _row(1.0, None), "b": _row(0.99, None)}, commit="def5678", rounds=3,
                 profile="avx2", summary={})  # a later sweep: its summary counted again from its models
    later_path = tmp_path / "zoo_later_avx2.json"
    later_path.write_text(json.dumps(later))
    zoo_report.write_docs([path], tmp_path / "zoo.md", [later_path])
    doc = (tmp_path / "zoo.md").read_text()
    assert "## Later sweeps" in doc and "| `zoo_later_avx2.json` | avx2 | `def5678` | 4 | 3 | 2 | 0 | 100% | 0.995x | 2 of 2 | 2 | 0% |" in doc
    later_path.write_text(json.dumps(dict(later, min_run_s=1.0, max_steps=400)))  # K scaled for short runs
    zoo_report.write_docs([path], tmp_path / "zoo.md", [later_path])
    assert "| `def5678` | 4-400, >= 1 s | 3 | 2 |" in (tmp_path / "zoo.md").read_text()


def test_a_curve_sweep_counts_auto_by_when_it_reached_the_loops_loss(tmp_path):
    """With the curve: reached no slower where the loop's seconds over auto's seconds to that loss are 1 or more,
    whatever its K-step loss; the share is also given over the learnable models, with the misses listed."""
    def curve_row(reach_vs, data="learnable", loss_auto=1.2):
        row = _row(1.0, 0.8, loss_auto=loss_auto)
        row["data"] = data
        row["runs"]["auto"].update(reach_seconds=None if reach_vs is None else 1.0 / reach_vs,
                                   reach_vs_plain=reach_vs, reach_step=None if reach_vs is None else 7)
        return row
    models = {"fast": curve_row(1.5), "slow": curve_row(0.9), "never": curve_row(None),
              "noise": curve_row(2.0, "noise")}
    a = zoo_report.summarize(models, {})["auto"]
    assert a["share_reaches_plain_loss_no_slower"] == 0.5 and a["learnable_runs"] == 3
    assert a["share_reaches_learnable"] == 0.333 and a["never_reached"] == ["never"]
    assert a["missed"] == ["never", "slow"]
    data = dict(profile="host", K=4, command="c", commit="abc1234", cpu="a CPU",
                versions={"torch": "t", "torchvision": "v"}, models=models, plain_fails={}, rounds=3)
    (tmp_path / "zoo.json").write_text(json.dumps(data))
    (tmp_path / "later.json").write_text(json.dumps(data))
    zoo_report.write_docs([tmp_path / "zoo.json"], tmp_path / "zoo.md", [tmp_path / "later.json"])
    doc = (tmp_path / "zoo.md").read_text()
    assert "| 0 | 50% (curve; learnable data: 33% of 3, geomean" in doc
    assert "| never | None | never |" in doc and "| slow | None | 1.11 s, step 7 | 0.90x | 0.80x |" in doc


def test_a_sample_spreads_over_the_sources_and_is_repeatable():
    pools = {"torchvision": [f"tv{i}" for i in range(9)], "timm": [f"timm/{i}" for i in range(9)],
             "hand": ["hand/a", "hand/b"]}
    s = bench_zoo.select(pools, None, 6, seed=3)
    assert s == bench_zoo.select(pools, None, 6, seed=3) and len(s) == 6
    assert {n.split("/")[0] if "/" in n else "tv" for n in s} == {"tv", "timm", "hand"}
    assert bench_zoo.select(pools, ["hand/"], None) == ["hand/a", "hand/b"]


def test_the_registry_covers_the_issues_zoo():
    reg = zoo_run.registry()
    by = {}
    for c in reg.values():
        by.setdefault(c.source, []).append(c.name)
    import torchvision
    assert set(torchvision.models.list_models(module=torchvision.models)) <= set(by["torchvision"])
    assert len(by["torchvision-detection"]) >= 3 and len(by["torchvision-segmentation"]) >= 3
    assert len(by["timm"]) >= 40 and len(by["transformers"]) >= 15 and len(reg) >= 150


def test_a_model_runs_in_its_own_process(tmp_path):
    row = bench_zoo.run_child("hand/mlp_regression", 3, ["plain", "fit"], "avx2", timeout=300)
    assert row["runs"]["plain"]["finished"] and row["runs"]["fit"]["finished"], row
    assert row["runs"]["fit"]["loss_equal"], row


# The slow sweep: a sample of the zoo's forms, each model in its own process, the trial live.
SAMPLE = ["resnet18", "mobilenet_v3_small", "fasterrcnn_mobilenet_v3_large_320_fpn", "lraspp_mobilenet_v3_large",
          "timm/resnet10t", "timm/vit_tiny_patch16_224", "hf/gpt2", "hf/t5", "hand/lstm_lm_carried",
          "hand/kv_cache_decoder", "hand/step_counter", "hand/gan"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_sampled_zoo_trains_under_fit_as_under_its_own_loop(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_zoo.py"), "--models", *SAMPLE, "--steps", "12",
           "--profiles", "host", "avx2", "--out-dir", str(tmp_path), "--docs", "", "--timeout", "240",
           "--per-process", "6"]
    subprocess.run(cmd, check=True, timeout=880)
    problems = []
    for path in (tmp_path / "zoo.json", tmp_path / "zoo_avx2.json"):
        data = json.loads(path.read_text())
        for name, m in data["models"].items():
            for way in ("fit", "auto"):
                r = m["runs"][way]
                if not r["finished"]:
                    problems.append(f"{data['profile']} {name} {way}: {r['error']}")
                elif way == "fit" and r["kept_plain"] and not r["loss_equal"]:
                    problems.append(f"{data['profile']} {name}: fit kept the plain settings, loss {r['loss']} "
                                    f"!= plain {m['runs']['plain']['loss']}")
    assert problems == []
