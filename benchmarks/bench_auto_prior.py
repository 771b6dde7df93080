"""Claim: `fit(recipe="auto")` with no LR, on a run too short for the optimizer trial, reaches a lower held-out loss
in the same steps (and seconds) with today's optimizer prior than with an earlier commit's.

The bench's byte-level GPT on the standard library's source (`bench_horizon.py`'s `gpt_text`: 4,096 windows of 128
bytes, batch 32), `fit(model, loader, recipe="auto", max_steps=N)` cold (an empty decision cache), as a user calls
it. Each run is its own process, on the source tree given (`--trees`: a worktree of each commit), the trees
alternated per (seed, steps) so a slow phase of the machine hits both. Per run: the held-out loss at the end, the
whole call's seconds, the optimizer, LR and schedule the plan took.

Run (two worktrees, e.g. `git worktree add --detach /tmp/before <commit>`):
    python benchmarks/bench_auto_prior.py --trees /tmp/before /tmp/after --steps 128 256 --seeds 0 1 \\
        --out benchmarks/results/cpu-avx512-bf16/auto_prior_gpt_wsd.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r'''
import json, math, sys, time, torch
from torch.utils.data import DataLoader
import torchspeed
from torchspeed.bench.text import byte_text_datasets
from torchspeed.bench.workloads import create_model
seed, steps = int(sys.argv[1]), int(sys.argv[2])
train, val = byte_text_datasets(train_size=4096, val_size=512, block_size=128, seed=seed)
torch.manual_seed(seed)
model = create_model("gpt")
loader = DataLoader(train, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(seed))
t0 = time.perf_counter()
res = torchspeed.fit(model, loader, epochs=math.ceil(steps / len(loader)), max_steps=steps, recipe="auto",
                     progress=False)
seconds = time.perf_counter() - t0
model.eval()
xs, ys = zip(*(val[i] for i in range(len(val))))
with torch.no_grad():
    x, y = torch.stack(xs), torch.stack(ys)
    loss = float(torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()))
d = res.decisions
print("AUTO_PRIOR " + json.dumps({"val_loss": loss, "seconds": seconds, "steps": res.steps,
      "optimizer": str(d["optimizer"].value), "lr": d["lr"].value, "schedule": str(d["schedule"].value)}))
'''


def one(tree: str, seed: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="torchspeed-auto-prior-") as cache:
        env = dict(os.environ, PYTHONPATH=str(Path(tree) / "src"), TORCHSPEED_CACHE_DIR=cache)
        out = subprocess.run([sys.executable, "-c", CHILD, str(seed), str(steps)], env=env, capture_output=True,
                             text=True, check=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("AUTO_PRIOR "))
    return json.loads(line[len("AUTO_PRIOR "):])


def commit(tree: str) -> str:
    return subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", nargs=2, required=True, help="the before and after source trees")
    ap.add_argument("--steps", nargs="+", type=int, default=[256])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    sys.path.insert(0, str(Path(a.trees[1]) / "src"))
    from torchspeed.bench.runner import provenance
    names = {"before": commit(a.trees[0]), "after": commit(a.trees[1])}
    runs = []
    for i, (seed, steps) in enumerate((s, n) for s in a.seeds for n in a.steps):
        order = [("before", a.trees[0]), ("after", a.trees[1])]
        for which, tree in (order if i % 2 == 0 else order[::-1]):
            r = one(tree, seed, steps) | {"which": which, "commit": names[which], "seed": seed}
            runs.append(r)
            print(f"{which} {names[which]} seed {seed} {steps} steps: val loss {r['val_loss']:.4f} "
                  f"{r['seconds']:.1f} s ({r['optimizer']}, lr {r['lr']}, {r['schedule']})", flush=True)
    result = {"benchmark": "auto_prior_gpt", "claim": __doc__.splitlines()[0], "commits": names,
              "command": "python benchmarks/bench_auto_prior.py --trees BEFORE AFTER --steps "
                         + " ".join(map(str, a.steps)) + " --seeds " + " ".join(map(str, a.seeds)),
              "provenance": provenance(), "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
