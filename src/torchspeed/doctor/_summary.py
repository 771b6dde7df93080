"""The step-time summary (T02, T03): where each optimizer step's time went, from the probe's per-step
records, with robust statistics.

A few steps can be far slower than the rest for reasons that a long run pays only once: DataLoader
workers starting at an epoch boundary, a first evaluation, a lazy allocation. Over the doctor's short
window they would dominate a mean and flip a verdict (a loop that waits for data at one step in ten
would read as data-bound). So the breakdown is a trimmed mean: steps slower than
`median + max(3 x 1.4826 x MAD, 0.5 x median)` are left out (at most a tenth of the steps, at least one
when there are five or more), and the shares are read from the steps kept, so they still add up to the
step. The steps left out are counted in the report. A run that ended within the warm-up has only
warm-up steps: all but the first are measured, and the breakdown says so (`within_warmup`), so the
report calls its figure rough; a run with no step at all (an optimizer made but never stepped) gets a
note that there is nothing to measure (`no_steps_note`), and the registry runs no rule that rests on
the step. Next to these, `fractions_median` holds the median
step's own shares: a verdict such as data-bound reads the smaller of the two, so a wait that only a
few steps pay cannot carry it.
"""

from __future__ import annotations

import resource
import statistics
import sys

import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler
from torch.utils.data._utils.collate import default_collate, default_convert

from torchspeed.doctor._contention import quartiles
from torchspeed.train.in_memory import in_memory_tensors

__all__ = ["summarize", "robust_steps", "no_steps_note"]


