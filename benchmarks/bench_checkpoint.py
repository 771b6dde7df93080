"""What a checkpoint costs: `save_checkpoint` (atomic, checksummed, fsynced) vs plain `torch.save`.

Claim: the safety of an atomic, checksummed, durable write costs one fsync plus one SHA-256 pass
over the file; this measures both against a plain `torch.save` to the same folder, for the
tiny MLP of the kill test and for ResNet-18 (CIFAR) with its SGD momentum state. Also the
load side: `load_checkpoint` (checksum + weights_only) vs `torch.load(weights_only=True)`.

Method: one warm-up, then N rounds with the candidates interleaved; medians and raw samples are
written to benchmarks/results/cpu/checkpoint.json with provenance (commit, versions, machine).

    python benchmarks/bench_checkpoint.py [--rounds 7] [--dir PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from torchspeed.bench.runner import provenance
from torchspeed.bench.workloads import resnet18_cifar
from torchspeed.train.state.checkpoint import load_checkpoint, save_checkpoint
from torchspeed.train.state.rng import capture_rng_state


def _state(model: nn.Module, x: torch.Tensor) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(x).sum().backward()
    opt.step()  # creates the momentum buffers, as in a real run
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": capture_rng_state(), "step": 1}


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default=None, help="folder to write to (default: a temporary folder)")
    args = ap.parse_args()
    torch.manual_seed(0)
    workloads = {
        "mlp_16x32x3": (nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 3)),
                        torch.randn(2, 16)),
        "resnet18_cifar": (resnet18_cifar(), torch.randn(2, 3, 32, 32)),
    }
    results = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        d = Path(tmp)
        for name, (model, x) in workloads.items():
            state = _state(model, x)
            cands = {
                "torch.save": lambda: torch.save(state, d / f"{name}.plain.pt"),
                "save_checkpoint": lambda: save_checkpoint(d / f"{name}.pt", state),
                "torch.load(weights_only)": lambda: torch.load(d / f"{name}.plain.pt", weights_only=True),
                "load_checkpoint": lambda: load_checkpoint(d / f"{name}.pt"),
            }
            for fn in cands.values():  # warm-up (and creates the files the loads read)
                fn()
            samples = {k: [] for k in cands}
            for _ in range(args.rounds):
                for k, fn in cands.items():
                    samples[k].append(_time(fn))
            med = {k: statistics.median(v) for k, v in samples.items()}
            size = (d / f"{name}.pt").stat().st_size
            results[name] = {"bytes": size, "median_s": med, "samples_s": samples,
                             "save_ratio": med["save_checkpoint"] / med["torch.save"],
                             "load_ratio": med["load_checkpoint"] / med["torch.load(weights_only)"]}
            print(f"{name}: {size / 2**20:.2f} MiB  " + "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med.items())
                  + f"  save x{results[name]['save_ratio']:.2f} load x{results[name]['load_ratio']:.2f}")
    out = Path(__file__).parent / "results" / "cpu" / "checkpoint.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "checkpoint", "rounds": args.rounds, "provenance": provenance(),
                               "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
