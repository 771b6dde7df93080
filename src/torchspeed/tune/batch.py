"""Batch-size finder (T17): the largest batch that fits, and the fastest one, both measured.

What it does:
- largest: doubles the batch from `min_batch` until a training step runs out of memory,
  then binary-searches between the last batch that fitted and the first that did not, in
  multiples of 8. On CUDA an out-of-memory error is caught, the failed step's tensors are
  dropped and the cache is emptied before the next try. On CPU a step rarely fails (the OS
  swaps or kills the process instead), so "fits" means: the step's estimated peak memory is
  within a budget (by default half of the memory the OS reports available). The estimate
  is measured, not guessed: the bytes autograd saves for backward are counted at two batch
  sizes (saved-tensor hooks), which gives the per-sample activation memory; weights,
  gradients and optimizer state are added once, and the activations twice (their gradients
  exist during backward). A safety `margin` (10%) is then taken off (allocator fragmentation,
  a longer caption, a larger image), and the result is run again to prove it fits.
- fastest: samples/s measured at candidate batches (multiples of 8: powers of two up to the
  largest), in interleaved rounds after a warm-up; the fastest is the smallest batch within
  `tolerance` (5%) of the best throughput, since a smaller batch generalises at least as
  well and leaves memory for everything else.

Model weights and buffers, gradients, optimizer state and RNG are restored afterwards, and
on CUDA the allocator's cache is emptied again, so the tuner leaves nothing behind.

When it helps: a new model or GPU; the largest batch is rarely the fastest (past the point
where the device is saturated throughput is flat, and the LR must be scaled, T17).
What it costs: a few dozen training steps.

Example:
    >>> res = find_batch_size(model, train_set, optimizer=opt)
    >>> res.largest, res.fastest
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from torchspeed.env import host_memory, sync
from torchspeed.train.loop.progress import progress_bar
from torchspeed.train.rounds import interleaved, run_for
from torchspeed.train.loop.guard import is_out_of_memory
from torchspeed.train.trial.precision import make_grad_scaler, resolve_precision
from torchspeed.train.transfer import to_device
from torchspeed.train.wrappers import unwrap_model
from torchspeed.tune._common import StateSnapshot, TrainStep, decide_once, make_batch, model_device, release_memory

__all__ = ["BatchTrial", "BatchSizeResult", "find_batch_size", "available_memory"]


@dataclass(frozen=True)
class BatchTrial:
    """One measured batch size."""

    batch_size: int
    fits: bool
    samples_per_s: float | None = None   # median over rounds (None when not timed)
    peak_bytes: int | None = None        # CUDA: measured peak; CPU: measured estimate
    note: str = ""


@dataclass(frozen=True)
class BatchSizeResult:
    largest: int                 # after the safety margin; verified to run
    fastest: int                 # smallest batch within `tolerance` of the best samples/s
    largest_raw: int             # the largest batch that ran, before the margin
    limited_by: str              # "memory" | "max_batch" | "dataset"
    table: tuple[BatchTrial, ...]
    device: str
    memory_budget: int | None    # CPU budget in bytes (None on CUDA: the device's own memory)
    margin: float

    def to_dict(self) -> dict:
        return asdict(self)


def available_memory() -> int:
    """Bytes of memory the OS says a process can still get (MemAvailable)."""
    return host_memory()[0]

def find_batch_size(model: nn.Module, dataset, *, loss_fn: Callable | None = None, step_fn: Callable | None = None,
                    optimizer: torch.optim.Optimizer | None = None, precision: str = "auto",
                    min_batch: int = 8, max_batch: int = 1024, multiple: int = 8, margin: float = 0.1,
                    memory_budget: int | None = None, steps: int = 3, rounds: int = 3, tolerance: float = 0.05, min_time: float = 0.1,
                    collate_fn: Callable | None = None, progress: bool = True) -> BatchSizeResult:
    """Find the largest batch that fits and the fastest batch for training `model` on `dataset`.

    Batches are built from `dataset` samples (cycled if it is short), collated with
    `collate_fn`, and trained with `optimizer` (default SGD with momentum) in `precision`
    ("auto": fit's rule, `resolve_precision`).
    On CPU, `memory_budget` (bytes) bounds the estimated peak; default half of MemAvailable.
    Under torch.distributed, rank 0 measures and every rank gets the same result.

    Example:
        >>> res = find_batch_size(model, train_set, optimizer=opt, max_batch=512)
        >>> loader = DataLoader(train_set, batch_size=res.fastest, shuffle=True)
    """
    if multiple < 1 or min_batch < multiple or min_batch % multiple:
        raise ValueError(f"min_batch={min_batch} must be a positive multiple of multiple={multiple}")
    if max_batch < min_batch:
        raise ValueError(f"max_batch={max_batch} is below min_batch={min_batch}")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    return decide_once(lambda: _Finder(unwrap_model(model), dataset, loss_fn=loss_fn, step_fn=step_fn, optimizer=optimizer,
                                       precision=precision, min_batch=min_batch, max_batch=max_batch,
                                       multiple=multiple, margin=margin, memory_budget=memory_budget, steps=steps,
                                       rounds=rounds, tolerance=tolerance, min_time=min_time, collate_fn=collate_fn,
                                       progress=progress).run())


class _Finder:
    def __init__(self, model, dataset, *, loss_fn, optimizer, precision, min_batch, max_batch, multiple, margin,
                 memory_budget, steps, rounds, tolerance, min_time, collate_fn, progress, step_fn=None):
        self.model, self.dataset, self.collate_fn = model, dataset, collate_fn
        self.device = model_device(model)
        self.prec = resolve_precision(precision, device=self.device)
        self.optimizer = optimizer
        self.scaler = make_grad_scaler(self.prec)
        self.loss_fn, self.step_fn = loss_fn, step_fn
        self.m, self.margin, self.steps, self.rounds, self.tolerance = multiple, margin, steps, rounds, tolerance
        self.min_batch, self.min_time = min_batch, min_time
        n = len(dataset)
        self.max_batch = max(min_batch, min(max_batch, n) // multiple * multiple)
        self.dataset_cap = n < max_batch
        self.cuda = self.device.type == "cuda"
        self.budget = None if self.cuda else int(memory_budget if memory_budget is not None
                                                 else available_memory() // 2)
        self.progress = progress
        self.trials: dict[int, BatchTrial] = {}
        self._batches: dict[int, list] = {}
        self._cpu_model: tuple[float, float, float] | None = None  # static, saved intercept, saved per sample

    # ------------------------------------------------------------------ steps
    def _batch(self, b: int):
        # cached on the host; only the batch being stepped is on the device (cached device
        # batches of other sizes would take memory the search is measuring)
        if b not in self._batches:
            self._batches[b] = make_batch(self.dataset, b, collate_fn=self.collate_fn)
        return to_device(self._batches[b], self.device)

    def _step(self, b: int, n: int) -> None:
        batch = self._batch(b)
        for _ in range(n):
            self.train_step(batch)

    def _try(self, b: int, n: int) -> tuple[bool, int | None, str]:
        """Run `n` steps at batch `b`; (fits, peak bytes, note). Out-of-memory is caught and cleaned up."""
        est = None
        if not self.cuda:
            est = self.estimate(b)
            if est > self.budget:
                return False, est, f"estimated {_gib(est)} > budget {_gib(self.budget)}"
        if self.cuda:
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        failed = False
        try:
            self._step(b, n)
            sync(self.device)
        except Exception as e:  # noqa: BLE001 - only out-of-memory is expected; the rest re-raises
            if not is_out_of_memory(e):
                raise
            failed = True
        if failed:
            # Cleaned up outside the except block: while it runs, the traceback's frames still
            # hold the failed step's activations, and emptying the cache would free nothing.
            self.opt.zero_grad(set_to_none=True)
            release_memory(self.device)
            return False, None, "out of memory"
        peak = torch.cuda.max_memory_allocated(self.device) if self.cuda else est
        return True, peak, ""

    # ------------------------------------------------------------------ CPU memory estimate
    def _saved_bytes(self, b: int) -> int:
        seen: set[tuple[int, int]] = set()
        total = 0

        def pack(t: torch.Tensor):
            nonlocal total
            try:
                key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                if key not in seen:
                    seen.add(key)
                    total += key[1]
            except (RuntimeError, NotImplementedError):
                total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = self.train_step.loss(self._batch(b))
        loss.backward()
        self.opt.zero_grad(set_to_none=True)
        return total

    def estimate(self, b: int) -> int:
        """Estimated peak bytes of a training step at batch `b` (CPU)."""
        if self._cpu_model is None:
            self._step(self.min_batch, 1)  # creates the optimizer state, so it is counted
            params = sum(p.numel() * p.element_size() for p in self.model.parameters())
            opt_state = sum(v.numel() * v.element_size() for s in self.opt.state.values()
                            for v in s.values() if isinstance(v, torch.Tensor))
            b1, b2 = self.min_batch, 2 * self.min_batch
            s1, s2 = self._saved_bytes(b1), self._saved_bytes(b2)
            per = max(0.0, (s2 - s1) / (b2 - b1))
            self._cpu_model = (2 * params + opt_state, s1 - per * b1, per)
            self._in_bytes = _batch_bytes(self._batch(b1)) / b1
        static, intercept, per = self._cpu_model
        return int(static + 2 * (intercept + per * b) + self._in_bytes * b)

    # ------------------------------------------------------------------ search
    def run(self) -> BatchSizeResult:
        snap = StateSnapshot(self.model, self.optimizer, None, None)
        try:
            self.opt = self.optimizer or torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
            self.train_step = TrainStep(self.model, self.opt, loss_fn=self.loss_fn, precision=self.prec,
                                        scaler=self.scaler, step_fn=self.step_fn)
            self.model.train()
            with progress_bar(enabled=self.progress) as bar:
                task = bar.add_task("batch size: searching the largest that fits", total=None)
                largest_raw, limited = self._search_largest(bar, task)
                largest = largest_raw
                if limited == "memory":
                    largest = max(self.min_batch, int(largest_raw * (1 - self.margin)) // self.m * self.m)
                # prove it: the returned batch must run `steps` full steps
                while True:
                    ok, peak, note = self._try(largest, self.steps)
                    if ok or largest <= self.min_batch:
                        break
                    largest -= self.m
                if not ok:
                    raise RuntimeError(self._no_fit_message())
                self.trials[largest] = BatchTrial(largest, True, None, peak, "largest (after margin)" if limited == "memory"
                                          else f"largest (limited by {limited})")
                fastest = self._measure(largest, bar)
        finally:
            self._batches.clear()
            snap.restore()
            release_memory(self.device)
        table = tuple(self.trials[b] for b in sorted(self.trials))
        return BatchSizeResult(largest=largest, fastest=fastest, largest_raw=largest_raw, limited_by=limited,
                               table=table, device=str(self.device), memory_budget=self.budget, margin=self.margin)

    def _record(self, b: int, ok: bool, peak, note: str) -> bool:
        self.trials[b] = BatchTrial(b, ok, None, peak, note)
        return ok

    def _search_largest(self, bar, task) -> tuple[int, str]:
        good, bad = 0, None
        b = self.min_batch
        while True:
            bar.update(task, description=f"batch size: trying {b}")
            if self._record(b, *self._try(b, 1)):
                good = b
                if b >= self.max_batch:
                    break
                b = min(2 * b, self.max_batch)
            else:
                bad = b
                break
        if good == 0:
            raise RuntimeError(self._no_fit_message())
        while bad is not None and bad - good > self.m:
            mid = (good + bad) // 2 // self.m * self.m
            if mid <= good:
                break
            bar.update(task, description=f"batch size: bisecting {good}..{bad}, trying {mid}")
            if self._record(mid, *self._try(mid, 1)):
                good = mid
            else:
                bad = mid
        if bad is not None:
            return good, "memory"
        return good, "dataset" if self.dataset_cap else "max_batch"

    def _no_fit_message(self) -> str:
        where = "GPU memory" if self.cuda else f"the CPU memory budget ({_gib(self.budget or 0)})"
        return (f"even batch {self.min_batch} does not fit in {where}; try precision='bf16'/'fp16', "
                "gradient accumulation (grad_accum) with a smaller batch, activation checkpointing, or a larger "
                "memory_budget")

    def _rate(self, b: int) -> float:
        """samples/s at batch `b`: at least `steps` steps and at least `min_time` seconds (tiny steps are noisy)."""
        def chunk():
            self._step(b, self.steps)
            sync(self.device)

        calls, seconds = run_for(chunk, min_time=self.min_time, clock=time.perf_counter)
        return b * calls * self.steps / seconds

    def _measure(self, largest: int, bar) -> int:
        cands = []
        b = self.min_batch
        while b < largest:
            cands.append(b)
            b *= 2
        cands.append(largest)
        task = bar.add_task("batch size: measuring samples/s", total=len(cands) * (self.rounds + 1))

        def turn(b: int, r: int) -> None:
            if r:
                bar.update(task, description=f"batch size: round {r}/{self.rounds}, batch {b}")
            bar.advance(task)

        # one untimed step each, then interleaved rounds: drifts of a shared machine hit every size alike
        rates = interleaved({b: (lambda b=b: self._rate(b)) for b in cands}, rounds=self.rounds, warmup=1,
                            warm=lambda b: self._step(b, 1), before=turn).medians()
        best = max(rates.values())
        fastest = min(b for b in cands if rates[b] >= (1 - self.tolerance) * best)
        for b in cands:
            old = self.trials.get(b)
            note = ", ".join(x for x in ((old.note if old else ""), "fastest" if b == fastest else "") if x)
            peak = old.peak_bytes if old else (self.estimate(b) if not self.cuda else None)
            self.trials[b] = BatchTrial(b, True, rates[b], peak, note)
        return fastest


def _batch_bytes(batch) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    if isinstance(batch, dict):
        return sum(_batch_bytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(_batch_bytes(v) for v in batch)
    return 0


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 28 else f"{n / 2 ** 20:.1f} MiB"

