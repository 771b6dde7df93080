"""`torchspeed bench`: naive vs each technique vs all, on this machine, side by side."""

from __future__ import annotations

import os
import sys

from torchspeed.cli.main import CLIError


def register(sub) -> None:
    p = sub.add_parser("bench", help="train the default workload the naive way and the fast way, side by side")
    p.add_argument("--quick", action="store_true", help="fewer steps (under 2 minutes on 2 CPU cores)")
    p.add_argument("--data", default="synthetic", choices=["synthetic", "digits"],
                   help="synthetic (CIFAR-shaped, built in) or digits (scikit-learn's real handwritten digits)")
    p.add_argument("--model", default="resnet18", help="resnet18 | resnet34 | resnet50 | mlp (CIFAR variants)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=None, help="timed steps per config per round")
    p.add_argument("--rounds", type=int, default=None, help="interleaved measuring rounds")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--configs", default=None, help="comma-separated subset of configs (naive is always run)")
    p.add_argument("--json", default="bench.json", help="where to write the results JSON (default bench.json)")
    p.add_argument("--png", default=None, help="bar chart path (default: next to the JSON, .png)")
    p.add_argument("--no-preload", action="store_true", help="do not restart under tcmalloc even if available")
    p.add_argument("--nproc", type=int, default=None,
                   help="instead: N DistributedDataParallel processes against 1, as torchrun jobs (T31)")
    p.set_defaults(func=run)


def _maybe_reexec_with_tcmalloc(args) -> None:
    """On CPU, glibc malloc costs ~10% in training; restart this process under tcmalloc if present."""
    from torchspeed.env import allocator_in_use, find_tcmalloc

    if args.no_preload or os.environ.get("TORCHSPEED_NO_PRELOAD") or allocator_in_use() != "glibc":
        return
    if args.device == "cuda":
        return
    lib = find_tcmalloc()
    if not lib:
        return
    env = dict(os.environ, LD_PRELOAD=(lib + " " + os.environ.get("LD_PRELOAD", "")).strip(),
               TORCHSPEED_NO_PRELOAD="1")
    os.execve(sys.executable, [sys.executable, "-m", "torchspeed", "bench", *sys.argv[2:]], env)


def run(args) -> int:
    if args.batch_size <= 0:
        raise CLIError(f"--batch-size must be positive, got {args.batch_size}")
    if args.steps is not None and args.steps <= 0:
        raise CLIError(f"--steps must be positive, got {args.steps}")
    if args.nproc is not None:
        from torchspeed.bench.scaling import run_scaling_cli

        return run_scaling_cli(args)
    if sys.argv[1:2] == ["bench"]:
        _maybe_reexec_with_tcmalloc(args)
    from rich.console import Console
    from rich.table import Table

    from torchspeed.bench.runner import run_bench, write_results

    steps = args.steps or (3 if args.quick else 6)
    rounds = args.rounds or (2 if args.quick else 3)
    configs = args.configs.split(",") if args.configs else None
    console = Console()
    console.print(f"[bold]torchspeed bench[/]: {args.model} on {args.data}, batch {args.batch_size}, "
                  f"{rounds} interleaved rounds of {steps} steps per config after warm-up")
    try:
        result = run_bench(model=args.model, data=args.data, batch_size=args.batch_size, steps=steps, rounds=rounds,
                           warmup=1 if args.quick else 2, device=args.device, configs=configs,
                           eval_batches=2 if args.quick else None)
    except ValueError as e:
        raise CLIError(str(e)) from e
    table = Table(title=f"{result.workload} on {result.device} (allocator: {result.meta['allocator']})")
    for col in ("config", "samples/s", "speed-up", "train loss", "val acc"):
        table.add_column(col, justify="right" if col != "config" else "left")
    for r in result.rows:
        style = "bold red" if r.config == "all" else None
        table.add_row(r.config, f"{r.samples_per_s:,.1f}", f"{r.speedup:.2f}x", f"{r.train_loss:.4f}",
                      "-" if r.val_acc is None else f"{r.val_acc:.3f}", style=style)
    console.print(table)
    png = args.png or os.path.splitext(args.json)[0] + ".png"
    write_results(result, args.json, png)
    all_row = next(r for r in result.rows if r.config == "all")
    console.print(f"all: {all_row.speedup:.2f}x naive; decisions: "
                  + ", ".join(f"{k}={v}" for k, v in all_row.decisions.items()))
    console.print(f"wrote {args.json} and {png}")
    return 0
