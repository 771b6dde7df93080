"""How training throughput scales with DistributedDataParallel processes (T31), measured here.

`measure_scaling(nproc=2)` runs the same workload as torchrun jobs of 1 and N processes,
interleaved round by round (1, N, N, 1, ...), each timed after its own warm-up, and
reports samples/s per configuration and the ratio N-process / 1-process. Each process
trains on `batch_size` samples per step (weak scaling: the global batch grows with N,
which is how data parallelism is used).

On CPU two comparisons matter and both are measured:
- `1 proc x T threads` vs `N procs x T threads`: the data-parallel speed-up with N times
  the cores (ideal: N); what is lost is DDP's all-reduce and the process overhead.
- `1 proc x N*T threads` vs `N procs x T threads`: the same cores used by intra-op threads
  in one process, or by processes. That answers "is DDP worth it on this CPU machine?".

Within a job, `windows` timed windows of `steps` steps follow the warm-up; the job reports
the median window. Each job is a fresh `python -m torch.distributed.run` (a few seconds of start-up that is
not timed). `torchspeed bench --nproc N` and benchmarks/bench_distributed.py call this.

Example:
    >>> r = measure_scaling(nproc=2, model="mlp", steps=20)
    >>> r.ratios["2 procs / 1 proc"]
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

from torchspeed.bench.runner import provenance
from torchspeed.bench.workloads import create_model, make_datasets
from torchspeed.env import usable_cores
from torchspeed.train.config import TrainConfig
from torchspeed.train.loop.trainer import Trainer
from torchspeed.train.parallel.distributed import all_reduce_sum, barrier, is_rank_zero
from torchspeed.train.parallel.shard import shard_loader
from torchspeed.train.rounds import interleaved, paired_ratios

__all__ = ["ScalingRow", "ScalingResult", "measure_scaling", "run_scaling_cli"]


def _config_name(nproc: int, threads: int) -> str:
    """A configuration's label in the table and the JSON: "2 procs x 4 threads"."""
    return f"{nproc} proc{'s' if nproc > 1 else ''} x {threads} threads"


@dataclass(frozen=True)
class ScalingRow:
    """One configuration (`nproc` processes of `threads` intra-op threads each) and what its jobs measured. Its
    label and its median are derived from these fields, so a row cannot disagree with its own samples."""
    nproc: int
    threads: int
    samples: list[float]               # samples/s of each round's job, all processes together
    final_loss: float | None = None

    @property
    def name(self) -> str:
        return _config_name(self.nproc, self.threads)

    @property
    def samples_per_s(self) -> float:
        """The median over the rounds."""
        return statistics.median(self.samples)

    def to_dict(self) -> dict:
        return {"name": self.name, "nproc": self.nproc, "threads": self.threads, "samples_per_s": self.samples_per_s,
                "samples": list(self.samples), "final_loss": self.final_loss}


@dataclass(frozen=True)
class ScalingResult:
    rows: list[ScalingRow]
    ratios: dict[str, float]
    meta: dict

    def to_dict(self) -> dict:
        return {"rows": [r.to_dict() for r in self.rows], "ratios": self.ratios, "meta": self.meta}



