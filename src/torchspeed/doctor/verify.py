"""`--verify`: measure each fix on the user's own model, in the same process (T02).

After the script stopped, the doctor holds the model whose forward the script called, its
optimizer, a captured training batch (and target, when the loss was an `nn.Module`) and the
script's DataLoader. For each fix torchspeed can apply by itself it builds a baseline and a
candidate (fresh copies of the model and optimizer, same weights), runs a training step on
the captured batch, and times them in randomised interleaved rounds after an untimed warm-up
(`_interval.measure_rounds`: 5 rounds a side by default, more while the interval is too wide to
rank). The speed-up is the median of the per-round ratios, with the 95% bootstrap interval of the
ratio of the medians, which decides the finding's severity (`registry.settle`); rounds that disagree
by more than 2x are marked inconclusive (`_rounds.round_summary`), and no finding claims them.
A fix of the model's step is timed on the model's step alone, but the user's loop also waits for data, copies
and runs Python: the gain and its interval are those of the script's whole step (`_interval.whole_step`, by the
probe's compute share), with the model-step figures kept beside them (`model_speedup`, `model_interval`).
The loss check (`loss_check`): both sides' first 3 steps run from the same weights on the same batch
with the same random draws, and the fix's losses must stay within 5% of the script's. An optimizer
whose step needs a closure (`torch.optim.LBFGS`) is given one that runs forward and backward on the captured batch again
(`torchspeed.train.loop.step.closure_for`, as the library's own trainer does).

Fixes: `autocast` (T21: bf16, fp16 on pre-Ampere CUDA), `channels_last` (T23), `workers`
(T06, T45: the worker count `torchspeed.tune.tune_loader` chooses, fewer or more than the
script's, each step = next batch + train step), `pin_memory` (T07,
CUDA), `set_to_none` (T26), `conv_bias` (T27), `compile` (T25; its compile time is reported
separately), `bf16_math` (T21: oneDNN fp32 matmuls/convolutions with bf16 inputs, CPUs with
AVX512-BF16/AMX), `fused_optimizer` (T51: the script's Adam/AdamW/SGD/Adagrad rebuilt with
fused=True, same hyper-parameters), `sparse_momentum` (T51: the script's SGD with its sparse-gradient weights in a
group without momentum; a lower bound: the captured batch repeats its rows, which torch adds into the sparse
momentum buffer in place, so the buffer's growth over a run's changing batches is not in the figure). A fix whose
gain a measured share bounds under the 2% minimum effect
(`rules._ceiling`: `workers` by the data wait, unless workers and threads oversubscribe the cores) is not
run; its entry says why. A fix that is slower on this machine is reported as a slow-down,
never hidden.

Cost: a few seconds per fix for small models; the model copies need memory for 2 models.
"""

from __future__ import annotations

import copy
import multiprocessing
import statistics
import time

import torch

from torchspeed.doctor._candidate import _Trainer, loss_check
from torchspeed.doctor._interval import MAX_ROUNDS, measure_rounds, whole_step
from torchspeed.doctor import _contention  # its functions read when called (tests patch them there)
from torchspeed.doctor.registry import fix_rules
from torchspeed.doctor._tree import map_tensors
from torchspeed.doctor.observation import CpuContention, Observation
from torchspeed.doctor.observation_runs import VerifyResult
from torchspeed.doctor.rules._ceiling import below_minimum, ceiling, skipped_entry
from torchspeed.env import detect
from torchspeed.env import sync
from torchspeed.train.sampler import rebuild_loader
from torchspeed.train.trial.precision import half_precision
from torchspeed.tune.loader import tune_loader

__all__ = ["IMPLEMENTED", "verify_fixes", "applicable_fixes", "time_model_alone", "measure_contention"]

# The fixes this module can measure. Which rule each one proves is declared by the rules themselves
# (`register(..., fix=)`, read with `registry.fix_rules()`); a test checks the two sets agree.
IMPLEMENTED = ("autocast", "bf16_math", "channels_last", "workers", "pin_memory", "set_to_none", "conv_bias", "compile",
               "fused_optimizer", "sparse_momentum")


