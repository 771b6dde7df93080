"""`torchspeed bench`: the naive loop, each technique alone, and everything, side by side.

Every configuration runs in its own process (its own allocator, compile cache and thread
pool) and trains the same model from the same initial weights on the same batches. They run
interleaved (round 1: every config, round 2: every config, ...) after a warm-up that is not
timed (it includes compilation and the compile="auto" trial), so slow drifts of a noisy
machine hit all configs alike; a short pause before each config's turn lets the previous
config's OpenMP threads stop spinning first. After its warm-up each config restarts from the
initial weights and optimizer state, so every row trains the same number of steps and the
loss column compares like with like (a numerics check: the same kernels give the same loss).
A config's throughput is the median over rounds; its speed-up is the median of the per-round
ratios to `naive`. The table is about speed: accuracy after a few steps says nothing about a
switch's effect on accuracy, which bench/time_to_target.py judges. Each row's JSON keeps it as
`check_val_acc` (does the config still learn?), its chance level in `meta["check_val_acc_chance"]`.

Rows (each technique switched on alone on top of `naive`):
  naive            fp32, NCHW, num_workers=0, zero_grad(set_to_none=False), .item() every step, eager
  plain            the plain fp32 PyTorch loop most users write (bench/peers.py): `all` must not be slower
  lightning        Lightning Fabric with the precision a user picks for speed here (when lightning is installed)
  bf16 / fp16      autocast (T21), the precision this device runs fast
  channels_last    T23
  no_item_sync     losses kept on the device, read every 50 steps (T13)
  set_to_none      zero_grad(set_to_none=True) (T26)
  fused_optimizer  fused/foreach optimizer kernels (T18)
  compile          torch.compile (T25)
  workers          DataLoader(num_workers>0), pinned memory on CUDA (T06, T07)
  compile_cudagraphs  torch.compile(mode="reduce-overhead"): CUDA graphs replay the step's kernels (CUDA only)
  tcmalloc         the process started with tcmalloc instead of glibc malloc (CPU, when installed)
  malloc_tuned     glibc malloc keeps activation blocks for reuse instead of mmap/munmap each step
                   (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_; CPU without tcmalloc; env.GLIBC_MALLOC_ENV)
  omp_passive      OMP_WAIT_POLICY=PASSIVE: idle OpenMP threads sleep instead of spinning (CPU)
  prefetch         CUDA side-stream prefetcher (T07, T12), CUDA only
  cudnn_benchmark  T22, CUDA only
  hand             the best hand-written loop for this machine: plain PyTorch, settings found by
                   trying precision x channels_last x fused optimizer, then compile (bench/hand.py)
  all              torchspeed's automatic choice (`TrainConfig()` defaults)

A row whose technique cannot act on the model (channels_last and cudnn_benchmark on a model
without 2D convolutions, such as `mlp` or `gpt`) is not run: it is reported "not applicable",
samples/s None and the reason in its decisions, so every workload shows the same rows.

`all/hand` (the median of per-round ratios) says whether torchspeed beats a skilled engineer's
own loop on this machine. On GPUs each row also gets its MFU: model FLOPs/s over the GPU's
dense bf16 peak (bench/flops.py).
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from torchspeed import env as env_probes  # machine_busy reads its probes when called (tests inject them)
from torchspeed._extras import require
from torchspeed._io import write_json
from torchspeed.bench.compare import compare_ratios
from torchspeed.bench.config_process import ConfigProcess
from torchspeed.bench.flops import mfu, peak_bf16_flops, train_flops_per_sample
from torchspeed.bench.peers import lightning_available
from torchspeed.bench.workloads import BLOCK_SIZE, check_workload, create_model, default_data
from torchspeed.env import GLIBC_MALLOC_ENV, default_device, detect
from torchspeed.train.config import TrainConfig
from torchspeed.train.trial.memory_format import has_conv2d
from torchspeed.train.trial.precision import half_precision
from torchspeed.train.loop.progress import progress_bar
from torchspeed.train.rounds import interleaved, paired_ratios

__all__ = ["BenchConfig", "BenchRow", "BenchResult", "bench_configs", "run_bench", "provenance", "cpu_kind",
           "write_results"]


# A pause before each config's timed steps. The previous config's OpenMP threads spin for a few
# ms after its last step (libgomp's default wait policy) and take the cores from whichever config
# runs next: without the pause, `all` (which runs right after `hand`) measured 0.97x hand over 8
# rounds on a 2-core CPU, with it 0.99x (0.95-1.01), and in reverse order 1.06x.
PAUSE_S = 0.05


@dataclass(frozen=True)
class BenchConfig:
    name: str
    train: TrainConfig
    num_workers: int = 0
    allocator: str = "glibc"   # "glibc" (the system default) or "tcmalloc" (LD_PRELOAD at process start)
    env: tuple[tuple[str, str], ...] = ()  # environment set at process start (OpenMP reads it once)
    kind: str = "trainer"      # "trainer" (torchspeed's Trainer), "hand" (bench/hand.py, plain PyTorch), "lightning"
    hand_settings: tuple = ()  # kind "hand": fixed HandSettings fields (empty: searched, the hand-written ceiling)


@dataclass
class BenchRow:
    config: str
    samples_per_s: float | None  # None (with speedup and train_loss): not applicable to this model
    speedup: float | None
    train_loss: float | None
    # Validation accuracy after the timed rounds' few steps: a check that the config still learns (against
    # meta["check_val_acc_chance"]), not its effect on accuracy: the time-to-target table judges that.
    check_val_acc: float | None
    samples_per_s_runs: list[float] = field(default_factory=list)
    decisions: dict = field(default_factory=dict)
    mfu: float | None = None
    # Time to accuracy, the rows it ran: means over seeds (None: not on every seed), per-seed lists, final accuracy.
    time_to_target_s: float | None = None
    steps_to_target: float | None = None
    time_to_target_s_runs: list = field(default_factory=list)
    steps_to_target_runs: list = field(default_factory=list)
    val_acc_runs: list = field(default_factory=list)


@dataclass
class BenchResult:
    device: str
    torch: str
    workload: str
    rows: list[BenchRow]
    meta: dict
    tta: dict | None = None  # time to accuracy (bench/time_to_target.py), when it ran

    def to_dict(self) -> dict:
        out = {"device": self.device, "torch": self.torch, "workload": self.workload,
               "rows": [asdict(r) for r in self.rows], "meta": self.meta}
        return out if self.tta is None else out | {"tta": self.tta}


OMP_PASSIVE = (("OMP_WAIT_POLICY", "PASSIVE"),)


def bench_configs(device: torch.device, *, workers: int | None = None, compile: bool = True,
                  hand: bool = True, busy: bool = False) -> list[BenchConfig]:
    """The ablation: naive, each technique alone on top of naive, the hand-written ceiling, and all.

    `busy` (other jobs share the cores, see `machine_busy`): on a CPU, `all` starts its process with
    OpenMP's passive wait, so its threads sleep between parallel regions instead of spinning on cores
    the other jobs need. On idle cores spinning is as fast or faster, and `all` keeps the default.
    On a CPU without tcmalloc, `all` also starts with glibc malloc's settings for training
    (`env.GLIBC_MALLOC_ENV`: activation blocks reused instead of faulted in afresh every step).
    """
    info = detect()
    naive = TrainConfig.naive(schedule=None, progress=False)
    fast_precision = half_precision(device) or "fp32"
    n_workers = workers if workers is not None else min(4, max(1, info.cpu_cores - 1))
    cuda = device.type == "cuda"
    rows = [BenchConfig("naive", naive)]
    if hand:  # where users would otherwise go (bench/peers.py): a plain fp32 loop, and Lightning
        rows.append(BenchConfig("plain", naive, kind="hand", hand_settings=(("precision", "fp32"),)))
        if lightning_available():
            rows.append(BenchConfig("lightning", naive, kind="lightning"))
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
        if cuda:
            rows.append(BenchConfig("compile_cudagraphs", replace(naive, compile=True, compile_mode="reduce-overhead")))
    rows.append(BenchConfig("workers", naive, num_workers=n_workers))
    if cuda:
        rows += [BenchConfig("prefetch", replace(naive, prefetch=True)),
                 BenchConfig("cudnn_benchmark", replace(naive, cudnn_benchmark=True))]
    tcmalloc = not cuda and info.tcmalloc_path is not None
    if tcmalloc:
        rows.append(BenchConfig("tcmalloc", naive, allocator="tcmalloc"))
    if not cuda:
        if not tcmalloc:  # glibc's own knobs, where there is no tcmalloc to start with
            rows.append(BenchConfig("malloc_tuned", naive, env=GLIBC_MALLOC_ENV))
        rows.append(BenchConfig("omp_passive", naive, env=OMP_PASSIVE))
    # hand: plain PyTorch with the best settings found by trying them; its loader is all's loader.
    loader_workers = n_workers if cuda else 0
    if hand:
        rows.append(BenchConfig("hand", naive, num_workers=loader_workers, kind="hand"))
    # all: torchspeed's automatic choice. The bench data is an in-memory tensor set, so on a
    # CPU the loader needs no workers (they would only take cores from the compute).
    all_cfg = TrainConfig(schedule=None, progress=False, compile="auto" if compile else False)
    all_env = () if cuda else (OMP_PASSIVE if busy else ()) + (() if tcmalloc else GLIBC_MALLOC_ENV)
    rows.append(BenchConfig("all", all_cfg, num_workers=loader_workers, allocator="tcmalloc" if tcmalloc else "glibc",
                            env=all_env))
    return rows


BUSY_BELOW = 1.6  # 2 processes finish 2 units of work less than 1.6x faster than 1 does 1: the cores are shared
BUSY_OTHERS = 0.5  # on average at least half a core's worth of other runnable tasks: the cores are shared


def machine_busy() -> tuple[bool, dict]:
    """(busy?, the evidence): whether other jobs hold this machine's cores now.

    Read from the kernel's run queue where it reports one (`env.other_runnable`: busy when other
    tasks are runnable half the time or more); else from a timing probe (`env.parallel_speedup`
    below 1.6x). The evidence dict carries both numbers (the probe's for the record).
    """
    if env_probes.usable_cores() < 2:
        return True, {"parallel_speedup_2proc": 1.0, "other_runnable": None, "busy_rule": "one usable core"}
    others, speedup = env_probes.other_runnable(), env_probes.parallel_speedup()
    if others is not None:
        return others >= BUSY_OTHERS, {"parallel_speedup_2proc": speedup, "other_runnable": others,
                                       "busy_rule": f"other runnable tasks >= {BUSY_OTHERS}"}
    return speedup < BUSY_BELOW, {"parallel_speedup_2proc": speedup, "other_runnable": None,
                                  "busy_rule": f"2-process speed-up < {BUSY_BELOW}"}


def cpu_kind(prov: dict) -> str:
    """The results folder a provenance's CPU belongs in (benchmarks/results/<kind>/): cpu-amx, cpu-avx512-bf16,
    cpu-avx512 or cpu-avx2."""
    flags = prov.get("cpu_flags") or {}
    return ("cpu-amx" if flags.get("amx") else "cpu-avx512-bf16" if flags.get("avx512_bf16")
            else "cpu-avx512" if flags.get("avx512") else "cpu-avx2")


def provenance() -> dict:
    """Commit, versions and device: saved with every benchmark result."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    info = detect()
    return {"commit": commit, "torch": torch.__version__, "torchvision": info.torchvision,
            "python": platform.python_version(), "device": f"{info.device}: {info.device_name}",
            "cpu": info.cpu_model, "cores": info.cpu_cores, "threads": torch.get_num_threads(),
            "cpu_flags": {"avx512": info.avx512, "avx512_bf16": info.avx512_bf16, "amx": info.amx},
            "allocator": info.allocator, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def not_applicable(configs: list[BenchConfig], model: str, *, image_size: int = 32) -> dict[str, str]:
    """{config name: why it cannot act on `model`} for the rows that would only measure noise."""
    with torch.device("meta"):  # shapes only: no memory, no weights initialised for real
        conv = has_conv2d(create_model(model, image_size=image_size))
    if conv:
        return {}
    why = {"channels_last": f"{model} has no 2D convolutions: channels_last (T23) changes no kernel",
           "cudnn_benchmark": f"{model} has no 2D convolutions: cudnn.benchmark (T22) picks convolution algorithms"}
    return {c.name: why[c.name] for c in configs if c.name in why}


def run_bench(*, model: str = "resnet18", data: str | None = None, batch_size: int = 128, steps: int = 2,
              rounds: int = 3, warmup: int = 1, device: str | None = None, configs: list[str] | None = None,
              eval_batches: int | None = 2, train_size: int | None = None, lr: float = 0.05, seed: int = 0,
              compile: bool = True, hand: bool = True, image_size: int = 32, progress: bool = True) -> BenchResult:
    """Train every config for warmup + rounds x steps steps, interleaved; return the table.

    `data` None: the model's own kind of data (`text` for `gpt`, else `synthetic`).
    """
    data = data or default_data(model)
    check_workload(model, data)
    dev = default_device(device or None)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible to torch here; use --device cpu")
    busy, evidence = machine_busy() if dev.type == "cpu" else (False, {})
    chosen = bench_configs(dev, compile=compile, hand=hand, busy=busy)
    if configs:
        unknown = set(configs) - {c.name for c in chosen}
        if unknown:
            raise ValueError(f"unknown bench config(s) {sorted(unknown)}; available: {[c.name for c in chosen]}")
        chosen = [c for c in chosen if c.name in configs or c.name == "naive"]
    if train_size is None:  # small images: 2048 samples; large ones: 4 batches (memory per process)
        train_size = 2048 if image_size < 64 else 4 * batch_size
    spec = {"model": model, "data": data, "batch_size": batch_size, "train_size": train_size, "lr": lr,
            "seed": seed, "device": str(dev), "image_size": image_size,
            "val_size": 1024 if image_size < 64 else 2 * batch_size, "hand": {"compile": compile}}
    rows, times = _run_configs(chosen, spec, rounds=rounds, steps=steps, warmup=warmup, eval_batches=eval_batches,
                               progress=progress)
    info = detect()
    flops = _flops_per_sample(model, image_size)
    if dev.type == "cuda" and flops:
        for r in rows:
            if r.samples_per_s is not None:
                r.mfu = mfu(samples_per_s=r.samples_per_s, flops_per_sample=flops, device_name=info.device_name)
    meta = provenance() | {"batch_size": batch_size, "steps_per_round": steps, "rounds": rounds,
                           "warmup_steps": warmup, "model": model, "data": data, "compile": compile,
                           "eval_batches": eval_batches, "image_size": image_size,
                           "parallel_speedup_2proc": evidence.get("parallel_speedup_2proc"),
                           "other_runnable": evidence.get("other_runnable"), "busy_rule": evidence.get("busy_rule"),
                           "busy": busy, "train_size": train_size,
                           "check_val_acc_chance": check_chance(data),
                           "train_flops_per_sample": flops,
                           "peak_bf16_flops": peak_bf16_flops(info.device_name) if dev.type == "cuda" else None}
    if "all" in times and "hand" in times:  # does torchspeed beat the best loop written by hand, here?
        meta["all_over_hand_runs"] = paired_ratios(times["hand"], times["all"])
        meta["all_over_hand_interval"] = compare_ratios(meta["all_over_hand_runs"])
        meta["all_over_hand"] = meta["all_over_hand_interval"]["median"]
        meta["all_over_hand_verdict"] = meta["all_over_hand_interval"]["verdict"]
    shape = f"(bytes, {BLOCK_SIZE} per sample)" if data == "text" else f"3x{image_size}x{image_size}"
    return BenchResult(device=f"{info.device}: {info.device_name}", torch=torch.__version__,
                       workload=f"{model} on {data} {shape}, batch {batch_size}", rows=rows,
                       meta=meta)


def _run_configs(chosen: list[BenchConfig], spec: dict, *, rounds: int, steps: int, warmup: int,
                 eval_batches: int | None, progress: bool) -> tuple[list[BenchRow], dict[str, list[float]]]:
    """(rows in `chosen`'s order, each config's round seconds): each config that can act on the model runs in its
    own process, timed by `_measure`, then validated; the processes are closed whatever happens."""
    procs: list[ConfigProcess] = []
    try:
        with progress_bar(enabled=progress) as bar:
            skipped = not_applicable(chosen, spec["model"], image_size=spec["image_size"])
            procs = [ConfigProcess(c, spec) for c in chosen if c.name not in skipped]  # set-up: all at once
            _measure(procs, bar, rounds=rounds, steps=steps, warmup=warmup)
            task = bar.add_task("validation", total=len(procs))
            rows = []
            for p in procs:
                bar.update(task, description=f"validation {p.cfg.name}")
                fin = p.send({"op": "finish", "eval_batches": eval_batches})
                rates = [steps * spec["batch_size"] / t for t in p.times]
                rows.append(BenchRow(p.cfg.name, statistics.median(rates),
                                     statistics.median(paired_ratios(procs[0].times, p.times)),
                                     fin["train_loss"], fin["val_acc"], rates,
                                     fin["decisions"] | {"warmup_steps": p.warmup_steps}))
                bar.advance(task)
            rows += [BenchRow(name, None, None, None, None, decisions={"not_applicable": why})
                     for name, why in skipped.items()]
            order = [c.name for c in chosen]
            rows.sort(key=lambda r: order.index(r.config))
            return rows, {p.cfg.name: p.times for p in procs}
    finally:
        for p in procs:
            p.close()


def _measure(procs: list[ConfigProcess], bar, *, rounds: int, steps: int, warmup: int) -> None:
    """Each config's warm-up (its set-up finished first), then `rounds` interleaved rounds of `steps` timed steps;
    the seconds of each round go to the config's `times`."""
    by_name = {p.cfg.name: p for p in procs}
    warm_task = bar.add_task("warm-up (includes compilation)", total=len(procs))
    task = bar.add_task("measuring (interleaved rounds)", total=rounds * len(procs))

    def warm(name: str) -> None:
        p = by_name[name]
        what = "hand-written loop: searching its settings" if p.cfg.kind == "hand" else name
        bar.update(warm_task, description=f"warm-up {what}")
        p.receive()  # set-up done
        p.warmup_steps = p.send({"op": "warmup", "n": warmup})["steps"]
        bar.advance(warm_task)

    def turn(name: str, r: int) -> None:
        if r:
            time.sleep(PAUSE_S)  # the previous config's OpenMP threads stop spinning first
            bar.update(task, description=f"round {r}/{rounds}: {name}")
            bar.advance(task)

    measured = interleaved({p.cfg.name: (lambda p=p: p.send({"op": "steps", "n": steps})["seconds"])
                            for p in procs}, rounds=rounds, warmup=1, warm=warm, before=turn)
    for p in procs:
        p.times = measured.times[p.cfg.name]


def check_chance(data: str) -> float:
    """The chance level of a row's check_val_acc: a uniform guess over 10 classes, or 256 bytes for text."""
    return 1 / 256 if data == "text" else 1 / 10


def _flops_per_sample(model: str, image_size: int) -> float | None:
    try:
        return train_flops_per_sample(model, image_size=image_size)
    except Exception:  # an unusual model the meta device cannot run: the MFU column stays empty
        return None


def write_results(result: BenchResult, json_path: str | os.PathLike, png_path: str | os.PathLike | None) -> None:
    write_json(json_path, result.to_dict())
    if png_path:
        plot_results(result, png_path)


def plot_results(result: BenchResult, png_path: str | os.PathLike) -> None:
    matplotlib = require("matplotlib", "plot", feature="the bench's PNG (the JSON is already written)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.config for r in result.rows]
    speed = [r.speedup or 0.0 for r in result.rows]  # a row not applicable: no bar, "n/a"
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.5))
    colors = ["#999999" if n == "naive" else "#2a7ab0" if n != "all" else "#d1495b" for n in names]
    ax.barh(names[::-1], speed[::-1], color=colors[::-1])
    for i, s in enumerate(speed[::-1]):
        ax.text(s, i, f" {s:.2f}x" if s else " n/a", va="center")
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xlabel("speed-up over naive (samples/s ratio, median of interleaved rounds)")
    ax.set_title(f"torchspeed bench: {result.workload}\n{result.device}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
