"""`torchspeed launch --nproc N -- CMD...`: start N training processes with torchrun (T31). Its parser and its runner
in one module: running it needs only the standard library (and torch for `--nproc gpu`).

A thin wrapper over PyTorch's own launcher (`python -m torch.distributed.run`): it turns
`python script.py ARGS` into `torchrun ... -m torchspeed.cli._rank script.py ARGS` (the
script unchanged, each rank then ended without the interpreter teardown that can abort a
finished DDP rank: `cli/_rank.py`), `torchspeed ARGS` into
`torchrun ... -m torchspeed ARGS` (the same interpreter and install as `launch` itself), and
any other command into `torchrun --no-python CMD`, passes the multi-node flags through, and
picks a sensible per-process thread count on CPU. Inside each process `fit` finds the
torchrun environment and trains with DistributedDataParallel; nothing else changes in the script.

What it costs: one process per device (a model copy each) and torchrun's agent process.

Examples:
    torchspeed launch --nproc 4 -- python train.py --epochs 10           # one machine, 4 GPUs
    torchspeed launch --nnodes 2 --nproc 8 --rdzv-endpoint head:29500 --rdzv-id job1 -- python train.py
    torchspeed launch --nproc 2 --dry-run -- python train.py              # print the torchrun command
    torchspeed launch --nproc 2 -- torchspeed train --data photos/ --device cpu   # the CLI trainer, 2 processes
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

from torchspeed.cli.main import CLIError
from torchspeed.env import usable_cores

__all__ = ["register", "run", "torchrun_command"]

RANK_ENTRY = "torchspeed.cli._rank"  # runs a `python` command's script or module, then exits cleanly


def register(sub) -> None:
    p = sub.add_parser("launch", help="run a training command in N processes with torchrun (DistributedDataParallel)",
                       description="Run CMD in N processes under torchrun; `fit` inside it trains with DDP. "
                                   "Put the command after `--`.")
    p.add_argument("--nproc", default=None,
                   help="processes on this machine: a number, or 'gpu' (one per GPU); required")
    p.add_argument("--nnodes", default="1", help="machines in the job (or a range MIN:MAX for elastic jobs)")
    p.add_argument("--node-rank", type=int, default=None, help="this machine's rank (static rendezvous)")
    p.add_argument("--master-addr", default=None, help="address of the node-rank 0 machine (static rendezvous)")
    p.add_argument("--master-port", type=int, default=None, help="a free port on that machine")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous (multi-node)")
    p.add_argument("--rdzv-id", default=None, help="a job id shared by all machines (multi-node)")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads per process (default: usable cores / nproc on this machine)")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command instead of running it")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after `--`: python train.py ARGS")



def torchrun_command(cmd: list[str], *, nproc: str | int, nnodes: str = "1", node_rank: int | None = None,
                     master_addr: str | None = None, master_port: int | None = None,
                     rdzv_endpoint: str | None = None, rdzv_id: str | None = None) -> list[str]:
    """The `python -m torch.distributed.run ...` argv that runs `cmd` in `nproc` processes per machine.

    Example:
        >>> torchrun_command(["python", "train.py", "--lr", "0.1"], nproc=2)[-3:]
        ['train.py', '--lr', '0.1']
    """
    if not cmd:
        raise CLIError("no command to launch: put it after `--`, e.g. `torchspeed launch --nproc 2 -- python train.py`")
    nproc = str(nproc)
    if not (nproc.isdigit() and int(nproc) > 0) and nproc not in ("gpu", "auto"):
        raise CLIError(f"--nproc must be a positive number or 'gpu', got {nproc!r}")
    if nproc == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise CLIError("--nproc gpu: no CUDA GPU is visible here; give a number (e.g. --nproc 2 on CPU)")
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", nproc]
    multi_node = nnodes not in ("1", "1:1")
    if rdzv_endpoint:
        argv += ["--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
                 "--rdzv-id", rdzv_id or "torchspeed"]
    elif master_addr or node_rank is not None:
        if node_rank is None or not master_addr:
            raise CLIError("a static multi-node launch needs both --master-addr and --node-rank "
                           "(or use --rdzv-endpoint HOST:PORT --rdzv-id JOB)")
        argv += ["--nnodes", nnodes, "--node-rank", str(node_rank), "--master-addr", master_addr]
        if master_port:
            argv += ["--master-port", str(master_port)]
    elif multi_node:
        raise CLIError(f"--nnodes {nnodes} needs a rendezvous: --rdzv-endpoint HOST:PORT --rdzv-id JOB "
                       "(or --master-addr HOST --node-rank R)")
    else:
        argv += ["--standalone"]  # one machine: a free port, no rendezvous server to set up
    first = os.path.basename(cmd[0])
    if first.startswith("python") or cmd[0] == sys.executable:
        rest = cmd[1:]
        if not rest:
            raise CLIError("`python` needs a script or `-m module` to run")
        # every rank runs the script through cli/_rank.py: unchanged, then ended by exit_process
        if rest[0] == "-m" and len(rest) >= 2:
            argv += ["-m", RANK_ENTRY, "-m", *rest[1:]]
        elif rest[0].startswith("-"):
            raise CLIError(f"cannot pass the python option {rest[0]!r} through torchrun; "
                           "launch `python script.py ...` or `python -m module ...`")
        else:
            if not os.path.isfile(rest[0]):
                raise CLIError(f"no such script: {rest[0]} (the command after `--` is run in every process)")
            argv += ["-m", RANK_ENTRY, *rest]
    elif cmd[0] == "torchspeed":
        # `torchspeed train ...`: this interpreter's torchspeed, found without the environment's bin/ on PATH
        argv += ["-m", "torchspeed", *cmd[1:]]
    else:
        argv += ["--no-python", *cmd]  # any other executable, run as is in every process
    return argv


def run(args) -> int:
    cmd = list(args.cmd)
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    if args.nproc is None:
        raise CLIError("give the number of processes: --nproc N (or --nproc gpu for one per GPU)")
    argv = torchrun_command(cmd, nproc=args.nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                            master_addr=args.master_addr, master_port=args.master_port,
                            rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id)
    env = dict(os.environ)
    if args.threads is not None or "OMP_NUM_THREADS" not in env:
        # torchrun's default is 1 thread per process; on CPU training that leaves cores idle.
        per_node = int(args.nproc) if str(args.nproc).isdigit() else None
        threads = args.threads or (max(1, usable_cores() // per_node) if per_node else 1)
        env["OMP_NUM_THREADS"] = str(threads)
    if args.dry_run:
        print(f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} " + shlex.join(argv))
        return 0
    try:
        return subprocess.call(argv, env=env)
    except KeyboardInterrupt:
        return 130
