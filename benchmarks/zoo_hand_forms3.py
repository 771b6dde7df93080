"""Forms of real training code the other hand-written cases do not have, each as its script writes it: a 3D conv net
on video clips (5-D batches), transfer learning on a frozen backbone, parameter groups at their own LRs, a LoRA
adapter on frozen weights, an LSTM over packed variable-length sequences, an embedding whose `max_norm` renormalises
its rows inside the forward, fake-quantised (QAT) layers, a custom autograd Function (a gradient reversal layer), an
orthogonal parametrization, a forward hook that keeps an activation for an auxiliary loss, a forward that branches on
a value it reads from the batch, batches that carry strings, namedtuple batches, a model the script compiled itself,
lazy layers, `nn.DataParallel` on the CPU, a MAML-style inner step through `torch.func.functional_call`, a multi-label
BCE loss, frame-wise logits `(B, C, T)` and a loss with learnable parameters (a center loss, optimised
with the model). `zoo_hand.cases()` lists them with the others.
"""

from __future__ import annotations

from collections import namedtuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from zoo_cases import Case, adam, adamw, images, sgd, stateless, vectors, xy_logits, xy_with

VOCAB, T, N = 200, 24, 16
Pair = namedtuple("Pair", ["inputs", "labels"])


def clips(g: torch.Generator):
    """A batch of 8 video clips: (B, 3, 4 frames, 16, 16), 10 classes."""
    return torch.randn(8, 3, 4, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)


def conv3d_net():
    return nn.Sequential(nn.Conv3d(3, 8, 3, padding=1), nn.BatchNorm3d(8), nn.ReLU(), nn.AdaptiveAvgPool3d(1),
                         nn.Flatten(), nn.Linear(8, 10))


class Backbone(nn.Module):
    """A small conv backbone and a linear head, as a transfer-learning script has them."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                      nn.Flatten())
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.features(x))


def frozen_backbone():
    """The backbone's weights frozen (requires_grad False, BatchNorm in eval as the script sets it), the head
    trained: `optimizer = SGD(model.head.parameters())`."""
    m = Backbone()
    for p in m.features.parameters():
        p.requires_grad_(False)
    return m


def head_only(m: nn.Module):
    return torch.optim.SGD(m.head.parameters(), lr=0.05, momentum=0.9)


def two_groups(m: nn.Module):
    """Fine-tuning's parameter groups: the backbone at a tenth of the head's LR."""
    return torch.optim.AdamW([{"params": m.features.parameters(), "lr": 1e-4},
                              {"params": m.head.parameters(), "lr": 1e-3}], weight_decay=0.01)


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable rank-4 update B @ A (B starts at zero, as LoRA's does)."""

    def __init__(self, d_in: int, d_out: int, rank: int = 4):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, d_in) * 0.01)
        self.b = nn.Parameter(torch.zeros(d_out, rank))

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


def lora_mlp():
    return nn.Sequential(LoRALinear(32, 64), nn.ReLU(), LoRALinear(64, 10))


def trainable(m: nn.Module):
    return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)


class PackedLSTM(nn.Module):
    """Variable-length sequences through `pack_padded_sequence`: the classifier reads each one's last real step."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32, padding_idx=0)
        self.lstm = nn.LSTM(32, 48, batch_first=True)
        self.fc = nn.Linear(48, 4)

    def forward(self, tokens, lengths):
        packed = pack_padded_sequence(self.emb(tokens), lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = pad_packed_sequence(out, batch_first=True)
        last = out[torch.arange(out.shape[0]), lengths - 1]
        return self.fc(last)


def padded(g: torch.Generator):
    lengths = torch.randint(3, T + 1, (N,), generator=g)
    tokens = torch.randint(1, VOCAB, (N, T), generator=g)
    tokens[torch.arange(T)[None, :] >= lengths[:, None]] = 0
    return tokens, lengths, torch.randint(0, 4, (N,), generator=g)


def packed_plain(model, batch):
    tokens, lengths, y = batch
    return F.cross_entropy(model(tokens, lengths), y)


class MaxNormBag(nn.Module):
    """`nn.Embedding(max_norm=1.0)`: every forward renormalises the rows it looks up, in place, under no_grad."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32, max_norm=1.0)
        self.fc = nn.Linear(32, 4)

    def forward(self, tokens):
        return self.fc(self.emb(tokens).mean(1))


def token_labels(g: torch.Generator):
    return torch.randint(0, VOCAB, (N, T), generator=g), torch.randint(0, 4, (N,), generator=g)


