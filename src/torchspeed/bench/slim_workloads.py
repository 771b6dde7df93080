"""The workloads of `torchspeed bench --slim` (T38): data, the full model, and its quarter-width student.

- `digits_resnet20`, `digits_cnn`: scikit-learn's handwritten digits (10 classes) with ResNet-20 at 32 px and the
  suite's digits CNN at 8 px. Both the prune rows and the distillation rows run on them (the trained full model
  is the teacher).
- `digit_pairs_cnn`, `digit_pairs_vit`: two digits side by side (8x16 px), the class the two-digit number
  (100 classes), with a CNN that pools each half apart and a two-layer Vision Transformer over 4x4 patches.
  Distillation rows only (the teacher is trained first, its seconds not counted: it is given). The training pairs
  are drawn from the digits' training split and the validation pairs from its validation split, so no validation
  digit was seen in training. Here the quarter-width students fall 3-5 points short of their teachers when trained
  from labels alone; on the 10-class digits they come within 1-2 points, which leaves a teacher little to add.

Nothing is downloaded: the digits ship with scikit-learn.

Example:
    >>> (x, y), (vx, vy) = digit_pairs(seed=0)
    >>> x.shape, int(y.max())
    (torch.Size([12000, 1, 8, 16]), 99)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from torchspeed.bench.workloads import digits, resnet20

__all__ = ["SlimWorkload", "SLIM_WORKLOADS", "digit_pairs", "pairs_vit", "digits_cnn"]

Tensors = tuple[torch.Tensor, torch.Tensor]


def digits_cnn(widths: tuple[int, int, int] = (32, 32, 64), *, num_classes: int = 10, pool: tuple[int, int] = (1, 1),
               in_channels: int = 1) -> nn.Module:
    """The suite's digits CNN (bench/suite.py digits_cnn) with its widths as a parameter; `pool=(1, 2)` keeps the
    left and right halves of the image apart (a digit pair's two digits)."""
    a, b, c = widths
    return nn.Sequential(nn.Conv2d(in_channels, a, 3, padding=1), nn.BatchNorm2d(a), nn.ReLU(),
                         nn.Conv2d(a, b, 3, padding=1), nn.BatchNorm2d(b), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(b, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(pool), nn.Flatten(), nn.Linear(c * pool[0] * pool[1], num_classes))


class _PatchViT(nn.Module):
    """A small Vision Transformer: 4x4 patches of a one-channel image, learned positions, pre-norm encoder layers
    (torch's own), the mean token, a linear head."""

    def __init__(self, dim: int, num_classes: int, *, image: tuple[int, int] = (8, 16), patch: int = 4,
                 depth: int = 2):
        super().__init__()
        self.patch = patch
        tokens = (image[0] // patch) * (image[1] // patch)
        self.embed = nn.Linear(patch * patch, dim)
        self.pos = nn.Parameter(torch.zeros(tokens, dim))
        layer = nn.TransformerEncoderLayer(dim, max(1, dim // 16), 2 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.patch
        patches = x[:, 0].unfold(1, p, p).unfold(2, p, p).reshape(x.shape[0], -1, p * p)
        return self.head(self.encoder(self.embed(patches) + self.pos).mean(1))


def pairs_vit(dim: int = 64, num_classes: int = 100) -> nn.Module:
    return _PatchViT(dim, num_classes)


def _digits(size: int, channels: int, seed: int) -> tuple[Tensors, Tensors]:
    train, val = digits(size=size, seed=seed)
    (x, y), (vx, vy) = train.tensors, val.tensors
    return (x[:, :channels].contiguous(), y), (vx[:, :channels].contiguous(), vy)


def digit_pairs(*, seed: int = 0, train_size: int = 12_000, val_size: int = 3_000) -> tuple[Tensors, Tensors]:
    """Two 8x8 digits side by side (1x8x16, normalised as `digits` does), labelled 10 x left + right: pairs of
    the digits' training split for training, of its validation split for validation."""
    (x, y), (vx, vy) = _digits(8, 1, seed)

    def pair(images: torch.Tensor, labels: torch.Tensor, n: int, draw: int) -> Tensors:
        g = torch.Generator().manual_seed(draw)
        left, right = torch.randint(len(labels), (2, n), generator=g)
        return torch.cat([images[left], images[right]], dim=3).contiguous(), labels[left] * 10 + labels[right]
    return pair(x, y, train_size, seed + 11), pair(vx, vy, val_size, seed + 12)


@dataclass(frozen=True)
class SlimWorkload:
    """`data(seed)` -> ((x, y), (val_x, val_y)); `full()` the teacher (and the model the prune rows cut);
    `student()` a quarter of its width. `prune`: the prune rows run on it too (else distillation only)."""
    data: Callable[[int], tuple[Tensors, Tensors]]
    full: Callable[[], nn.Module]
    student: Callable[[], nn.Module]
    prune: bool = True


SLIM_WORKLOADS: dict[str, SlimWorkload] = {
    "digits_resnet20": SlimWorkload(lambda s: _digits(32, 3, s), resnet20, lambda: resnet20(widths=(4, 8, 16))),
    "digits_cnn": SlimWorkload(lambda s: _digits(8, 1, s), digits_cnn, lambda: digits_cnn((8, 8, 16))),
    "digit_pairs_cnn": SlimWorkload(lambda s: digit_pairs(seed=s), lambda: digits_cnn(num_classes=100, pool=(1, 2)),
                                    lambda: digits_cnn((8, 8, 16), num_classes=100, pool=(1, 2)), prune=False),
    "digit_pairs_vit": SlimWorkload(lambda s: digit_pairs(seed=s), lambda: pairs_vit(64), lambda: pairs_vit(16),
                                    prune=False),
}
