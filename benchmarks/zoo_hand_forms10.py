"""A tenth set of hand-written forms, each an operation that a half-precision candidate may not run: a speech model
trained with CTC (`F.ctc_loss` on log-probabilities), a forward that reads a statistic through NumPy (`.numpy()`
has no bf16), a graph network that sums its messages with `index_add_` into a float32 buffer it made itself, a
spatial transformer (`affine_grid` + `grid_sample`), an LSTMCell stepped in a Python loop, a Fourier neural
operator whose spectral weights are complex parameters (`torch.fft` inside the forward), and an EMA of the weights
(`torch.optim.swa_utils.AveragedModel`) updated by the step. `zoo_hand.cases()` lists them with the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo_cases import Case, adam, adamw, images, sgd, stateless, vectors, xy_logits

# ---------------------------------------------------------------- CTC speech

FEATS, FRAMES, LABELS, TARGET = 20, 48, 12, 10  # 12 labels, blank = 0


class SpeechCTC(nn.Module):
    """Conv1d front end over (B, F, T) features, a GRU, per-frame log-probabilities (T, B, C) for CTC."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(FEATS, 32, 5, padding=2)
        self.gru = nn.GRU(32, 32, batch_first=True)
        self.out = nn.Linear(32, LABELS)

    def forward(self, x):
        h, _ = self.gru(F.relu(self.conv(x)).transpose(1, 2))
        return self.out(h).log_softmax(-1).transpose(0, 1)


def utterances(g: torch.Generator):
    """(features (B, F, T), targets (B, S) in 1..C-1, input lengths, target lengths)."""
    n = 16
    x = torch.randn(n, FEATS, FRAMES, generator=g)
    y = torch.randint(1, LABELS, (n, TARGET), generator=g)
    in_len = torch.full((n,), FRAMES, dtype=torch.long)
    out_len = torch.randint(4, TARGET + 1, (n,), generator=g)
    return x, y, in_len, out_len


def ctc_step(model, batch):
    x, y, in_len, out_len = batch
    return F.ctc_loss(model(x), y, in_len, out_len, blank=0, zero_infinity=True)


# ---------------------------------------------------------------- NumPy in the forward

class NumpyScaled(nn.Module):
    """Hidden features scaled by their batch's 95th percentile, read through NumPy (a script's own
    normalisation): `.numpy()` takes float32, not bf16."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 10)

    def forward(self, x):
        h = F.relu(self.a(x))
        import numpy as np

        scale = float(np.percentile(h.detach().numpy(), 95)) + 1e-3
        return self.b(h / scale)


# ---------------------------------------------------------------- messages summed with index_add_

NODES, EDGES = 48, 192


class MessagePassing(nn.Module):
    """Two rounds of messages along edges, summed per node with `index_add_` into a buffer made with
    `x.new_zeros` (the input's float32: the messages come out of a Linear)."""

    def __init__(self):
        super().__init__()
        self.msg1, self.msg2, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x, edges):
        src, dst = edges
        h = x
        for lin in (self.msg1, self.msg2):
            m = lin(h)[src]
            agg = x.new_zeros(x.shape[0], m.shape[1]).index_add_(0, dst, m)
            h = F.relu(agg)
        return self.head(h)


def graph(g: torch.Generator):
    return (torch.randn(NODES, 16, generator=g), torch.randint(0, NODES, (2, EDGES), generator=g),
            torch.randint(0, 4, (NODES,), generator=g))


def graph_plain(model, batch):
    x, edges, y = batch
    return F.cross_entropy(model(x, edges), y)


# ---------------------------------------------------------------- spatial transformer

class SpatialTransformer(nn.Module):
    """A localisation net predicts an affine map (initialised to the identity); the input is resampled with
    `affine_grid` + `grid_sample`, then classified."""

    def __init__(self):
        super().__init__()
        self.loc = nn.Sequential(nn.Conv2d(1, 8, 5, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                                 nn.Linear(128, 6))
        nn.init.zeros_(self.loc[-1].weight)
        with torch.no_grad():
            self.loc[-1].bias.copy_(torch.tensor([1.0, 0, 0, 0, 1, 0]))
        self.cls = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                 nn.Linear(16 * 14 * 14, 10))

    def forward(self, x):
        theta = self.loc(x).view(-1, 2, 3)
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return self.cls(F.grid_sample(x, grid, align_corners=False))


# ---------------------------------------------------------------- LSTMCell in a Python loop

