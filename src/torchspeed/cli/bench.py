"""`torchspeed bench`'s parser (run by bench_run.py): by default the suite (bench/suite_run.py: time to target on
every registered workload, rows naive, fit, all, schedulefree, onecycle, auto and auto_warm, scored as AlgoPerf
does); with `--full` or any of the throughput bench's options, naive vs each technique vs all on one workload, side
by side (bench/runner.py), and its time to target (bench/time_to_target.py)."""

from __future__ import annotations

SHARED = ("json", "png", "seeds", "full")  # the suite's options and the throughput bench's alike
SUITE_ONLY = ("workloads", "rows", "time_limit")


def register(sub) -> None:
    p = sub.add_parser("bench", help="time to target on the workload suite (default), or the throughput bench "
                                     "(--full, or its options) on one workload")
    p.add_argument("--slim", action="store_true",
                   help="smaller models (not part of make bench): prune 50%% + fine-tune against the full model, a "
                        "distilled quarter-width student against one from scratch, on ResNet-20 and the digits CNN, "
                        "and distillation alone on a CNN and a small ViT on digit pairs (100 classes) "
                        "(--quick: 4 epochs; --seeds N; --json, default slim.json)")
    p.add_argument("--full", action="store_true",
                   help="the throughput bench instead of the suite: each technique on its own and all together "
                        "(ResNet-18 by default), then time to target where the data has one (make bench-full)")
    p.add_argument("--workloads", default=None,
                   help="suite: comma-separated workloads (default: every registered one: "
                        "cnn1d, mlp, transformer, digits_cnn, regression, char_lm)")
    p.add_argument("--rows", default=None,
                   help="suite: comma-separated rows (default naive,fit,all,schedulefree,onecycle,auto,auto_warm)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="suite: seconds after which no seed or workload starts (default 480); a workload still "
                        "running 90 s later stops and its seed's runs are dropped")
    p.add_argument("--quick", action="store_true",
                   help="fewer steps, batch 64, no torch.compile (throughput table in 2-3 minutes on 2 CPU cores; "
                        "time to accuracy on digits about 2 more)")
    p.add_argument("--data", default=None, choices=["synthetic", "digits", "text"],
                   help="synthetic (CIFAR-shaped, built in), digits (scikit-learn's real handwritten digits) or "
                        "text (bytes of the Python standard library's source, for gpt); default: the model's own")
    p.add_argument("--model", default=None,
                   help="resnet20 (CIFAR), resnet18/34/50 (torchvision; CIFAR stem under 64 px, ImageNet stem from "
                        "64 px; resnet18-small: the ImageNet stem on small images, as resnet18(num_classes=10) "
                        "builds it), mlp, gpt (a small byte-level GPT language model), or your own image model: "
                        "package.module:function or path/to/file.py:function (default resnet18; resnet20 with "
                        "--data digits)")
    p.add_argument("--image-size", type=int, default=32, help="square image side in pixels (default 32; 224 for "
                                                               "the ImageNet-sized GPU benchmark)")
    p.add_argument("--batch-size", type=int, default=128, help="default 128 (64 with --quick)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per config per round")
    p.add_argument("--rounds", type=int, default=None, help="interleaved measuring rounds")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--configs", default=None, help="comma-separated subset of configs (naive is always run)")
    p.add_argument("--json", default="bench.json", help="where to write the results JSON (default bench.json)")
    p.add_argument("--png", default=None, help="the suite's performance profile, or the throughput bench's bar "
                                               "chart (default: next to the JSON, .png)")
    p.add_argument("--no-compile", action="store_true", help="leave torch.compile out (rows and all)")
    p.add_argument("--no-hand", action="store_true",
                   help="leave out the hand-written ceiling (its settings search trains every combination)")
    p.add_argument("--nproc", type=int, default=None,
                   help="instead: N DistributedDataParallel processes against 1, as torchrun jobs (T31)")
    p.add_argument("--parallel", default="ddp", choices=["ddp", "fsdp2"],
                   help="with --nproc: fsdp2 compares memory per process of FSDP2 against DDP (default model gpt)")
    _time_to_target_options(p)
    classic = {k: v for k, v in vars(p.parse_args([])).items() if k not in SHARED + SUITE_ONLY}
    p.set_defaults(classic_defaults=classic)


def _time_to_target_options(p) -> None:
    """The throughput bench's time-to-target options (its accuracy or loss target, seeds, rows, ablation)."""
    p.add_argument("--target-acc", type=float, default=None,
                   help="time to accuracy: the validation accuracy naive, all and auto must end at (0-1; default "
                        "0.97 and 0.90 with --data digits, off otherwise; 0 switches it off)")
    p.add_argument("--target-loss", default=None,
                   help="time to a validation loss instead (language models): a number, or 'all' (or 'naive') for "
                        "the loss all (or naive, the plain loop) reaches in its default budget")
    p.add_argument("--no-tta", action="store_true", help="skip time to accuracy (as --target-acc 0)")
    p.add_argument("--seeds", type=int, default=None,
                   help="seeds per row (default 3): the suite's or time to accuracy's")
    p.add_argument("--tta-configs", default="naive,all,auto,auto_warm,schedulefree",
                   help="time to accuracy: which of naive, all, auto (cold cache, choosing counted), auto_warm "
                        "(the cache an earlier run left) and schedulefree (Schedule-Free AdamW at its defaults, "
                        "the switches of all) to run (default all five)")
    p.add_argument("--ablation", action="store_true",
                   help="time to accuracy: also leave each recipe part out (or add it) and find its budget")
