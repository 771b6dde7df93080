"""`torchspeed bench`: the naive loop, each technique alone, and everything, side by side.

Every configuration trains the same model from the same initial weights on the same
batches. They run interleaved (round 1: every config, round 2: every config, ...) after a
warm-up that is not timed (it includes compilation and the compile="auto" trial), so slow
drifts of a noisy machine hit all configs alike. A config's throughput is the median over
rounds; its speed-up is the median of the per-round ratios to `naive`.

Rows (each technique switched on alone on top of `naive`):
  naive            fp32, NCHW, num_workers=0, zero_grad(set_to_none=False), .item() every step, eager
  bf16 / fp16      autocast (T21), the precision this device runs fast
  channels_last    T23
  no_item_sync     losses kept on the device, read every 50 steps (T13)
  set_to_none      zero_grad(set_to_none=True) (T26)
  fused_optimizer  fused/foreach optimizer kernels (T18)
  compile          torch.compile (T25)
  workers          DataLoader(num_workers>0), pinned memory on CUDA (T06, T07)
  prefetch         CUDA side-stream prefetcher (T07, T12), CUDA only
  cudnn_benchmark  T22, CUDA only
  all              torchspeed's automatic choice (`TrainConfig()` defaults)
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from torchspeed.bench.workloads import create_model, make_datasets
from torchspeed.env import detect
from torchspeed.train.compile import sync
from torchspeed.train.trainer import Trainer, TrainConfig

__all__ = ["BenchConfig", "BenchRow", "BenchResult", "bench_configs", "run_bench", "provenance"]


@dataclass(frozen=True)
class BenchConfig:
    name: str
    train: TrainConfig
    num_workers: int = 0


@dataclass
class BenchRow:
    config: str
    samples_per_s: float
    speedup: float
    train_loss: float
    val_acc: float | None
    samples_per_s_runs: list[float] = field(default_factory=list)
    decisions: dict = field(default_factory=dict)


@dataclass
class BenchResult:
    device: str
    torch: str
    workload: str
    rows: list[BenchRow]
    meta: dict

    def to_dict(self) -> dict:
        return {"device": self.device, "torch": self.torch, "workload": self.workload,
                "rows": [asdict(r) for r in self.rows], "meta": self.meta}


def bench_configs(device: torch.device, *, workers: int | None = None) -> list[BenchConfig]:
    """The ablation: naive, each technique alone on top of naive, and all."""
    info = detect()
    naive = TrainConfig.naive(schedule=None, progress=False)
    fast_precision = info.best_precision if device.type == "cpu" else ("bf16" if info.bf16_supported else "fp16")
    n_workers = workers if workers is not None else min(4, max(1, info.cpu_cores - 1))
    rows = [BenchConfig("naive", naive)]
    if fast_precision != "fp32":
        rows.append(BenchConfig(fast_precision, replace(naive, precision=fast_precision)))
    rows += [
        BenchConfig("channels_last", replace(naive, channels_last=True)),
        BenchConfig("no_item_sync", replace(naive, log_every=50)),
        BenchConfig("set_to_none", replace(naive, set_to_none=True)),
        BenchConfig("fused_optimizer", replace(naive, fused_optimizer="auto")),
        BenchConfig("compile", replace(naive, compile=True)),
        BenchConfig("workers", naive, num_workers=n_workers),
    ]
    if device.type == "cuda":
        rows += [BenchConfig("prefetch", replace(naive, prefetch=True)),
                 BenchConfig("cudnn_benchmark", replace(naive, cudnn_benchmark=True))]
    # all: torchspeed's automatic choice. The bench data is an in-memory tensor set, so on a
    # CPU the loader needs no workers (they would only take cores from the compute).
    all_workers = n_workers if device.type == "cuda" else 0
    rows.append(BenchConfig("all", TrainConfig(schedule=None, progress=False), num_workers=all_workers))
    return rows


class _Run:
    """One config's trainer and its endless stream of device batches."""

    def __init__(self, cfg: BenchConfig, model_name: str, state: dict, train_set, batch_size: int,
                 device: torch.device, lr: float, seed: int):
        model = create_model(model_name)
        model.load_state_dict(state)
        self.cfg = cfg
        self.trainer = Trainer(model, optimizer="sgd", lr=lr, device=device, config=cfg.train)
        self.train_set, self.batch_size, self.seed = train_set, batch_size, seed
        self.loader = DataLoader(train_set, batch_size=batch_size, shuffle=True, drop_last=True,
                                 generator=torch.Generator().manual_seed(seed),
                                 num_workers=cfg.num_workers, pin_memory=cfg.num_workers > 0 and device.type == "cuda",
                                 persistent_workers=cfg.num_workers > 0)
        self._it = None
        self.times: list[float] = []

    def batches(self):
        while True:
            yield from self.trainer.batches(self.loader)

    def steps(self, n: int) -> float:
        if self._it is None:
            self._it = self.batches()
        return self.trainer.run_steps(self._it, n)

    def warm_up(self, n: int) -> None:
        self.steps(n)
        while self.trainer._compile_trial is not None:  # finish the compile="auto" trial
            self.steps(1)


