"""Knowledge distillation in `fit`: `fit(student, loader, teacher=teacher)` (T38).

A small student trained on a large teacher's softened outputs (Hinton et al. 2015) can reach an
accuracy its own labels do not give it in the same time. The loss is

    alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * task_loss(student, target)

(`kd_loss`; T the temperature). The teacher runs in eval mode, under `torch.no_grad`, inside the
run's autocast (its precision); it gets no gradients and is not trained.

The teacher's forward is not free: in a fixed-time speed competition distillation lost to the plain
baseline for that reason. So for data held in memory (a DataLoader over a `TensorDataset`, or a dataset
`train.in_memory` reads as tensors) the teacher's top-k logits per sample can be computed once, before
training, and carried in the batches (`(inputs..., topk_values, topk_index, target)`): each sample then
costs one teacher forward for the whole run. `cache="auto"` decides it: a run that reads its data
twice or more (`COUNTED_PASSES`) caches by count (its steps would run the teacher on every sample that
many times, and a cache chunk's forward costs no more a sample than a batch's); a run nearer one pass
by measurement: one timed teacher forward of a training batch, times the run's steps, against one timed
forward of a cache chunk, times the chunks (recorded as `decisions["distill"]`, with both costs). The
measurement costs about 4 teacher forwards of a chunk (0.5 s of a 13 s ResNet-20 run on the digits,
more than the cache pass itself), so a run it cannot change does not pay it. The cache pass's
seconds are inside `fit`'s, so they count toward the time to target as the per-step forwards do.
Augmented data (a transform per sample) is never cached: its inputs change every epoch.

With the top k < classes, the teacher's distribution is renormalised over its k classes and the
student is scored at those classes (sparse KD); k >= classes is exact. Validation batches get the
task loss alone (val_loss is comparable with a run without a teacher).

Example:
    >>> fit(student, loader, teacher=Teacher(big, temperature=4.0, alpha=0.9), epochs=10, val_loader=val)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

from torchspeed.env import default_device, sync
from torchspeed.train.decision import Decision
from torchspeed.train.in_memory import in_memory_tensors
from torchspeed.train.losses import default_loss
from torchspeed.train.trial.precision import resolve_precision
from torchspeed.train.rounds import run_for
from torchspeed.train.sampler import rebuild_loader

__all__ = ["Teacher", "Distillation", "kd_loss", "prepare_distillation", "CACHE_CHUNK", "TOPK", "COUNTED_PASSES"]

CACHE_CHUNK = 512   # samples per teacher forward while caching (no backward: a large batch is cheap in memory)
TOPK = 64           # logits kept per sample by default (all of them for up to 64 classes: exact)
COUNTED_PASSES = 2  # a run that reads its data this many times or more caches without timing the teacher


@dataclass
class Teacher:
    """The teacher and how it teaches: `temperature`, `alpha` (the KD term's weight; 1 - alpha the task
    loss's), `topk` cached logits per sample, `cache` ("auto": measured; True; False)."""

    model: nn.Module
    temperature: float = 4.0
    alpha: float = 0.9
    topk: int = TOPK
    cache: bool | str = "auto"

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature!r}: use a positive temperature (4.0 is usual)")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha={self.alpha!r}: the KD term's weight must be in [0, 1] (0.9 is usual)")
        if self.cache not in ("auto", True, False):
            raise ValueError(f"cache={self.cache!r}: use 'auto', True or False")


@dataclass
class Distillation:
    """What `fit` trains with: the loader (the cached logits in its batches, or the one given), the step."""

    loader: Iterable
    step_fn: Callable
    decision: Decision


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, target: torch.Tensor, *,
            temperature: float = 4.0, alpha: float = 0.9, loss_fn: Callable | None = None,
            teacher_index: torch.Tensor | None = None) -> torch.Tensor:
    """alpha * T^2 * KL(teacher || student) at temperature T + (1 - alpha) * loss_fn(student_logits, target).

    `teacher_logits` are every class's (B, C), or the top k (B, k) with their classes in `teacher_index`."""
    t = float(temperature)
    log_s = F.log_softmax(student_logits.float() / t, dim=-1)
    if teacher_index is not None:
        log_s = log_s.gather(-1, teacher_index)
    log_t = F.log_softmax(teacher_logits.float() / t, dim=-1)
    kd = (log_t.exp() * (log_t - log_s)).sum(-1).mean() * (t * t)
    if alpha >= 1.0:
        return kd
    return alpha * kd + (1.0 - alpha) * (loss_fn or default_loss())(student_logits, target)


