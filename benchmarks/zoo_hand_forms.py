"""More hand-written forms people train, each as its script writes it: parametrized weights (spectral norm in a
GAN's critic, weight norm), activation checkpointing, a TorchScript submodule, a buffer a forward updates in place,
attention with a padding mask fed as a dict batch, a WGAN-GP critic (a gradient penalty: a double backward inside
the step_fn) and a forward that writes its own input. `zoo_hand.cases()` lists them with the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zoo_cases import Case, adam, adamw, images, sgd, xy_logits

CHANNELS = 16


class _Head(nn.Module):
    """One conv block, global average pooling, a linear classifier; `conv` made by the subclass."""

    def __init__(self, conv: nn.Module, classes: int = 10):
        super().__init__()
        self.conv, self.fc = conv, nn.Linear(CHANNELS, classes)

    def features(self, x):
        return F.relu(self.conv(x))

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3)))


def spectral_norm_cnn():
    return _Head(nn.utils.parametrizations.spectral_norm(nn.Conv2d(3, CHANNELS, 3, padding=1)))


def weight_norm_cnn():
    return _Head(nn.utils.parametrizations.weight_norm(nn.Conv2d(3, CHANNELS, 3, padding=1)))


def scripted_cnn():
    return _Head(torch.jit.script(nn.Conv2d(3, CHANNELS, 3, padding=1)))


class Checkpointed(_Head):
    """A conv + BatchNorm block recomputed in backward (`torch.utils.checkpoint`, non-reentrant)."""

    def __init__(self):
        super().__init__(nn.Sequential(nn.Conv2d(3, CHANNELS, 3, padding=1), nn.BatchNorm2d(CHANNELS)))

    def features(self, x):
        return checkpoint(lambda t: F.relu(self.conv(t)), x, use_reentrant=False)


class CentredFeatures(_Head):
    """A running mean of the features, updated in place by the forward (not a BatchNorm: the module's own)."""

    def __init__(self):
        super().__init__(nn.Conv2d(3, CHANNELS, 3, padding=1))
        self.register_buffer("mean", torch.zeros(CHANNELS))

    def forward(self, x):
        h = self.features(x).mean((2, 3))
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * h.mean(0))
        return self.fc(h - self.mean)


class HalvesItsInput(_Head):
    """A forward that scales its input batch in place before using it."""

    def __init__(self):
        super().__init__(nn.Conv2d(3, CHANNELS, 3, padding=1))

    def forward(self, x):
        x.mul_(0.5)
        return super().forward(x)


class MaskedAttention(nn.Module):
    """Token embeddings, `nn.MultiheadAttention` with a key padding mask, mean over tokens, a classifier."""

    def __init__(self, vocab=100, d=32, classes=4):
        super().__init__()
        self.emb, self.attn, self.fc = nn.Embedding(vocab, d), nn.MultiheadAttention(d, 4, batch_first=True), \
            nn.Linear(d, classes)

    def forward(self, tokens, mask):
        h = self.emb(tokens)
        out, _ = self.attn(h, h, h, key_padding_mask=mask, need_weights=False)
        return self.fc(out.mean(1))


def masked_batch(g: torch.Generator, n=16, t=12):
    mask = torch.zeros(n, t, dtype=torch.bool)
    mask[:, 9:] = True  # the last 3 positions are padding
    return {"tokens": torch.randint(0, 100, (n, t), generator=g), "mask": mask,
            "labels": torch.randint(0, 4, (n,), generator=g)}


def masked_step():
    def step_fn(model, batch):
        return F.cross_entropy(model(batch["tokens"], batch["mask"]), batch["labels"])
    return step_fn


def critic():
    return nn.Sequential(nn.Conv2d(3, CHANNELS, 3, padding=1), nn.LeakyReLU(0.2), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(CHANNELS, 1))


def wgan_gp_step():
    """The critic's WGAN-GP loss: fake minus real scores, plus 10 x the gradient penalty on interpolates."""
    def step_fn(model, batch):
        real = batch[0]
        fake = torch.randn_like(real)
        eps = torch.rand(real.size(0), 1, 1, 1)
        mixed = (eps * real + (1 - eps) * fake).requires_grad_(True)
        grad, = torch.autograd.grad(model(mixed).sum(), mixed, create_graph=True)
        penalty = ((grad.flatten(1).norm(dim=1) - 1) ** 2).mean()
        return model(fake).mean() - model(real).mean() + 10 * penalty
    return step_fn


def wgan_probe(model, batch):
    """The K-step loss without the penalty (no gradients under the probe): the critic's fake minus real score."""
    real = batch[0]
    return model(torch.randn_like(real)).mean() - model(real).mean()


def cases() -> list[Case]:
    img = images(16, 16)
    return [
        Case("hand/spectral_norm_cnn", "hand", spectral_norm_cnn, img, xy_logits, adam(2e-4, betas=(0.5, 0.999)),
             note="a conv under spectral_norm (parametrizations): its power iteration writes buffers in forward"),
        Case("hand/weight_norm_cnn", "hand", weight_norm_cnn, img, xy_logits, sgd(0.05, momentum=0.9),
             note="a conv under weight_norm (parametrizations)"),
        Case("hand/checkpointed_block", "hand", Checkpointed, img, xy_logits, sgd(0.05, momentum=0.9),
             note="torch.utils.checkpoint around a conv + BatchNorm block"),
        Case("hand/torchscript_submodule", "hand", scripted_cnn, img, xy_logits, sgd(0.05, momentum=0.9),
             note="a torch.jit.script conv inside an eager model"),
        Case("hand/buffer_updated_in_forward", "hand", CentredFeatures, img, xy_logits, sgd(0.05, momentum=0.9),
             note="a buffer the forward updates in place (a running mean of its own)"),
        Case("hand/forward_writes_input", "hand", HalvesItsInput, img, xy_logits, sgd(0.05, momentum=0.9),
             note="a forward that scales its input batch in place", fresh_batches=True),
        Case("hand/attention_padding_mask", "hand", MaskedAttention, masked_batch, step_fn=masked_step,
             optimizer=adamw(1e-3), note="nn.MultiheadAttention with key_padding_mask, dict batches"),
        Case("hand/wgan_gp_critic", "hand", critic, img, step_fn=wgan_gp_step, optimizer=adam(1e-4, betas=(0.0, 0.9)),
             probe=wgan_probe, note="a WGAN-GP critic: a gradient penalty (double backward) in the step_fn"),
    ]
