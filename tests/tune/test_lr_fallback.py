"""When the range test's curve is flat or noisy, find_lr measures a few LRs instead (the fallback trial)."""

import math
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from torchspeed.bench.workloads import create_model, digits
from torchspeed.tune import find_lr, suggest_lr
from torchspeed.tune import lr as lr_mod
from torchspeed.tune.lr import choose_trial, trial_candidates

LRS = np.geomspace(1e-6, 10, 100)
X = np.log10(LRS)
CLEAN = 2.3 - 2.0 / (1 + np.exp(-(X + 1.5) * 3)) + np.where(X > 0, (X * 3) ** 2, 0)  # falls near 3e-2
FLAT = 2.3 - 0.05 * (CLEAN - CLEAN.min()) / (CLEAN.max() - CLEAN.min())


def _random_labels(seed=0, n=256):
    """A linear model on noise with random labels: nothing to learn, so the range test's curve is flat."""
    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 10, (n,), generator=g))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    return model, DataLoader(data, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(seed))


def _mlp_digits():
    torch.manual_seed(0)
    train = digits(size=8)[0]
    return create_model("mlp", image_size=8), DataLoader(train, batch_size=64, shuffle=True,
                                                         generator=torch.Generator().manual_seed(0))


def test_candidates_span_factor_3_below_the_min_loss_lr():
    res = suggest_lr(LRS, FLAT)
    cands = trial_candidates(res, n=5)
    assert len(cands) == 5 and cands == sorted(cands)
    assert all(b / a == pytest.approx(3.0) for a, b in zip(cands, cands[1:]))
    assert cands[-1] == pytest.approx(max(res.min_loss_lr, res.suggestion))
    assert cands[0] >= LRS[0]


def test_choose_trial_takes_the_lowest_score_and_says_so():
    res = suggest_lr(LRS, FLAT)
    table = [(1e-3, 2.2), (3e-3, 2.1), (1e-2, 1.7), (3e-2, 1.9), (9e-2, math.inf)]
    out = choose_trial(res, table, trial_steps=20)
    assert out.suggestion == out.max_lr == 1e-2 and out.min_lr == pytest.approx(1e-3)
    assert out.trial == tuple(table) and out.steps == res.steps + 5 * 20
    assert "measured trial" in out.rule and out.confidence == "low"  # the curve itself is still unreadable
    # every candidate diverged: the curve's suggestion stands, and the rule says why
    bad = choose_trial(res, [(a, math.inf) for a, _ in table], trial_steps=20)
    assert bad.suggestion == res.suggestion and "diverged at every candidate" in bad.rule


def test_flat_curve_runs_the_trial_by_default_and_restores_bit_identical():
    model, loader = _random_labels()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = [g["lr"] for g in opt.param_groups]
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    res = find_lr(model, loader, optimizer=opt, num_steps=40, trial_steps=8, progress=False, precision="fp32")
    assert res.confidence == "low"
    assert 5 <= len(res.trial) <= 7, "a low-confidence curve must fall back to the measured trial by default"
    lrs, scores = zip(*res.trial)
    assert list(lrs) == sorted(lrs)
    assert res.suggestion == res.max_lr == lrs[int(np.argmin(scores))]
    assert res.steps == len(res.lrs) + len(res.trial) * 8
    assert "measured trial" in res.rule
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters()) and not opt.state
    assert [g["lr"] for g in opt.param_groups] == opt_before
    assert torch.equal(torch.get_rng_state(), rng[0]) and random.getstate() == rng[1]
    assert np.array_equal(np.random.get_state()[1], rng[2])


