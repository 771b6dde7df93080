import math
import os
import tempfile

import pytest
import torch

# Tests run on 2 cores next to other work: keep torch's threads predictable.
torch.set_num_threads(min(2, os.cpu_count() or 1))


# Measured decisions are cached per machine (torchspeed.train.decision.TrialCache): the suite keeps
# its own cache, so no test reads a decision measured outside it.
os.environ["TORCHSPEED_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchspeed-test-cache-")

# Every plan stage decides and refines only the decision keys it declares (plan.stages.Stage.writes, .refines):
# in the suite an undeclared one raises (elsewhere it is a warning), so every fit here checks the declarations.
os.environ["TORCHSPEED_STAGE_CHECK"] = "raise"

# The CPU kinds the suite must pass on (torchspeed.env.CPU_PROFILES). A test marked `capability`
# depends on what the CPU can run natively: it runs once under each profile, injected through
# TORCHSPEED_CPU_PROFILE, whatever CPU this is (docs/architecture.md).
PROFILES = ("avx2", "avx512", "avx512_bf16")


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("capability") is not None:
        metafunc.fixturenames.append("cpu_profile")
        metafunc.parametrize("cpu_profile", PROFILES, indirect=True)


@pytest.fixture
def cpu_profile(request, monkeypatch):
    """The injected CPU profile's name (parametrized over PROFILES for `capability` tests)."""
    name = getattr(request, "param", None) or os.environ.get("TORCHSPEED_CPU_PROFILE") or "avx2"
    monkeypatch.setenv("TORCHSPEED_CPU_PROFILE", name)
    return name


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiny_cnn():
    def make(seed: int = 0, bias: bool = False):
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1, bias=bias), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
    return make


class FakeClock:
    """A stand-in for a module's `time`: perf_counter only moves when the test calls `advance`,
    so measuring code is tested on fixed step times, whatever the machine's load."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def fake_clock():
    """A `FakeClock`; patch it in with `monkeypatch.setattr(module, "time", fake_clock)`."""
    return FakeClock()


@pytest.fixture(autouse=True)
def _unpriced_switch_trials(request, monkeypatch):
    """A switch trial is priced in real seconds (switches.LiveTrial._price): a slow first step on a loaded machine
    would stop it. Tests see the unpriced trial unless marked `priced` (those inject their seconds), and a cached
    switch choice read as final unless marked `pooled` (whether a real timing's choice was close is chance)."""
    if request.node.get_closest_marker("priced") is None:
        monkeypatch.setattr("torchspeed.train.trial.autoswitch.PRICE_SHARE", math.inf)
        monkeypatch.setattr("torchspeed.plan.planner.PORTED_TRIAL_SHARE", math.inf)
    if request.node.get_closest_marker("pooled") is None:
        monkeypatch.setattr("torchspeed.train.trial.pool.POOL_RUNS", 1)
    if request.node.get_closest_marker("paced") is None:  # its turns timed apart are paced in real seconds too
        monkeypatch.setattr("torchspeed.train.trial.shadow.SHADOW_SHARE", math.inf)


@pytest.fixture
def adamw_step_calls(monkeypatch):
    """A list that gets one entry per call of `torch.optim.AdamW.step` (torch's own step, not the lean one)."""
    calls = []
    real = torch.optim.AdamW.step

    def counting(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)
    monkeypatch.setattr(torch.optim.AdamW, "step", counting)
    return calls


@pytest.fixture
def recipe_of(monkeypatch, tmp_path):
    """The recipe `make_plan(..., recipe="auto")` chooses: its `Recipe` (whose `decisions` are the plan's), for a
    run of `steps` optimizer steps (None: one epoch of the loader), with trial=False (the LR part measured before the
    run, not left for the run). `share`: the tuning budget's share of the run (None: every part affordable);
    `lr_steps`, `lr_trial_steps`: the LR part's range test and trial steps; the rest goes to make_plan (`cache=`: else
    a cache of the test's own)."""
    from torchspeed.plan import budget, make_plan, recipe_lr
    from torchspeed.train.config import TrainConfig

    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path / "recipe-cache"))

    def choose(model, loader, *, parts=None, steps=None, share=None, lr_steps=None, lr_trial_steps=None,
               precision="auto", **kw):
        monkeypatch.setattr(budget, "TUNING_SHARE", 1e9 if share is None else share)
        if lr_steps is not None:
            monkeypatch.setattr(recipe_lr, "LR_STEPS", lr_steps)
        if lr_trial_steps is not None:
            monkeypatch.setattr(recipe_lr, "LR_TRIAL_STEPS", lr_trial_steps)
        cfg = TrainConfig(epochs=steps or 1, max_steps=steps, precision=precision, trial=False, progress=False,
                          compile=False)
        return make_plan(model, loader, cfg, recipe="auto", recipe_parts=parts, **kw).recipe

    return choose
