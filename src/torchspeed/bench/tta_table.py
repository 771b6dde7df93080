"""The time-to-target result table (seconds to a fixed accuracy or loss, all tuning counted): per target, each
config's budget, samples and seconds over the seeds, and each config against another (samples, training time,
time with every second of choosing counted, the interval of the per-seed ratios, and the training time at which
choosing pays for itself). `time_to_target.run_time_to_target` fills it from its searches.
"""

from __future__ import annotations

import statistics

from torchspeed.bench.compare import compare_ratios

__all__ = ["config_entry", "target_entry", "target_entries"]


def config_entry(search, budget: int | None, batch: int, tuning: list[float]) -> dict:
    runs = [search.runs.get((budget, s)) for s in search.seeds] if budget else []
    tried = sorted({b for b, _ in search.runs})
    best = max(tried) if tried else None
    shown = runs if budget else [search.runs.get((best, s)) for s in search.seeds]
    return {"budget_steps": budget, "samples_to_target": budget * batch if budget else None,
            "train_time_s": statistics.fmean(r.train_s for r in runs) if budget else None,
            "train_time_s_runs": [r.train_s for r in runs] if budget else [],
            "tuning_time_s": statistics.fmean(r.tuning_s for r in runs) if budget else 0.0,
            "tuning_steps": statistics.fmean(r.tuning_steps for r in runs) if budget else 0.0,
            "total_time_s": statistics.fmean(r.total_s for r in runs) if budget else None,
            "total_time_s_runs": [r.total_s for r in runs] if budget else [],
            "tuning_share": (statistics.fmean(r.tuning_s for r in runs) / statistics.fmean(r.total_s for r in runs))
            if budget else None,
            "warm_cache_tuning_s": statistics.fmean(tuning) if tuning else None,
            "reached": sum(1 for r in shown if r is not None) if budget else 0,
            "seeds": len(search.seeds),
            "val_acc": [r.val_acc if r else None for r in shown],
            "val_loss": [r.val_loss if r else None for r in shown],
            "budgets_tried": tried}


def _versus(a: dict, b: dict) -> dict:
    """b against a: samples, training time, and time with every second of choosing counted (the headline)."""
    ratios = [x / y for x, y in zip(a["total_time_s_runs"], b["total_time_s_runs"])]
    saved = a["train_time_s"] - b["train_time_s"]
    return {"samples": a["samples_to_target"] / b["samples_to_target"],
            "train_time": a["train_time_s"] / b["train_time_s"],
            "tuning_included": a["total_time_s"] / b["total_time_s"],
            "tuning_included_interval": compare_ratios(ratios),
            "tuning_share": b["tuning_share"],
            # b's choosing pays for itself on runs longer than this many seconds of a's training
            "break_even_train_s": (b["tuning_time_s"] / (saved / a["train_time_s"])) if saved > 0 and b["tuning_time_s"]
            else None}


def target_entry(workload: str, target: float, metric: str, searches: dict, budgets: dict, batch: int,
                  tuning: dict) -> dict:
    configs = {name: config_entry(s, budgets[name], batch, tuning.get(name, [])) for name, s in searches.items()}
    # per config under "configs", and the same under each config's own name (the schema the issue names)
    entry = {"workload": workload, "target": target, "metric": metric, "configs": configs, **configs}
    for base, cand in (("all", "auto"), ("naive", "auto"), ("all", "auto_warm"), ("naive", "auto_warm")):
        a, b = configs.get(base), configs.get(cand)
        if a and b and a["budget_steps"] and b["budget_steps"]:
            entry[f"{cand}_vs_{base}"] = _versus(a, b)
    a, n = configs.get("all"), configs.get("naive")
    if a and n and a["budget_steps"] and n["budget_steps"]:
        entry["all_vs_naive"] = {"train_time": n["train_time_s"] / a["train_time_s"],
                                 "samples": n["samples_to_target"] / a["samples_to_target"]}
    return entry


def target_entries(workload: str, targets, metric: str, searches: dict, found: dict, batch_size: int, runner,
             same_budget: dict) -> list[dict]:
    """One entry per target: each config's budget and seconds, with auto at naive's budget where measured."""
    tuning = {"auto_warm": [r["tuning_s"] for r in runner.recipes.values()]}
    entries = [target_entry(workload, t, metric, searches, found[t], batch_size, tuning) for t in targets]
    for e in entries:
        if e["target"] in same_budget:
            e["auto_at_naive_budget"] = same_budget[e["target"]]
    return entries
