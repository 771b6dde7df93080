"""Claim: `fit`'s lean Adam/AdamW update a piece at a time (`train/lean_kernels.adam_chunked`) takes less time than
the same foreach ops over the whole lists, on the zoo's models, inside whole runs of `fit` as ported.

For each zoo model named, in one process: a warm-up, then `--rounds` runs of `fit` as ported (the zoo's own
AdamW, K steps on the same batches), alternating between the pieces on (`lean_schedulefree.CHUNK` = 2^19) and off
(a piece larger than any model: the whole lists), the order swapped each round. Each run records its whole
seconds, its median step (between `on_step_end` calls) and its median lean update (`LeanStep.step`, the steps
after the first two). Both give the same numbers (tests/train/test_lean_chunks.py), so only time is compared.

Run:
    python benchmarks/bench_lean_chunks.py --models timm/gernet_s timm/cspresnet50 --steps 24 --rounds 6 \\
        --out benchmarks/results/cpu-avx512-bf16/lean_chunks.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

WAYS = {"whole": 1 << 40, "pieces": 1 << 19}


def _runs(name: str, steps: int, rounds: int) -> dict:
    import torchspeed
    import zoo_run as z
    from torchspeed.train import lean_schedulefree
    from torchspeed.train.loop import lean_step
    from torchspeed.train.loop.callbacks import Callback

    case = z.registry()[name]
    batches = z.batches_for(case, steps)
    z.warm_up(case, batches)
    updates: list[float] = []
    step = lean_step.LeanStep.step

    def timed(self):
        t0 = time.perf_counter()
        done = step(self)
        updates.append(time.perf_counter() - t0)
        return done

    class Clock(Callback):
        def __init__(self):
            self.at: list[float] = []

        def on_step_end(self, trainer) -> None:
            self.at.append(time.perf_counter())

    def run(chunk: int) -> dict:
        lean_schedulefree.CHUNK = chunk
        model, clock = z.fresh(case), Clock()
        updates.clear()
        kw = dict(case.fit_kwargs, max_steps=steps, progress=False, optimizer=case.optimizer(model), callbacks=[clock])
        os.environ["TORCHSPEED_CACHE_DIR"] = tempfile.mkdtemp(prefix="lean-chunks-")
        z.seed(z.RUN_SEED)
        t0 = time.perf_counter()
        torchspeed.fit(model, z.loader(batches, case.fresh_batches), **kw)
        seconds = time.perf_counter() - t0
        gaps = [b - a for a, b in zip(clock.at, clock.at[1:])]
        return {"seconds": round(seconds, 4), "step_ms": round(statistics.median(gaps) * 1e3, 3),
                "update_ms": round(statistics.median(updates[2:]) * 1e3, 3) if len(updates) > 2 else None}

    lean_step.LeanStep.step = timed
    out: dict = {w: [] for w in WAYS}
    try:
        for r in range(rounds):
            for way in (list(WAYS) if r % 2 == 0 else list(WAYS)[::-1]):
                out[way].append(run(WAYS[way]))
    finally:
        lean_step.LeanStep.step = step
        lean_schedulefree.CHUNK = WAYS["pieces"]
    med = {w: {k: statistics.median(x[k] for x in v if x[k] is not None) for k in ("seconds", "step_ms", "update_ms")}
           for w, v in out.items()}
    return {"runs": out, "median": med,
            "update_whole_over_pieces": round(med["whole"]["update_ms"] / med["pieces"]["update_ms"], 3),
            "run_whole_over_pieces": round(med["whole"]["seconds"] / med["pieces"]["seconds"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", required=True)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from torchspeed.bench.runner import provenance

    result = {"benchmark": "lean_chunks", "claim": __doc__.split("\n\n")[0], "provenance": provenance(),
              "command": f"python benchmarks/bench_lean_chunks.py --models {' '.join(a.models)} --steps {a.steps} "
                         f"--rounds {a.rounds}", "models": {}}
    for name in a.models:
        r = result["models"][name] = _runs(name, a.steps, a.rounds)
        print(f"{name}: update {r['median']['whole']['update_ms']:.2f} -> {r['median']['pieces']['update_ms']:.2f} ms "
              f"({r['update_whole_over_pieces']:.2f}x), run {r['median']['whole']['seconds']:.3f} -> "
              f"{r['median']['pieces']['seconds']:.3f} s ({r['run_whole_over_pieces']:.2f}x)", flush=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
