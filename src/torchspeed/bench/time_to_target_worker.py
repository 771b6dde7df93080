"""One time-to-target run in its own process (bench/time_to_target.py starts it): the spec on stdin, the reply on
stdout. `train_budget` trains one config for one step budget and evaluates once; `warm` fills the cache an
`auto_warm` run reads.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, replace

from torchspeed.bench.time_to_target import SF_LR, TTARun, _met
from torchspeed.train.eval_view import eval_weights

__all__ = ["train_budget", "warm", "main"]


def _setup(spec: dict):
    from torchspeed.bench._worker import _data, _model

    loader, val_loader, device = _data(spec)
    if len(loader) < 1:
        raise ValueError(f"the training set has fewer samples than one batch of {spec['batch_size']}")
    return loader, val_loader, device, _model(spec)


def warm(spec: dict) -> dict:
    """What an earlier run leaves in the cache: the recipe measured with no budget and the switch trial, both
    written to spec["cache_dir"] (the auto_warm row reads them; this time is not on its clock)."""
    from torchspeed.bench._worker import _data, _model
    from torchspeed.plan.recipe import choose_recipe
    from torchspeed.train.decision import TrialCache
    from torchspeed.train.config import TrainConfig
    from torchspeed.train.trainer import Trainer

    os.environ["TORCHSPEED_CACHE_DIR"] = spec["cache_dir"]
    t0 = time.perf_counter()
    loader, _, device = _data(spec)  # its validation loader is never read
    model = _model(spec)
    rec = choose_recipe(model, loader, optimizer=spec["optimizer"], lr=spec["lr"], precision=spec["train"]["precision"],
                        device=device, progress=False, schedule="onecycle", cache=TrialCache())
    cfg = replace(TrainConfig(**spec["train"]), progress=False, **rec.config())
    trainer = Trainer(model, optimizer=rec.optimizer or spec["optimizer"], lr=rec.lr or spec["lr"], device=device,
                      config=cfg)
    trainer.prepare(loader)  # a run of unknown length: the full switch trial, cached for the next run
    while trainer.switch_trial is not None:
        for batch in trainer.batches(loader):
            trainer.step_batch(batch)
            if trainer.switch_trial is None:
                break
    d = rec.to_dict()
    d["on"] = [p for p in rec.parts if _part_on(rec, p)]
    return {"recipe": d, "tuning_s": time.perf_counter() - t0}


def _part_on(rec, part: str) -> bool:
    return {"lr": rec.lr is not None and "lr" in rec.parts, "label_smoothing": rec.label_smoothing > 0,
            "bn_stats": rec.bn_stats, "ema": rec.ema_decay is not None, "tta": "tta" in rec.parts,
            "muon": rec.optimizer == "muon", "schedulefree": rec.optimizer == "schedulefree"}.get(part, False)


def train_budget(spec: dict) -> TTARun:
    """One complete run of spec['budget'] optimizer steps (one-cycle over them); evaluated once, at the end."""
    from torchspeed.env import allocator_in_use
    from torchspeed.train.config import TrainConfig
    from torchspeed.train.trainer import Trainer

    # cold: an empty decision cache for this run alone (the switch trial and the recipe measure, on the clock);
    # auto_warm: the cache an earlier run left
    os.environ["TORCHSPEED_CACHE_DIR"] = spec.get("cache_dir") or tempfile.mkdtemp(prefix="torchspeed-cold-")
    loader, val_loader, device, model = _setup(spec)
    budget = int(spec["budget"])
    cfg = replace(TrainConfig(**spec["train"]), max_steps=budget, grad_accum=1, progress=False)
    optimizer, lr, callbacks, rec = spec["optimizer"], spec["lr"], [], None
    tuning_s = 0.0
    if spec["config"] == "schedulefree":  # the switches of `all`; Schedule-Free AdamW at its defaults, no schedule
        optimizer, lr = "schedulefree", SF_LR
    if spec["config"] in ("auto", "auto_warm"):  # the plan's recipe, chosen in this run for this run's length
        t0 = time.perf_counter()
        rec = _choose_for_run(model, loader, spec, device, budget)
        tuning_s = time.perf_counter() - t0
        cfg = replace(cfg, **rec.config())
        lr = rec.lr if rec.lr is not None else lr
        optimizer = rec.optimizer or optimizer
        callbacks = rec.callbacks()
    trainer = Trainer(model, optimizer=optimizer, lr=lr, device=device, config=cfg, callbacks=callbacks)
    trainer.setup_schedule(None, 1)       # one-cycle over the budget
    trainer.compiler.plan(budget)         # compile="auto": its short-run rule sees the whole budget

    def batches():
        while True:
            yield from trainer.batches(loader)

    t0 = time.perf_counter()
    trainer.prepare(loader, remaining_steps=budget)  # what fit() does first; its time counts
    it, clock = batches(), time.perf_counter() - t0
    with trainer.callbacks.running(trainer):
        while trainer.step < budget:
            clock += trainer.run_steps(it, 1)
            trainer.callbacks.on_step_end(trainer)
    clock += _judged_weights(trainer, rec)
    if rec is not None and rec.label_smoothing:  # the target's loss is the plain cross-entropy, as for every config
        from torchspeed.train.batch import default_loss

        trainer.loss_fn = default_loss()
    out = trainer.evaluate(val_loader)    # off the clock
    decisions = {k: str(v) for k, v in (trainer.decisions | (rec.decisions if rec is not None else {})).items()}
    decisions |= {"allocator": allocator_in_use(), "num_workers": loader.num_workers,
                  "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default (spin, then sleep)"),
                  "train_samples": len(loader.dataset), "val_samples": len(val_loader.dataset)}
    if rec is not None:
        decisions["recipe_on"] = [p for p in rec.parts if _part_on(rec, p)]
    return TTARun(config=spec["config"], seed=spec["seed"], budget=budget, val_acc=out["val_acc"],
                  val_loss=out["val_loss"], train_s=clock, samples=budget * spec["batch_size"], decisions=decisions,
                  tuning_s=tuning_s, tuning_steps=rec.tuning_steps if rec is not None else 0)


def _judged_weights(trainer, rec) -> float:
    """Seconds to the weights the run is judged by, on the clock: the recipe's TTA part (decided on training
    batches, or cached, or the prior) and, where nothing evaluated them yet, the weights evaluation looks through
    (Schedule-Free's average with its BatchNorm statistics recalibrated on the last training batches: work no
    model of such a run is usable without). Evaluation itself then repeats it off the clock, to the same statistics."""
    from torchspeed.plan.recipe_tta import after_training

    t0 = time.perf_counter()
    judged = rec is not None and "tta" in rec.parts and "tta" in rec.pending  # the TTA check evaluates them
    if rec is not None and "tta" in rec.parts:
        after_training(trainer, rec)
    if not judged:
        with eval_weights(trainer):
            pass
    return time.perf_counter() - t0


def _choose_for_run(model, loader, spec: dict, device, budget: int):
    """The recipe as `fit(recipe="auto")` chooses it for a run of `budget` steps: within the tuning budget, from
    the cache when it holds a measurement. The ablation's `parts` then switch parts off or on."""
    from torchspeed.plan.budget import TuningBudget
    from torchspeed.plan.recipe import PARTS, choose_recipe
    from torchspeed.train.decision import TrialCache

    rec = choose_recipe(model, loader, optimizer=spec["optimizer"], lr=spec["lr"], precision=spec["train"]["precision"],
                        device=device, progress=False, total_steps=budget, schedule="onecycle", parts=PARTS,
                        budget=TuningBudget(budget), cache=TrialCache())
    if spec.get("parts") is not None:  # the ablation: the recipe with some parts left out or put in
        rec = _with_parts(rec, tuple(spec["parts"]), spec)
    return rec


