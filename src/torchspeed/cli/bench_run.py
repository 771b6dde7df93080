"""Runs `torchspeed bench` (imported only when it runs): the suite (bench/suite_run.py) by default, `--slim`, or
the throughput bench on one workload (bench/runner.py) and its time to target (bench/time_to_target.py), each
table printed and the results written.

The bench modules are read as attributes when called (`runner.run_bench`, `time_to_target.run_time_to_target`,
`slim.run_slim_bench`): tests patch them in their homes."""

from __future__ import annotations

import importlib.util
import os

from rich.console import Console
from rich.table import Table

from torchspeed._io import write_json
from torchspeed.bench import runner, slim, suite_report, suite_run, time_to_target
from torchspeed.bench.compare import describe_comparison
from torchspeed.bench.scaling import run_scaling_cli
from torchspeed.bench.sharding import run_sharding_cli
from torchspeed.bench.workloads import MODELS, check_workload, default_data
from torchspeed.cli.bench import SUITE_ONLY
from torchspeed.cli.main import CLIError
from torchspeed.model.spec import build_model, is_custom, portable_spec


def run(args) -> int:
    if getattr(args, "slim", False):
        return run_slim_cli(args)
    given = [d for d, default in getattr(args, "classic_defaults", {}).items() if getattr(args, d, default) != default]
    if args.seeds is not None and args.seeds <= 0:
        raise CLIError(f"--seeds must be positive, got {args.seeds}")
    if args.time_limit is not None and args.time_limit <= 0:
        raise CLIError(f"--time-limit must be positive, got {args.time_limit:g}")
    if not (args.full or given):
        return run_suite_cli(args)
    suite_only = [f"--{d.replace('_', '-')}" for d in SUITE_ONLY if getattr(args, d, None) is not None]
    if suite_only:
        raise CLIError(f"{', '.join(suite_only)} belong to the suite: leave out --full and "
                       + ", ".join(f"--{d.replace('_', '-')}" for d in given or ["full"]))
    args.seeds = args.seeds or 3
    return run_throughput(args)


def run_slim_cli(args) -> int:
    """--slim (bench/slim.py): prune + fine-tune and distillation, time and accuracy, on 4 workloads."""
    seeds = tuple(range(args.seeds)) if args.seeds else (0,)
    result = slim.run_slim_bench(seeds=seeds, epochs=4 if args.quick else 15)
    print(slim.slim_table(result))
    path = "slim.json" if args.json == "bench.json" else args.json
    write_json(path, result)
    print(f"wrote {path} ({result['meta']['seconds']:.0f} s)")
    return 0


def run_suite_cli(args) -> int:
    """The suite (bench/suite_run.py): its table first (bench/suite_report.py), then the JSON and the performance profile."""
    console = Console()
    split = (lambda v: [x.strip() for x in v.split(",") if x.strip()] if v else None)  # noqa: E731
    seeds = tuple(range(args.seeds)) if args.seeds else suite_run.DEFAULT_SEEDS
    limit = suite_run.TIME_LIMIT_S if args.time_limit is None else args.time_limit
    console.print(f"[bold]torchspeed bench[/]: time to target on the suite, {len(seeds)} seeds, rows rotated per "
                  f"seed; a seed starts only where it fits in {limit:.0f} s (`--full`: the throughput bench)")
    try:
        result = suite_run.run_suite(workloads=split(args.workloads), rows=split(args.rows) or suite_run.ROWS,
                                     seeds=seeds, time_limit_s=limit, console=console)
    except ValueError as e:
        raise CLIError(str(e)) from e
    suite_report.print_suite(console, result)
    png = args.png or os.path.splitext(args.json)[0] + ".png"
    note = suite_report.write_suite(result, args.json, png)
    console.print(f"wrote {args.json}" + (f"; {note}" if note else f" and {png}")
                  + f" ({result['seconds']:.0f} s)")
    return 0


def _check_sizes(args) -> None:
    if args.batch_size <= 0:
        raise CLIError(f"--batch-size must be positive, got {args.batch_size}")
    if args.steps is not None and args.steps <= 0:
        raise CLIError(f"--steps must be positive, got {args.steps}")
    if args.image_size < 8:
        raise CLIError(f"--image-size must be at least 8, got {args.image_size}")


def _time_to_target(args, console, result, batch: int, targets, loss_target, tta_configs) -> None:
    """The throughput run's time to target, attached to its result and printed."""
    by_loss = args.target_loss is not None
    tta = time_to_target.run_time_to_target(model=args.model, data=args.data,
                             targets=(loss_target,) if loss_target else targets,
                             metric="val_loss" if by_loss else "val_acc",
                             target_from=(args.target_loss if args.target_loss in ("all", "naive") else None),
                             seeds=args.seeds, batch_size=batch, configs=tta_configs, device=args.device,
                             compile=not (args.quick or args.no_compile), train_size=result.meta.get("train_size"),
                             image_size=args.image_size, busy=result.meta.get("busy"), ablation=args.ablation)
    time_to_target.attach_time_to_target(result, tta)
    print_time_to_target(console, tta)


