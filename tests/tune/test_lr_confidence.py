"""The range test says how far to trust its suggestion: high on a clear fall, low on a flat or noisy curve."""

import numpy as np

from torchspeed.tune import suggest_lr

LRS = np.geomspace(1e-6, 10, 100)
X = np.log10(LRS)
CLEAN = 2.3 - 2.0 / (1 + np.exp(-(X + 1.5) * 3)) + np.where(X > 0, (X * 3) ** 2, 0)  # falls near 3e-2


def test_a_clear_fall_is_high_confidence():
    res = suggest_lr(LRS, CLEAN)
    assert res.confidence == "high" and res.warning is None


def test_a_flat_curve_is_low_confidence_and_says_flat():
    flat = 2.3 - 0.05 * (CLEAN - CLEAN.min()) / (CLEAN.max() - CLEAN.min())  # falls 2% at most
    res = suggest_lr(LRS, flat)
    assert res.confidence == "low" and "flat" in res.warning


def test_a_noisy_curve_is_low_confidence_and_says_noisy():
    noise = np.random.default_rng(0).normal(0, 1.0, len(LRS))  # scatter about half the 2.0 fall
    res = suggest_lr(LRS, CLEAN + noise)
    assert res.confidence == "low" and "noisy" in res.warning
    assert suggest_lr(LRS, CLEAN + noise * 0.02).confidence == "high"  # a little scatter is not noise