def _split(batch) -> tuple[tuple, torch.Tensor]:
    if not isinstance(batch, (list, tuple)) or len(batch) < 2:
        raise TypeError(f"fit(teacher=...) takes (inputs..., target) batches; got {type(batch).__name__}: "
                        "yield tuples from the loader, or distil in your own step_fn with torchspeed.distill.kd_loss")
    return tuple(batch[:-1]), batch[-1]


def _make_step(teacher: Teacher, fields: int, cached: bool, loss_fn: Callable | None) -> Callable:
    """step_fn(model, batch) -> (student logits, loss): the KD loss in training, the task loss in evaluation."""
    task = loss_fn or default_loss()

    def step(model, batch):
        if cached and len(batch) == fields + 2:  # (inputs..., topk values, topk index, target)
            inputs, (values, index, target) = tuple(batch[:-3]), batch[-3:]
        else:
            (inputs, target), values, index = _split(batch), None, None
        logits = model(*inputs)
        if not torch.is_grad_enabled():  # evaluation (and other no-grad reads): the task's own loss
            return logits, task(logits, target)
        if values is None:
            with torch.no_grad():
                values = teacher.model(*inputs)
        return logits, kd_loss(logits, values, target, temperature=teacher.temperature, alpha=teacher.alpha,
                               loss_fn=task, teacher_index=index)
    return step


def _classes(model: nn.Module, inputs: tuple) -> int:
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            return int(model(*inputs).shape[-1])
    finally:
        model.train(was)


def _check_classes(student: nn.Module, teacher_classes: int, inputs: tuple) -> None:
    n = _classes(student, inputs)
    if n != teacher_classes:
        raise ValueError(f"the teacher outputs {teacher_classes} classes and the student {n}: distil from a teacher "
                         f"trained on the same labels (its last layer with {n} outputs), or give the student a "
                         f"{teacher_classes}-way head")


def _teacher_logits(teacher: Teacher, tensors: tuple[torch.Tensor, ...], n_inputs: int, device, precision
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k values, their classes) of the teacher's logits for every sample, in index order, on the host."""
    values, index = [], []
    n = tensors[0].shape[0]
    with torch.no_grad(), precision.autocast():
        for lo in range(0, n, CACHE_CHUNK):
            chunk = [t[lo:lo + CACHE_CHUNK].to(device) for t in tensors[:n_inputs]]
            out = teacher.model(*chunk).float()
            v, i = out.topk(min(teacher.topk, out.shape[-1]), dim=-1)
            values.append(v.cpu())
            index.append(i.cpu())
    return torch.cat(values), torch.cat(index)


def _cacheable(loader) -> tuple[tuple[torch.Tensor, ...], int] | None:
    """(the dataset's tensors in index order, the number of input fields) for a DataLoader over tensors whose
    samples are `(inputs..., target)` and whose batches are collated as they are; None otherwise."""
    if not isinstance(loader, DataLoader) or loader.collate_fn is not default_collate:
        return None
    found = in_memory_tensors(loader.dataset)
    if found is None or found[2] is not None or len(found[0]) < 2:
        return None
    tensors, index, _ = found
    if index is not None:
        tensors = tuple(t[index] for t in tensors)
    return tensors, len(tensors) - 1


def _time(call: Callable[[], object], device) -> float:
    call()  # warm-up: first-call set-up is not the steady cost
    n, s = run_for(call, min_calls=2, min_time=0.05, sync=lambda: sync(device))
    return s / n


def _count_passes(loader: DataLoader, tensors, steps: int) -> Decision | None:
    """Cache, counted: a run whose steps read the data COUNTED_PASSES times or more runs the teacher on that many
    samples for each one the cache pass reads, and a chunk's forward costs no more a sample than a batch's (a larger
    batch runs each sample as cheaply or more so). None: a run nearer one pass, which `_decide_cache` measures."""
    n = tensors[0].shape[0]
    per_step = getattr(loader, "batch_size", None) or 0
    passes = steps * per_step / n if n else 0.0
    if passes < COUNTED_PASSES:
        return None
    return Decision(True, f"the run's {steps} steps read the data {passes:.1f} times: one teacher pass over it "
                          f"costs about 1/{passes:.1f} of its forward on each step (counted, not timed)",
                    {"steps": steps, "passes": round(passes, 2), "decide_s": 0.0})