class CellLoop(nn.Module):
    """An `nn.LSTMCell` stepped over the sequence in Python, (h, c) carried inside the forward."""

    def __init__(self):
        super().__init__()
        self.cell, self.out = nn.LSTMCell(8, 48), nn.Linear(48, 5)

    def forward(self, x):  # (B, T, 8)
        h = c = x.new_zeros(x.shape[0], 48)
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
        return self.out(h)


def sequences(g: torch.Generator):
    return torch.randn(32, 16, 8, generator=g), torch.randint(0, 5, (32,), generator=g)


# ---------------------------------------------------------------- Fourier neural operator

MODES, WIDTH, GRID = 6, 16, 24


class SpectralConv2d(nn.Module):
    """FNO's layer: rfft2, the lowest modes multiplied by complex weights (complex64 parameters), irfft2."""

    def __init__(self):
        super().__init__()
        scale = 1 / (WIDTH * WIDTH)
        self.w = nn.Parameter(scale * torch.randn(WIDTH, WIDTH, MODES, MODES, dtype=torch.cfloat))

    def forward(self, x):
        ft = torch.fft.rfft2(x)
        out = torch.zeros_like(ft)
        out[:, :, :MODES, :MODES] = torch.einsum("bixy,ioxy->boxy", ft[:, :, :MODES, :MODES], self.w)
        return torch.fft.irfft2(out, s=x.shape[-2:])


class FNO(nn.Module):
    """A two-layer Fourier neural operator on a (B, 1, H, W) field, predicting a field of the same shape."""

    def __init__(self):
        super().__init__()
        self.lift, self.proj = nn.Conv2d(1, WIDTH, 1), nn.Conv2d(WIDTH, 1, 1)
        self.spec = nn.ModuleList(SpectralConv2d() for _ in range(2))
        self.skip = nn.ModuleList(nn.Conv2d(WIDTH, WIDTH, 1) for _ in range(2))

    def forward(self, x):
        h = self.lift(x)
        for spec, skip in zip(self.spec, self.skip):
            h = F.gelu(spec(h) + skip(h))
        return self.proj(h)


def fields(g: torch.Generator):
    x = torch.randn(8, 1, GRID, GRID, generator=g)
    return x, torch.roll(x, 2, dims=-1).tanh()


def fno_plain(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


# ---------------------------------------------------------------- an EMA updated by the step

def ema_step():
    """The step updates an EMA of the weights (`AveragedModel`, made at its first call and kept on the model as a
    plain attribute, where the script's evaluation reads it) before its loss: the EMA trails by one step, as in
    scripts that update it at the top of the loop."""
    def step_fn(model, batch):
        ema = getattr(model, "ema", None)
        if ema is None:
            ema = torch.optim.swa_utils.AveragedModel(
                model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
            object.__setattr__(model, "ema", ema)
        ema.update_parameters(model)
        return xy_logits(model, batch)
    return step_fn


def ema_probe(model, batch):
    """The loss of the EMA's weights (the script evaluates those), or the model's where the run made none."""
    ema = getattr(model, "ema", None)
    return xy_logits(ema.module if ema is not None else model, batch)


def mlp32():
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))


def cases() -> list[Case]:
    return [
        Case("hand/ctc_speech", "hand", SpeechCTC, utterances, step_fn=stateless(ctc_step), optimizer=adam(1e-3),
             note="CTC loss on a Conv1d + GRU's per-frame log-probabilities"),
        Case("hand/numpy_in_forward", "hand", NumpyScaled, vectors(), plain=xy_logits, optimizer=sgd(0.05),
             note="the forward reads a percentile through NumPy (.numpy() has no bf16)"),
        Case("hand/index_add_messages", "hand", MessagePassing, graph, plain=graph_plain, optimizer=adam(3e-3),
             note="messages summed with index_add_ into a float32 buffer the forward makes"),
        Case("hand/spatial_transformer", "hand", SpatialTransformer, images(16, 28, channels=1), plain=xy_logits,
             optimizer=sgd(0.02, momentum=0.9), note="affine_grid + grid_sample on the input"),
        Case("hand/lstm_cell_loop", "hand", CellLoop, sequences, plain=xy_logits, optimizer=adam(2e-3),
             note="an LSTMCell stepped in a Python loop over time"),
        Case("hand/fno_complex_weights", "hand", FNO, fields, plain=fno_plain, optimizer=adamw(1e-3),
             fit_kwargs={"loss_fn": nn.MSELoss()}, note="a Fourier neural operator: complex64 parameters, torch.fft in the forward"),
        Case("hand/ema_in_step", "hand", mlp32, vectors(), step_fn=ema_step, optimizer=sgd(0.05, momentum=0.9),
             probe=ema_probe, note="an AveragedModel EMA updated by the step, kept on the model"),
    ]