def test_every_candidate_starts_from_the_same_state_on_the_same_batches(monkeypatch):
    seen = []
    original = lr_mod._trial_run

    def spy(step, set_lr, lr, batches, device, **kw):
        weights = torch.cat([p.detach().flatten().clone() for p in step.model.parameters()])
        momentum = [s.get("momentum_buffer") for s in step.optimizer.state.values()]
        seen.append((lr, weights, [b[0].sum().item() for b in batches], momentum, torch.get_rng_state()))
        return original(step, set_lr, lr, batches, device, **kw)

    monkeypatch.setattr(lr_mod, "_trial_run", spy)
    model, loader = _random_labels(seed=1)
    res = find_lr(model, loader, num_steps=40, trial_steps=8, progress=False, precision="fp32")
    assert sorted(s[0] for s in seen) == [lr for lr, _ in res.trial]
    for _, w, b, m, r in seen[1:]:
        assert torch.equal(w, seen[0][1]) and b == seen[0][2] and torch.equal(r, seen[0][4])
        assert all(x is None for x in m)  # no momentum carried over from the range test or another candidate


def test_the_best_scoring_candidate_wins(monkeypatch):
    """Scores injected: the trial's pick is the candidate with the lowest score, wherever the curve pointed."""
    model, loader = _random_labels(seed=2)
    target = {}

    def scored(step, set_lr, lr, batches, device, **kw):
        target.setdefault("lrs", []).append(lr)
        return 1.0 if len(target["lrs"]) == 2 else 2.0  # the second-lowest LR scores best

    monkeypatch.setattr(lr_mod, "_trial_run", scored)
    res = find_lr(model, loader, num_steps=40, trial_steps=8, progress=False, precision="fp32")
    assert len(target["lrs"]) == 5  # an inner candidate won: no extension
    assert res.suggestion == target["lrs"][1] and res.max_lr == target["lrs"][1]


def test_a_best_at_the_top_edge_extends_the_trial_upwards_inside_the_range(monkeypatch):
    monkeypatch.setattr(lr_mod, "_trial_run", lambda step, set_lr, lr, *a, **kw: 1.0 / lr)  # higher is better
    model, loader = _random_labels(seed=3)
    res = find_lr(model, loader, num_steps=40, trial_steps=8, progress=False, precision="fp32")
    lrs = [lr for lr, _ in res.trial]
    curve = suggest_lr(res.lrs, res.losses, diverged=res.diverged)  # the range test's own result
    assert lrs[:5] == pytest.approx(trial_candidates(curve, n=5))
    assert 5 < len(lrs) <= 5 + lr_mod.TRIAL_EXTEND  # extended: the top candidate scored best
    assert all(lr <= lr_mod.trial_ceiling(curve) for lr in lrs[5:]) and res.suggestion == max(lrs)


def test_no_trial_when_confidence_is_high_or_fallback_is_off():
    model, loader = _mlp_digits()
    res = find_lr(model, loader, progress=False, precision="fp32")
    assert res.confidence != "low" and res.trial == () and res.steps == len(res.lrs)
    model, loader = _random_labels()
    off = find_lr(model, loader, num_steps=40, progress=False, precision="fp32", fallback=False)
    assert off.confidence == "low" and off.trial == () and off.steps == len(off.lrs)
    assert "measured trial" not in off.rule


def test_bad_trial_settings_are_refused():
    model, loader = _random_labels()
    with pytest.raises(ValueError, match="trial_lrs"):
        find_lr(model, loader, trial_lrs=1, progress=False)


def test_one_cycle_peak_is_where_the_fall_ends_not_a_noisy_minimum_on_the_plateau():
    """max_lr = max(suggestion, bottom_lr): the lowest LR with 90% of the fall done, however far the plateau runs."""
    plateau = CLEAN.copy()
    mask = (X > -1) & (X <= 0)
    plateau[mask] = CLEAN[X > -1].min() - np.linspace(0, 0.02, mask.sum())  # a long bottom from 1e-1 to 1,
    res = suggest_lr(LRS, plateau)                                         # its lowest point 10x past its start
    assert res.min_loss_lr > 0.5
    assert res.bottom_lr < 0.2 * res.min_loss_lr
    assert res.max_lr == max(res.suggestion, res.bottom_lr) and res.min_lr == pytest.approx(res.max_lr / 10)
    smooth = np.asarray(res.smoothed)
    i = list(res.lrs).index(res.bottom_lr)
    fall = np.median(smooth[:10]) - smooth.min()
    assert smooth[i] <= smooth.min() + 0.1 * fall < smooth[i - 1]