def qat_mlp():
    """Fake-quantised activations (torch.ao's FakeQuantize: its observer updates buffers in every forward)."""
    from torch.ao.quantization import FakeQuantize
    return nn.Sequential(nn.Linear(32, 64), FakeQuantize(), nn.ReLU(), nn.Linear(64, 10), FakeQuantize())


class GradReverse(torch.autograd.Function):
    """Domain-adversarial training's gradient reversal: identity forward, negated (and scaled) gradient back."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


class DomainAdversarial(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU())
        self.label, self.domain = nn.Linear(64, 10), nn.Linear(64, 2)

    def forward(self, x):
        h = self.body(x)
        return self.label(h), self.domain(GradReverse.apply(h, 0.5))


def dann_step():
    def step_fn(model, batch):
        x, y = batch
        logits, dom = model(x)
        return F.cross_entropy(logits, y) + F.cross_entropy(dom, (y % 2))
    return step_fn


def dann_probe(model, batch):
    return dann_step()(model, batch)


def orthogonal_mlp():
    return nn.Sequential(nn.utils.parametrizations.orthogonal(nn.Linear(32, 32)), nn.ReLU(), nn.Linear(32, 10))


class HookedAux(nn.Module):
    """A forward hook keeps the hidden activation on the module; the step adds an L2 penalty on it."""

    def __init__(self):
        super().__init__()
        self.body, self.fc = nn.Sequential(nn.Linear(32, 64), nn.ReLU()), nn.Linear(64, 10)
        self.kept = None
        self.body.register_forward_hook(self._keep)

    def _keep(self, module, args, out):
        self.kept = out

    def forward(self, x):
        return self.fc(self.body(x))


def hooked_step():
    def step_fn(model, batch):
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits, y) + 1e-3 * model.kept.pow(2).mean()
    return step_fn


def hooked_probe(model, batch):
    return hooked_step()(model, batch)


class Branches(nn.Module):
    """Data-dependent control flow: the forward reads a value from the batch (`.item()`) and picks a branch."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 10), nn.Linear(32, 10)

    def forward(self, x):
        return self.a(x) if x.mean().item() > 0 else self.b(x)


def named_batch(g: torch.Generator):
    x, y = vectors()(g)
    return {"image": x, "label": y, "path": [f"img_{i:04d}.jpg" for i in range(len(y))]}


def named_plain(model, batch):
    return F.cross_entropy(model(batch["image"]), batch["label"])


def pair_batch(g: torch.Generator):
    return Pair(*vectors()(g))


def pair_plain(model, batch):
    return F.cross_entropy(model(batch.inputs), batch.labels)


def mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def compiled_mlp():
    """The script compiled the model itself (`model = torch.compile(model)`): fit gets an OptimizedModule."""
    return torch.compile(mlp())


def lazy_mlp():
    """Lazy layers, shaped by one dry forward before the optimizer is made (as torch's docs say to)."""
    m = nn.Sequential(nn.LazyLinear(64), nn.ReLU(), nn.LazyLinear(10))
    m(torch.zeros(2, 32))
    return m


def data_parallel_mlp():
    return nn.DataParallel(mlp())


def maml_step():
    """One inner SGD step on half the batch through `torch.func.functional_call` (create_graph: second order), the
    outer loss on the other half at the adapted weights."""
    from torch.func import functional_call

    def step_fn(model, batch):
        x, y = batch
        h = x.shape[0] // 2
        params = dict(model.named_parameters())
        inner = F.cross_entropy(functional_call(model, params, (x[:h],)), y[:h])
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
        adapted = {k: v - 0.1 * g for (k, v), g in zip(params.items(), grads)}
        return F.cross_entropy(functional_call(model, adapted, (x[h:],)), y[h:])
    return step_fn


def maml_probe(model, batch):
    return xy_logits(model, batch)


def multi_hot(g: torch.Generator):
    return torch.randn(32, 32, generator=g), (torch.rand(32, 10, generator=g) < 0.2).float()


def frame_net():
    """Frame-wise classes from a 1-D conv net: logits (B, C, T) for targets (B, T), as F.cross_entropy takes them."""
    return nn.Sequential(nn.Conv1d(8, 32, 5, padding=2), nn.ReLU(), nn.Conv1d(32, 6, 1))


def frames(g: torch.Generator):
    return torch.randn(16, 8, 50, generator=g), torch.randint(0, 6, (16, 50), generator=g)