def measure_scaling(*, nproc: int = 2, model: str = "mlp", data: str = "synthetic", batch_size: int = 64,
                    steps: int = 20, warmup: int = 3, rounds: int = 3, windows: int = 3, device: str = "cpu",
                    threads: int | None = None, same_cores_row: bool = True,
                    timeout_s: float = 600) -> ScalingResult:
    """Samples/s of 1-process and `nproc`-process DDP jobs, interleaved; see the module docstring."""
    if nproc < 2:
        raise ValueError(f"nproc must be at least 2 to compare with 1 process, got {nproc}")
    if device.startswith("cuda"):
        if torch.cuda.device_count() < nproc:
            raise ValueError(f"{nproc} processes need {nproc} GPUs; {torch.cuda.device_count()} visible")
        same_cores_row = False
    tpp = threads or max(1, usable_cores() // nproc)
    configs = [(1, tpp), (nproc, tpp)]  # (processes, threads each)
    if same_cores_row and device == "cpu":
        configs.append((1, tpp * nproc))
    spec = dict(model=model, data=data, batch_size=batch_size, steps=steps, warmup=warmup, windows=windows,
                device=device)
    losses: dict[tuple[int, int], float | None] = {}
    restarts: list[int] = []

    def job(n: int, t: int) -> float:
        out = _run_job(spec, nproc=n, threads=t, timeout_s=timeout_s)
        losses[(n, t)] = out.get("loss")
        restarts.append(out.get("attempts", 1) - 1)
        return out["samples_per_s"]

    # interleaved rounds, the order reversed every round so drift hits both sides
    times = interleaved({_config_name(*c): (lambda c=c: job(*c)) for c in configs}, rounds=rounds,
                        order="alternate").times
    restarted = sum(restarts)
    rows = [ScalingRow(n, t, times[_config_name(n, t)], losses.get((n, t))) for n, t in configs]
    base, multi = rows[0], rows[1]
    ratios = {f"{nproc} procs / 1 proc": multi.samples_per_s / base.samples_per_s}
    # Paired per round (the jobs of one round ran back to back): robust to slow drifts of the machine.
    per_round = {f"{nproc} procs / 1 proc, median of per-round ratios":
                 paired_ratios(multi.samples, base.samples)}
    if len(rows) > 2:
        ratios[f"{nproc} procs / 1 proc with the same cores"] = multi.samples_per_s / rows[2].samples_per_s
        per_round[f"{nproc} procs / 1 proc with the same cores, median of per-round ratios"] = paired_ratios(
            multi.samples, rows[2].samples)
    ratios.update({k: statistics.median(v) for k, v in per_round.items()})
    meta = dict(spec, nproc=nproc, rounds=rounds, threads_per_proc=tpp, usable_cores=usable_cores(),
                method="each row: a fresh torchrun job, timed after warm-up; rows interleaved, order alternating "
                       "each round; samples/s counts all processes; per-process batch fixed",
                jobs_restarted_after_a_crash=restarted)
    return ScalingResult(rows=rows, ratios=ratios, meta=dict(meta, per_round_ratios=per_round))


def run_scaling_cli(args) -> int:
    """`torchspeed bench --nproc N`: measure, print a table, write the JSON (rank 0 of each job reports)."""
    from rich.console import Console
    from rich.table import Table

    if args.nproc < 2:  # the CLI checks this first (a one-line error); a caller in Python gets a ValueError
        raise ValueError(f"--nproc compares N processes with 1: give N >= 2, got {args.nproc}")
    device = args.device or "cpu"
    steps = args.steps or (5 if args.quick else 20)
    rounds = args.rounds or (1 if args.quick else 3)
    console = Console()
    console.print(f"[bold]torchspeed bench --nproc {args.nproc}[/]: {args.model} on {args.data}, batch "
                  f"{args.batch_size} per process, {rounds} interleaved rounds of torchrun jobs, {steps} steps "
                  "per timed window")
    # a ValueError / RuntimeError here reaches the CLI, which prints it as one line (cli/bench_run.py)
    result = measure_scaling(nproc=args.nproc, model=args.model, data=args.data, batch_size=args.batch_size,
                             steps=steps, rounds=rounds, windows=2 if args.quick else 3, device=device)
    table = Table(title=f"DistributedDataParallel scaling on {device}")
    for col in ("config", "samples/s (all processes)", "vs 1 proc"):
        table.add_column(col, justify="left" if col == "config" else "right")
    for r in result.rows:
        table.add_row(r.name, f"{r.samples_per_s:,.1f}", f"{r.samples_per_s / result.rows[0].samples_per_s:.2f}x")
    console.print(table)
    for name, ratio in result.ratios.items():
        console.print(f"{name}: {ratio:.2f}x")
    path = args.json if args.json != "bench.json" else "bench_distributed.json"
    with open(path, "w") as f:
        json.dump({**result.to_dict(), "provenance": provenance()}, f, indent=2)
    console.print(f"wrote {path}")
    return 0


def _run_job(spec: dict, *, nproc: int, threads: int, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        job = dict(spec, out=out_path, threads=threads)
        out, attempts = _torchrun(["-m", "torchspeed.bench.scaling", json.dumps(job)], nproc=nproc, threads=threads,
                                  result=out_path, timeout_s=timeout_s)
        return dict(out, attempts=attempts)


# torchrun's failure summary: the first rank that failed, and how ("exitcode : -6 ... (SIGABRT)")
_ROOT_CAUSE_EXIT = re.compile(r"Root Cause.*?exitcode\s*:\s*(-?\d+)", re.DOTALL)


def _torchrun(cmd: list[str], *, nproc: int, threads: int, result: str, timeout_s: float,
              attempts: int = 2) -> tuple[dict, int]:
    """Run `cmd` (`script.py ARGS` or `-m module ARGS`) in `nproc` processes under torchrun; return the
    JSON that rank 0 wrote to `result`, and the number of attempts it took.

    Each rank's stdout and stderr go to files of their own (torchrun --redirects), and a failure
    quotes the failing ranks' stderr: torchrun's summary says which rank died of which signal,
    not why. A job whose first failing rank was killed by a signal (SIGABRT is what an uncaught
    C++ exception in gloo's transport thread becomes, SIGKILL what the OOM killer sends) is
    started again from scratch, up to `attempts` times, with a warning that quotes the crash; a
    rank that exits with an error, or a job still running after `timeout_s`, fails at once.
    """
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    for attempt in range(1, attempts + 1):
        log_dir = tempfile.mkdtemp(prefix="torchspeed-torchrun-")
        if os.path.exists(result):
            os.remove(result)  # a failed attempt's rank 0 may have written it: only a clean run counts
        try:
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                    "--log-dir", log_dir, "--redirects", "3", *cmd]
            try:
                proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired as e:
                raise RuntimeError(f"the {nproc}-process torchrun job did not finish in {timeout_s:.0f} s"
                                   f"{_rank_logs(log_dir)}") from e
            if proc.returncode == 0 and os.path.exists(result):
                with open(result) as f:
                    return json.load(f), attempt
            summary = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            failure = (f"the {nproc}-process torchrun job failed (exit {proc.returncode}, attempt {attempt} of "
                       f"{attempts}):\n{summary}{_rank_logs(log_dir)}")
        finally:
            shutil.rmtree(log_dir, ignore_errors=True)
        root = _ROOT_CAUSE_EXIT.search(proc.stdout + proc.stderr)
        if attempt == attempts or root is None or int(root.group(1)) >= 0:
            raise RuntimeError(failure)
        warnings.warn(f"{failure}\nstarting the job again", RuntimeWarning, stacklevel=2)
    raise AssertionError("unreachable")


def _rank_logs(log_dir: str, lines: int = 20) -> str:
    """The last `lines` of every rank's stderr that torchrun --redirects wrote under `log_dir`."""
    out = []
    for root, _, files in sorted(os.walk(log_dir)):
        if "stderr.log" in files:
            with open(os.path.join(root, "stderr.log"), errors="replace") as f:
                tail = f.read().strip().splitlines()[-lines:]
            if tail:
                out.append(f"\n--- rank {os.path.basename(root)} stderr ---\n" + "\n".join(tail))
    return "".join(out)


def _worker(job: dict) -> None:
    """One rank of a measuring job (run by torchrun)."""
    torch.set_num_threads(job["threads"])
    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", 1))
    n_batches = min(32, job["warmup"] + job["steps"])  # cycled: the data stays small in memory
    train, _ = make_datasets(job["data"], train_size=job["batch_size"] * world * n_batches, val_size=16)
    cfg = TrainConfig(schedule=None, progress=False, compile=False, log_every=10**9, distributed="auto")
    trainer = Trainer(create_model(job["model"]), lr=0.05, device=job["device"], config=cfg)
    loader = DataLoader(train, batch_size=job["batch_size"], shuffle=True, drop_last=True)
    if trainer.dist is not None:
        loader = shard_loader(loader)
    batches = list(trainer.batches(loader))  # on the device before timing: measure the training step
    it = itertools.cycle(batches)
    trainer.run_steps(it, job["warmup"])
    windows = []
    for _ in range(job.get("windows", 3)):
        barrier()
        t0 = time.perf_counter()
        trainer.run_steps(it, job["steps"])
        barrier()  # the step time is the slowest rank's
        windows.append(time.perf_counter() - t0)
    seconds = statistics.median(windows)
    seen = all_reduce_sum([job["steps"] * job["batch_size"]])[0]
    loss = float(trainer.meter.compute()["loss"])
    if is_rank_zero():
        with open(job["out"], "w") as f:
            json.dump({"samples_per_s": seen / seconds, "seconds": seconds, "windows": windows, "loss": loss,
                       "world": world}, f)


if __name__ == "__main__":
    from torchspeed.train.parallel.rank_exit import exit_process

    _worker(json.loads(sys.argv[1]))
    exit_process(0)  # not the interpreter teardown, which can abort a finished gloo rank
