"""The GPU check's measured parts, one per process: ResNet-50 throughput, GPT-2-small throughput, time to target.

`benchmarks/gpu_check.py` starts this file once per part with a time limit:

    python benchmarks/gpu_check_parts.py PART OPTIONS_JSON RESULT_PATH

and reads RESULT_PATH, which this process rewrites (atomically) each time it has more: a part
stopped at its limit keeps what it measured. PART is one of:

- `resnet`: torchvision's `resnet50(num_classes=1000)` on synthetic images made on the device,
  rows naive / hand / lightning / all_eager (fit's defaults without compilation), then all (fit's
  defaults) interleaved in rounds (gpu_check_rows.py); img/s per row, all/hand and
  all/lightning, MFU from `torchspeed.bench.flops` (FLOPs per sample counted by PyTorch, the
  datasheet's dense bf16 peak). On out of memory the batch is halved.
- `gpt`: a GPT-2-small-shaped model (`torchspeed.bench.text.GPT`) on synthetic tokens, all_eager
  and all (Trainer, AdamW) against the hand-written loop (bf16 autocast, fused AdamW, SDPA), eager
  and, when the part's time allows it, compiled; tokens/s and MFU (6 N + attention FLOPs per
  token) against the datasheet peak and against a measured bf16 matmul peak.
- `tta`: time to target on the digits at fixed step budgets (the CPU bench's JSON), each config
  in the time-to-target worker (`torchspeed.bench.time_to_target`), its seeds in one process.

Every result carries `provenance` (`torchspeed.bench.runner.provenance`).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

from gpu_check_rows import (Clock, HandRow, LightningRow, Partial, Timing, TrainerRow, measure_rows, out_of_memory,
                            profile_rows)
from torchspeed.bench.flops import peak_bf16_flops, train_flops_per_sample
from torchspeed.bench.hand import HandSettings
from torchspeed.bench.runner import provenance
from torchspeed.bench.text import GPT, GPTConfig
from torchspeed.bench.workloads import create_model
from torchspeed.env import sync
from torchspeed.train.config import TrainConfig
from torchspeed.train.trial.precision import half_precision
from torchspeed.train.rounds import run_for

ROOT = Path(__file__).resolve().parents[1]


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _halving(out: Partial, batch: int, run) -> None:
    """`run(batch)`; on out of memory, free everything and try again at half the batch (down to 1)."""
    out.data["batch_tried"] = []
    while True:
        out.data["batch_tried"].append(batch)
        out.save()
        try:
            run(batch)
            return
        except Exception as e:
            if not out_of_memory(e) or batch <= 1:
                raise
            out.data.setdefault("out_of_memory", []).append(f"batch {batch}: {str(e).splitlines()[0][:200]}")
        torch._dynamo.reset()  # compiled graphs (and their CUDA graph pools) of the failed try
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        batch //= 2


def _seeded(make):
    torch.manual_seed(0)  # every row starts from the same weights
    return make()


def _hand_compile_row(o: dict, rows: dict, res: dict, clock: Clock, make_row) -> None:
    """The hand loop under torch.compile (`make_row()`), or why not: o["hand_compile"] is True, False, or "auto"
    (on CUDA, when at its turn to warm up the part has o["compile_reserve_s"] left for a compilation)."""
    setting = o["hand_compile"]
    if setting is True or (setting == "auto" and o["device"].startswith("cuda")):
        def time_left() -> str | None:  # asked when its turn to warm up comes
            left = clock.left()
            return None if setting is True or left > o["compile_reserve_s"] else (
                f"{left:.0f} s left, under the {o['compile_reserve_s']} s a compilation needs")

        rows["hand_compile"] = make_row(time_left)
    else:
        res["rows"]["hand_compile"] = {"status": "skipped", "reason": "compile off here (hand_compile="
                                                                      f"{setting!r}, device {o['device']})"}


def _best_hand(res: dict, rows: dict, o: dict, clock: Clock, save) -> None:
    """`best_hand`: the faster of the hand loop eager and compiled; the fit rows' ratios against it; then, when
    o["profile_s"] are left, a profile of `all` and the best hand loop (gpu_check_rows.profile_rows)."""
    done = [r for r in ("hand", "hand_compile") if res["rows"].get(r, {}).get(res["unit"])]
    best = max(done, key=lambda r: res["rows"][r][res["unit"]], default=None)
    res["best_hand"] = best
    for fit_row in ("all", "all_eager"):
        res["ratios"][f"{fit_row}/best_hand"] = res["ratios"].get(f"{fit_row}/{best}") if best else None
    names = [r for r in ("all", best) if r and res["rows"].get(r, {}).get(res["unit"])]
    if len(names) < 2 or clock.left() < o["profile_s"]:
        res["profile"] = {"skipped": f"{clock.left():.0f} s left (under {o['profile_s']} s) or a row missing"}
        return
    save()
    try:
        res["profile"] = profile_rows(rows, names, o["steps"])
    except Exception as e:  # the profile is a diagnosis: its failure costs the part nothing it measured
        res["profile"] = {"error": f"{type(e).__name__}: {e}"}


# ---------------------------------------------------------------------------------------------- resnet
def _resnet_rows(o: dict, batch: int, device: torch.device, clock: Clock, res: dict) -> dict:
    size = o["image_size"]
    g = torch.Generator(device=device).manual_seed(0)
    data = [(torch.randn(batch, 3, size, size, device=device, generator=g),
             torch.randint(0, 1000, (batch,), device=device, generator=g)) for _ in range(o["data_batches"])]

    def make():
        return _seeded(lambda: create_model("resnet50", num_classes=1000, image_size=size))

    sgd = dict(optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=5e-4)
    half = half_precision(device) or "fp32"
    rows = {"naive": TrainerRow(make(), data, device, TrainConfig.naive(progress=False), warmup=o["warmup"], **sgd),
            "hand": HandRow(make(), data, device, HandSettings(half, channels_last=True, fused=True), lr=0.1,
                            warmup=o["warmup"], cudnn_benchmark=True)}
    _lightning_row(o, rows, data, device, res)
    # fit's defaults without compilation (the switch trial only), then all of them: on CUDA the compile trial
    # compiles twice (default mode and CUDA graphs), the longest warm-up of the part, so its own stage, last
    for name, cfg in (("all_eager", TrainConfig(progress=False, compile=False)), ("all", TrainConfig(progress=False))):
        rows[name] = TrainerRow(make(), data, device, cfg, warmup=o["warmup"], remaining_steps=o["all_run_steps"],
                                **sgd)
    _hand_compile_row(o, rows, res, clock, lambda time_left: HandRow(
        make(), data, device, HandSettings(half, channels_last=True, fused=True, compile=True), lr=0.1,
        warmup=o["warmup"], cudnn_benchmark=True, only_if=time_left))
    return rows


def _lightning_row(o: dict, rows: dict, data: list, device: torch.device, res: dict) -> None:
    """Add the Lightning row, or record why there is none (lightning missing or failing to start)."""
    from torchspeed.bench.peers import lightning_available, lightning_precision

    if not lightning_available():
        res["rows"]["lightning"] = {"status": "unavailable", "reason": "lightning is not installed"}
        return
    precision = "bf16-mixed" if device.type == "cuda" else lightning_precision(device)
    model = _seeded(lambda: create_model("resnet50", num_classes=1000, image_size=o["image_size"]))
    try:
        rows["lightning"] = LightningRow(model, data, device, lr=0.1, precision=precision, warmup=o["warmup"])
    except Exception as e:
        if out_of_memory(e):
            raise
        res["rows"]["lightning"] = {"status": "unavailable", "reason": f"{type(e).__name__}: {e}"}


def resnet_part(o: dict, out: Partial, clock: Clock) -> None:
    device = torch.device(o["device"])
    name = _device_name(device)
    flops = train_flops_per_sample("resnet50", image_size=o["image_size"], num_classes=1000)
    out.data.update(model="torchvision resnet50(num_classes=1000)", image_size=o["image_size"], device_name=name,
                    flops_per_sample=flops, peak_flops=peak_bf16_flops(name), unit="img_per_s",
                    steps_per_round=o["steps"], rounds=o["rounds"])

    def run(batch: int) -> None:
        out.data.update(batch=batch, rows={}, ratios={})
        rows = _resnet_rows(o, batch, device, clock, out.data)
        pairs = tuple((a, b) for a in ("all", "all_eager") for b in ("hand", "hand_compile", "lightning", "naive")) + (
            ("all", "all_eager"), ("hand", "naive"), ("hand_compile", "hand"), ("lightning", "naive"))
        timing = Timing(o["steps"], o["rounds"], batch, "img_per_s", flops, {"mfu": out.data["peak_flops"]}, pairs,
                        early_rounds=o["early_rounds"])
        # fit's defaults before the compiled hand loop: `all` is the part's point, the hand loop's compilation
        # (which can reuse the kernels all's compile trial cached) comes when the time left holds one
        measure_rows(rows, out.data, out.save, clock, timing,
                     stages=[("naive", "hand", "lightning", "all_eager"), ("all",), ("hand_compile",)])
        _best_hand(out.data, rows, o, clock, out.save)

    _halving(out, o["batch"], run)


# ---------------------------------------------------------------------------------------------- gpt
def matmul_peak(device: torch.device, n: int, iters: int) -> dict:
    """A large matmul timed (best of 3 runs of `iters` calls): bf16 where the device runs it natively, else fp32."""
    dtype = torch.bfloat16 if half_precision(device) == "bf16" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    sync(device)
    best = min(run_for(lambda: a @ b, min_calls=iters, sync=lambda: sync(device))[1] for _ in range(3))
    return {"flops_per_s": 2 * n**3 * iters / best, "n": n, "dtype": str(dtype).replace("torch.", ""),
            "iters": iters}


def gpt_flops_per_token(model: GPT) -> float:
    """6 N (N: the parameters but the position embedding; the tied head counts once) + 12 L d T (attention)."""
    cfg = model.cfg
    n = sum(p.numel() for p in model.parameters()) - model.pos.weight.numel()
    return 6 * n + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def _gpt_rows(o: dict, batch: int, device: torch.device, clock: Clock, res: dict) -> dict:
    cfg = GPTConfig(vocab_size=o["vocab"], block_size=o["block"], n_layer=o["n_layer"], n_head=o["n_head"],
                    n_embd=o["n_embd"], pad_vocab_to=64)
    g = torch.Generator(device=device).manual_seed(0)
    tokens = [torch.randint(0, o["vocab"], (batch, o["block"] + 1), device=device, generator=g)
              for _ in range(o["data_batches"])]
    data = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    half = half_precision(device) or "fp32"
    adamw = dict(optimizer="adamw", lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95))
    rows = {"hand": HandRow(_seeded(lambda: GPT(cfg)), data, device, HandSettings(half, fused=True), lr=6e-4,
                            warmup=o["warmup"], cudnn_benchmark=False, adamw=True)}
    for name, config in (("all_eager", TrainConfig(progress=False, compile=False)),
                         ("all", TrainConfig(progress=False))):  # fit's defaults without compiling, and all of them
        rows[name] = TrainerRow(_seeded(lambda: GPT(cfg)), data, device, config, warmup=o["warmup"],
                                remaining_steps=o["all_run_steps"], **adamw)
    _hand_compile_row(o, rows, res, clock, lambda time_left: HandRow(
        _seeded(lambda: GPT(cfg)), data, device, HandSettings(half, fused=True, compile=True), lr=6e-4,
        warmup=o["warmup"], cudnn_benchmark=False, adamw=True, only_if=time_left))
    res["flops_per_token"] = gpt_flops_per_token(rows["hand"].loop.model)
    return rows


def gpt_part(o: dict, out: Partial, clock: Clock) -> None:
    device = torch.device(o["device"])
    name = _device_name(device)
    peak = matmul_peak(device, o["matmul_n"], o["matmul_iters"])
    out.data.update(model={k: o[k] for k in ("n_layer", "n_embd", "n_head", "block", "vocab")}, device_name=name,
                    unit="tokens_per_s", peak_flops=peak_bf16_flops(name), measured_matmul_peak=peak,
                    steps_per_round=o["steps"], rounds=o["rounds"])
    out.save()

    def run(batch: int) -> None:
        out.data.update(batch=batch, rows={}, ratios={})
        rows = _gpt_rows(o, batch, device, clock, out.data)
        pairs = tuple((a, b) for a in ("all", "all_eager") for b in ("hand", "hand_compile")) + (
            ("all", "all_eager"), ("hand_compile", "hand"))
        timing = Timing(o["steps"], o["rounds"], batch * o["block"], "tokens_per_s", out.data["flops_per_token"],
                        {"mfu": out.data["peak_flops"], "mfu_vs_measured_peak": peak["flops_per_s"]}, pairs,
                        early_rounds=o["early_rounds"])
        # eager rows first; then the hand loop compiled (one compilation), then fit's defaults (its compile trial:
        # two, the first of which can reuse what the hand loop's compilation cached)
        measure_rows(rows, out.data, out.save, clock, timing, stages=[("hand", "all_eager"), ("hand_compile",),
                                                                      ("all",)])
        _best_hand(out.data, rows, o, clock, out.save)

    _halving(out, o["batch"], run)


# ---------------------------------------------------------------------------------------------- time to target
def tta_part(o: dict, out: Partial, clock: Clock) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_time_to_target import _budgets, _workload  # the interleaved benchmark's own readers of a bench JSON

    from torchspeed.bench.runner import bench_configs, machine_busy
    from torchspeed.bench.time_to_target import _process

    given = [f"{k}={v}" for k, v in (o.get("budgets") or {}).items()]
    args = SimpleNamespace(source=str(ROOT / o["source"]), target=o["target"], budgets=given or None,
                           configs=tuple(o["configs"]))
    base, metric, target = _workload(args)
    budgets = _budgets(args, target)
    device = torch.device(o["device"])
    by_name = {c.name: c for c in bench_configs(device, compile=False, hand=False, busy=machine_busy()[0])}
    base |= {"data_seed": 0, "device": str(device)}
    seeds = list(range(o["seeds"]))
    out.data.update(source=o["source"], budgets=budgets, budgets_overridden=bool(given), target=target, metric=metric,
                    workload=base, seeds=seeds, configs={},
                    schedulefree_installed=importlib.util.find_spec("schedulefree") is not None)
    for c, steps in budgets.items():
        spec = base | {"mode": "train", "config": c, "seed": seeds[0], "seeds": seeds, "budget": steps,
                       "target": None, "metric": None, "parts": None, "cache_dirs": {}}
        t0 = time.perf_counter()
        try:
            runs = _process(by_name["naive" if c == "naive" else "all"], spec)["runs"]
        except Exception as e:
            out.data["configs"][c] = {"status": "error", "error": str(e)[-2000:]}
            out.save()
            continue
        total = [r["train_s"] + r["tuning_s"] for r in runs]
        out.data["configs"][c] = {
            "status": "ok", "budget_steps": steps, "process_s": time.perf_counter() - t0,
            "val_acc": [r["val_acc"] for r in runs], "reached": [r[metric] >= target for r in runs],
            "train_s": [r["train_s"] for r in runs], "tuning_s": [r["tuning_s"] for r in runs],
            "mean_total_s": statistics.fmean(total), "decisions": runs[0].get("decisions"),
            "phases": [r.get("phases") for r in runs],  # per seed: where each run's seconds went
            "switch_trial": [(r.get("decisions") or {}).get("switch_trial") for r in runs]}
        out.save()
    done = {c: v["mean_total_s"] for c, v in out.data["configs"].items() if v["status"] == "ok"}
    out.data["sooner"] = {f"auto_vs_{c}": done[c] / done["auto"] for c in done if c != "auto" and "auto" in done}


PARTS = {"resnet": resnet_part, "gpt": gpt_part, "tta": tta_part}


def main(argv: list[str]) -> int:
    part, opts, path = argv[1], json.loads(argv[2]), argv[3]
    out = Partial(path)
    out.data["provenance"] = provenance()
    out.save()
    clock = Clock(opts["deadline"])
    torch.manual_seed(0)
    try:
        PARTS[part](opts, out, clock)
    except Exception as e:
        out.data["error"] = f"{type(e).__name__}: {e}"
        out.data["traceback"] = traceback.format_exc()[-4000:]
        out.save()
        traceback.print_exc()
        return 1
    out.data["complete"] = True
    out.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