class _LoaderStep:
    """Next batch from a DataLoader (moved to the model's device) plus a training step."""
    def __init__(self, trainer: _Trainer, loader, *, num_workers: int, pin_memory: bool):
        kw = {}
        if num_workers > 0:
            kw["persistent_workers"] = True
            kw["prefetch_factor"] = 4
            if "fork" in multiprocessing.get_all_start_methods():
                kw["multiprocessing_context"] = "fork"  # classes defined in the script's __main__ stay reachable
        self.loader = rebuild_loader(loader, batch_size=loader.batch_size or 1, sampler=None,
                                     replace_batch_sampler=True, num_workers=num_workers, pin_memory=pin_memory, **kw)
        self.trainer = trainer
        self.it = iter(self.loader)
        self.non_blocking = pin_memory
        # batches the workers load ahead: they fill up while the other side of a round runs
        self.depth = num_workers * kw.get("prefetch_factor", 0)

    def step(self) -> None:
        try:
            batch = next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            batch = next(self.it)
        if self.trainer.device.type != "cpu":
            map_tensors(batch, lambda t: t.to(self.trainer.device, non_blocking=self.non_blocking))
        self.trainer.step()

    def settle(self) -> None:
        """Before a timed round: take the batches the workers loaded ahead while the other side ran (untimed), so
        that the round times the rate the workers load at, not a full queue (a 2.3x fix read 6x on one)."""
        for _ in range(self.depth):
            self.step()

    def close(self) -> None:
        self.it = None
        self.loader = None


def _interleave(base, cand, device, *, rounds: int, budget_s: float = 0.25, max_rounds: int | None = None,
                settle=(None, None)) -> VerifyResult:
    """`base` and `cand` (one training step each) timed in `_interval.measure_rounds`: each side's measurement
    is `k` steps (`budget_s` of the baseline's, 1 to 20), in randomised interleaved rounds after a warm-up;
    `settle` (per side, or None): run untimed before each of that side's measurements."""
    for _ in range(2):  # warm-up: allocator, oneDNN primitives, worker start-up
        base()
        cand()
    sync(device)
    t0 = time.perf_counter()
    base()
    sync(device)
    one = max(1e-5, time.perf_counter() - t0)
    k = int(min(20, max(1, budget_s / one)))

    def timed(fn, before):
        def ms_per_step() -> float:
            if before is not None:
                before()
            sync(device)
            t = time.perf_counter()
            for _ in range(k):
                fn()
            sync(device)
            return (time.perf_counter() - t) / k * 1e3
        return ms_per_step

    out = measure_rounds(timed(base, settle[0]), timed(cand, settle[1]), rounds=rounds, max_rounds=max(rounds, max_rounds or rounds),
                         clock=time.perf_counter)
    return {**out, "steps_per_round": k}


def applicable_fixes(cap, obs: Observation) -> list[str]:
    """Fixes that change something for this script (the ones the script does not use yet)."""
    m = obs.get("model", {})
    out = []
    if cap.model is None or cap.args is None:
        return out
    env = detect()
    if not m.get("autocast"):
        out.append("autocast")
        if m.get("device", "cpu") == "cpu" and env.bf16_supported:
            out.append("bf16_math")
    if m.get("has_conv2d") and not m.get("channels_last_weights"):
        out.append("channels_last")
    loaders = _map_style(cap.loaders)
    if loaders:  # fewer workers can be the fix as well as more: the tuner measures both
        out.append("workers")
    if env.cuda_available and any(not ld.pin_memory for ld in loaders):
        out.append("pin_memory")
    if not cap.set_to_none:
        out.append("set_to_none")
    if m.get("conv_bias_before_bn"):
        out.append("conv_bias")
    if env.compile_available and not m.get("compiled"):
        out.append("compile")
    o = obs.get("optimizer") or {}
    if o.get("fused_available") and not o.get("fused"):
        out.append("fused_optimizer")
    if o.get("sparse_momentum"):
        out.append("sparse_momentum")
    return out


