"""The optimizer prior by the run's length and the model's kind (T14's alternative, Schedule-Free AdamW, against the
one-cycle optimizers): what `fit(recipe="auto")` takes when the run cannot afford the optimizer trial and no earlier
run measured one (`plan/recipe_optimizer.py`).

`PRIOR` is measured, not assumed: `benchmarks/bench_horizon.py` trains each workload of the suite and two of the
bench's (an image CNN, a 1D CNN, a tabular MLP, a regression, a transformer, a GRU language model, ResNet-20, a GPT)
cold through `fit`, at run lengths from an eighth of its default steps to twice them, with each optimizer a prior
could take without measuring: Schedule-Free AdamW at the width rule's LR, AdamW and SGD at their default LRs with a
one-cycle schedule, and AdamW with warmup-stable-decay or a linear decay to zero (at its default LR, and with WSD at
the width rule's). A winner with its own schedule reads "adamw+wsd" (`prior_parts`). `table_from` turns its JSON
into the table: per model kind and run-length bucket, the candidate with the best final held-out metric on most
(workload, length) pairs, where it did no worse than Schedule-Free on the workload's shorter runs (`_anytime`)
(docs/recipe.md, "The optimizer prior by run length", with the JSON). A test checks that `PRIOR` is what the
committed JSON says.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from torch import nn

from torchspeed.train.optim import has_attention
from torchspeed.train.trial.memory_format import has_conv

__all__ = ["KINDS", "BUCKETS", "TIE", "PRIOR", "model_kind", "table_from", "horizon_prior", "prior_parts"]

KINDS = ("language model", "attention", "recurrent", "conv", "mlp")
BUCKETS = (64, 256, 1024, None)  # run-length buckets, in optimizer steps: up to each edge (None: longer)
# the bench's candidates as the table names them: fit's optimizer name, "+" the schedule where it is not the plan's
NAMES = {"sf": "schedulefree", "adamw": "adamw", "sgd": "sgd", "adamw_wsd": "adamw+wsd", "adamw_linear": "adamw+linear",
         "adamw_constant": "adamw+constant", "adamw_wsd_width": "adamw+wsd+width"}
_RECURRENT = (nn.RNNBase, nn.RNNCellBase)

# kind -> ((bucket edge, winner, its wins, the (workload, length) pairs measured), ...): `table_from` of
# benchmarks/results/cpu-avx512-bf16/horizon*.json (a bucket nothing was measured in is left out)
PRIOR: dict[str, tuple[tuple[int | None, str, int, int], ...]] = {
    "language model": ((64, "adamw+wsd", 2, 3), (256, "adamw+wsd", 2, 2), (1024, "adamw+wsd", 2, 2)),
    "attention": ((64, "schedulefree", 1, 1), (256, "schedulefree", 2, 2), (1024, "schedulefree", 2, 2)),
    "recurrent": ((256, "schedulefree", 2, 2), (1024, "schedulefree", 2, 2), (None, "schedulefree", 1, 1)),
    "conv": ((64, "schedulefree", 6, 6), (256, "schedulefree", 6, 6), (1024, "schedulefree", 2, 2)),
    "mlp": ((64, "schedulefree", 3, 3), (256, "schedulefree", 4, 4), (1024, "schedulefree", 3, 3)),
}


def model_kind(model: nn.Module) -> str:
    """The model's kind as the prior reads it: "language model" (attention, and a last linear layer whose outputs
    are an embedding's vocabulary: a GPT's or a BERT's head), "attention" (an attention module or a
    LayerNorm/RMSNorm: `train.optim.has_attention`), "recurrent" (an RNN, LSTM or GRU), "conv" (a convolution),
    else "mlp"."""
    mods = list(model.modules())
    if has_attention(model):
        return "language model" if _vocabulary_head(mods) else "attention"
    if any(isinstance(m, _RECURRENT) for m in mods):
        return "recurrent"
    if has_conv(model):
        return "conv"
    return "mlp"


def _vocabulary_head(mods: list[nn.Module]) -> bool:
    """The last linear layer predicts an embedding's tokens (a language model's head, tied or not)."""
    vocab = {m.num_embeddings for m in mods if isinstance(m, nn.Embedding) and m.num_embeddings > 2}
    last = next((m for m in reversed(mods) if isinstance(m, nn.Linear)), None)
    return last is not None and last.out_features in vocab


def prior_parts(pick: str) -> tuple[str, str | None, bool]:
    """A table winner's parts: (fit's optimizer name, its schedule or None for the plan's, whether its LR is the
    width rule's (`train.optim.schedule_free_lr`) rather than the optimizer's default)."""
    name, *rest = pick.split("+")
    return name, next((r for r in rest if r != "width"), None), "width" in rest


def _bucket(steps: int | None) -> int | None:
    return next(b for b in BUCKETS if b is None or (steps is not None and steps <= b))


def table_from(results: Iterable[dict]) -> dict[str, tuple[tuple[int | None, str, int, int], ...]]:
    """The prior table from `bench_horizon.py` results: per kind and bucket, the winner of most (workload, length)
    pairs (a tie: Schedule-Free, the incumbent prior, if it is among the tied, else the first in name order). A pair
    goes to its winner only where that also did at least as well as Schedule-Free at every shorter length measured
    on the workload (`_anytime`), else to Schedule-Free."""
    wins: dict[tuple[str, int | None], Counter] = {}
    for res in results:
        for w in res["workloads"].values():
            for steps, winner in _anytime(w).items():
                wins.setdefault((w["kind"], _bucket(int(steps))), Counter())[NAMES[winner]] += 1
    table: dict[str, list] = {}
    for kind in KINDS:
        for edge in BUCKETS:
            count = wins.get((kind, edge))
            if not count:
                continue
            top = max(count.values())
            tied = sorted(n for n, c in count.items() if c == top)
            winner = "schedulefree" if "schedulefree" in tied else tied[0]
            table.setdefault(kind, []).append((edge, winner, top, sum(count.values())))
    return {k: tuple(v) for k, v in table.items()}


TIE = 0.005  # accuracies that round to the same multiple of this tie (bench_horizon's rule): the held-out loss decides


def _anytime(workload: dict) -> dict[str, str]:
    """Per length of one workload's results, its winner; but Schedule-Free where the winner did worse than
    Schedule-Free at a shorter length. A run's target often comes before its end (the suite's, at 10-50% of its
    budget; a callback that stops at an accuracy), where a schedule that pays only at its end (warmup-stable-decay
    holds the peak LR until its last fifth) is behind an averaged iterate: measured on the suite's 1D CNN (800-step
    budget), AdamW + WSD at the width rule's LR, the winner at 200-800 steps and behind at 50-100, reached the
    target in 80/200/240 steps where Schedule-Free took 80/120/120."""
    higher = workload.get("metric") == "val_acc"

    def key(s: dict) -> tuple:
        return (-round(s["metric"] / TIE) if higher else s["metric"], s["val_loss"])
    out: dict[str, str] = {}
    seen: list[dict] = []
    for steps, entry in sorted(workload["lengths"].items(), key=lambda kv: int(kv[0])):
        s = entry["summary"]
        win = s["winner"]
        if win != "sf" and any("sf" in x and win in x and key(x[win]) > key(x["sf"]) for x in seen):
            win = "sf"
        out[steps] = win
        seen.append(s)
    return out


def horizon_prior(model: nn.Module, run_steps: int | None, table: dict | None = None) -> tuple[str | None, str]:
    """(the optimizer the table says for this model's kind and a run of `run_steps`, and why); (None, why) where
    nothing of this kind was measured. A run longer than the longest measured takes that bucket's winner, and says
    it is beyond what was measured."""
    table = PRIOR if table is None else table
    kind = model_kind(model)
    rows = table.get(kind)
    if not rows:
        return None, f"no run of a {kind} model measured (benchmarks/bench_horizon.py)"
    edge = _bucket(run_steps)
    row = next((r for r in rows if r[0] == edge), None)
    beyond = ""
    if row is None:  # no measurement in this bucket: the nearest measured one
        order = list(BUCKETS)
        row = min(rows, key=lambda r: abs(order.index(r[0]) - order.index(edge)))
        beyond = f"; nothing measured at this length, the nearest measured lengths ({_label(row[0])}) say so"
    return row[1], (f"the best of the priors on {row[2]} of {row[3]} measured {kind} runs of {_label(row[0])} "
                    f"steps (docs/recipe.md){beyond}")


def _label(edge: int | None) -> str:
    if edge is None:
        return f"over {BUCKETS[-2]}"
    i = BUCKETS.index(edge)
    return f"up to {edge}" if i == 0 else f"{BUCKETS[i - 1] + 1}-{edge}"
