"""Claim: PyTorch's word-language-model example, ported to `fit` as docs/models.md says (the LSTM's hidden state
carried in the `step_fn`'s own state, detached each batch; the script's SGD at lr 20 and clipping at 0.25), trains
to the end on every CPU kind, no slower than the script's own loop and to the script's validation loss.

The script (pytorch/examples `word_language_model/main.py`, its defaults): `RNNModel("LSTM", ntokens, 200, 200, 2,
dropout=0.2)` (embedding, 2-layer LSTM, dropout, linear decoder, `log_softmax`), `NLLLoss`, the corpus batchified
into 20 columns, windows of 35 tokens, the hidden state carried from window to window and detached, plain SGD
written out by hand at lr 20 (`p.data.add_(p.grad, alpha=-lr)`, the same update as `torch.optim.SGD`),
`clip_grad_norm_(0.25)`, evaluation on the validation columns (batch 10) after each epoch. The corpus: the words of
the standard library's source (nothing downloaded), the 10,000 most frequent kept and the rest `<unk>`, 90% for
training and 10% for validation.

Rows, each in a fresh process (`--rounds` interleaved rounds after one untimed warm-up round, an empty trial cache
for each `fit` run, as a user's first run):
- `script`: its own loop;
- `fit`: `fit(model, batches, step_fn=..., optimizer=torch.optim.SGD(model.parameters(), lr=20),
  clip_grad_norm=0.25, schedule=None, val_loader=..., val_step_fn=...)`: the port (the switch trial live);
- `auto`: `fit(model, batches, step_fn=..., recipe="auto", clip_grad_norm=0.25)` with no optimizer or LR.

Per row: whole-run seconds (`--epochs` epochs), the validation loss after each epoch, and the seconds to the
script's final validation loss (+0.5%), evaluations counted. On each CPU profile that can be emulated
(`--profiles`, TORCHSPEED_CPU_PROFILE), the `fit` row is also run once for whether it finishes and its loss.

Run:
    python benchmarks/bench_word_lm.py --out benchmarks/results/cpu-avx512-bf16/word_lm.json
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

LOSS_TOLERANCE = 0.005
BPTT, BATCH, EVAL_BATCH, LR, CLIP = 35, 20, 10, 20.0, 0.25


class RNNModel(nn.Module):
    """pytorch/examples word_language_model's RNNModel, LSTM kind, untied."""

    def __init__(self, ntoken: int, ninp: int = 200, nhid: int = 200, nlayers: int = 2, dropout: float = 0.2):
        super().__init__()
        self.ntoken, self.drop = ntoken, nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers = nhid, nlayers
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, x, hidden):
        output, hidden = self.rnn(self.drop(self.encoder(x)), hidden)
        decoded = self.decoder(self.drop(output)).view(-1, self.ntoken)
        return nn.functional.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int):
        w = next(self.parameters())
        return w.new_zeros(self.nlayers, bsz, self.nhid), w.new_zeros(self.nlayers, bsz, self.nhid)


def corpus(max_bytes: int, vocab: int = 10_000) -> tuple[torch.Tensor, torch.Tensor, int]:
    from torchspeed.bench.text import stdlib_text
    words = re.findall(r"\w+|[^\w\s]", bytes(stdlib_text(max_bytes=max_bytes).data.tolist()).decode("latin-1"))
    keep = {w: i + 1 for i, (w, _) in enumerate(collections.Counter(words).most_common(vocab - 1))}
    ids = torch.tensor([keep.get(w, 0) for w in words])
    cut = int(len(ids) * 0.9)
    return ids[:cut], ids[cut:], vocab


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    n = data.size(0) // bsz
    return data[:n * bsz].view(bsz, -1).t().contiguous()


