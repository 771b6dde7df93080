"""One zoo model, three ways, in this process: the plain loop, `fit` as ported, `fit(recipe="auto")`.

Each way builds the model afresh from the same seed, takes the same K batches (one list, drawn once from a
seeded generator) through a fresh DataLoader, and draws its dropout and noise from the same seed; `fit` gets a
fresh, empty decision cache (TORCHSPEED_CACHE_DIR) each run, so its switch trial runs live, on the run's own
steps. Before any timed run, a throwaway model takes 2 plain steps and a 2-step `fit`: the process's one-time
costs (oneDNN's kernels for these shapes, torchspeed's lazy imports) are paid by none of the timed runs.

The K-step loss is the same for every way: the loss on the first batch after the run (train mode, no grad,
seeded), computed by the plain loop's own loss (or the case's probe). Run as a script, it prints one line
`ZOO_RESULT <json>` a model for `bench_zoo.py`:

    python benchmarks/zoo_run.py hf/gpt2 --steps 20 --ways plain fit auto

Given several names, it runs them one after another in this process (each model still built afresh, its
seeds and decision cache its own): `bench_zoo.py --per-process N` saves N - 1 start-ups of torch.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zoo_cases import Case  # noqa: E402

WAYS = ("plain", "fit", "auto")
BUILD_SEED, RUN_SEED, PROBE_SEED, DATA_SEED = 0, 1, 2, 1234
SOURCES = ("hand", "transformers", "timm", "torchvision")  # the registry's modules, in the sweep's order


def registry(sources: tuple[str, ...] = SOURCES) -> dict[str, Case]:
    """Every case by name (building nothing: the builders run only when a case runs)."""
    import importlib
    modules = {"hand": "zoo_hand", "transformers": "zoo_hf", "timm": "zoo_timm", "torchvision": "zoo_torchvision"}
    out: list[Case] = []
    for source in sources:
        out += importlib.import_module(modules[source]).cases()
    return {c.name: c for c in out}


class Listed(Dataset):
    """The run's batches, served as they are (`DataLoader(..., batch_size=None)`); `fresh`: each a copy, for a
    model that writes its input in place (else the way run first would hand the next ones its writes)."""

    def __init__(self, batches: list, fresh: bool = False):
        self.batches, self.fresh = batches, fresh

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        b = self.batches[i]
        return torch.utils._pytree.tree_map(lambda t: t.clone() if torch.is_tensor(t) else t, b) if self.fresh else b


def batches_for(case: Case, k: int) -> list:
    g = torch.Generator().manual_seed(DATA_SEED)
    return [case.batch(g) for _ in range(k)]


def loader(batches: list, fresh: bool = False) -> DataLoader:
    return DataLoader(Listed(batches, fresh), batch_size=None)


def seed(n: int) -> None:
    """torch's, numpy's and Python's generators (a model may draw from any: wav2vec2's masking uses numpy)."""
    import random

    import numpy as np
    torch.manual_seed(n)
    np.random.seed(n)
    random.seed(n)


def fresh(case: Case) -> torch.nn.Module:
    seed(BUILD_SEED)
    model = case.build()
    model.train()
    return model


def plain_loop(case: Case, batches: list) -> tuple[float, torch.nn.Module, list[float]]:
    """The script's own loop: forward, loss, backward, (clip,) step, zero_grad. Seconds, model, each step's loss."""
    model = fresh(case)
    opt = case.optimizer(model)
    step = case.step_fn() if case.step_fn else None
    clip, clip_value = case.fit_kwargs.get("clip_grad_norm"), case.fit_kwargs.get("clip_grad_value")
    losses = []
    seed(RUN_SEED)
    t0 = time.perf_counter()
    for batch in loader(batches, case.fresh_batches):
        def closure(batch=batch):  # L-BFGS's and SAM's, as their docs write the loop
            opt.zero_grad()
            out = step(model, batch) if step else case.plain(model, batch)
            out.backward()
            return out
        if isinstance(opt, torch.optim.LBFGS):
            loss = opt.step(closure)
            opt.zero_grad()
            losses.append(loss.detach())
            continue
        loss = step(model, batch) if step else case.plain(model, batch)
        loss.backward()
        if case.before_step:
            case.before_step(model)
        if clip_value:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step(closure) if hasattr(opt, "first_step") else opt.step()  # SAM: the gradient at its nearby point
        if case.after_step:
            case.after_step(model)
        opt.zero_grad()
        losses.append(loss.detach())
    sec = time.perf_counter() - t0
    return sec, model, torch.stack(losses).float().tolist()


def loop_hooks(case: Case):
    """The loop's code around `opt.step()` as a `Callback`: `before_step(model)` on the gradients (clipping's
    order: before it), `after_step(model)` on the weights after the step."""
    from torchspeed.train import Callback

    class LoopHooks(Callback):
        def on_before_optimizer_step(self, trainer, optimizer):
            if case.before_step:
                case.before_step(trainer.module)

        def on_step_end(self, trainer):
            if case.after_step:
                case.after_step(trainer.module)
    return LoopHooks()


def curve_callback(curve: list, t0: list):
    """A `Callback` that appends (seconds since the call began, the step's loss) at each optimizer step's end: the
    loss the loop reads at its `log_every` sync, which `fit_run` sets to every step for it (free on a CPU)."""
    from torchspeed.train import Callback

    class Curve(Callback):
        def on_step_end(self, trainer):
            curve.append((time.perf_counter() - t0[0], trainer.last_loss))
    return Curve()


def fit_run(case: Case, batches: list, auto: bool, curve: list | None = None) -> tuple[float, torch.nn.Module, object]:
    """`fit` as ported (the loop's optimizer object) or `fit(recipe="auto")`, timed as a whole call; `curve`, a
    list: each step's (seconds, loss) appended to it (`curve_callback`)."""
    import torchspeed

    model = fresh(case)
    kw = dict(case.fit_kwargs, max_steps=len(batches), progress=False)
    t0 = [0.0]
    if curve is not None:
        kw.update(log_every=1, callbacks=[*kw.get("callbacks", ()), curve_callback(curve, t0)])
    if case.step_fn:
        kw["step_fn"] = case.step_fn()
    if case.before_step or case.after_step:  # ported as docs/models.md says: a Callback with the loop's code
        kw["callbacks"] = [*kw.get("callbacks", ()), loop_hooks(case)]
    if auto:
        kw["recipe"] = "auto"
    else:
        kw["optimizer"] = case.optimizer(model)
    before = os.environ.get("TORCHSPEED_CACHE_DIR")
    os.environ["TORCHSPEED_CACHE_DIR"] = tempfile.mkdtemp(prefix="zoo-cache-")
    try:
        seed(RUN_SEED)
        t0[0] = time.perf_counter()
        res = torchspeed.fit(model, loader(batches, case.fresh_batches), **kw)
        return time.perf_counter() - t0[0], model, res
    finally:
        if before is None:
            os.environ.pop("TORCHSPEED_CACHE_DIR", None)
        else:
            os.environ["TORCHSPEED_CACHE_DIR"] = before


def probe(case: Case, model: torch.nn.Module, batch) -> float:
    """The K-step loss: the first batch's loss after the run, the same function for every way."""
    model.train()
    seed(PROBE_SEED)
    if case.fresh_batches:
        batch = Listed([batch], fresh=True)[0]
    with torch.no_grad():
        if case.probe:
            loss = case.probe(model, batch)
        elif case.step_fn:
            loss = case.step_fn()(model, batch)
        else:
            loss = case.plain(model, batch)
    return float(loss)


def settings(res) -> dict:
    """The decisions' values (what the run chose), JSON-ready; the trial's reason in words, cut short."""
    out = {}
    for k, d in res.decisions.items():
        v = d.get("value") if isinstance(d, dict) else d
        out[k] = v if isinstance(v, (bool, int, float, str, type(None))) else str(v)
    trial = res.decisions.get("switch_trial")
    if isinstance(trial, dict):
        out["switch_trial_reason"] = str(trial.get("reason", ""))[:300]
    return out


def kept_plain(s: dict) -> bool:
    """The trial kept the plain settings: fp32 (or the model's own dtype), NCHW, eager, the loop's kernel."""
    prec = str(s.get("precision", "fp32")).lower()
    return (prec in ("fp32", "float32", "fp64", "float64", "none", "model")
            and not s.get("channels_last") and not s.get("compile")
            and s.get("fused_optimizer") in (None, False, "default", "False"))


def error_of(e: BaseException) -> dict:
    msg = (str(e).strip().splitlines() or [""])[0][:400]
    tb = traceback.extract_tb(e.__traceback__)
    frames = [f for f in tb if "torchspeed" in f.filename][-4:] + tb[-2:]  # where torchspeed was, and the raise
    where = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames]
    return {"finished": False, "error": f"{type(e).__name__}: {msg}", "where": where}


def warm_up(case: Case, batches: list) -> None:
    """Pay the process's one-time costs on a throwaway model: 2 plain steps and a 2-step fit."""
    plain_loop(case, batches[:2])
    try:
        fit_run(case, batches[:2], auto=False)
    except Exception:  # noqa: BLE001  (the timed fit run records its own error)
        pass


def too_big(case: Case, max_params: float | None) -> str | None:
    """Why the sweep leaves a model out (its size on this machine), or None."""
    if not max_params:
        return None
    n = sum(p.numel() for p in fresh(case).parameters())
    return f"SizeLimit: {n / 1e6:.0f}M parameters, over the sweep's --max-params {max_params / 1e6:.0f}M" \
        if n > max_params else None


def window(k: int) -> int:
    """The steps a training loss is averaged over to compare two runs: a tenth of the run, 2 at least."""
    return max(2, round(k / 10))


def reach_seconds(curve: list, target: float, w: int) -> tuple[float, int] | tuple[None, None]:
    """When a run's training loss, averaged over `w` steps, first fell to `target`: (seconds since the call began,
    the step), or (None, None) where it never did. Both runs see the same batches in the same order."""
    losses = [x for _, x in curve]
    for s in range(w, len(curve) + 1):
        if sum(losses[s - w:s]) / w <= target:
            return curve[s - 1][0], s
    return None, None


def _plain_row(case: Case, batches: list) -> dict:
    sec, model, losses = plain_loop(case, batches)
    w = window(len(losses))
    return {"finished": True, "error": None, "seconds": sec, "vs_plain": 1.0, "loss": probe(case, model, batches[0]),
            "train_loss": sum(losses) / len(losses), "target_loss": sum(losses[-w:]) / w,
            "params": sum(p.numel() for p in model.parameters())}


def _fit_row(case: Case, batches: list, way: str, plain: dict) -> dict:
    try:
        curve = [] if way == "auto" else None
        sec, model, res = fit_run(case, batches, auto=(way == "auto"), curve=curve)
        s = settings(res)
        row = {"finished": True, "error": None, "seconds": sec, "vs_plain": plain["seconds"] / sec,
               "loss": probe(case, model, batches[0]),
               "train_loss": (res.final or {}).get("train_loss"), "steps": res.steps, "kept_plain": kept_plain(s),
               "settings": s}
        row["loss_equal"] = row["loss"] == plain["loss"]
        if curve is not None:
            row["reach_seconds"], row["reach_step"] = reach_seconds(curve, plain["target_loss"], window(len(batches)))
        return row
    except Exception as e:  # noqa: BLE001
        return error_of(e)


def steps_for(k: int, seconds: float, min_run_s: float, max_steps: int) -> int:
    """The steps of a run that lasts about `min_run_s`, from a K-step run of `seconds` (K at least, `max_steps` at
    most): a 20-ms run measures fit's fixed costs, which a real run pays once."""
    if not min_run_s or seconds >= min_run_s:
        return k
    return max(k, min(max_steps, math.ceil(k * min_run_s / max(seconds, 1e-9))))


def _timed_round(case: Case, batches: list, way: str, target: float) -> tuple[float, float | None]:
    """A round's seconds, and (auto) when its training loss reached the plain loop's."""
    if way == "plain":
        return plain_loop(case, batches)[0], None
    curve = [] if way == "auto" else None
    sec = fit_run(case, batches, way == "auto", curve=curve)[0]
    return sec, (reach_seconds(curve, target, window(len(batches)))[0] if curve is not None else None)


def run_case(case: Case, k: int, ways: tuple[str, ...] = WAYS, warm: bool = True, emit=None, rounds: int = 1,
             max_params: float | None = None, min_seconds: float = 0.0, max_rounds: int = 15,
             min_run_s: float = 0.0, max_steps: int = 400) -> dict:
    """{"source", "runs": {way: {...}}} for one model; fit and auto run only where the plain loop trains.
    The ways run again in turn for `rounds` rounds, and more (up to `max_rounds`) until each way has been timed
    for `min_seconds` in all: a short run gets many rounds. The order alternates (round 0: the plain loop first;
    round 1: the plain loop last; ...), so that neither side always runs first. Each way's `seconds` is the median
    of its rounds, and `vs_plain` the ratio of the medians (`vs_plain_fastest`: of the fastest rounds); the rows
    are otherwise the first round's. `emit(way, row)` is called as each way's first round ends (the parent keeps
    what ended if the process dies later). `min_run_s`: a model whose K-step plain run is shorter trains more
    steps (K scaled to about that long, at most `max_steps`), as a real run would; `out["steps"]` says how many."""
    emit = emit or (lambda way, row: None)
    batches = batches_for(case, k)
    out = {"source": case.source, "note": case.note, "runs": {}, "load": [round(os.getloadavg()[0], 2)],
           "data": "learnable" if getattr(case.batch, "learnable", False) else "noise"}
    try:
        if (why := too_big(case, max_params)) is not None:
            raise MemoryError(why)
        if warm:
            warm_up(case, batches)
        plain = _plain_row(case, batches)
        if (more := steps_for(k, plain["seconds"], min_run_s, max_steps)) > k:  # that run: one more warm-up
            batches = batches_for(case, more)
            plain = _plain_row(case, batches)
    except Exception as e:  # noqa: BLE001
        out["runs"]["plain"] = error_of(e)
        return out
    out["steps"] = len(batches)
    runs = out["runs"]
    runs["plain"] = plain
    emit("plain", plain)
    others = [w for w in ways if w != "plain"]
    for way in others:
        runs[way] = _fit_row(case, batches, way, plain)
        emit(way, runs[way])
    secs = {w: [runs[w]["seconds"]] for w in runs if runs[w].get("finished")}  # the plain loop's first
    reach = {w: [runs[w].get("reach_seconds")] for w in secs}
    r = 1
    while r < rounds or (r < max_rounds and min(sum(v) for v in secs.values()) < min_seconds):
        order = list(secs)
        for way in (order[1:] + order[:1]) if r % 2 else order:  # odd rounds: the plain loop last
            try:
                sec, at = _timed_round(case, batches, way, plain["target_loss"])
                secs[way].append(sec)
                reach[way].append(at)
            except Exception as e:  # noqa: BLE001  (a later round that fails: the way's error, the others go on)
                if way == "plain":
                    raise
                del secs[way]
                runs[way] = dict(error_of(e), round=r)
        r += 1
    for way in secs:
        runs[way]["round_seconds"] = secs[way]
        runs[way]["seconds"] = statistics.median(secs[way])
        runs[way]["vs_plain"] = statistics.median(secs["plain"]) / runs[way]["seconds"]
        runs[way]["vs_plain_fastest"] = min(secs["plain"]) / min(secs[way])
        if way == "auto":  # a round that never reached the loss counts as infinitely slow
            at = statistics.median([math.inf if x is None else x for x in reach[way]])
            runs[way]["round_reach_seconds"] = reach[way]
            runs[way]["reach_seconds"] = None if math.isinf(at) else at
            runs[way]["reach_vs_plain"] = None if math.isinf(at) else statistics.median(secs["plain"]) / at
    out["rounds"] = r
    out["load"].append(round(os.getloadavg()[0], 2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="zoo models, three ways each, one after another in this process "
                                             "(bench_zoo.py runs this)")
    ap.add_argument("names", nargs="+")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    ap.add_argument("--rounds", type=int, default=1, help="time each way at least this many times (the median counts)")
    ap.add_argument("--min-seconds", type=float, default=0.0, help="more rounds until each way is timed this long")
    ap.add_argument("--max-rounds", type=int, default=15, help="the most rounds --min-seconds adds up to")
    ap.add_argument("--min-run-s", type=float, default=0.0, help="a shorter K-step run trains more steps")
    ap.add_argument("--max-steps", type=int, default=400, help="the most steps --min-run-s scales K to")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--max-params", type=float, help="leave out (as the plain loop's error) a larger model")
    args = ap.parse_args()
    source = {"torchvision": "torchvision", "timm": "timm", "hf": "transformers", "hand": "hand"}
    prefixes = {source.get(n.split("/")[0] if "/" in n else "torchvision", "torchvision") for n in args.names}
    cases = registry(tuple(s for s in SOURCES if s in prefixes))
    for name in args.names:
        def emit(way, row, name=name):
            print(f"ZOO_WAY {way} " + json.dumps(dict(row, model=name), default=str), flush=True)
        result = run_case(cases[name], args.steps, tuple(args.ways), warm=not args.no_warmup, rounds=args.rounds,
                          max_params=args.max_params, emit=emit, min_seconds=args.min_seconds,
                          max_rounds=args.max_rounds, min_run_s=args.min_run_s, max_steps=args.max_steps)
        print("ZOO_RESULT " + json.dumps(dict(result, model=name), default=str), flush=True)
        gc.collect()


if __name__ == "__main__":
    main()
