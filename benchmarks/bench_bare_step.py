"""Claim: `fit` steps torch's other optimizers (SparseAdam, a sparse SGD, RMSprop, Adadelta, ...) without torch's
per-step wrapper and clears their gradients without `zero_grad`'s, so a small model under them trains in `fit` as
fast as in its own loop (T51; `train/trial/dynamo_deferred.py`: `torch_step`, `train/optim_kernel.py`: `zero_grad`).

The zoo's hand-written models whose optimizer no lean kernel takes (benchmarks/zoo_hand.py), each trained three
ways in one process, interleaved in rounds after a warm-up, the order rotated each round:

- `plain`: the script's own loop (`zoo_run.plain_loop`: forward, loss, backward, step, zero_grad);
- `fit_wrapped`: `fit` as ported with `lean_step=False`: torch's `step()` and `zero_grad()`, wrapper and all (what
  `fit` did for these optimizers before; the bench's naive row keeps it);
- `fit`: `fit` as ported.

Each model trains the steps of a run of about 1 s (`zoo_run.steps_for`, as the zoo's `--min-run-s 1`). Per way the
JSON has every round's seconds and, against plain, the median over rounds of the ratio within a round (plain
seconds / the way's: above 1 is faster). Nothing is asserted.

Run:
    python benchmarks/bench_bare_step.py --out benchmarks/results/<cpu kind>/bare_step.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import zoo_run  # noqa: E402
from zoo_report import provenance  # noqa: E402

CASES = ("hand/text_bag_sparse_sgd", "hand/matrix_factorization_sparseadam", "hand/mlp_rmsprop",
         "hand/mnist_cnn_adadelta")
WAYS = ("plain", "fit_wrapped", "fit")


def one(case, batches, way: str) -> float:
    if way == "plain":
        return zoo_run.plain_loop(case, batches)[0]
    extra = {"lean_step": False} if way == "fit_wrapped" else {}
    saved = case.fit_kwargs
    case.fit_kwargs = {**saved, **extra}
    try:
        return zoo_run.fit_run(case, batches, auto=False)[0]
    finally:
        case.fit_kwargs = saved


def measure(name: str, rounds: int) -> dict:
    case = zoo_run.registry(("hand",))[name]
    steps = zoo_run.steps_for(12, zoo_run.plain_loop(case, zoo_run.batches_for(case, 12))[0], 1.0, 400)
    batches = zoo_run.batches_for(case, steps)
    zoo_run.warm_up(case, batches)
    for way in WAYS:  # the warm-up round: nothing counted
        one(case, batches, way)
    seconds = {w: [] for w in WAYS}
    for r in range(rounds):
        for way in WAYS[r % 3:] + WAYS[:r % 3]:
            seconds[way].append(one(case, batches, way))
    vs = {w: statistics.median(p / s for p, s in zip(seconds["plain"], seconds[w])) for w in WAYS if w != "plain"}
    return {"steps": steps, "rounds": rounds, "seconds": seconds, "vs_plain": vs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--cases", nargs="+", default=list(CASES))
    ap.add_argument("--out", default="bare_step.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = {}
    for name in args.cases:
        rows[name] = measure(name, args.rounds)
        print(name, {w: round(v, 3) for w, v in rows[name]["vs_plain"].items()}, flush=True)
    out = {**provenance("host", 0, " ".join(["python", *sys.argv])), "ways": WAYS, "models": rows,
           "seconds": round(time.perf_counter() - t0, 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
