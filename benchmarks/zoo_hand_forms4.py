"""A fourth set of hand-written forms: a graph network fed a sparse adjacency matrix in each batch, L-BFGS (a
closure the optimizer calls several times a step), attention weights that enter the loss, stochastic depth drawn
from Python's `random`, an STFT front end (complex tensors inside the forward), a step_fn that builds adversarial
inputs from the input gradient (FGSM adversarial training), and a model that keeps a queue of past features for a
contrastive loss (MoCo's memory bank, a buffer it rotates in place). `zoo_hand.cases()` lists them with the others.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn

from zoo_cases import Case, adam, sgd, stateless, vectors, xy_logits, xy_with
from zoo_hand_forms3 import mlp

NODES, FEATS = 64, 16


class GCN(nn.Module):
    """Two graph convolutions `A @ X @ W` with a sparse normalised adjacency `A` (N, N); node classification."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(FEATS, 32), nn.Linear(32, 4)

    def forward(self, x, adj):
        h = F.relu(torch.sparse.mm(adj, self.w1(x)))
        return torch.sparse.mm(adj, self.w2(h))


def graph(g: torch.Generator):
    """One graph a batch: node features (N, F), a sparse adjacency with self-loops (row-normalised), labels (N,)."""
    edges = torch.randint(0, NODES, (2, 4 * NODES), generator=g)
    loops = torch.arange(NODES).repeat(2, 1)
    idx = torch.cat([edges, loops], 1)
    val = torch.ones(idx.shape[1])
    adj = torch.sparse_coo_tensor(idx, val, (NODES, NODES)).coalesce()
    deg = torch.sparse.sum(adj, 1).to_dense()
    adj = torch.sparse_coo_tensor(adj.indices(), adj.values() / deg[adj.indices()[0]], (NODES, NODES)).coalesce()
    return torch.randn(NODES, FEATS, generator=g), adj, torch.randint(0, 4, (NODES,), generator=g)


def gcn_plain(model, batch):
    x, adj, y = batch
    return F.cross_entropy(model(x, adj), y)


def regression(g: torch.Generator):
    x = torch.randn(64, 8, generator=g)
    return x, (x[:, :1] * 2 - x[:, 1:2]).sin()


def lbfgs(m: nn.Module):
    return torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=4, history_size=5)


def small_regressor():
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


class AttentionWithWeights(nn.Module):
    """Self-attention whose weights the loss reads: an entropy penalty keeps them from collapsing."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.fc = nn.Linear(32, 5)

    def forward(self, tokens):
        h = self.emb(tokens)
        out, weights = self.attn(h, h, h, need_weights=True)
        return self.fc(out.mean(1)), weights


def tokens(g: torch.Generator):
    return torch.randint(0, 100, (16, 12), generator=g), torch.randint(0, 5, (16,), generator=g)


def attn_step():
    def step_fn(model, batch):
        x, y = batch
        logits, w = model(x)
        entropy = -(w.clamp_min(1e-9).log() * w).sum(-1).mean()
        return F.cross_entropy(logits, y) - 0.01 * entropy
    return step_fn


def attn_probe(model, batch):
    return attn_step()(model, batch)


class StochasticDepth(nn.Module):
    """Residual blocks each skipped with probability 0.2 in training, the draw from Python's `random`."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(32, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4))
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        h = self.stem(x)
        for b in self.blocks:
            if not self.training or random.random() > 0.2:
                h = h + b(h)
        return self.fc(h)


class SpectrogramNet(nn.Module):
    """Audio classification from a magnitude STFT computed in the forward (complex tensors inside the model)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("window", torch.hann_window(64))
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.fc = nn.Linear(8, 6)

    def forward(self, wave):
        spec = torch.stft(wave, 64, hop_length=16, window=self.window, return_complex=True).abs()
        h = F.relu(self.conv(spec.log1p().unsqueeze(1)))
        return self.fc(h.mean((2, 3)))


def waves(g: torch.Generator):
    return torch.randn(16, 1024, generator=g), torch.randint(0, 6, (16,), generator=g)


def fgsm_step():
    """Adversarial training: the input gradient's sign builds the perturbed batch, trained beside the clean one."""
    def step_fn(model, batch):
        x, y = batch
        x = x.clone().requires_grad_(True)
        loss = F.cross_entropy(model(x), y)
        grad, = torch.autograd.grad(loss, x, retain_graph=True)
        x_adv = (x + 0.05 * grad.sign()).detach()
        return 0.5 * loss + 0.5 * F.cross_entropy(model(x_adv), y)
    return step_fn


def fgsm_probe(model, batch):
    return xy_logits(model, batch)


class MemoryBank(nn.Module):
    """MoCo-style: a queue of past (detached) features, rotated in place each forward, read by a contrastive loss."""

    def __init__(self, size: int = 256):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
        self.register_buffer("queue", F.normalize(torch.randn(size, 16), dim=1))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        z = F.normalize(self.enc(x), dim=1)
        negatives = self.queue.clone()
        if self.training:
            with torch.no_grad():
                n, i = z.shape[0], int(self.ptr)
                self.queue[i:i + n] = z.detach()
                self.ptr.fill_((i + n) % self.queue.shape[0])
        return z, negatives


def contrastive_step():
    def step_fn(model, batch):
        x, _ = batch
        z1, neg = model(x + 0.1 * torch.randn_like(x))
        z2, _ = model(x + 0.1 * torch.randn_like(x))
        pos = (z1 * z2).sum(1, keepdim=True)
        logits = torch.cat([pos, z1 @ neg.t()], 1) / 0.2
        return F.cross_entropy(logits, torch.zeros(len(x), dtype=torch.long))
    return step_fn


def contrastive_probe(model, batch):
    x, _ = batch
    z, neg = model(x)
    return -(z @ neg.t()).mean()


def cases() -> list[Case]:
    return [
        Case("hand/gcn_sparse_adjacency", "hand", GCN, graph, step_fn=stateless(gcn_plain), optimizer=adam(1e-2),
             probe=gcn_plain, note="a graph convolution network fed (features, sparse adjacency, labels)"),
        Case("hand/lbfgs_regression", "hand", small_regressor, regression, xy_with(nn.MSELoss()), lbfgs,
             fit_kwargs={"loss_fn": nn.MSELoss()}, note="torch.optim.LBFGS: a closure called several times a step"),
        Case("hand/attention_weights_in_loss", "hand", AttentionWithWeights, tokens, step_fn=attn_step,
             optimizer=adam(1e-3), probe=attn_probe, note="nn.MultiheadAttention's weights in an entropy penalty"),
        Case("hand/stochastic_depth_python_random", "hand", StochasticDepth, vectors(), xy_logits, sgd(0.05),
             note="residual blocks dropped by random.random() in training"),
        Case("hand/stft_frontend", "hand", SpectrogramNet, waves, xy_logits, adam(1e-3),
             note="torch.stft (complex) inside the forward, a conv on the log magnitude"),
        Case("hand/fgsm_adversarial", "hand", mlp, vectors(), step_fn=fgsm_step, optimizer=sgd(0.05, momentum=0.9),
             probe=fgsm_probe, note="adversarial training: the input gradient builds a perturbed batch"),
        Case("hand/memory_bank_contrastive", "hand", MemoryBank, vectors(), step_fn=contrastive_step,
             optimizer=sgd(0.05, momentum=0.9), probe=contrastive_probe,
             note="a queue buffer of past features rotated in place, a contrastive loss"),
    ]
