"""Small models held in memory, and the plain loop their users write (T10, T11, T13): the never-slower workloads.

A training script for a small model often holds its data as tensors and trains with about 15
lines: shuffle the indices, slice, step, evaluate each epoch. Its steps take 1-5 ms on 2 cores, so
whatever a trainer does around the step shows. These workloads are that case, made offline and
deterministically from a seed (no download), and `plain_loop` is that script's loop:

- `cnn1d`: three Conv1d layers and a linear head (about 5k parameters) on 4,000 noisy waveforms of
  length 40, four classes by shape;
- `mlp`: a two-hidden-layer MLP (512 wide) on 4,000 rows of 20 tabular features, five classes set by a
  random teacher network;
- `transformer`: a 2-layer, 32-wide transformer encoder on 4,000 sequences of 16 tokens, classified by
  which of four marker tokens comes first.

`benchmarks/bench_plain_loop.py` times `fit` against `plain_loop` on each (docs/bench.md).

Example:
    >>> w = make_small("cnn1d", seed=0)
    >>> plain_loop(w.model(), w, epochs=3, lr=1e-2)["val_acc"]
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SMALL", "SmallWorkload", "make_small", "plain_loop", "shuffled_epochs", "evaluate_plain"]

N_TRAIN, N_VAL = 4000, 1000


@dataclass
class SmallWorkload:
    """A small model's data in memory (`x`, `y` for training, `vx`, `vy` held out) and how to build the model."""

    name: str
    x: torch.Tensor
    y: torch.Tensor
    vx: torch.Tensor
    vy: torch.Tensor
    model: Callable[[], nn.Module]
    lr: float = 1e-2
    batch_size: int = 100


class Conv1dNet(nn.Module):
    """The 1D CNN of a time-series benchmark's script: three Conv1d layers, global pooling, a linear head."""

    def __init__(self, classes: int = 4, width: int = 16):
        super().__init__()
        self.convs = nn.Sequential(nn.Conv1d(1, width, 5, padding=2), nn.ReLU(),
                                   nn.Conv1d(width, width, 5, padding=2), nn.ReLU(),
                                   nn.Conv1d(width, width, 5, padding=2), nn.ReLU())
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.convs(x).mean(-1))


class TinyTransformer(nn.Module):
    """A 2-layer, 32-wide transformer encoder over token ids, mean-pooled to class logits."""

    def __init__(self, vocab: int = 32, seq: int = 16, classes: int = 4, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(seq, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x) + self.pos).mean(1))


def _waves(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy waveforms of length 40: sine, square, sawtooth or a bump, at a random phase and frequency."""
    y = torch.randint(0, 4, (n,), generator=g)
    t = torch.linspace(0, 1, 40)
    freq = 1 + 2 * torch.rand(n, 1, generator=g)
    phase = torch.rand(n, 1, generator=g)
    u = (freq * t + phase) % 1.0
    shapes = torch.stack([torch.sin(2 * math.pi * u), torch.sign(u - 0.5), 2 * u - 1,
                          torch.exp(-((u - 0.5) ** 2) / 0.01) * 2 - 1])
    x = shapes[y, torch.arange(n)] + 0.8 * torch.randn(n, 40, generator=g)
    return x.unsqueeze(1), y


def _tabular(n: int, g: torch.Generator, teacher: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 20, generator=g)
    with torch.no_grad():
        y = teacher(x).argmax(1)
    return x, y


def _markers(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences over 32 ids; the class is which marker (ids 0-3) comes first."""
    x = torch.randint(4, 32, (n, 16), generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    first = torch.randint(0, 12, (n,), generator=g)
    x[torch.arange(n), first] = y
    later = first + 1 + torch.randint(0, 3, (n,), generator=g)
    x[torch.arange(n), later.clamp(max=15)] = torch.randint(0, 4, (n,), generator=g)
    return x, y


def make_small(name: str, *, seed: int = 0, n_train: int = N_TRAIN, n_val: int = N_VAL) -> SmallWorkload:
    """Workload `name` (one of `SMALL`): its data from `seed`, and a model builder seeded by the caller."""
    g = torch.Generator().manual_seed(seed)
    n = n_train + n_val
    if name == "cnn1d":
        x, y = _waves(n, g)
        model: Callable[[], nn.Module] = Conv1dNet
        lr = 1e-2
    elif name == "mlp":
        # The teacher at torch's own Linear init scale (uniform within 1/sqrt(fan_in)): a function the MLP learns
        # over its epochs, its held-out accuracy climbing from about 0.6 to 0.9 over 10 epochs at Adam 1e-4. (Its
        # weights drawn N(0, 1) saturated the tanh: the accuracy sat at 0.64-0.67 from the first epoch on, so a time
        # to the loop's final accuracy read only that noise.)
        teacher = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 5))
        with torch.no_grad():
            for layer in (teacher[0], teacher[2]):
                bound = 1 / math.sqrt(layer.in_features)
                for p in (layer.weight, layer.bias):
                    p.uniform_(-bound, bound, generator=g)
        x, y = _tabular(n, g, teacher)
        model = lambda: nn.Sequential(nn.Linear(20, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),  # noqa: E731
                                      nn.Linear(512, 5))
        lr = 1e-4
    elif name == "transformer":
        x, y = _markers(n, g)
        model = TinyTransformer
        lr = 1e-3
    else:
        raise ValueError(f"no small workload {name!r}; choose one of {', '.join(SMALL)}")
    return SmallWorkload(name, x[:n_train], y[:n_train], x[n_train:], y[n_train:], model, lr=lr)


