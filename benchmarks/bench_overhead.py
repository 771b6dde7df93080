"""Claim: torchspeed's loop adds no measurable overhead over a hand-written loop with the same settings.

The Trainer with torchspeed's automatic choices ("all": auto precision, channels_last for
conv nets, fused SGD, set_to_none, loss read every 50 steps) against a plain hand-written
loop doing the same computation. Both train in this one process, interleaved in rounds
after a warm-up; the ratio is the median over rounds of (hand-written time / trainer time).
torch.compile is off in both (its decision is the same either way, and compile time would
dominate a short run).

Run:
    python benchmarks/bench_overhead.py                       # ResNet-18 (CIFAR), batch 128
    python benchmarks/bench_overhead.py --model mlp --batch-size 256 --steps 20   # worst case: tiny steps
Writes benchmarks/results/<device>/overhead_<model>.json with commit, versions and raw samples.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from torchspeed.bench.runner import provenance
from torchspeed.bench.workloads import create_model, make_datasets
from torchspeed.train import Trainer, TrainConfig, create_optimizer, has_conv2d, resolve_precision


class HandWritten:
    """The loop a careful user writes by hand with the same settings."""

    def __init__(self, model, loader, device, precision, lr):
        self.model = model.to(device)
        self.cl = has_conv2d(model)
        if self.cl:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.opt = create_optimizer("sgd", self.model, lr=lr, weight_decay=5e-4)  # fused SGD, same groups
        self.precision = resolve_precision(precision, device=device)
        self.loader, self.device = loader, device
        self.it = self._batches()

    def _batches(self):
        while True:
            for x, y in self.loader:
                x = x.to(self.device, non_blocking=True)
                if self.cl:
                    x = x.contiguous(memory_format=torch.channels_last)
                yield x, y.to(self.device, non_blocking=True)

    def steps(self, n):
        t0 = time.perf_counter()
        for _ in range(n):
            x, y = next(self.it)
            with self.precision.autocast():
                loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0


class Framework:
    def __init__(self, model, loader, device, lr):
        cfg = TrainConfig(compile=False, schedule=None, progress=False)
        self.trainer = Trainer(model, optimizer="sgd", lr=lr, device=device, config=cfg)
        self.loader = loader
        self.it = self._batches()

    def _batches(self):
        while True:
            yield from self.trainer.batches(self.loader)

    def steps(self, n):
        return self.trainer.run_steps(self.it, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="steps per round per loop")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    train, _ = make_datasets("synthetic", train_size=max(1024, args.batch_size * 8))
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    state = create_model(args.model).state_dict()

    def fresh():
        m = create_model(args.model)
        m.load_state_dict(state)
        return m

    fw = Framework(fresh(), loader, device, 0.05)
    hw = HandWritten(fresh(), loader, device, fw.trainer.precision.name, 0.05)
    fw.steps(2), hw.steps(2)  # warm-up, not timed
    t_fw, t_hw = [], []
    for k in range(args.rounds):
        # alternate which loop goes first, so drift within a round does not favour either
        order = [(fw, t_fw), (hw, t_hw)] if k % 2 == 0 else [(hw, t_hw), (fw, t_fw)]
        for loop, times in order:
            times.append(loop.steps(args.steps))
        print(f"round {k + 1}/{args.rounds}: trainer {t_fw[-1]:.3f}s  hand-written {t_hw[-1]:.3f}s", flush=True)
    ratios = [h / f for h, f in zip(t_hw, t_fw)]
    result = {
        "claim": "torchspeed Trainer ('all' settings) vs a hand-written loop with the same settings",
        "model": args.model, "batch_size": args.batch_size, "steps_per_round": args.steps, "rounds": args.rounds,
        "precision": fw.trainer.precision.name, "channels_last": fw.trainer.channels_last,
        "trainer_s": t_fw, "handwritten_s": t_hw,
        "trainer_over_handwritten_speed": statistics.median(ratios),
        "ratio_runs": ratios, **provenance(),
    }
    out = Path(args.out or f"benchmarks/results/{device.type}/overhead_{args.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"trainer speed / hand-written speed = {result['trainer_over_handwritten_speed']:.3f} "
          f"(median of {args.rounds} interleaved rounds; >= 0.97 means within 3%) -> {out}")


if __name__ == "__main__":
    main()