def frame_plain(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


class CenterLoss(nn.Module):
    """Cross-entropy plus a center loss: each class's learnable center in logit space (its parameters are the
    loss's, handed to the script's optimizer beside the model's)."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.centers = nn.Parameter(torch.zeros(classes, classes))

    def forward(self, logits, y):
        return F.cross_entropy(logits, y) + 0.01 * (logits - self.centers[y]).pow(2).sum(1).mean()


CENTER = CenterLoss()  # one object per process, as a script has one (its state reset per run by `center_opt`)


def center_opt(m: nn.Module):
    with torch.no_grad():
        CENTER.centers.zero_()
    CENTER.centers.grad = None
    return torch.optim.Adam(list(m.parameters()) + list(CENTER.parameters()), lr=1e-3)


def center_plain(model, batch):
    x, y = batch
    return CENTER(model(x), y)


def cases() -> list[Case]:
    return [
        Case("hand/conv3d_video", "hand", conv3d_net, clips, xy_logits, sgd(0.05, momentum=0.9),
             note="Conv3d + BatchNorm3d on (B, C, T, H, W) clips"),
        Case("hand/frozen_backbone", "hand", frozen_backbone, images(16, 16), xy_logits, head_only,
             note="requires_grad False on the backbone, the optimizer over the head alone"),
        Case("hand/param_groups_lrs", "hand", Backbone, images(16, 16), xy_logits, two_groups,
             note="AdamW with two parameter groups at their own LRs"),
        Case("hand/lora_adapter", "hand", lora_mlp, vectors(), xy_logits, trainable,
             note="frozen linear layers with trainable low-rank updates"),
        Case("hand/packed_lstm", "hand", PackedLSTM, padded, step_fn=stateless(packed_plain), optimizer=adam(1e-3),
             probe=packed_plain, note="pack_padded_sequence over variable lengths, (tokens, lengths, labels)"),
        Case("hand/embedding_max_norm", "hand", MaxNormBag, token_labels, xy_logits, sgd(0.1),
             note="nn.Embedding(max_norm=1.0) renormalises rows in place in forward"),
        Case("hand/qat_fake_quant", "hand", qat_mlp, vectors(), xy_logits, sgd(0.05, momentum=0.9),
             note="torch.ao FakeQuantize after each layer (observers update buffers)"),
        Case("hand/grad_reversal", "hand", DomainAdversarial, vectors(), step_fn=dann_step, optimizer=adam(1e-3),
             probe=dann_probe, note="a custom autograd.Function (gradient reversal), two heads"),
        Case("hand/orthogonal_param", "hand", orthogonal_mlp, vectors(), xy_logits, adam(1e-3),
             note="nn.utils.parametrizations.orthogonal on a Linear"),
        Case("hand/forward_hook_aux", "hand", HookedAux, vectors(), step_fn=hooked_step, optimizer=adam(1e-3),
             probe=hooked_probe, note="a forward hook keeps an activation for an auxiliary loss"),
        Case("hand/data_dependent_branch", "hand", Branches, vectors(), xy_logits, sgd(0.05),
             note="forward picks a branch from x.mean().item()"),
        Case("hand/batch_with_strings", "hand", mlp, named_batch, step_fn=stateless(named_plain), optimizer=adamw(1e-3),
             probe=named_plain, note="dict batches with a list of file names beside the tensors"),
        Case("hand/namedtuple_batch", "hand", mlp, pair_batch, step_fn=stateless(pair_plain), optimizer=adamw(1e-3),
             probe=pair_plain, note="batches as a namedtuple (inputs, labels)"),
        Case("hand/user_compiled", "hand", compiled_mlp, vectors(), xy_logits, adamw(1e-3),
             note="the script's own torch.compile(model): an OptimizedModule"),
        Case("hand/lazy_layers", "hand", lazy_mlp, vectors(), xy_logits, adam(1e-3),
             note="nn.LazyLinear, shaped by a dry forward"),
        Case("hand/data_parallel_cpu", "hand", data_parallel_mlp, vectors(), xy_logits, sgd(0.05),
             note="nn.DataParallel around the model, on the CPU"),
        Case("hand/maml_functional_call", "hand", mlp, vectors(), step_fn=maml_step, optimizer=adam(1e-3),
             probe=maml_probe, note="a second-order inner step through torch.func.functional_call"),
        Case("hand/multilabel_bce", "hand", mlp, multi_hot, xy_with(nn.BCEWithLogitsLoss()), adam(1e-3),
             fit_kwargs={"loss_fn": nn.BCEWithLogitsLoss()}, note="multi-hot float targets, BCEWithLogitsLoss"),
        Case("hand/framewise_conv1d", "hand", frame_net, frames, frame_plain, sgd(0.05, momentum=0.9),
             note="Conv1d logits (B, C, T) for frame targets (B, T), the default loss"),
        Case("hand/loss_with_parameters", "hand", mlp, vectors(), center_plain, center_opt,
             fit_kwargs={"loss_fn": CENTER}, note="a center loss whose centers the optimizer trains with the model"),
    ]