def _decide_cache(teacher: Teacher, loader: DataLoader, tensors, n_inputs: int, steps: int, device, precision
                  ) -> Decision:
    """Cache when one pass over the data costs less than the teacher's forward on every step of the run."""
    t0 = time.perf_counter()
    first = [t.to(device) for t in next(iter(loader))[:n_inputs]]
    chunk = [t[:CACHE_CHUNK].to(device) for t in tensors[:n_inputs]]

    def forward(inputs):
        def call():
            with torch.no_grad(), precision.autocast():
                teacher.model(*inputs)
        return call

    batch_s, chunk_s = _time(forward(first), device), _time(forward(chunk), device)
    per_step = batch_s * steps
    once = chunk_s * math.ceil(tensors[0].shape[0] / CACHE_CHUNK)
    measured = {"teacher_batch_s": round(batch_s, 6), "steps": steps, "per_step_total_s": round(per_step, 3),
                "cache_chunk_s": round(chunk_s, 6), "cache_total_s": round(once, 3),
                "decide_s": round(time.perf_counter() - t0, 3)}  # this measurement's own cost, in fit's seconds
    if once < per_step:
        return Decision(True, f"one teacher pass over the data ({once:.2f} s) costs less than its forward on "
                              f"each of {steps} steps ({per_step:.2f} s)", measured)
    return Decision(False, f"the teacher's forward on each of {steps} steps ({per_step:.2f} s) costs no more than "
                           f"one pass over the data ({once:.2f} s)", measured)


def prepare_distillation(teacher: Teacher | nn.Module, student: nn.Module, train_loader: Iterable, *,
                         loss_fn: Callable | None = None, step_fn: Callable | None = None, epochs: int = 1,
                         max_steps: int | None = None, device=None, precision: str = "auto") -> Distillation:
    """The loader and step `fit` trains `student` with: the teacher moved to the run's device in eval mode,
    its number of classes checked, and its top-k logits cached when `Teacher.cache` says so (or measures so)."""
    if step_fn is not None:
        raise ValueError("fit(teacher=...) builds the training step itself: leave step_fn out (loss_fn= sets the "
                         "task loss), or distil inside your own step_fn with torchspeed.distill.kd_loss")
    teacher = teacher if isinstance(teacher, Teacher) else Teacher(teacher)
    device = default_device(device)
    teacher.model.to(device).eval()
    prec = resolve_precision(precision, device=device)
    found = _cacheable(train_loader)
    inputs, _ = _split(next(iter(train_loader)))
    sample = tuple(t[:2].to(device) for t in inputs)
    _check_classes(student.to(device), _classes(teacher.model, sample), sample)
    if found is None or teacher.cache is False:
        why = "cache=False" if teacher.cache is False else \
            "the data is not tensors in memory (or has its own collate_fn)"
        decision = Decision(False, f"{why}: the teacher runs on each step")
        return Distillation(train_loader, _make_step(teacher, 0, False, loss_fn), decision)
    tensors, n_inputs = found
    steps = epochs * len(train_loader) if max_steps is None else min(max_steps, epochs * len(train_loader))
    if teacher.cache == "auto":
        decision = _count_passes(train_loader, tensors, steps) or _decide_cache(
            teacher, train_loader, tensors, n_inputs, steps, device, prec)
    else:
        decision = Decision(bool(teacher.cache), f"cache={teacher.cache} was asked for")
    if not decision.value:
        return Distillation(train_loader, _make_step(teacher, n_inputs + 1, False, loss_fn), decision)
    t0 = time.perf_counter()
    values, index = _teacher_logits(teacher, tensors, n_inputs, device, prec)
    seconds = time.perf_counter() - t0
    decision = Decision(True, decision.reason, {**(decision.measured or {}), "cache_s": round(seconds, 3),
                                                "topk": int(values.shape[-1])})
    dataset = TensorDataset(*tensors[:n_inputs], values, index, tensors[-1])
    loader = rebuild_loader(train_loader, dataset=dataset, sampler=train_loader.sampler)  # same order, same length
    return Distillation(loader, _make_step(teacher, n_inputs + 1, True, loss_fn), decision)
