"""Claim: a change to `fit` moves its whole-run speed against the zoo's plain loop, measured per form with two source
trees side by side.

For each zoo case named, each tree (`--trees BEFORE AFTER`: checkouts of two commits) runs in its own process: a
warm-up, then `--rounds` rounds of the zoo's plain loop and `fit` as ported (`zoo_run._timed_round`, K steps on
the same batches), interleaved, the order alternating; the tree's figure is the plain loop's median seconds over `fit`'s (above 1: `fit`
is faster). The trees alternate per case.

Run:
    python benchmarks/bench_zoo_pair.py --trees /tmp/before /tmp/after --cases hand/byol_momentum_target \\
        --steps 200 --rounds 5 --out benchmarks/results/cpu-avx512-bf16/zoo_pair.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHILD = r'''
import json, statistics, sys
sys.path.insert(0, sys.argv[1])
import zoo_run as z
case = z.registry()[sys.argv[2]]
batches = z.batches_for(case, int(sys.argv[3]))
z.warm_up(case, batches)
plain, fit = [], []
for r in range(int(sys.argv[4])):  # the order alternates round by round
    for way in (("plain", "fit") if r % 2 == 0 else ("fit", "plain")):
        (plain if way == "plain" else fit).append(z._timed_round(case, batches, way, 0.0)[0])
print("PAIR " + json.dumps({"plain_s": plain, "fit_s": fit,
                            "fit_vs_plain": statistics.median(plain) / statistics.median(fit)}))
'''


def rounds_in_child(case: str, steps: int, rounds: int, env: dict) -> dict:
    """`rounds` interleaved rounds of the plain loop and `fit` as ported on `case`, in a fresh process with `env`:
    {"plain_s", "fit_s", "fit_vs_plain"} (bench_zoo_recheck.py runs them too)."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(HERE), case, str(steps), str(rounds)], env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("PAIR "))[5:])


def one(tree: str, case: str, steps: int, rounds: int) -> dict:
    return rounds_in_child(case, steps, rounds, dict(os.environ, PYTHONPATH=str(Path(tree) / "src")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", nargs=2, required=True)
    ap.add_argument("--cases", nargs="+", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    sys.path.insert(0, str(Path(a.trees[1]) / "src"))
    from torchspeed.bench.runner import provenance
    commits = {w: subprocess.run(["git", "-C", t, "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip() for w, t in zip(("before", "after"), a.trees)}
    cases = {}
    for i, case in enumerate(a.cases):
        order = list(zip(("before", "after"), a.trees))
        for which, tree in (order if i % 2 == 0 else order[::-1]):
            r = cases.setdefault(case, {})[which] = one(tree, case, a.steps, a.rounds)
            print(f"{case} {which} {commits[which]}: fit {r['fit_vs_plain']:.3f}x the plain loop", flush=True)
    Path(a.out).write_text(json.dumps({"benchmark": "zoo_pair", "claim": __doc__.splitlines()[0], "commits": commits,
                                       "command": " ".join(["python benchmarks/bench_zoo_pair.py --trees BEFORE AFTER",
                                                            "--cases", *a.cases, "--steps", str(a.steps),
                                                            "--rounds", str(a.rounds)]),
                                       "provenance": provenance(), "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