def _amp_dtype(device: torch.device) -> torch.dtype:
    # bf16 also where the CPU only emulates it: the measurement then shows the slow-down.
    return torch.float16 if half_precision(device) == "fp16" else torch.bfloat16


def _map_style(loaders) -> list:
    return [ld for ld in loaders if hasattr(ld.dataset, "__getitem__") and hasattr(ld.dataset, "__len__")]


def tuned_workers(cap, loader) -> tuple[int, str]:
    """The worker count `torchspeed.tune.tune_loader` chooses for this loader and model, and why.

    The tuner measures fewer workers as well as more (0 up to the usable cores), end to end with a
    training step of a copy of the script's model, so the doctor and `torchspeed tune` agree.
    """

    model = copy.deepcopy(cap.model)
    loss_fn = cap.loss_module if cap.loss_module is not None else None
    s = tune_loader(loader.dataset, batch_size=loader.batch_size or 1, model=model, loss_fn=loss_fn,
                    collate_fn=loader.collate_fn, progress=False, rounds=2, min_time=0.3)
    return s.num_workers, s.reason


def _verify_workers(cap, fix: str, device, rounds: int, entry: VerifyResult, max_rounds: int) -> None:
    loaders = _map_style(cap.loaders)
    if fix == "pin_memory":
        loader = next(ld for ld in loaders if not ld.pin_memory)
        nw, pin = loader.num_workers, True
    else:
        loader = max(loaders, key=lambda ld: ld.num_workers == 0)
        try:
            nw, why = tuned_workers(cap, loader)
            entry["tuner"] = why
        except Exception as e:  # a batch the tuner's step cannot train on: measure one step either way
            nw = 0 if loader.num_workers > 0 else min(4, max(1, detect().cpu_cores))
            entry["tuner"] = f"tune_loader failed ({type(e).__name__}: {e}); tried num_workers={nw}"
        pin = loader.pin_memory
    entry["current"] = f"num_workers={loader.num_workers}"
    entry["candidate"] = f"num_workers={nw}" + (", pin_memory=True" if fix == "pin_memory" else "")
    entry["direction"] = "fewer" if nw < loader.num_workers else "more" if nw > loader.num_workers else "same"
    base = _Trainer(cap, set_to_none=cap.set_to_none)
    b = _LoaderStep(base, loader, num_workers=loader.num_workers, pin_memory=loader.pin_memory)
    c = _LoaderStep(base, loader, num_workers=nw, pin_memory=pin)
    try:
        entry.update(_interleave(b.step, c.step, device, rounds=rounds, max_rounds=max_rounds,
                                 settle=(b.settle, c.settle)))
    finally:
        b.close()
        c.close()


def time_model_alone(cap, *, reps: int = 7) -> list[float] | None:
    """ms of each of `reps` training steps of a copy of the model on its captured batch, nothing else running."""
    if cap.model is None or cap.args is None:
        return None
    t = _Trainer(cap, set_to_none=cap.set_to_none)
    device = t.device
    for _ in range(2):
        t.step()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        t.step()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def measure_contention(cap, obs: Observation) -> None:
    """`obs["cpu"]`: workers, threads and cores, and, when workers + threads exceed the cores, the model's
    step alone: timed once the script's workers have filled their queue and gone idle (`_contention`),
    with how busy they still were while it ran."""

    workers = max((ld["num_workers"] for ld in obs.get("loaders") or []), default=0)
    threads, cores = int(obs.get("threads", 1)), int(obs.get("cpu_cores", 1))
    b = obs.get("breakdown") or {}
    c: CpuContention = {"workers": workers, "threads": threads, "cores": cores,
                        "compute_ms_in_script": b.get("compute_ms", 0.0), "compute_ms_alone": None,
                        "compute_ms_in_script_iqr": list(b.get("compute_ms_iqr") or [b.get("compute_ms", 0.0)] * 2),
                        "compute_ms_alone_iqr": None, "workers_busy_during_alone": None,
                        # the CPU work one batch costs in a worker (`dataset[i]` x batch size, timed after the run)
                        "worker_ms_per_batch": round(max((d["getitem_ms"] * (d.get("batch_size") or 1)
                                                          for d in obs.get("datasets") or []), default=0.0), 3)}
    model_on_cpu = cap.model is not None and next(cap.model.parameters()).device.type == "cpu"
    if workers and workers + threads > cores and model_on_cpu:
        _contention.wait_children_idle()
        cpu0, t0 = _contention.children_cpu_s(), time.perf_counter()
        alone = time_model_alone(cap)
        cpu1, wall = _contention.children_cpu_s(), time.perf_counter() - t0
        if alone:
            c["compute_ms_alone"] = round(statistics.median(alone), 3)
            c["compute_ms_alone_iqr"] = _contention.quartiles(alone)
        if cpu0 is not None and cpu1 is not None and wall > 0:
            c["workers_busy_during_alone"] = round((cpu1 - cpu0) / wall, 3)
    obs["cpu"] = c


