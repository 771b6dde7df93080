"""One time-to-target run in its own process (bench/time_to_target.py starts it): the spec on stdin, the reply on
stdout. `train_budget` trains one config for one step budget through `torchspeed.fit`, what users run, and
evaluates once; `warm` fills the cache an `auto_warm` run reads. The process's one job is to train: its whole
stack is imported at the top.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, replace

from torchspeed import fitting  # `fitting.fit` read at each run (tests spy on it)
from torchspeed._allocator import allocator_in_use
from torchspeed.bench import _worker  # `_worker._data` read at each run (tests swap the validation set)
from torchspeed.bench._protocol import reply
from torchspeed.bench.time_to_target import SF_LR, TTARun, _met
from torchspeed.train.config import TrainConfig
from torchspeed.train.eval_view import eval_weights
from torchspeed.train.loop.callbacks import Callback
from torchspeed.train.losses import default_loss

__all__ = ["train_budget", "warm", "main"]


def _setup(spec: dict):
    loader, val_loader, device = _worker._data(spec)
    if len(loader) < 1:
        raise ValueError(f"the training set has fewer samples than one batch of {spec['batch_size']}")
    return loader, val_loader, device, _worker._model(spec)


WARM_STEPS = 1_000_000  # the earlier run's length: long enough that every part of the recipe measures


def warm(spec: dict) -> dict:
    """What an earlier run leaves in the cache: a `fit(recipe="auto")` call like the auto_warm row's, as long as
    `WARM_STEPS` (every part measures, the switch trial runs in full), stopped once the switch trial and the
    in-run measurements have settled; its cache is spec["cache_dir"] (the auto_warm row reads it; this time is
    not on its clock)."""
    os.environ["TORCHSPEED_CACHE_DIR"] = spec["cache_dir"]
    t0 = time.perf_counter()
    loader, _, device, model = _setup(spec)  # its validation loader is never read
    cfg = replace(TrainConfig(**spec["train"]), grad_accum=1, progress=False)
    result = fitting.fit(model, loader, optimizer=spec["optimizer"], device=device, epochs=WARM_STEPS, config=cfg,
                         max_steps=WARM_STEPS, schedule="onecycle", callbacks=[_StopWhenSettled()], recipe="auto",
                         recipe_parts=spec.get("parts"))
    d = {k: getattr(v, "value", v) for k, v in result.decisions.items()
         if k in ("optimizer", "lr", "label_smoothing", "bn_stats", "ema", "batch_size", "tta", "switch_trial")}
    d["on"] = _recipe_on(result.decisions)
    return {"recipe": d, "tuning_s": time.perf_counter() - t0}


class _StopWhenSettled(Callback):
    """Ends the warming run at the first step end after its switch trial decided (the in-run parts measure at
    that same step end)."""

    def on_step_end(self, trainer):
        if trainer.switcher.live is None and not trainer.should_stop:
            trainer.request_stop("the cache is filled: the switch trial and the in-run parts decided")


def train_budget(spec: dict) -> TTARun:
    """One complete `fit` run of spec['budget'] optimizer steps (one-cycle over them, or Schedule-Free), what a user
    runs: `recipe="auto"` for auto and auto_warm (the ablation's parts through `recipe_parts`), the config's
    switches for every row. Its seconds are fit's own, choosing included, plus the preparation of the weights the
    run is judged by; then one evaluation, off the clock."""
    # cold: an empty decision cache for this run alone (the switch trial and the recipe measure, on the clock);
    # auto_warm: the cache an earlier run left
    os.environ["TORCHSPEED_CACHE_DIR"] = spec.get("cache_dir") or tempfile.mkdtemp(prefix="torchspeed-cold-")
    loader, val_loader, device, model = _setup(spec)
    budget = int(spec["budget"])
    cfg = replace(TrainConfig(**spec["train"]), grad_accum=1, progress=False)
    optimizer, lr = spec["optimizer"], spec["lr"]
    if spec["config"] == "schedulefree":  # the switches of `all`; Schedule-Free AdamW at its defaults, no schedule
        optimizer, lr = "schedulefree", SF_LR
    auto = spec["config"] in ("auto", "auto_warm")
    if auto:  # fit(recipe="auto") as a user calls it: no LR of their own (one given would be the recipe's prior loop)
        lr = None
    keep = _Keep()
    t0 = time.perf_counter()
    result = fitting.fit(model, loader, optimizer=optimizer, lr=lr, device=device, epochs=budget,  # max_steps ends it
                         config=cfg, max_steps=budget, schedule="onecycle", callbacks=[keep],
                         recipe="auto" if auto else None, recipe_parts=spec.get("parts") if auto else None)
    t_end = time.perf_counter()
    clock = t_end - t0
    trainer, decided = keep.trainer, result.decisions
    judged = _judged_weights(trainer, decided)
    clock += judged
    if trainer.config.label_smoothing:  # the target's loss is the plain cross-entropy, as for every config
        trainer.loss_fn = default_loss()
    out = trainer.evaluate(val_loader)    # off the clock
    decisions = {k: str(v) for k, v in decided.items()}
    decisions |= {"allocator": allocator_in_use(), "num_workers": loader.num_workers,
                  "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default (spin, then sleep)"),
                  "train_samples": len(loader.dataset), "val_samples": len(val_loader.dataset)}
    tuning = decided.get("tuning")
    measured = getattr(tuning, "measured", None) or {}
    if auto:
        decisions["recipe_on"] = _recipe_on(decided)
    return TTARun(config=spec["config"], seed=spec["seed"], budget=budget, val_acc=out["val_acc"],
                  val_loss=out["val_loss"], train_s=clock, samples=budget * spec["batch_size"], decisions=decisions,
                  tuning_s=float(measured.get("seconds", 0.0)) if auto else 0.0,
                  tuning_steps=int(measured.get("steps_off_run", 0)) if auto else 0,
                  phases=keep.phases(t0, t_end) | {"judged_weights_s": judged})


class _Keep(Callback):
    """Keeps the Trainer `fit` ran, for the evaluation after it (off the clock), and where its seconds went."""

    trainer = None
    EARLY = 16  # the steps after the first that a switch trial on the run's own steps may take

    def __init__(self):
        self.started, self.ends = None, []

    def on_train_start(self, trainer):
        self.started = time.perf_counter()

    def on_step_end(self, trainer):
        self.ends.append(time.perf_counter())

    def on_train_end(self, trainer, status):
        self.trainer = trainer

    def phases(self, t0: float, t_end: float) -> dict:
        """The run's clock in parts, host-side (an asynchronous device's work lands where the host next waits for
        it): fit's set-up before the first step, the first step, the next EARLY steps, the rest, and fit's work
        after the last step."""
        if self.started is None or not self.ends:
            return {}
        e, k = self.ends, min(self.EARLY, len(self.ends) - 1)
        return {"before_steps_s": self.started - t0, "first_step_s": e[0] - self.started,
                f"next_{k}_steps_s": e[k] - e[0], "rest_steps_s": e[-1] - e[k], "steps": len(e),
                "after_steps_s": t_end - e[-1]}


def _recipe_on(decisions: dict) -> list[str]:
    """The recipe parts that changed the run, read from fit's decisions."""
    def value(k):
        return getattr(decisions.get(k), "value", None)

    on = {"label_smoothing": bool(value("label_smoothing")), "bn_stats": bool(value("bn_stats")),
          "ema": value("ema") is not None, "tta": bool(value("tta")), "lr": "lr" in decisions,
          "schedulefree": value("optimizer") == "schedulefree", "muon": value("optimizer") == "muon",
          "batch": value("batch_size") is not None}
    return [k for k, v in on.items() if v]


