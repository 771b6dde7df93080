"""Built-in workloads for the bench, the tuners and the tests: no download, deterministic.

- `resnet18_cifar`: torchvision's ResNet-18 with the CIFAR stem (3x3 stride-1 first conv,
  no max-pool), the usual model for 32 px images. The torchvision ResNets (18/34/50) take
  the CIFAR stem under 64 px and torchvision's own ImageNet stem from 64 px up (ResNet-50
  at 224 px is the usual GPU benchmark).
- `resnet18-small`: torchvision's ResNet-18 exactly as `resnet18(num_classes=10)` builds it
  (the ImageNet stem: 7x7 stride-2 conv and max-pool) on small images. What a user who does
  not rewrite the stem trains on 32 px: after the stem the feature maps are 8x8 to 1x1, where
  the fixed rules (bf16 + channels_last on a bf16 CPU) lose to a plain fp32 loop.
- `resnet20`: He et al.'s CIFAR ResNet-20 (3 stages of 3 basic blocks, 16/32/64 channels,
  0.27 M parameters, 41 MFLOPs per 32 px image forward): a real residual conv net small
  enough to train to a target accuracy in seconds on 2 CPU cores (the default CPU bench).
- `SyntheticImages`: a CIFAR-shaped (3x32x32, 10 classes) image set made from a seed. Each
  class is a smooth random pattern; a sample is its class pattern, shifted, mirrored and
  scaled in brightness, plus noise. It is learnable (a ResNet reaches high accuracy in a few
  hundred steps) but not trivial in the first steps.
- `digits`: scikit-learn's bundled handwritten digits (1,797 real 8x8 images), upsampled to
  32x32 and repeated over 3 channels, normalised.
- `gpt` on `text`: a small nanoGPT-style language model on bytes of the Python standard
  library's source (bench/text.py; vocabulary padded to a multiple of 64, T24). Image models
  take image data and `gpt` takes `text`: `default_data` picks it, `check_workload` refuses
  a mismatch.

Example:
    >>> train, val = make_datasets("synthetic", train_size=2048, val_size=512)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from torchspeed._extras import require
from torchspeed.bench.text import GPT, byte_text_datasets
from torchspeed.model.spec import build_model

__all__ = ["resnet18_cifar", "create_model", "SyntheticImages", "digits", "make_datasets", "MODELS", "DATASETS",
           "TEXT_MODELS", "TEXT_DATASETS", "default_data", "check_workload", "example_input"]

MODELS = ("resnet20", "resnet18", "resnet18-small", "resnet34", "resnet50", "mlp", "gpt")
DATASETS = ("synthetic", "digits", "text")
TEXT_MODELS = ("gpt",)      # models of token ids (B, T) -> logits (B, T, V)
TEXT_DATASETS = ("text",)   # datasets of (B, T) token windows
BLOCK_SIZE = 128            # tokens per text window (the GPT's context)


def default_data(model: str) -> str:
    """The bench dataset a model trains on when none is named: `text` for `gpt`, else `synthetic`."""
    return "text" if model in TEXT_MODELS else "synthetic"


def check_workload(model: str, data: str) -> None:
    """Raise ValueError when `model` cannot train on `data` (a language model on images, or the reverse)."""
    if (model in TEXT_MODELS) != (data in TEXT_DATASETS):
        need = "text" if model in TEXT_MODELS else "an image dataset (synthetic or digits)"
        raise ValueError(f"model {model!r} trains on {need}, not on {data!r}; "
                         f"leave the data out to get {default_data(model)!r}")


def example_input(model: str, n: int = 2, *, image_size: int = 32) -> torch.Tensor:
    """A batch of `n` inputs of the shape and dtype `model` takes (on the current default device)."""
    if model in TEXT_MODELS:
        return torch.zeros(n, BLOCK_SIZE, dtype=torch.long)
    return torch.randn(n, 3, image_size, image_size)


def resnet18_cifar(num_classes: int = 10) -> nn.Module:
    return _cifar_resnet("resnet18", num_classes)


def _cifar_resnet(name: str, num_classes: int) -> nn.Module:
    torchvision = require("torchvision", "bench", feature=f"model {name!r}")
    model = getattr(torchvision.models, name)(num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet20(num_classes: int = 10, *, widths: tuple[int, int, int] = (16, 32, 64), blocks: int = 3) -> nn.Module:
    """He et al. (2016) CIFAR ResNet-20: a 3x3 stem, 3 stages of `blocks` basic blocks, global pool, linear."""
    layers: list[nn.Module] = [nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()]
    cin = widths[0]
    for stage, cout in enumerate(widths):
        for b in range(blocks):
            layers.append(_BasicBlock(cin, cout, 2 if stage > 0 and b == 0 else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


def create_model(name: str = "resnet18", *, num_classes: int = 10, image_size: int = 32) -> nn.Module:
    """A bench model by name: ResNet-20, the torchvision ResNets, 'mlp' (a small fully-connected net) or 'gpt'.

    The torchvision ResNets get the CIFAR stem under 64 px and their own ImageNet stem from 64 px up.
    A `module:function` or `file.py:function` name is the user's own image model (model/spec.py).
    """
    if ":" in name:
        return build_model(name, num_classes=num_classes)
    if name == "resnet20":
        return resnet20(num_classes)
    if name == "resnet18-small":
        import torchvision

        return torchvision.models.resnet18(num_classes=num_classes)
    if name in ("resnet18", "resnet34", "resnet50"):
        if image_size >= 64:
            torchvision = require("torchvision", "bench", feature=f"model {name!r}")
            return getattr(torchvision.models, name)(num_classes=num_classes)
        return _cifar_resnet(name, num_classes)
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * image_size * image_size, 512), nn.ReLU(),
                             nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, num_classes))
    if name == "gpt":  # a byte-level language model: num_classes and image_size do not apply
        return GPT(block_size=BLOCK_SIZE)
    raise ValueError(f"model {name!r} is not one of {', '.join(MODELS)}")


class SyntheticImages(Dataset):
    """Deterministic, learnable, CIFAR-shaped images held in memory as a float tensor."""

    def __init__(self, n: int, *, num_classes: int = 10, size: int = 32, seed: int = 0, noise: float = 0.6,
                 pattern_seed: int = 1234):
        g = torch.Generator().manual_seed(pattern_seed)  # the class patterns: shared by train and val
        low = torch.randn(num_classes, 3, 4, 4, generator=g)
        patterns = F.interpolate(low, size=(size, size), mode="bicubic", align_corners=False)
        patterns = (patterns - patterns.mean()) / patterns.std()
        g = torch.Generator().manual_seed(seed)     # the samples: differ by seed
        self.targets = torch.randint(0, num_classes, (n,), generator=g)
        x = patterns[self.targets]
        shift = torch.randint(-3, 4, (n, 2), generator=g)
        x = torch.stack([torch.roll(img, shifts=(int(s[0]), int(s[1])), dims=(1, 2)) for img, s in zip(x, shift)])
        flip = torch.rand(n, generator=g) < 0.5
        x[flip] = x[flip].flip(-1)
        x = x * (0.7 + 0.6 * torch.rand(n, 1, 1, 1, generator=g))
        x = x + noise * torch.randn(x.shape, generator=g)
        self.data = x.contiguous()
        self.num_classes = num_classes

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        return self.data[i], self.targets[i]


def digits(*, size: int = 32, val_fraction: float = 0.25, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's real handwritten digits as 3x`size`x`size` normalised tensors (train, val)."""
    load_digits = require("sklearn.datasets", "bench", feature="the digits workload").load_digits
    d = load_digits()
    x = torch.from_numpy(d.images).float().unsqueeze(1) / 16.0  # from_numpy: no copy (T11)
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    x = (x - x.mean()) / x.std()
    y = torch.from_numpy(d.target).long()
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(y) * val_fraction)
    val, train = perm[:n_val], perm[n_val:]
    return TensorDataset(x[train].contiguous(), y[train]), TensorDataset(x[val].contiguous(), y[val])


def make_datasets(name: str = "synthetic", *, train_size: int = 4096, val_size: int = 1024,
                  seed: int = 0, image_size: int = 32) -> tuple[Dataset, Dataset]:
    """(train, val) for a bench dataset name, images `image_size` px square (`text`: windows of bytes)."""
    if name == "synthetic":
        return (SyntheticImages(train_size, seed=seed, size=image_size),
                SyntheticImages(val_size, seed=seed + 10_000, size=image_size))
    if name == "digits":
        return digits(seed=seed, size=image_size)
    if name == "text":
        return byte_text_datasets(train_size=train_size, val_size=val_size, block_size=BLOCK_SIZE, seed=seed)
    raise ValueError(f"dataset {name!r} is not one of {', '.join(DATASETS)}")