def run_throughput(args) -> int:
    """The throughput bench on one workload (`--full`, or any of its options), then its time to target."""
    _check_sizes(args)
    sharding = _check_workload(args)
    targets, loss_target, tta_on, tta_configs = _time_to_target_args(args)
    if args.nproc is not None:
        if args.nproc < 2:
            raise CLIError(f"--nproc compares N processes with 1: give N >= 2, got {args.nproc}")
        try:
            return run_sharding_cli(args) if sharding else run_scaling_cli(args)
        except (ValueError, RuntimeError) as e:  # a bad combination or a failed rank: one line, no traceback
            raise CLIError(str(e)) from e
    # --quick: batch 64 and no torch.compile (its ~40 s of compilation on 2 CPU cores alone would
    # exceed the quick budget); 4 rounds of 3 steps, enough pairs for all/hand's interval (2
    # rounds of 2 steps read all/hand anywhere from 0.90 to 1.01 on idle cores here).
    steps = args.steps or (3 if args.quick else 2)
    rounds = args.rounds or (4 if args.quick else 3)
    batch = args.batch_size if args.batch_size != 128 or not args.quick else 64
    configs = args.configs.split(",") if args.configs else None
    console = Console()
    console.print(f"[bold]torchspeed bench[/]: {args.model} on {args.data}, batch {batch}, "
                  f"{rounds} interleaved rounds of {steps} steps per config after warm-up"
                  + (f"; then time to target ({', '.join(tta_configs)}, {args.seeds} seeds)" if tta_on else ""))
    try:
        result = runner.run_bench(model=args.model, data=args.data, batch_size=batch, steps=steps, rounds=rounds,
                           warmup=1, device=args.device, configs=configs, eval_batches=1 if args.quick else 2,
                           compile=not (args.quick or args.no_compile), hand=not args.no_hand,
                           image_size=args.image_size)
    except ValueError as e:
        raise CLIError(str(e)) from e
    _print_throughput(console, result, tta_on)
    if tta_on:  # time to target (bench/time_to_target.py): the shortest budget per config that ends at the target
        _time_to_target(args, console, result, batch, targets, loss_target, tta_configs)
    png = args.png or os.path.splitext(args.json)[0] + ".png"
    runner.write_results(result, args.json, png)
    all_row = next((r for r in result.rows if r.config == "all"), None)
    if all_row is not None:
        console.print(f"all: {all_row.speedup:.2f}x naive; decisions: "
                      + ", ".join(f"{k}={v['value'] if isinstance(v, dict) and 'value' in v else v}"
                                  for k, v in all_row.decisions.items()))
    console.print(f"wrote {args.json} and {png}")
    return 0


def _check_workload(args) -> bool:
    """--model and --data, checked and filled in (a custom model imported once here); True for --parallel fsdp2."""
    # --data digits alone: ResNet-20, the CIFAR-sized net that trains to 90% on them in seconds per seed.
    sharding = getattr(args, "parallel", "ddp") == "fsdp2"
    if sharding and args.nproc is None:
        raise CLIError("--parallel fsdp2 compares N sharded processes with N DDP processes: add --nproc 2")
    args.model = args.model or ("gpt" if sharding else "resnet20" if args.data == "digits" else "resnet18")
    if is_custom(args.model):
        try:  # import it here, so a mistake is one line now and not a worker's traceback later
            build_model(args.model, num_classes=10)
        except ValueError as e:
            raise CLIError(str(e)) from None
        args.model = portable_spec(args.model)  # the bench's worker processes import it too
    elif args.model not in MODELS:
        raise CLIError(f"--model {args.model}: not one of {', '.join(MODELS)}, nor package.module:function")
    args.data = args.data or default_data(args.model)
    try:
        check_workload(args.model, args.data)
    except ValueError as e:
        raise CLIError(str(e)) from e
    return sharding


def _time_to_target_args(args):
    """--target-acc, --target-loss and --tta-configs, checked: (targets, loss target, on, configs)."""
    try:
        targets = time_to_target.resolve_targets(args.data, args.target_acc,
                                                 off=args.no_tta or args.target_loss is not None)
    except ValueError as e:
        raise CLIError(str(e)) from e
    loss_target = None
    if args.target_loss is not None and not args.no_tta:
        if args.target_loss not in ("all", "naive"):
            try:
                loss_target = float(args.target_loss)
            except ValueError:
                raise CLIError(f"--target-loss takes a number, 'all' or 'naive', got {args.target_loss!r}") from None
            if loss_target <= 0:
                raise CLIError(f"--target-loss must be positive, got {loss_target:g}")
    tta_on = bool(targets) or (args.target_loss is not None and not args.no_tta)
    tta_configs = tuple(c.strip() for c in args.tta_configs.split(",") if c.strip())
    if set(tta_configs) - set(time_to_target.CONFIGS) or not tta_configs:
        raise CLIError(f"--tta-configs {args.tta_configs!r}: choose from {', '.join(time_to_target.CONFIGS)}")
    if tta_on and args.target_loss in ("all", "naive") and args.target_loss not in tta_configs:
        raise CLIError(f"--target-loss {args.target_loss} is the loss the {args.target_loss} row reaches: add "
                       f"{args.target_loss} to --tta-configs")
    if tta_on and "schedulefree" in tta_configs and importlib.util.find_spec("schedulefree") is None:
        raise CLIError("the schedulefree row needs the schedulefree package: pip install 'torchspeed[schedulefree]', "
                       "or leave it out with --tta-configs naive,all,auto,auto_warm")
    return targets, loss_target, tta_on, tta_configs