def provenance() -> dict:
    """Commit, versions and device: saved with every benchmark result."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    info = detect()
    import torchvision

    return {"commit": commit, "torch": torch.__version__, "torchvision": torchvision.__version__,
            "python": platform.python_version(), "device": f"{info.device}: {info.device_name}",
            "cpu": info.cpu_model, "cores": info.cpu_cores, "threads": torch.get_num_threads(),
            "allocator": info.allocator, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def run_bench(*, model: str = "resnet18", data: str = "synthetic", batch_size: int = 128, steps: int = 6,
              rounds: int = 3, warmup: int = 2, device: str | None = None, configs: list[str] | None = None,
              eval_batches: int | None = None, train_size: int = 4096, lr: float = 0.05, seed: int = 0,
              progress: bool = True) -> BenchResult:
    """Train every config for warmup + rounds x steps steps, interleaved; return the table."""
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is visible to torch here; use --device cpu")
    chosen = bench_configs(dev)
    if configs:
        unknown = set(configs) - {c.name for c in chosen}
        if unknown:
            raise ValueError(f"unknown bench config(s) {sorted(unknown)}; available: {[c.name for c in chosen]}")
        chosen = [c for c in chosen if c.name in configs or c.name == "naive"]
    train_set, val_set = make_datasets(data, train_size=train_size, seed=seed)
    torch.manual_seed(seed)
    state = create_model(model).state_dict()
    runs = [_Run(c, model, state, train_set, batch_size, dev, lr, seed) for c in chosen]

    from rich.progress import Progress

    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("warm-up (includes compilation)", total=len(runs))
        for r in runs:
            bar.update(task, description=f"warm-up {r.cfg.name}")
            r.warm_up(warmup)
            bar.advance(task)
        task = bar.add_task("measuring (interleaved rounds)", total=rounds * len(runs))
        for k in range(rounds):
            for r in runs:
                bar.update(task, description=f"round {k + 1}/{rounds}: {r.cfg.name}")
                r.trainer.meter.reset()
                r.times.append(r.steps(steps))
                bar.advance(task)
        val_loader = DataLoader(val_set, batch_size=256)
        if eval_batches is not None:
            val_loader = [b for _, b in zip(range(eval_batches), val_loader)]
        task = bar.add_task("validation", total=len(runs))
        rows = []
        naive_times = runs[0].times
        for r in runs:
            bar.update(task, description=f"validation {r.cfg.name}")
            loss = r.trainer.meter.compute()["loss"]  # mean loss of the last round
            val = r.trainer.evaluate(val_loader)["val_acc"]
            rates = [steps * batch_size / t for t in r.times]
            ratios = [n / t for n, t in zip(naive_times, r.times)]
            rows.append(BenchRow(r.cfg.name, statistics.median(rates), statistics.median(ratios), loss, val,
                                 rates, {k: str(v) for k, v in r.trainer.decisions.items() if k != "compile_detail"}))
            bar.advance(task)
    sync(dev)
    info = detect()
    meta = provenance() | {"batch_size": batch_size, "steps_per_round": steps, "rounds": rounds,
                           "warmup_steps": warmup, "model": model, "data": data}
    return BenchResult(device=f"{info.device}: {info.device_name}", torch=torch.__version__,
                       workload=f"{model} on {data} 3x32x32, batch {batch_size}", rows=rows, meta=meta)


def write_results(result: BenchResult, json_path: str | os.PathLike, png_path: str | os.PathLike | None) -> None:
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = json_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result.to_dict(), indent=2))
    os.replace(tmp, json_path)
    if png_path:
        plot_results(result, png_path)


def plot_results(result: BenchResult, png_path: str | os.PathLike) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.config for r in result.rows]
    speed = [r.speedup for r in result.rows]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.5))
    colors = ["#999999" if n == "naive" else "#2a7ab0" if n != "all" else "#d1495b" for n in names]
    ax.barh(names[::-1], speed[::-1], color=colors[::-1])
    for i, s in enumerate(speed[::-1]):
        ax.text(s, i, f" {s:.2f}x", va="center")
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xlabel("speed-up over naive (samples/s ratio, median of interleaved rounds)")
    ax.set_title(f"torchspeed bench: {result.workload}\n{result.device}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
