"""Claim: `fit(recipe="auto")` on a model with a sparse embedding trains it with SGD and no momentum on the sparse
weight (`train.optim.sparse_without_momentum`), each step as cheap as the last, where momentum there made each step
dearer than the one before (torch's SGD appends every step's rows to a sparse momentum buffer it never coalesces).

For each zoo model with a sparse embedding (benchmarks/zoo_hand.py), in one process, cold, the ways interleaved with
their order alternating after a warm-up: the plain loop (the script's own optimizer), auto with momentum on the
sparse weight (the groups as before), and auto as it is. Per way: the whole runs' seconds, the mean step over the
first and the last 50 steps, the training loss over the last tenth, and the plain loop's whole-run seconds over the
seconds to its last tenth's loss (`zoo_run.reach_seconds`).

Run:
    python benchmarks/bench_sparse_momentum.py --json benchmarks/results/cpu-avx512-bf16/sparse_momentum.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from zoo_run import batches_for, fit_run, plain_loop, registry, reach_seconds, warm_up, window  # noqa: E402

from torchspeed._io import write_json  # noqa: E402
from torchspeed.bench.runner import provenance  # noqa: E402
from torchspeed.train import optim  # noqa: E402

MODELS = {"hand/text_bag_sparse_sgd": 400, "hand/matrix_factorization_sparseadam": 266}  # the zoo sweeps' K


def _auto(case, batches, momentum: bool) -> dict:
    kept = optim.sparse_without_momentum
    if momentum:
        optim.sparse_without_momentum = lambda groups, sparse: groups
    try:
        curve: list = []
        sec = fit_run(case, batches, True, curve)[0]
    finally:
        optim.sparse_without_momentum = kept
    return {"seconds": sec, "curve": curve}


def one_model(name: str, steps: int, rounds: int) -> dict:
    case = registry(("hand",))[name]
    batches = batches_for(case, steps)
    warm_up(case, batches)
    runs: dict = {"plain": [], "auto_momentum": [], "auto": []}
    for r in range(rounds):
        for way in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            if way == "plain":
                sec, _, losses = plain_loop(case, batches)
                w = window(len(losses))
                runs[way].append({"seconds": sec, "target": sum(losses[-w:]) / w})
            else:
                runs[way].append(_auto(case, batches, momentum=way == "auto_momentum"))
    plain_s = statistics.median(x["seconds"] for x in runs["plain"])
    target = statistics.median(x["target"] for x in runs["plain"])
    w = window(steps)
    out = {"steps": steps, "plain_s": plain_s, "target_loss": target, "ways": {}}
    for way in ("auto_momentum", "auto"):
        rs = runs[way]
        reach = statistics.median(reach_seconds(x["curve"], target, w)[0] or float("inf") for x in rs)
        out["ways"][way] = {
            "seconds": [x["seconds"] for x in rs], "whole_vs_plain": plain_s / statistics.median(x["seconds"] for x in rs),
            "reach_vs_plain": plain_s / reach,
            "step_ms_first_50": [1000 * (x["curve"][49][0] - x["curve"][0][0]) / 49 for x in rs],
            "step_ms_last_50": [1000 * (x["curve"][-1][0] - x["curve"][-50][0]) / 49 for x in rs],
            "last_tenth_loss": [sum(b for _, b in x["curve"][-w:]) / w for x in rs]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    res = {"provenance": provenance(), "command": " ".join(sys.argv), "models": {}}
    for name, steps in MODELS.items():
        res["models"][name] = m = one_model(name, steps, args.rounds)
        print(name, f"plain {m['plain_s']:.2f} s, target {m['target_loss']:.3f}", {
            way: {k: [round(v, 3) for v in x] if isinstance(x, list) else round(x, 3) for k, x in row.items()}
            for way, row in m["ways"].items()}, flush=True)
    if args.json:
        write_json(args.json, res)


if __name__ == "__main__":
    main()