def verify_fixes(cap, obs: Observation, *, fixes=None, rounds: int = 5, max_rounds: int | None = None
                 ) -> dict[str, VerifyResult]:
    """Measure each applicable fix (or the ones named in `fixes`) in `rounds` rounds a side, up to `max_rounds`
    (default `_interval.MAX_ROUNDS`, at least `rounds`) while its interval is too wide to rank; {fix: result}."""
    max_rounds = max(rounds, MAX_ROUNDS if max_rounds is None else max_rounds)

    proves = fix_rules()
    wanted = applicable_fixes(cap, obs)
    if fixes is not None:
        wanted = [f for f in wanted if f in set(fixes)]
    results: dict[str, VerifyResult] = {}
    if cap.model is None or cap.args is None:
        obs["notes"].append("verify skipped: no model forward with a captured batch")
        return results
    device = next(cap.model.parameters()).device
    sp_default = cap.set_to_none
    for fix in wanted:
        t0 = time.perf_counter()
        entry: VerifyResult = {"fix": fix, "rule": (proves.get(fix) or (None,))[0]}
        bound = ceiling(obs, fix)
        if below_minimum(bound):  # the measured share it removes bounds its gain under the minimum effect
            results[fix] = skipped_entry(fix, entry["rule"], bound)
            continue
        try:
            if fix in ("workers", "pin_memory"):
                _verify_workers(cap, fix, device, rounds, entry, max_rounds)
            else:
                base = _Trainer(cap, set_to_none=sp_default)
                kw = {"autocast": {"amp_dtype": _amp_dtype(device)}, "bf16_math": {"bf16_math": True},
                      "channels_last": {"channels_last": True},
                      "set_to_none": {"set_to_none": True}, "conv_bias": {"conv_bias": True},
                      "compile": {"compile_model": True}, "fused_optimizer": {"fused_optimizer": True},
                      "sparse_momentum": {"sparse_momentum": True}}[fix]
                cand = _Trainer(cap, **{"set_to_none": sp_default, **kw})
                if fix == "compile":
                    tc = time.perf_counter()
                    cand.step()
                    entry["compile_s"] = round(time.perf_counter() - tc, 2)
                timed = _interleave(base.step, cand.step, device, rounds=rounds, max_rounds=max_rounds)
                entry.update(whole_step(timed, (obs.get("breakdown") or {}).get("fractions", {}).get("compute")))
                entry["loss_check"] = loss_check(base, cand)
                entry["candidate"] = {"autocast": f"torch.autocast({device.type!r}, dtype={kw.get('amp_dtype')})"}.get(
                    fix, fix)
                if base.note:
                    entry["note"] = base.note
        except Exception as e:  # a fix that does not apply to this model: say so, keep going
            entry["error"] = f"{type(e).__name__}: {e}"
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        results[fix] = entry
    return results
