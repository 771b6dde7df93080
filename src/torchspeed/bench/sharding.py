"""Memory per process with FSDP2 against DDP (T31), measured here: `torchspeed bench --nproc N --parallel fsdp2`.

Each configuration is a fresh torchrun job of N processes training the same workload (the GPT
by default) with AdamW, once with `parallel="ddp"` and once with `parallel="fsdp2"`. Every
process reports:

- `state_mib`: the bytes it holds of parameters, gradients and optimizer state, counted from
  the tensors themselves (a shard's local piece under FSDP2). This is what sharding divides
  by N; it does not depend on the allocator or the machine's load.
- `peak_rss_mib`: the peak resident memory of the process from just before the model is built
  to the end of the timed steps (Linux: the high-water mark reset through
  /proc/self/clear_refs), which adds activations, the gathered blocks and allocator slack;
  `peak_over_base_mib` is that peak minus the resident memory just before the model (torch,
  the data, the interpreter: the same in both modes).
- samples/s of all processes together.

On gloo (CPU) reduce-scatter is emulated with an all-reduce, so CPU throughput says little
about FSDP2 on GPUs: memory per process is the point of this comparison.

Example:
    >>> r = measure_sharding(nproc=2, model="gpt", steps=10)
    >>> r["ratios"]["state per process, fsdp2 / ddp"]
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from torch.utils.data import DataLoader

from torchspeed.bench.runner import provenance
from torchspeed.bench.scaling import _torchrun
from torchspeed.bench.workloads import create_model, make_datasets
from torchspeed.env import other_runnable, usable_cores
from torchspeed.train.config import TrainConfig
from torchspeed.train.loop.trainer import Trainer
from torchspeed.train.parallel.distributed import all_reduce_sum, barrier, broadcast_object, is_rank_zero
from torchspeed.train.parallel.shard import shard_loader
from torchspeed.train.rounds import turns

__all__ = ["measure_sharding", "run_sharding_cli"]

MODES = ("ddp", "fsdp2")


def measure_sharding(*, nproc: int = 2, model: str = "gpt", data: str = "text", batch_size: int = 16,
                     steps: int = 10, warmup: int = 2, rounds: int = 1, timeout_s: float = 900) -> dict:
    """Per-process memory and throughput of DDP and FSDP2 jobs of `nproc` processes (see the module docstring)."""
    if nproc < 2:
        raise ValueError(f"nproc must be at least 2 to shard anything, got {nproc}")
    threads = max(1, usable_cores() // nproc)
    spec = dict(model=model, data=data, batch_size=batch_size, steps=steps, warmup=warmup)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for mode, _ in turns(MODES, rounds=rounds, order="alternate"):  # interleaved, the order reversed every round
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            job = dict(spec, parallel=mode, out=out, threads=threads)
            result, _ = _torchrun(["-m", "torchspeed.bench.sharding", json.dumps(job)], nproc=nproc,
                                  threads=threads, result=out, timeout_s=timeout_s)
            runs[mode].append(result)
    rows = {}
    for mode, results in runs.items():
        last = results[-1]
        rows[mode] = {"samples_per_s": statistics.median(r["samples_per_s"] for r in results),
                      "state_mib_per_rank": last["state_mib"], "peak_rss_mib_per_rank": last["peak_rss_mib"],
                      "peak_over_base_mib_per_rank": last["peak_over_base_mib"],
                      "params_per_rank": last["params"], "decisions": last["decisions"]}
    ddp, fsdp = rows["ddp"], rows["fsdp2"]
    ratios = {"state per process, fsdp2 / ddp": max(fsdp["state_mib_per_rank"]) / max(ddp["state_mib_per_rank"]),
              "peak RSS per process, fsdp2 / ddp": max(fsdp["peak_rss_mib_per_rank"]) /
              max(ddp["peak_rss_mib_per_rank"]),
              "peak RSS above the pre-model baseline, fsdp2 / ddp": max(fsdp["peak_over_base_mib_per_rank"]) /
              max(1e-9, max(ddp["peak_over_base_mib_per_rank"])),
              "samples/s, fsdp2 / ddp": fsdp["samples_per_s"] / ddp["samples_per_s"]}
    return {"rows": rows, "ratios": ratios,
            "meta": dict(spec, nproc=nproc, rounds=rounds, threads_per_proc=threads, optimizer="adamw",
                         backend="gloo" if not torch.cuda.is_available() else "nccl",
                         note="gloo emulates reduce-scatter: CPU throughput is not the point, memory per "
                              "process is")}


def run_sharding_cli(args) -> int:
    """`torchspeed bench --nproc N --parallel fsdp2`: measure, print a table, write the JSON."""
    from rich.console import Console
    from rich.table import Table

    steps = args.steps or (5 if args.quick else 10)
    batch = args.batch_size if args.batch_size != 128 else 16  # 128 is the image bench's default
    console = Console()
    console.print(f"[bold]torchspeed bench --nproc {args.nproc} --parallel fsdp2[/]: {args.model} on {args.data}, "
                  f"batch {batch} per process, AdamW, DDP vs FSDP2 (fresh torchrun job each)")
    load = other_runnable()
    # a ValueError / RuntimeError here reaches the CLI, which prints it as one line (cli/bench_run.py)
    result = measure_sharding(nproc=args.nproc, model=args.model, data=args.data, batch_size=batch,
                              steps=steps, rounds=args.rounds or 1)
    table = Table(title=f"memory per process, {args.nproc} processes")
    for col in ("parallel", "params + grads + AdamW state (MiB)", "peak RSS (MiB)", "peak RSS above base (MiB)",
                "samples/s"):
        table.add_column(col, justify="left" if col == "parallel" else "right")
    for mode, r in result["rows"].items():
        table.add_row(mode, " / ".join(f"{v:.1f}" for v in r["state_mib_per_rank"]),
                      " / ".join(f"{v:.0f}" for v in r["peak_rss_mib_per_rank"]),
                      " / ".join(f"{v:.0f}" for v in r["peak_over_base_mib_per_rank"]), f"{r['samples_per_s']:,.1f}")
    console.print(table)
    for name, ratio in result["ratios"].items():
        console.print(f"{name}: {ratio:.2f}x")
    console.print("gloo emulates reduce-scatter: CPU throughput is not the point here, memory per process is")
    path = args.json if args.json != "bench.json" else "bench_fsdp2.json"
    with open(path, "w") as f:
        json.dump({**result, "provenance": provenance(), "machine_load": {"other_runnable": load}}, f, indent=2)
    console.print(f"wrote {path}")
    return 0


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _state_bytes(trainer) -> tuple[int, int]:
    """(bytes of this rank's parameters + gradients + optimizer state, parameter count held)."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    params = [local(p) for p in trainer.module.parameters()]
    total = sum(p.numel() * p.element_size() for p in params)
    total += sum(local(p.grad).numel() * local(p.grad).element_size() for p in trainer.module.parameters()
                 if p.grad is not None)
    for st in trainer.optimizer.state.values():
        total += sum(local(v).numel() * local(v).element_size() for v in st.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total, sum(p.numel() for p in params)


def _worker(job: dict) -> None:
    """One rank of a measuring job (run by torchrun)."""
    torch.set_num_threads(job["threads"])
    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", 1))
    n_batches = job["warmup"] + job["steps"]
    train, _ = make_datasets(job["data"], train_size=job["batch_size"] * world * n_batches, val_size=16)
    reset = _reset_peak_rss()
    base = _rss_mib("VmRSS")  # torch, the data and the interpreter: the same in both modes
    cfg = TrainConfig(schedule=None, progress=False, compile=False, log_every=10**9, precision="fp32",
                      set_to_none=False, parallel=job["parallel"])  # set_to_none=False: gradients stay counted
    trainer = Trainer(create_model(job["model"]), optimizer="adamw", lr=1e-3, weight_decay=0.0, device="cpu",
                      config=cfg)
    loader = shard_loader(DataLoader(train, batch_size=job["batch_size"], shuffle=True, drop_last=True))
    it = itertools.cycle(list(trainer.batches(loader)))
    trainer.run_steps(it, job["warmup"])
    barrier()
    t0 = time.perf_counter()
    trainer.run_steps(it, job["steps"])
    barrier()
    seconds = time.perf_counter() - t0
    state, params = _state_bytes(trainer)
    peak = _rss_mib("VmHWM" if reset else "VmRSS")
    mine = {"state_mib": state / 2**20, "peak_rss_mib": peak, "peak_over_base_mib": peak - base, "params": params}
    everyone = [broadcast_object(mine, src=r) for r in range(world)]
    seen = all_reduce_sum([job["steps"] * job["batch_size"]])[0]
    if is_rank_zero():
        with open(job["out"], "w") as f:
            json.dump({"samples_per_s": seen / seconds, "seconds": seconds,
                       "state_mib": [e["state_mib"] for e in everyone],
                       "peak_rss_mib": [e["peak_rss_mib"] for e in everyone],
                       "peak_over_base_mib": [e["peak_over_base_mib"] for e in everyone],
                       "params": [e["params"] for e in everyone], "peak_reset": reset,
                       "decisions": {k: str(v) for k, v in trainer.decisions.items()
                                     if k in ("parallel", "distributed", "fsdp_blocks")}}, f)


if __name__ == "__main__":
    from torchspeed.train.parallel.rank_exit import exit_process

    _worker(json.loads(sys.argv[1]))
    exit_process(0)
