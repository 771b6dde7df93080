"""`torchspeed bench`: the naive loop, each technique alone, and everything, side by side.

Every configuration runs in its own process (its own allocator, compile cache and thread
pool) and trains the same model from the same initial weights on the same batches. They run interleaved (round 1: every config, round 2: every config, ...) after a
warm-up that is not timed (it includes compilation and the compile="auto" trial), so slow
drifts of a noisy machine hit all configs alike. After its warm-up each config restarts
from the initial weights and optimizer state, so every row trains the same number of steps
and the loss and accuracy columns compare like with like. A config's throughput is the median over
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
  tcmalloc         the process started with tcmalloc instead of glibc malloc (CPU, when installed)
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
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torchspeed._io import write_json
from torchspeed.env import detect
from torchspeed.train.trainer import TrainConfig

__all__ = ["BenchConfig", "BenchRow", "BenchResult", "bench_configs", "run_bench", "provenance", "write_results"]


@dataclass(frozen=True)
class BenchConfig:
    name: str
    train: TrainConfig
    num_workers: int = 0
    allocator: str = "glibc"   # "glibc" (the system default) or "tcmalloc" (LD_PRELOAD at process start)


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


def bench_configs(device: torch.device, *, workers: int | None = None, compile: bool = True) -> list[BenchConfig]:
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
    ]
    if compile:
        rows.append(BenchConfig("compile", replace(naive, compile=True)))
    rows.append(BenchConfig("workers", naive, num_workers=n_workers))
    if device.type == "cuda":
        rows += [BenchConfig("prefetch", replace(naive, prefetch=True)),
                 BenchConfig("cudnn_benchmark", replace(naive, cudnn_benchmark=True))]
    tcmalloc = device.type == "cpu" and info.tcmalloc_path is not None
    if tcmalloc:
        rows.append(BenchConfig("tcmalloc", naive, allocator="tcmalloc"))
    # all: torchspeed's automatic choice. The bench data is an in-memory tensor set, so on a
    # CPU the loader needs no workers (they would only take cores from the compute).
    all_cfg = TrainConfig(schedule=None, progress=False, compile="auto" if compile else False)
    rows.append(BenchConfig("all", all_cfg, num_workers=n_workers if device.type == "cuda" else 0,
                            allocator="tcmalloc" if tcmalloc else "glibc"))
    return rows


class ConfigProcess:
    """A bench config running in its own Python process (its own allocator, caches, threads)."""

    def __init__(self, cfg: BenchConfig, spec: dict):
        self.cfg = cfg
        env = dict(os.environ)
        env.pop("LD_PRELOAD", None)
        if cfg.allocator == "tcmalloc":
            lib = detect().tcmalloc_path
            if lib:
                env["LD_PRELOAD"] = lib
        self.proc = subprocess.Popen([sys.executable, "-m", "torchspeed.bench._worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, bufsize=1)
        self.spec = spec | {"train": asdict(cfg.train), "num_workers": cfg.num_workers}
        self.times: list[float] = []
        self.send({"op": "setup", "spec": self.spec}, wait=False)

    def send(self, cmd: dict, *, wait: bool = True) -> dict | None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.receive() if wait else None

    def receive(self) -> dict:
        from torchspeed.bench._worker import PREFIX

        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                reply = json.loads(line[len(PREFIX):])
                if not reply.get("ok"):
                    raise RuntimeError(f"bench config {self.cfg.name!r} failed: {reply.get('error')}\n"
                                       f"{reply.get('traceback', '')}")
                return reply
        raise RuntimeError(f"bench config {self.cfg.name!r}: its process exited (code {self.proc.wait()})")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "exit"})
            except (RuntimeError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


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
            "cpu_flags": {"avx512": info.avx512, "avx512_bf16": info.avx512_bf16, "amx": info.amx},
            "allocator": info.allocator, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def run_bench(*, model: str = "resnet18", data: str = "synthetic", batch_size: int = 128, steps: int = 2,
              rounds: int = 3, warmup: int = 1, device: str | None = None, configs: list[str] | None = None,
              eval_batches: int | None = 2, train_size: int = 2048, lr: float = 0.05, seed: int = 0,
              compile: bool = True, progress: bool = True) -> BenchResult:
    """Train every config for warmup + rounds x steps steps, interleaved; return the table."""
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible to torch here; use --device cpu")
    chosen = bench_configs(dev, compile=compile)
    if configs:
        unknown = set(configs) - {c.name for c in chosen}
        if unknown:
            raise ValueError(f"unknown bench config(s) {sorted(unknown)}; available: {[c.name for c in chosen]}")
        chosen = [c for c in chosen if c.name in configs or c.name == "naive"]
    spec = {"model": model, "data": data, "batch_size": batch_size, "train_size": train_size, "lr": lr,
            "seed": seed, "device": str(dev)}

    from rich.progress import Progress

    procs: list[ConfigProcess] = []
    try:
        with Progress(disable=not progress, transient=True) as bar:
            procs = [ConfigProcess(c, spec) for c in chosen]  # set-up runs in all processes at once
            task = bar.add_task("warm-up (includes compilation)", total=len(procs))
            for p in procs:
                bar.update(task, description=f"warm-up {p.cfg.name}")
                p.receive()  # set-up done
                p.warmup_steps = p.send({"op": "warmup", "n": warmup})["steps"]
                bar.advance(task)
            task = bar.add_task("measuring (interleaved rounds)", total=rounds * len(procs))
            for k in range(rounds):
                for p in procs:
                    bar.update(task, description=f"round {k + 1}/{rounds}: {p.cfg.name}")
                    p.times.append(p.send({"op": "steps", "n": steps})["seconds"])
                    bar.advance(task)
            task = bar.add_task("validation", total=len(procs))
            rows = []
            naive_times = procs[0].times
            for p in procs:
                bar.update(task, description=f"validation {p.cfg.name}")
                fin = p.send({"op": "finish", "eval_batches": eval_batches})
                rates = [steps * batch_size / t for t in p.times]
                ratios = [n / t for n, t in zip(naive_times, p.times)]
                rows.append(BenchRow(p.cfg.name, statistics.median(rates), statistics.median(ratios),
                                     fin["train_loss"], fin["val_acc"], rates,
                                     fin["decisions"] | {"warmup_steps": p.warmup_steps}))
                bar.advance(task)
    finally:
        for p in procs:
            p.close()
    info = detect()
    meta = provenance() | {"batch_size": batch_size, "steps_per_round": steps, "rounds": rounds,
                           "warmup_steps": warmup, "model": model, "data": data, "compile": compile,
                           "eval_batches": eval_batches}
    return BenchResult(device=f"{info.device}: {info.device_name}", torch=torch.__version__,
                       workload=f"{model} on {data} 3x32x32, batch {batch_size}", rows=rows, meta=meta)


def write_results(result: BenchResult, json_path: str | os.PathLike, png_path: str | os.PathLike | None) -> None:
    write_json(json_path, result.to_dict())
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
