"""A twelfth set of hand-written forms, the code a loop runs around `opt.step()` and shapes that change from batch to
batch: a DQN-style Q-network step clipped by `clip_grad_value_` (PyTorch's reinforcement-learning tutorial), a CNN
whose loop centralizes its gradients before the step (gradient centralization, a callback's
`on_before_optimizer_step` in the port), an MLP held to a max-norm constraint after each step (`renorm_`, a
callback's `on_step_end`), a Transformer classifier fed batches padded to each batch's own longest sequence, an MLP
whose activation is a `torch.autograd.Function` of its own, and an MLP whose weights are bfloat16 (a model cast with
`.to(torch.bfloat16)`, its batches too). `zoo_hand.cases()` lists them with the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo_cases import Case, adam, adamw, images, mlp, sgd, stateless, vectors, xy_logits


# ---------------------------------------------------------------- DQN: clip_grad_value_

def q_batch(g: torch.Generator):
    """(states, actions, TD targets): a replay batch of 64 transitions of an 8-dim state with 4 actions."""
    return (torch.randn(64, 8, generator=g), torch.randint(0, 4, (64, 1), generator=g),
            torch.randn(64, 1, generator=g) * 3)


def q_loss(model: nn.Module, batch) -> torch.Tensor:
    """Q(s, a) against the TD target, Huber loss: the tutorial's `optimize_model`."""
    s, a, target = batch
    return F.smooth_l1_loss(model(s).gather(1, a), target)


# ---------------------------------------------------------------- gradient centralization, max-norm

def small_cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def centralize(model: nn.Module) -> None:
    """Each conv and linear weight's gradient minus its mean over all but the output dimension (Yong et al. 2020)."""
    for p in model.parameters():
        if p.grad is not None and p.dim() > 1:
            p.grad.sub_(p.grad.mean(dim=tuple(range(1, p.dim())), keepdim=True))


def max_norm(model: nn.Module, limit: float = 1.0) -> None:
    """Every linear layer's rows held to an L2 norm of at most `limit` after the step (Keras's max_norm)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.renorm_(2, 0, limit)


# ---------------------------------------------------------------- variable-length batches

def ragged_tokens(g: torch.Generator):
    """(ids, padding mask, labels): 16 sequences padded to this batch's longest, 12 to 40 tokens."""
    lengths = torch.randint(12, 41, (16,), generator=g)
    t = int(lengths.max())
    ids = torch.randint(1, 500, (16, t), generator=g)
    pad = torch.arange(t)[None, :] >= lengths[:, None]
    return ids.masked_fill(pad, 0), pad, torch.randint(0, 4, (16,), generator=g)


class RaggedClassifier(nn.Module):
    """Embedding, a 2-layer Transformer encoder with a key padding mask, the mean over real tokens, a linear head."""

    def __init__(self, vocab: int = 500, d: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        layer = nn.TransformerEncoderLayer(d, 4, 128, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 4)

    def forward(self, ids, pad):
        h = self.enc(self.emb(ids), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


def ragged_plain(model: nn.Module, batch) -> torch.Tensor:
    ids, pad, y = batch
    return F.cross_entropy(model(ids, pad), y)


# ---------------------------------------------------------------- a torch.autograd.Function of the script's own

class ClippedSwish(torch.autograd.Function):
    """x * sigmoid(x) with its gradient written by hand, clamped to [-2, 2] (a straight-through-like activation)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * (s * (1 + x * (1 - s))).clamp(-2, 2)


class FunctionMLP(nn.Module):
    def __init__(self, d_in: int = 32, hidden: int = 256, classes: int = 10):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(d_in, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, classes)

    def forward(self, x):
        return self.l3(ClippedSwish.apply(self.l2(ClippedSwish.apply(self.l1(x)))))


# ---------------------------------------------------------------- bfloat16 weights

def bf16_mlp() -> nn.Module:
    return mlp(32, 10, 256).to(torch.bfloat16)


def cases() -> list[Case]:
    return [
        Case("hand/dqn_clip_grad_value", "hand", lambda: mlp(8, 4, 128), q_batch, step_fn=stateless(q_loss),
             optimizer=adamw(1e-4, amsgrad=True), fit_kwargs={"clip_grad_value": 1.0},
             note="PyTorch's DQN tutorial step: gather, Huber loss, AdamW(amsgrad), clip_grad_value_"),
        Case("hand/gradient_centralization", "hand", small_cnn, images(32, 32), plain=xy_logits,
             optimizer=sgd(0.05, momentum=0.9), before_step=centralize,
             note="the loop centralizes conv/linear gradients before opt.step(): a callback's on_before_optimizer_step"),
        Case("hand/max_norm_constraint", "hand", lambda: mlp(32, 10, 256), vectors(64, 32), plain=xy_logits,
             optimizer=sgd(0.1, momentum=0.9), after_step=max_norm,
             note="linear rows renormed to norm 1 after each step: a callback's on_step_end"),
        Case("hand/ragged_padded_batches", "hand", RaggedClassifier, ragged_tokens, plain=ragged_plain,
             optimizer=adam(1e-3), note="each batch padded to its own longest sequence: shapes change every step"),
        Case("hand/autograd_function", "hand", FunctionMLP, vectors(64, 32), plain=xy_logits, optimizer=adam(1e-3),
             note="an activation written as a torch.autograd.Function with its own backward"),
        Case("hand/bf16_weights", "hand", bf16_mlp, vectors(64, 32, dtype=torch.bfloat16), plain=xy_logits,
             optimizer=adamw(1e-3), note="model.to(torch.bfloat16), bf16 batches: no fp32 master weights"),
    ]
