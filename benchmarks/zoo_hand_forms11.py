"""An eleventh set of hand-written forms, conv nets whose switch trial has a bf16 and a channels_last candidate on a
CPU that runs them: a step that scores its accuracy through NumPy (`.numpy()` has no bf16), a small U-Net (skip
connections concatenated, transposed convolutions), a style loss on Gram matrices of a frozen feature net the step
holds (PyTorch's fast-neural-style example), a super-resolution net with `PixelShuffle` (PyTorch's example), a
VQ-VAE (`torch.cdist` to a codebook, the straight-through estimator) and a box head on `torchvision.ops.roi_align`.
`zoo_hand.cases()` lists them with the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo_cases import Case, adam, images, masks, sgd, stateless, xy_logits, xy_with


def cnn() -> nn.Module:
    """Three conv blocks, global pooling, a linear head: 10 classes."""
    return nn.Sequential(conv_block(3, 32), nn.MaxPool2d(2), conv_block(32, 64), nn.MaxPool2d(2), conv_block(64, 64),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def numpy_metric_step():
    """The step scores the batch's accuracy through NumPy, as scripts that log it each step do."""
    seen: list[float] = []

    def step_fn(model, batch):
        x, y = batch
        logits = model(x)
        seen.append(float((logits.detach().numpy().argmax(1) == y.numpy()).mean()))
        return F.cross_entropy(logits, y)
    return step_fn


def conv_block(i: int, o: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(inplace=True))


class TinyUNet(nn.Module):
    """Two levels down, two up: skip connections concatenated, transposed convolutions, per-pixel logits."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.d1, self.d2, self.mid = conv_block(3, 16), conv_block(16, 32), conv_block(32, 64)
        self.up2, self.u2 = nn.ConvTranspose2d(64, 32, 2, stride=2), conv_block(64, 32)
        self.up1, self.u1 = nn.ConvTranspose2d(32, 16, 2, stride=2), conv_block(32, 16)
        self.out = nn.Conv2d(16, classes, 1)

    def forward(self, x):
        a = self.d1(x)
        b = self.d2(F.max_pool2d(a, 2))
        c = self.mid(F.max_pool2d(b, 2))
        b = self.u2(torch.cat([self.up2(c), b], 1))
        return self.out(self.u1(torch.cat([self.up1(b), a], 1)))


class Stylizer(nn.Module):
    """A small image-transform net: down, residual, up (fast-neural-style's shape, smaller)."""

    def __init__(self):
        super().__init__()
        self.down = nn.Sequential(conv_block(3, 16), nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU())
        self.res = nn.Sequential(conv_block(32, 32), nn.Conv2d(32, 32, 3, padding=1))
        self.up = nn.Sequential(nn.Upsample(scale_factor=2), nn.Conv2d(32, 3, 3, padding=1))

    def forward(self, x):
        h = self.down(x)
        return self.up(h + self.res(h))


def gram(f: torch.Tensor) -> torch.Tensor:
    b, c, h, w = f.shape
    f = f.flatten(2)
    return f.bmm(f.transpose(1, 2)) / (c * h * w)


def style_step():
    """A frozen feature net held by the step (the example's VGG, small and random here), a style Gram target and a
    content loss on its features."""
    torch.manual_seed(7)
    features = nn.Sequential(conv_block(3, 16), conv_block(16, 32)).eval().requires_grad_(False)
    style = torch.rand(1, 3, 32, 32)
    with torch.no_grad():
        target = gram(features(style))

    def step_fn(model, batch):
        x = batch[0]
        y = model(x)
        fy, fx = features(y), features(x)
        return F.mse_loss(fy, fx) + 1e3 * F.mse_loss(gram(fy), target.expand(len(x), -1, -1))
    return step_fn


def style_probe(model, batch):
    return F.mse_loss(model(batch[0]), batch[0])


class SuperRes(nn.Module):
    """PyTorch's super_resolution example: convolutions, then PixelShuffle(3) to 3x the size."""

    def __init__(self, factor: int = 3):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(32, factor ** 2, 3, padding=1))
        self.shuffle = nn.PixelShuffle(factor)

    def forward(self, x):
        return self.shuffle(self.body(x))