def robust_steps(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """(kept, left out): the step records without the start-up outliers (see the module docstring)."""
    if len(records) < 5:
        return list(records), []
    steps = [r["step"] for r in records]
    med = statistics.median(steps)
    mad = statistics.median(abs(s - med) for s in steps)
    limit = med + max(3 * 1.4826 * mad, 0.5 * med)
    budget = max(1, len(records) // 10)
    slowest = sorted(range(len(records)), key=lambda i: -steps[i])[:budget]
    out = {i for i in slowest if steps[i] > limit}
    return [r for i, r in enumerate(records) if i not in out], [r for i, r in enumerate(records) if i in out]


def _mean(xs):
    return statistics.fmean(xs) if xs else 0.0


def _top(counter: dict, n: int = 3) -> list[str]:
    return [f"{k} ({v}x)" for k, v in sorted(counter.items(), key=lambda kv: -kv[1])[:n]]


def training_loop(modules: set[str]) -> str | None:
    """The framework whose loop the script trains with, from the modules it imported: Lightning (its Trainer or
    Fabric) or Hugging Face's `Trainer` (`transformers.trainer` is imported only when it is used); None: a loop
    of the script's own."""
    if modules & {"lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric"}:
        return "lightning"
    return "transformers" if "transformers.trainer" in modules else None


def no_steps_note(optimizers_made: int) -> str:
    """Why a run recorded no step: an optimizer made but never stepped, or no optimizer and no backward."""
    what = (f"{'an optimizer was' if optimizers_made == 1 else f'{optimizers_made} optimizers were'} made but "
            "step() was never called" if optimizers_made else "the script made no torch optimizer and called no "
            "backward()")
    return (f"{what}: no training step, nothing to measure (no step-time breakdown, no findings that rest on "
            "the step's time)")


def summarize(probe, obs: dict) -> None:
    """The probe's records summed up into the observation: the steps, the step's breakdown, the host reads, the
    tensor copies, the zero_grad calls, the loaders and the memory."""
    obs["loop"] = training_loop(set(sys.modules))
    recs = probe.records
    measured = recs[probe.warmup:] if len(recs) > probe.warmup else (recs[1:] or recs)
    use, left_out = robust_steps(measured)
    _steps(probe, obs, recs, measured)
    obs["breakdown"] = _breakdown(use, measured, left_out, within_warmup=bool(recs) and len(recs) <= probe.warmup)
    _counters(probe, obs, recs, measured, sync_ms=round(_mean([r.get("sync", 0.0) for r in use]), 4))
    obs["loaders"] = sorted((_loader(probe, lid, loader) for lid, loader in probe.loaders.items()),
                            key=lambda d: -d["wait_ms_total"])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    obs["memory"] = {"max_rss_mib": round(rss, 1)}
    if torch.cuda.is_available():
        obs["memory"]["cuda_max_allocated_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        obs["memory"]["cuda_total_mib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**20, 1)


def _steps(probe, obs: dict, recs: list, measured: list) -> None:
    """How many steps were seen and measured, where a step ends, and the notes on a script that trained none."""
    obs["steps_observed"] = len(recs)
    obs["step_boundary"] = "backward" if probe.step_opt is None and recs else "optimizer"  # by hand: no optimizer
    obs["processes_spawned"] = probe.spawned[0] if probe.spawned else 0
    if probe.spawned:
        n, fn = probe.spawned
        obs["notes"].append(
            f"the script starts {n} training processes itself (torch.multiprocessing.spawn of {fn}): the doctor "
            "measures the process it runs, so it stopped the script there, before they started. To diagnose the "
            f"training step, call {fn} in the script's own process with a world size of 1 (for {fn}(rank, "
            f"world_size): {fn}(0, 1)), or give the script a switch that does")
    obs["steps_measured"] = len(measured)
    obs["optimizers_made"] = probe.optimizers_made
    if not recs and not probe.spawned:
        obs["notes"].append(no_steps_note(probe.optimizers_made))


def _breakdown(use: list, measured: list, left_out: list, *, within_warmup: bool) -> dict:
    """The step's time by part (the kept steps' means), its shares, and the spread of its compute."""
    def m(key):
        return round(_mean([r.get(key, 0.0) for r in use]), 4)

    step = m("step")
    data, copy, sync = m("data"), m("copy"), m("sync")
    fwd, bwd, opt, zg = m("forward"), m("backward"), m("optim"), m("zero_grad")
    compute = fwd + bwd + opt + zg
    other = max(0.0, step - data - copy - compute - sync)
    frac = (lambda v: round(v / step, 4) if step > 0 else 0.0)
    return {
        "step_ms": round(step, 3),
        "step_ms_median": round(statistics.median([r["step"] for r in measured]), 3) if measured else 0.0,
        "step_ms_mean_all": round(_mean([r["step"] for r in measured]), 3),
        "data_wait_ms": round(data, 3), "copy_ms": round(copy, 3), "compute_ms": round(compute, 3),
        "sync_ms": round(sync, 3), "other_ms": round(other, 3),
        # the middle half of the kept steps' own compute times: a spread, not one reading (cpu-oversubscribed)
        "compute_ms_iqr": quartiles([sum(r.get(k, 0.0) for k in ("forward", "backward", "optim", "zero_grad")) for r in use]),
        "compute_detail_ms": {"forward": round(fwd, 3), "backward": round(bwd, 3), "optimizer": round(opt, 3),
                              "zero_grad": round(zg, 3)},
        "fractions": {"data_wait": frac(data), "copy": frac(copy), "compute": frac(compute), "sync": frac(sync),
                      "other": frac(other)},
        # the median step's shares: a wait that only a few steps pay (start-up) does not move these
        "fractions_median": {k: round(statistics.median([r.get(k, 0.0) / r["step"] for r in use if r["step"] > 0]), 4)
                             if use else 0.0 for k in ("data", "copy", "sync")},
        "steps": len(use), "within_warmup": within_warmup, "outlier_steps": len(left_out),
        "outlier_step_ms": [round(r["step"], 3) for r in left_out],
        # the mean, not the median: the faults' cost adds up, and a process's steps alternate between a few
        # hundred and a few thousand (glibc's dynamic threshold), where a median jumps between the two
        "minor_faults_per_step": round(_mean([r.get("minflt", 0) for r in use]), 1) if use else 0.0,
        # the optimizer's time over the first and the last third of the kept steps: a step that grows (sparse-momentum)
        "optimizer_ms_thirds": [round(_mean([r.get("optim", 0.0) for r in part]), 4)
                                for part in (use[:len(use) // 3], use[-(len(use) // 3):])] if len(use) >= 3 else None,
    }


def _counters(probe, obs: dict, recs: list, measured: list, *, sync_ms: float) -> None:
    """The host reads, the tensor copies, the zero_grad calls and the evaluation forwards the probe counted."""
    n_steps = max(1, len(recs))
    obs["syncs"] = {"calls": int(sum(probe.syncs.values())), "by_kind": dict(probe.syncs),
                    "calls_per_step": round(sum(probe.syncs.values()) / n_steps, 3), "ms_per_step": round(sync_ms, 4),
                    "sites": _top(probe.sync_sites), "cuda_sync_warnings": probe.cuda_sync_warnings}
    c = probe.copies
    n_measured = max(1, len(measured))  # the measured steps' own copies: one made while loading is in none of them
    obs["tensor_copies"] = {"count": c["count"],
                            "per_step": round(sum(r.get("tensor_copies", 0) for r in measured) / n_measured, 3),
                            "ms_per_step": round(sum(r.get("tensor_copy_ms", 0.0) for r in measured) / n_measured, 4),
                            "mib": round(c["bytes"] / 2**20, 3), "float64": c["float64"], "sites": _top(c["sites"])}
    z = probe.zero_grads
    obs["zero_grad"] = {"calls": z["calls"], "set_to_none_false": z["set_to_none_false"],
                        "ms_per_call": round(z["ms"] / z["calls"], 4) if z["calls"] else 0.0, "sites": _top(z["sites"])}
    obs["eval"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in probe.eval.items()}


def _loader(probe, lid, loader) -> dict:
    """One DataLoader the script iterated: its settings, its dataset, the time the loop waited on it."""
    ds = getattr(loader, "dataset", None)
    return {"num_workers": int(getattr(loader, "num_workers", 0)), "pin_memory": bool(getattr(loader, "pin_memory", False)),
            "batch_size": getattr(loader, "batch_size", None),
            "persistent_workers": bool(getattr(loader, "persistent_workers", False)),
            "prefetch_factor": int(getattr(loader, "prefetch_factor", None) or 0),
            "dataset": type(ds).__name__, "wait_ms_total": round(probe.loader_wait.get(lid, 0.0) * 1e3, 3),
            "map_style": hasattr(ds, "__getitem__") and hasattr(ds, "__len__"),
            "in_memory": _in_memory(ds), "own_batching": own_batching(loader)}


def own_batching(loader) -> list[str]:
    """The parts of a DataLoader that batch its own way (a collate_fn, a sampler or batch sampler of its own):
    indexing whole batches (`--fix`'s batched_index) would drop them, so the in-memory finding offers no patch."""
    own = []
    whole = getattr(loader, "batch_size", 1) is None and type(getattr(loader, "sampler", None)) is BatchSampler
    if getattr(loader, "collate_fn", default_collate) not in (default_collate, default_convert):
        own.append("collate_fn")
    bs = getattr(loader, "batch_sampler", None)
    if bs is not None and type(bs) is not BatchSampler:
        own.append("batch_sampler")
    sampler = getattr(loader, "sampler", None)
    if sampler is not None and not whole and type(sampler) not in (RandomSampler, SequentialSampler):
        own.append("sampler")
    return own


def _in_memory(ds) -> bool:
    """Every sample is a row of tensors already in memory: a TensorDataset, a Subset of one, or a Dataset whose
    `__getitem__` only indexes its tensors (`train.in_memory.in_memory_tensors`, what `fit` slices)."""
    return in_memory_tensors(ds) is not None