def _with_parts(rec, parts: tuple, spec: dict):
    """The recipe with only `parts` on; a part put in that auto had off gets its usual setting."""
    from torchspeed.plan.recipe import LABEL_SMOOTHING

    return replace(rec, parts=parts,
                   lr=rec.lr if "lr" in parts else spec["lr"],
                   min_lr=rec.min_lr if "lr" in parts else None,
                   label_smoothing=(rec.label_smoothing or LABEL_SMOOTHING) if "label_smoothing" in parts else 0.0,
                   bn_stats="bn_stats" in parts,
                   ema_decay=(rec.ema_decay or round(min(0.9999, max(0.5, 1 - 5 / int(spec["budget"]))), 4))
                   if "ema" in parts else None,
                   optimizer=rec.optimizer if rec.optimizer in parts else None)


def main() -> int:
    from torchspeed.bench._worker import _reply

    spec = json.loads(sys.stdin.readline())
    try:
        if spec.get("mode") == "warm":
            _reply({"ok": True} | warm(spec))
        else:  # the seeds in turn, stopping at the first that misses the target (when one is given)
            runs = []
            for s in spec["seeds"]:
                run = train_budget(spec | {"seed": s, "cache_dir": (spec.get("cache_dirs") or {}).get(str(s))})
                runs.append(asdict(run))
                if spec.get("target") is not None and not _met(run, spec["target"], spec["metric"]):
                    break
            _reply({"ok": True, "runs": runs})
    except Exception as e:  # reported to the parent, which names the config, seed and budget that failed
        import traceback

        _reply({"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