def low_high(g: torch.Generator):
    hi = torch.rand(16, 1, 48, 48, generator=g)
    return F.avg_pool2d(hi, 3), hi


class VQVAE(nn.Module):
    """A conv encoder, a codebook looked up by `torch.cdist`, the straight-through estimator, a conv decoder; its
    loss is reconstruction + codebook + 0.25 x commitment."""

    def __init__(self, codes: int = 32, dim: int = 16):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 32, 4, 2, 1), nn.ReLU(), nn.Conv2d(32, dim, 4, 2, 1))
        self.codebook = nn.Embedding(codes, dim)
        self.dec = nn.Sequential(nn.ConvTranspose2d(dim, 32, 4, 2, 1), nn.ReLU(), nn.ConvTranspose2d(32, 3, 4, 2, 1))

    def forward(self, x):
        z = self.enc(x)
        flat = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
        idx = torch.cdist(flat, self.codebook.weight).argmin(1)
        q = self.codebook(idx).view(z.shape[0], z.shape[2], z.shape[3], -1).permute(0, 3, 1, 2)
        zq = z + (q - z).detach()
        recon = self.dec(zq)
        return F.mse_loss(recon, x) + F.mse_loss(q, z.detach()) + 0.25 * F.mse_loss(z, q.detach())


def vq_loss(model, batch):
    return model(batch[0])


class RoIHead(nn.Module):
    """A conv backbone, `torchvision.ops.roi_align` over given boxes, a class head per box."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.backbone = nn.Sequential(conv_block(3, 16), nn.MaxPool2d(2), conv_block(16, 32))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, classes))

    def forward(self, x, boxes):
        from torchvision.ops import roi_align

        return self.head(roi_align(self.backbone(x), boxes, output_size=4, spatial_scale=0.5, aligned=True))


def images_with_boxes(g: torch.Generator):
    """(images, boxes (K, 5) as (image index, x0, y0, x1, y1), a class per box)."""
    n, k = 8, 24
    xy = torch.rand(k, 2, generator=g) * 20
    wh = 4 + torch.rand(k, 2, generator=g) * 10
    boxes = torch.cat([torch.randint(0, n, (k, 1), generator=g).float(), xy, xy + wh], 1)
    return torch.randn(n, 3, 32, 32, generator=g), boxes, torch.randint(0, 5, (k,), generator=g)


def roi_plain(model, batch):
    x, boxes, y = batch
    return F.cross_entropy(model(x, boxes), y)


def cases() -> list[Case]:
    return [
        Case("hand/numpy_metric_in_step", "hand", cnn, images(16, 32), step_fn=numpy_metric_step,
             optimizer=sgd(0.05, momentum=0.9), probe=xy_logits,
             note="the step scores its accuracy through .numpy() (no bf16 there)"),
        Case("hand/unet_skip_concat", "hand", TinyUNet, masks(8, 32), plain=xy_logits, optimizer=adam(1e-3),
             note="a small U-Net: skips concatenated, transposed convolutions"),
        Case("hand/gram_style_loss", "hand", Stylizer, images(8, 32), step_fn=style_step, optimizer=adam(1e-3),
             probe=style_probe, note="fast-neural-style: Gram matrices of a frozen feature net the step holds"),
        Case("hand/pixel_shuffle_sr", "hand", SuperRes, low_high, plain=xy_with(nn.MSELoss()), optimizer=adam(1e-3),
             fit_kwargs={"loss_fn": nn.MSELoss()}, note="PyTorch's super-resolution example: PixelShuffle, MSE"),
        Case("hand/vq_vae_cdist", "hand", VQVAE, images(16, 32), step_fn=stateless(vq_loss), optimizer=adam(1e-3),
             note="VQ-VAE: torch.cdist to a codebook, the straight-through estimator"),
        Case("hand/roi_align_head", "hand", RoIHead, images_with_boxes, plain=roi_plain, optimizer=sgd(0.02, momentum=0.9),
             note="a box head on torchvision.ops.roi_align"),
    ]
