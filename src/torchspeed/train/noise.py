"""The gradient noise scale: how large a batch still buys progress per step (T17).

McCandlish et al. (2018), "An Empirical Model of Large-Batch Training": with G the true
gradient and Σ the per-sample gradient covariance, the simple noise scale

    B_simple = tr(Σ) / |G|²

is about the critical batch size: below it, doubling the batch nearly halves the steps to a
target; far above it, a larger batch only costs more samples. Both terms are estimated
without per-sample gradients, from the squared norms of gradients at two batch sizes
b < B (their appendix A.1), which are unbiased:

    |G|²   ≈ (B |g_B|² - b |g_b|²) / (B - b)
    tr(Σ)  ≈ (|g_b|² - |g_B|²) / (1/b - 1/B)

Each is averaged (an exponential moving average) before the ratio is taken, because the
ratio of two noisy estimates is biased. The two batch sizes come from gradients the loop
already has (k accumulation micro-batches of b give b and B = k b; DDP ranks likewise) or,
here, from two halves of a batch: `measure_noise_scale` runs the two halves' backward
passes separately at the model's current weights, leaves the weights, gradients and RNG
as they were, and reports B_simple with the critical batch size it implies.

During training, `fit(noise_scale_every=N)` does the same on the current batch every N
optimizer steps (two half-batch backward passes: about one extra step per N) and logs the
running estimate as `noise_scale` in each epoch's row. `BatchRamp.from_noise_scale`
(`train/batch_ramp.py`) turns a measured value into a batch-size warm-up.

Example:
    >>> res = measure_noise_scale(model, loader, batches=8)
    >>> res.noise_scale, res.suggestion
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from torchspeed.train.trial.backends import no_autotune
from torchspeed.train.loop.batch import batch_size, forward_loss
from torchspeed.train.state.rng import capture_rng_state, restore_rng_state
from torchspeed.train.sampler import iter_batches
from torchspeed.train.transfer import to_device

__all__ = ["NoiseScaleEstimator", "NoiseScaleResult", "measure_noise_scale", "split_batch_in_two", "grad_sq_norm",
           "observe_batch"]


def grad_sq_norm(params: Iterable[torch.Tensor]) -> float:
    """The squared L2 norm of the gradients of `params` (one host read)."""
    sq = [p.grad.detach().float().pow(2).sum() for p in params if p.grad is not None]
    return float(torch.stack(sq).sum()) if sq else 0.0


class NoiseScaleEstimator:
    """Running estimates of |G|² and tr(Σ) from gradient norms at two batch sizes; `value` is B_simple."""

    def __init__(self, ema: float = 0.9):
        self.ema, self.g2, self.trace, self.updates = ema, None, None, 0

    def update(self, sq_small: float, sq_big: float, b_small: int, b_big: int) -> None:
        """`sq_small`: mean |g|² of batches of `b_small` samples; `sq_big`: |g|² of their union of `b_big`."""
        if not b_big > b_small > 0:
            raise ValueError(f"need two batch sizes b_big > b_small > 0, got {b_small} and {b_big}")
        g2 = (b_big * sq_big - b_small * sq_small) / (b_big - b_small)
        tr = (sq_small - sq_big) / (1.0 / b_small - 1.0 / b_big)
        if self.g2 is None:
            self.g2, self.trace = g2, tr
        else:
            self.g2 = self.ema * self.g2 + (1 - self.ema) * g2
            self.trace = self.ema * self.trace + (1 - self.ema) * tr
        self.updates += 1

    @property
    def value(self) -> float | None:
        """B_simple = tr(Σ) / |G|² (None before an update, inf when |G|² is not yet positive)."""
        if self.g2 is None:
            return None
        return self.trace / self.g2 if self.g2 > 0 else float("inf")


@dataclass
class NoiseScaleResult:
    noise_scale: float           # B_simple, in samples
    grad_sq: float               # |G|² estimate
    trace: float                 # tr(Σ) estimate
    batches: int                 # batches measured
    batch_size: int              # samples per measured batch (two halves of it)
    suggestion: str

    @property
    def critical_batch_size(self) -> int:
        return max(1, round(self.noise_scale)) if self.noise_scale != float("inf") else 0


def split_batch_in_two(batch):
    """Two halves of a batch along its first dimension (tuples, lists, dicts and tensors, nested)."""
    if isinstance(batch, torch.Tensor):
        h = batch.shape[0] // 2
        return batch[:h], batch[h:2 * h]
    if isinstance(batch, dict):
        parts = {k: split_batch_in_two(v) for k, v in batch.items()}
        return {k: v[0] for k, v in parts.items()}, {k: v[1] for k, v in parts.items()}
    if isinstance(batch, (list, tuple)):
        parts = [split_batch_in_two(v) for v in batch]
        return type(batch)(p[0] for p in parts), type(batch)(p[1] for p in parts)
    return batch, batch


def observe_batch(model: nn.Module, batch, est: NoiseScaleEstimator, *, loss_fn: Callable | None = None,
                  step_fn: Callable | None = None, autocast: Callable | None = None) -> None:
    """Feed `est` one measurement from `batch` (on the model's device) split in two halves, at the current
    weights. Gradients, buffers (BatchNorm statistics) and RNGs are left as they were."""
    params = [p for p in model.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    rng = capture_rng_state()
    halves = split_batch_in_two(batch)
    b = batch_size(halves[0])
    if b < 1:
        raise ValueError("a batch of one sample cannot be split in two: use batches of 2 or more")
    try:
        grads, sq = [], []
        for half in halves:
            for p in params:
                p.grad = None
            with autocast() if autocast is not None else contextlib.nullcontext():
                loss = forward_loss(model, half, loss_fn=loss_fn, step_fn=step_fn).loss
            loss.backward()
            g = [p.grad.detach().float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
                 for p in params]
            grads.append(g)
            sq.append(float(torch.stack([x.pow(2).sum() for x in g]).sum()))
        big = float(torch.stack([((a + c) / 2).pow(2).sum() for a, c in zip(*grads)]).sum())
        est.update(sum(sq) / 2, big, b, 2 * b)
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(buffers[k])
        restore_rng_state(rng)


def measure_noise_scale(model: nn.Module, loader: Iterable, *, batches: int = 8, loss_fn: Callable | None = None,
                        step_fn: Callable | None = None, ema: float = 0.9) -> NoiseScaleResult:
    """B_simple of `model` at its current weights, from `batches` batches of `loader` split in halves.

    Nothing is trained: weights, gradients, buffers, train/eval modes and RNGs are left as they were.
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    est = NoiseScaleEstimator(ema=ema)
    modes = {n: m.training for n, m in model.named_modules()}
    size = 0
    reader = iter_batches(loader, cycle=False, what="the loader given to measure_noise_scale")
    try:
        model.train()
        with no_autotune():  # half batches: a shape the run never trains at
            for batch in itertools.islice(reader, batches):
                observe_batch(model, to_device(batch, device), est, loss_fn=loss_fn, step_fn=step_fn)
                size = max(size, 2 * batch_size(split_batch_in_two(batch)[0]))
    finally:
        reader.close()
        for n, m in model.named_modules():
            m.training = modes[n]
    if est.updates == 0:
        raise ValueError("the loader yielded no batch: nothing to measure the gradient noise on")
    value = est.value
    return NoiseScaleResult(value, est.g2, est.trace, est.updates, size, _suggest(value, size))


def _suggest(value: float, size: int) -> str:
    if value == float("inf") or value <= 0:
        return ("the gradient noise is not measurable against the signal yet (|G|² <= 0): measure again after "
                "a few hundred steps")
    crit = round(value)
    if size < crit / 2:
        return (f"critical batch size ~{crit}: batches up to about {crit} samples still cut the steps nearly "
                f"in proportion; a batch-size warm-up from {size} toward {crit} as training goes on saves steps "
                f"where larger batches cost little more time per step (a GPU): "
                f"DataLoader(ds, batch_sampler=BatchRamp.from_noise_scale(RandomSampler(ds), {value:.0f}, "
                f"start={size}, max_batch=..., ramp_samples=...)), torchspeed.train.batch_ramp")
    if size > 2 * crit:
        return (f"critical batch size ~{crit}: batches of {size} spend samples for little gain per step now; "
                f"{crit}-{2 * crit} trains as fast per sample (the noise scale grows as the loss falls)")
    return f"critical batch size ~{crit}: a batch of {size} is in the efficient range"