SMALL = ("cnn1d", "mlp", "transformer")


@torch.no_grad()
def evaluate_plain(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 500) -> float:
    """Accuracy of `model` on (`x`, `y`), in eval mode, as the plain script measures it."""
    model.eval()
    correct = 0
    for i in range(0, len(x), batch_size):
        correct += int((model(x[i:i + batch_size]).argmax(1) == y[i:i + batch_size]).sum())
    model.train()
    return correct / len(x)


def shuffled_epochs(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, *,
                    loss_fn: Callable, batch_size: int, epochs: int, seed: int,
                    evaluate: Callable[[nn.Module], float], on_epoch: Callable[[int, float], bool] | None = None,
                    loader: Iterable | None = None) -> dict:
    """The plain script's loop, the one home of it: shuffled index slices of (`x`, `y`), one optimizer step a
    batch, `evaluate(model)` after each epoch; `on_epoch(epoch, metric)` returning True stops the run.

    The slices come in the order a `DataLoader(shuffle=True, generator=Generator().manual_seed(seed))` gives, so
    the loop and `fit` over that loader train on the same batches. `loader`: iterate it instead (the same loop over
    a DataLoader, with its per-sample collate). Returns the seconds, the steps and each epoch's metric."""
    g = torch.Generator().manual_seed(seed)
    t0, steps, history = time.perf_counter(), 0, []
    model.train()
    for epoch in range(epochs):
        for xb, yb in (loader if loader is not None else _shuffled_slices(x, y, batch_size, g)):
            loss = loss_fn(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
        history.append(evaluate(model))
        if on_epoch is not None and on_epoch(epoch, history[-1]):
            break
    return {"seconds": time.perf_counter() - t0, "steps": steps, "history": history}


def _shuffled_slices(x: torch.Tensor, y: torch.Tensor, batch: int, g: torch.Generator) -> Iterator:
    # A DataLoader's draws per epoch: one number before its permutation, the permutation, and RandomSampler's
    # second one for the remainder (empty here).
    torch.empty((), dtype=torch.int64).random_(generator=g)
    perm = torch.randperm(len(x), generator=g)
    torch.randperm(len(x), generator=g)
    for i in range(0, len(x), batch):
        idx = perm[i:i + batch]
        yield x[idx], y[idx]


def plain_loop(model: nn.Module, w: SmallWorkload, *, epochs: int, lr: float | None = None, seed: int = 0,
               on_epoch: Callable[[int, float], bool] | None = None, loader: Iterable | None = None,
               fused: bool | None = None) -> dict:
    """The script's own loop (`shuffled_epochs`): Adam at a constant LR, an evaluation of the held-out accuracy per
    epoch. `on_epoch(epoch, val_acc)` returning True stops the run (time to a target); `loader` replaces the
    slices; `fused=True`: Adam's fused kernel (the same update, rounded differently). Returns the seconds, the
    steps and the last validation accuracy."""
    opt = torch.optim.Adam(model.parameters(), lr=lr if lr is not None else w.lr, fused=fused)
    out = shuffled_epochs(model, opt, w.x, w.y, loss_fn=F.cross_entropy, batch_size=w.batch_size, epochs=epochs,
                          seed=seed, evaluate=lambda m: evaluate_plain(m, w.vx, w.vy), on_epoch=on_epoch,
                          loader=loader)
    history = out.pop("history")
    return out | {"val_acc": history[-1] if history else float("nan")}