def _judged_weights(trainer, decisions: dict) -> float:
    """Seconds to the weights the run is judged by, on the clock, where nothing prepared them yet: the weights
    evaluation looks through (Schedule-Free's average with its BatchNorm statistics recalibrated on the last
    training batches: work no model of such a run is usable without). `fit` ends holding them (`settle_averaged`,
    on fit's own clock), so this is a check that costs nothing; a TTA check that measured has looked through them
    too. Evaluation then uses them as they are."""
    tta = decisions.get("tta")
    if tta is not None and getattr(tta, "measured", None) is not None:
        return 0.0
    t0 = time.perf_counter()
    with eval_weights(trainer):
        pass
    return time.perf_counter() - t0


def main() -> int:
    spec = json.loads(sys.stdin.readline())
    try:
        if spec.get("mode") == "warm":
            reply({"ok": True} | warm(spec))
        else:  # the seeds in turn, stopping at the first that misses the target (when one is given)
            runs = []
            for s in spec["seeds"]:
                run = train_budget(spec | {"seed": s, "cache_dir": (spec.get("cache_dirs") or {}).get(str(s))})
                runs.append(asdict(run))
                if spec.get("target") is not None and not _met(run, spec["target"], spec["metric"]):
                    break
            reply({"ok": True, "runs": runs})
    except Exception as e:  # reported to the parent, which names the config, seed and budget that failed
        reply({"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