def windows(source: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for i in range(0, source.size(0) - 1, BPTT):
        n = min(BPTT, len(source) - 1 - i)
        out.append((source[i:i + n], source[i + 1:i + 1 + n].reshape(-1)))
    return out


def carried_step_fn(criterion):
    """The script's step as a step_fn: the hidden state carried in its own state, detached each window."""
    state = {"hidden": None}

    def step_fn(model, batch):
        data, targets = batch
        if state["hidden"] is None or state["hidden"][0].size(1) != data.size(1):
            state["hidden"] = model.init_hidden(data.size(1))
        output, hidden = model(data, tuple(h.detach() for h in state["hidden"]))
        state["hidden"] = hidden
        return criterion(output, targets)
    return step_fn, state


@torch.no_grad()
def evaluate(model, val, criterion) -> float:
    model.eval()
    hidden, total, n = model.init_hidden(EVAL_BATCH), 0.0, 0
    for data, targets in val:
        output, hidden = model(data, hidden)
        total += len(data) * float(criterion(output, targets))
        n += len(data)
    model.train()
    return total / n


def run(row: str, epochs: int, max_bytes: int, seed: int, target: float | None) -> dict:
    train_ids, val_ids, ntokens = corpus(max_bytes)
    train, val = windows(batchify(train_ids, BATCH)), windows(batchify(val_ids, EVAL_BATCH))
    criterion = nn.NLLLoss()
    torch.manual_seed(seed)
    model = RNNModel(ntokens)
    history, at = [], None
    t0 = time.perf_counter()
    if row == "script":
        step_fn, _ = carried_step_fn(criterion)
        model.train()
        for _ in range(epochs):
            for batch in train:
                model.zero_grad()
                step_fn(model, batch).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-LR)
            history.append(evaluate(model, val, criterion))
            if target is not None and at is None and history[-1] <= target:
                at = time.perf_counter() - t0
        decisions = {}
    else:
        import torchspeed
        from torchspeed.train.loop.callbacks import Callback

        class Eval(Callback):
            def on_evaluate(self, trainer, metrics):
                nonlocal at
                history.append(evaluate(trainer.module, val, criterion))
                if target is not None and at is None and history[-1] <= target:
                    at = time.perf_counter() - t0
        step_fn, _ = carried_step_fn(criterion)
        kw = dict(recipe="auto") if row == "auto" else dict(
            optimizer=torch.optim.SGD(model.parameters(), lr=LR), schedule=None)
        res = torchspeed.fit(model, train, step_fn=step_fn, epochs=epochs, clip_grad_norm=CLIP, progress=False,
                             callbacks=[Eval()], **kw)
        decisions = {k: str(res.decisions[k].value)[:60] for k in ("optimizer", "lr", "precision", "switch_trial",
                                                                    "switch_recovered", "compile") if k in
                     res.decisions}
    return {"seconds": time.perf_counter() - t0, "val_loss": history, "to_target_s": at, "decisions": decisions}


def in_fresh_process(row: str, args, target: float | None = None, profile: str | None = None) -> dict:
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as cache:
        env["TORCHSPEED_CACHE_DIR"] = cache
        if profile:
            env["TORCHSPEED_CPU_PROFILE"] = profile
        cmd = [sys.executable, __file__, "--child", row, "--epochs", str(args.epochs), "--max-bytes",
               str(args.max_bytes), "--target", str(target if target is not None else "none")]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        return {"finished": False, "error": (out.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return {"finished": True, **json.loads(out.stdout.strip().splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", default=None)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--max-bytes", type=int, default=1_200_000)
    ap.add_argument("--target", default="none")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profiles", default="avx2,avx512,avx512_bf16,amx")
    ap.add_argument("--out", default="benchmarks/results/cpu/word_lm.json")
    args = ap.parse_args()
    if args.child:
        torch.set_num_threads(os.cpu_count() or 1)
        print(json.dumps(run(args.child, args.epochs, args.max_bytes, 0,
                             None if args.target == "none" else float(args.target))))
        return
    from torchspeed._io import write_json
    from torchspeed.bench.runner import provenance
    t0 = time.perf_counter()
    rows = ("script", "fit", "auto")
    script = in_fresh_process("script", args)  # warm-up, and the target: the script's final validation loss
    target = script["val_loss"][-1] * (1 + LOSS_TOLERANCE)
    runs: dict[str, list[dict]] = {k: [] for k in rows}
    for r in range(args.rounds):
        for row in (rows if r % 2 == 0 else rows[::-1]):
            runs[row].append(in_fresh_process(row, args, target))
            x = runs[row][-1]
            print(f"round {r} {row}: " + (f"{x['seconds']:.1f} s, val loss {x['val_loss']}, to target "
                                          f"{x['to_target_s']}" if x["finished"] else f"FAILED {x['error']}"),
                  flush=True)
    med = {k: statistics.median(x["seconds"] for x in v if x["finished"]) if any(x["finished"] for x in v)
           else math.nan for k, v in runs.items()}
    tta = {k: statistics.median((x["to_target_s"] or math.inf) for x in v if x["finished"]) for k, v in runs.items()}
    profiles = {p: in_fresh_process("fit", args, target, profile=p) for p in args.profiles.split(",") if p}
    for p, x in profiles.items():
        print(f"profile {p}: fit " + (f"finished, val loss {x['val_loss']}" if x["finished"] else
                                     f"FAILED {x['error']}"), flush=True)
    result = {"kind": "word_language_model_port", "epochs": args.epochs, "max_bytes": args.max_bytes,
              "target_val_loss": target, "runs": runs, "median_s": med,
              "whole_run_vs_script": {k: med["script"] / med[k] for k in rows},
              "to_target_median_s": tta,
              "to_target_vs_script": {k: tta["script"] / tta[k] if math.isfinite(tta[k]) else 0.0 for k in rows},
              "profiles": profiles, "seconds": time.perf_counter() - t0, "provenance": provenance()}
    path = write_json(args.out, result, indent=1)
    print(f"whole run vs script: {result['whole_run_vs_script']}; to target vs script: "
          f"{result['to_target_vs_script']}; wrote {path}")


if __name__ == "__main__":
    main()