def _print_throughput(console, result, tta_on: bool) -> None:
    """The throughput table, then what all/hand measured."""
    table = Table(title=f"{result.workload} on {result.device}")
    show_mfu = any(r.mfu is not None for r in result.rows)
    for col in ("config", "samples/s", "speed-up", "train loss") + (("MFU",) if show_mfu else ()):
        table.add_column(col, justify="right" if col != "config" else "left")
    for r in result.rows:
        style = "bold red" if r.config == "all" else "bold" if r.config == "hand" else None
        if r.samples_per_s is None:  # the technique cannot act on this model (the reason is in the JSON)
            cells = [r.config, "n/a", "n/a", "n/a"]
        else:
            cells = [r.config, f"{r.samples_per_s:,.1f}", f"{r.speedup:.2f}x", f"{r.train_loss:.4f}"]
        if show_mfu:
            cells.append("-" if r.mfu is None else f"{r.mfu:.1%}")
        table.add_row(*cells, style=style)
    console.print(table)
    console.print("speed only: the loss after the same steps checks the numerics; accuracy is judged by "
                  "time to target" + ("" if tta_on else " (skipped here)"))
    hand_row = next((r for r in result.rows if r.config == "hand"), None)
    if hand_row is not None:
        console.print(f"hand: the best hand-written loop found here was {hand_row.decisions.get('hand_settings')}")
    if "all_over_hand" in result.meta:
        console.print(f"[bold]all/hand: {result.meta['all_over_hand']:.2f}x[/] (median of per-round ratios): "
                      + describe_comparison(result.meta["all_over_hand_interval"], candidate="all",
                                            baseline="the best hand-written loop"))


def print_time_to_target(console, tta) -> None:
    """One table per target: budget, samples, training time, choosing time, their total, final metric per seed."""
    m = tta.meta
    for e in tta.targets:
        better = "<=" if e["metric"] == "val_loss" else ">="
        table = Table(title=f"time to {e['metric']} {better} {e['target']:.4g}: {e['workload']}, batch "
                            f"{m.get('batch_size')}, {len(tta.seeds)} seeds; the shortest one-cycle budget that ends "
                            "there on every seed; every config from an empty cache but auto_warm")
        for col in ("config", "budget (steps)", "samples", "train (s)", "choosing (s)", "total (s)",
                    e["metric"] + " per seed"):
            table.add_column(col, justify="left" if col == "config" else "right")
        for name, c in e["configs"].items():
            vals = ", ".join("-" if v is None else f"{v:.3f}" for v in c[e["metric"]])
            if c["budget_steps"] is None:
                table.add_row(name, f"not reached (<= {max(c['budgets_tried'])})", "-", "-", "-", "-", vals)
                continue
            table.add_row(name, str(c["budget_steps"]), f"{c['samples_to_target']:,}", f"{c['train_time_s']:.1f}",
                          f"{c['tuning_time_s']:.1f}", f"{c['total_time_s']:.1f}", vals,
                          style="bold red" if name == "auto" else None)
        console.print(table)
        for key, label in (("auto_vs_all", "auto vs all"), ("auto_vs_naive", "auto vs naive"),
                           ("auto_warm_vs_all", "auto (warm cache) vs all")):
            av = e.get(key)
            if not av:
                continue
            iv = av["tuning_included_interval"]
            console.print(f"[bold]{label}[/]: {av['tuning_included']:.2f}x sooner with choosing counted (per seed "
                          f"{iv['low']:.2f}-{iv['high']:.2f}); {av['samples']:.2f}x fewer samples, "
                          f"{av['train_time']:.2f}x less training time; choosing {av['tuning_share'] or 0:.0%} "
                          "of its time")
        sb = e.get("auto_at_naive_budget")
        if sb:
            console.print(f"[bold]auto at naive's budget[/] ({sb['budget_steps']} steps): {sb['metric']} "
                          + ", ".join(f"{x:.3f}" for x in sb["auto"]) + " against naive's "
                          + ", ".join(f"{x:.3f}" for x in sb["naive"])
                          + f" ({'not below' if sb['not_worse'] else 'below'} naive on average; "
                            f"{sb['seeds_not_worse']}/{len(sb['auto'])} seeds)")
    for row in tta.ablation:
        console.print(f"ablation: auto {row['variant']}: budget {row['budget_steps'] or 'not reached'}"
                      + (f" ({row['steps_vs_auto']:.2f}x auto's steps)" if row.get("steps_vs_auto") else ""))
