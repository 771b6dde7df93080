"""A seventh set of hand-written forms: a noise layer that draws from a `torch.Generator` of its own, a triplet
loss mined within the batch, a CLIP-style two-tower model whose learnable temperature the step clamps in place,
the script's own `nn.CrossEntropyLoss` as `loss_fn` (label smoothing; class weights), segmentation targets that
mark unlabelled pixels 255 (`ignore_index=255`), and uint8 images the model scales itself. `zoo_hand.cases()` lists
them with the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo_cases import Case, adam, images, mlp, sgd, stateless, vectors, xy_logits, xy_with


def mlp64() -> nn.Module:
    return mlp(hidden=64)


class OwnGeneratorNoise(nn.Module):
    """Gaussian noise on the hidden layer in training, drawn from the module's own torch.Generator (seeded once)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 10)
        self.gen = torch.Generator().manual_seed(7)

    def forward(self, x):
        h = F.relu(self.a(x))
        if self.training:
            h = h + 0.3 * torch.randn(h.shape, generator=self.gen, dtype=h.dtype)
        return self.b(h)


class Embedder(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))

    def forward(self, x):
        return F.normalize(self.net(x), dim=-1)


def triplet_loss(model, batch):
    """Batch-hard triplet loss: for each anchor its farthest positive and nearest negative in the batch."""
    x, y = batch
    e = model(x)
    d = torch.cdist(e, e)
    same = y[:, None] == y[None, :]
    hardest_pos = (d * same).max(1).values
    hardest_neg = d.masked_fill(same, float("inf")).min(1).values
    return F.relu(hardest_pos - hardest_neg + 0.2).mean()


class TwoTower(nn.Module):
    """CLIP's shape: two encoders, normalised embeddings, a learnable log temperature."""

    def __init__(self):
        super().__init__()
        self.img = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
        self.txt = nn.Sequential(nn.Embedding(100, 32), nn.Flatten(), nn.Linear(32 * 4, 16))
        self.logit_scale = nn.Parameter(torch.tensor(2.6593))  # log(1 / 0.07)

    def forward(self, image, text):
        a, b = F.normalize(self.img(image), dim=-1), F.normalize(self.txt(text), dim=-1)
        return self.logit_scale.exp() * a @ b.t()


def pairs(g: torch.Generator):
    return torch.randn(32, 32, generator=g), torch.randint(0, 100, (32, 4), generator=g)


def clip_loss(model, batch):
    image, text = batch
    logits = model(image, text)
    labels = torch.arange(logits.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def clip_step(model, batch):
    """CLIP's loop clamps the temperature (at most 100) before each step's forward, in place."""
    with torch.no_grad():
        model.logit_scale.clamp_(0, 4.6052)
    return clip_loss(model, batch)


class TinyFCN(nn.Module):
    def __init__(self, classes: int = 5):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, classes, 1))

    def forward(self, x):
        return self.body(x)


def masks_with_void(g: torch.Generator):
    """(images, per-pixel classes 0-4 with a void border of 255s), as VOC and Cityscapes label them."""
    y = torch.randint(0, 5, (8, 16, 16), generator=g)
    y[:, :2], y[:, :, -2:] = 255, 255
    return torch.randn(8, 3, 16, 16, generator=g), y


class ScalesItsInput(nn.Module):
    """Takes uint8 images and scales and normalises them itself (the loader hands it raw pixels)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

    def forward(self, x):
        return self.net((x.float() / 255 - self.mean) / self.std)


def uint8_images(g: torch.Generator):
    return torch.randint(0, 256, (16, 3, 16, 16), generator=g, dtype=torch.uint8), torch.randint(0, 10, (16,),
                                                                                                  generator=g)


def cases() -> list[Case]:
    smooth = nn.CrossEntropyLoss(label_smoothing=0.1)
    weighted = nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2.0, 10))
    void = nn.CrossEntropyLoss(ignore_index=255)
    return [
        Case("hand/own_generator_noise", "hand", OwnGeneratorNoise, vectors(), xy_logits, adam(1e-3),
             note="noise drawn from a torch.Generator the module holds"),
        Case("hand/triplet_batch_hard", "hand", Embedder, vectors(n=32, classes=4), step_fn=stateless(triplet_loss),
             optimizer=adam(1e-3), probe=triplet_loss, note="batch-hard triplet loss on normalised embeddings"),
        Case("hand/clip_two_tower", "hand", TwoTower, pairs, step_fn=stateless(clip_step), optimizer=adam(1e-3),
             probe=clip_loss, note="two towers, learnable temperature clamped in place by the step"),
        Case("hand/label_smoothing_loss_fn", "hand", mlp64, vectors(), xy_with(smooth), sgd(0.05, momentum=0.9),
             fit_kwargs={"loss_fn": smooth}, note="the script's nn.CrossEntropyLoss(label_smoothing=0.1)"),
        Case("hand/class_weighted_ce", "hand", mlp64, vectors(), xy_with(weighted), adam(1e-3),
             fit_kwargs={"loss_fn": weighted}, note="nn.CrossEntropyLoss(weight=...) for imbalanced classes"),
        Case("hand/segmentation_void_255", "hand", TinyFCN, masks_with_void, xy_with(void), sgd(0.05, momentum=0.9),
             fit_kwargs={"loss_fn": void}, note="per-pixel targets with unlabelled pixels 255, ignore_index=255"),
        Case("hand/uint8_images", "hand", ScalesItsInput, uint8_images, xy_logits, sgd(0.05, momentum=0.9),
             note="raw uint8 pixels, scaled and normalised inside forward"),
    ]
