"""Batch augmentation on the device (T05): crop, flip, colour jitter and normalize, uint8 in.

What it does: takes a uint8 NCHW batch already on the accelerator (or the CPU) and, for the
whole batch at once: a per-sample RandomResizedCrop, a random horizontal flip, per-sample
brightness, contrast and saturation jitter (fused into one affine pass), and normalization
(1/255, mean and std folded into one multiply-add). On CUDA the crop of the whole batch is
**one** `torchvision.ops.roi_align` call on the float batch (each sample its own box,
bilinear with adaptive supersampling, so shrinking is antialiased). On a CPU each sample is
cropped and resized on uint8 with torch's antialiased bilinear kernel and only the output is
converted to float, which measured several times faster there than the float roi_align.
The CPU loader only decodes and ships 1 byte per channel instead of 4.

When it helps: on an accelerator, when the loader's CPU time is the bottleneck (few cores per
accelerator), as with DALI. On a CPU-only machine it is *not* a win: every float pass over
the batch is memory-bound there (measured in docs/data.md), so `build_loaders` crops on the
CPU in the loader workers instead (augment="auto") and only converts and normalizes here.
What it costs: the crop is taken from the decoded (already resized) image, so small crops see
fewer source pixels than a full-resolution RandomResizedCrop; clamping is done once at the end
rather than after each jitter step as torchvision does (so values pushed past 0 or 255 by one step
can come back in the next), and the jitter is applied in the fixed order brightness, contrast,
saturation (torchvision shuffles it); no hue jitter (a per-pixel colour-space round trip that costs
more than the rest together).

Kornia's `RandomResizedCrop` + `ColorJitter` do the same on float batches; benchmarks/bench_data.py
measures both (see docs/data.md for which is faster and why this module does not depend on it).

Example:
    >>> aug = DeviceAugment(size=224, train=True).to(device)
    >>> x = aug(x_uint8)           # float32, normalized, (N, 3, 224, 224)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from torchspeed._extras import require
from torchspeed.train.parallel.shard import shard_loader

__all__ = ["DeviceAugment", "DeviceLoader", "IMAGENET_MEAN", "IMAGENET_STD", "random_boxes"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_GRAY = (0.299, 0.587, 0.114)  # ITU-R 601 luma, as torchvision's rgb_to_grayscale


def random_boxes(n: int, h: int, w: int, *, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), device=None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """`n` RandomResizedCrop boxes (x1, y1, x2, y2) in pixel coordinates, drawn on `device` without a loop.

    Like torchvision's get_params: up to 10 draws per sample of area fraction and log-ratio;
    a sample with no valid draw falls back to the whole image clipped to `ratio`.
    """
    tries = 10
    area = h * w * torch.empty(n, tries, device=device).uniform_(scale[0], scale[1], generator=generator)
    logr = torch.empty(n, tries, device=device).uniform_(math.log(ratio[0]), math.log(ratio[1]), generator=generator)
    ar = torch.exp(logr)
    cw = torch.sqrt(area * ar).round()
    ch = torch.sqrt(area / ar).round()
    ok = (cw > 0) & (cw <= w) & (ch > 0) & (ch <= h)
    first = torch.argmax(ok.int(), dim=1)  # first valid try per sample
    idx = torch.arange(n, device=device)
    cw, ch, any_ok = cw[idx, first], ch[idx, first], ok.any(dim=1)
    # Fallback (rare): the largest centred box within the ratio range.
    in_ratio = w / h
    fw = float(w) if in_ratio <= ratio[1] else round(h * ratio[1])
    fh = float(h) if in_ratio >= ratio[0] else round(w / ratio[0])
    cw = torch.where(any_ok, cw, torch.full_like(cw, fw))
    ch = torch.where(any_ok, ch, torch.full_like(ch, fh))
    u = torch.rand(n, 2, device=device, generator=generator)
    x1 = torch.floor(u[:, 0] * (w - cw + 1)).clamp_max(w - cw)
    y1 = torch.floor(u[:, 1] * (h - ch + 1)).clamp_max(h - ch)
    x1 = torch.where(any_ok, x1, (w - cw) / 2).floor()
    y1 = torch.where(any_ok, y1, (h - ch) / 2).floor()
    return torch.stack([x1, y1, x1 + cw, y1 + ch], dim=1)


class DeviceAugment(nn.Module):
    """uint8 NCHW batch -> float normalized batch, with per-sample random crop/flip/jitter when training.

    Options (keyword-only): `size` (output side; None keeps the input size), `train`
    (False: only convert + normalize, plus a resize to `size` if it differs), `crop` (False:
    the loader already cropped and flipped; only jitter + normalize), `scale`, `ratio`
    (RandomResizedCrop), `flip` (probability 0.5), `brightness`, `contrast`, `saturation`
    (jitter strengths as torchvision's ColorJitter), `mean`, `std` (in 0..1 units),
    `channels_last` (return channels_last memory), `dtype` (float32; bfloat16/float16 halve the bytes).
    """

    def __init__(self, *, size: int | None = 224, train: bool = True, crop: bool = True, scale=(0.08, 1.0),
                 ratio=(3 / 4, 4 / 3), flip: bool = True, brightness: float = 0.0, contrast: float = 0.0, saturation: float = 0.0,
                 mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                 channels_last: bool = True, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.size, self.train_mode, self.crop, self.scale, self.ratio, self.flip = size, train, crop, scale, ratio, flip
        self.brightness, self.contrast, self.saturation = brightness, contrast, saturation
        self.channels_last, self.dtype = channels_last, dtype
        # normalize((x / 255) - mean) / std as one multiply-add: x * a + b
        std_t = torch.tensor(std, dtype=torch.float32)
        self.register_buffer("_a", (1.0 / (255.0 * std_t)).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("_b", (-torch.tensor(mean, dtype=torch.float32) / std_t).view(1, 3, 1, 1),
                             persistent=False)
        self.register_buffer("_gray", torch.tensor(_GRAY, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)

    def extra_repr(self) -> str:
        return (f"size={self.size}, train={self.train_mode}, crop={self.crop}, scale={self.scale}, flip={self.flip}, "
                f"brightness={self.brightness}, contrast={self.contrast}, saturation={self.saturation}")

    @torch.no_grad()
    def forward(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        if x.dtype != torch.uint8 or x.dim() != 4 or x.shape[1] != 3:
            raise ValueError(f"DeviceAugment expects a uint8 (N, 3, H, W) batch, got {tuple(x.shape)} {x.dtype}; "
                             "use a loader that returns uint8 tensors (FastImageFolder, PackedDataset)")
        n, _, h, w = x.shape
        out_hw = (self.size, self.size) if self.size else (h, w)
        if self.train_mode and self.crop:
            boxes = random_boxes(n, h, w, scale=self.scale, ratio=self.ratio, device=x.device, generator=generator)
            flip = torch.rand(n, device=x.device, generator=generator) < 0.5 if self.flip else None
            if x.device.type == "cpu":
                u8 = self._crop_cpu(x, boxes, out_hw, flip)
                # The only dtype conversion, into NCHW: the per-channel/per-sample broadcasts below
                # vectorize over H*W there, but crawl over the 3-wide inner dim of channels_last.
                xf = torch.empty(u8.shape, dtype=torch.float32).copy_(u8)
            else:
                xf = self._crop(x.float(), boxes, out_hw)  # the only dtype conversion, then one kernel
                if flip is not None:
                    # Only the flipped half is touched. (roi_align with x1 > x2 would flip for free,
                    # but its adaptive sampling grid rejects negative widths.)
                    xf[flip] = xf[flip].flip(-1)
            xf = self._jitter(xf, generator)
        else:
            xf = x.float()
            if (h, w) != out_hw:
                xf = torch.nn.functional.interpolate(xf, size=out_hw, mode="bilinear", antialias=True,
                                                     align_corners=False)
            if self.train_mode:
                xf = self._jitter(xf, generator)
        out = torch.addcmul(self._b, xf, self._a)
        if self.channels_last:
            out = out.contiguous(memory_format=torch.channels_last)
        return out.to(self.dtype)

    @staticmethod
    def _crop_cpu(x: torch.Tensor, boxes: torch.Tensor, size, flip: torch.Tensor | None) -> torch.Tensor:
        """CPU: crop + antialiased bilinear resize per sample on uint8 (torch's AVX2 uint8 kernel, fastest
        on channels_last input), so only the output is converted to float. Measured 5-10x faster than
        float roi_align on a CPU; on CUDA one batched roi_align call wins (one kernel instead of N)."""
        hw = (size, size) if isinstance(size, int) else size
        x = x.contiguous(memory_format=torch.channels_last)
        out = torch.empty(x.shape[0], 3, *hw, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
        fl = flip.tolist() if flip is not None else [False] * x.shape[0]
        for i, (x1, y1, x2, y2) in enumerate(boxes.round().int().tolist()):
            crop = torch.nn.functional.interpolate(x[i:i + 1, :, y1:y2, x1:x2], size=hw, mode="bilinear",
                                                   antialias=True, align_corners=False)
            out[i] = crop[0].flip(-1) if fl[i] else crop[0]
        return out

    @staticmethod
    def _crop(xf: torch.Tensor, boxes: torch.Tensor, size: int | tuple[int, int]) -> torch.Tensor:
        roi_align = require("torchvision.ops", "data", feature="DeviceAugment's crop").roi_align
        rois = torch.cat([torch.arange(len(boxes), device=boxes.device, dtype=boxes.dtype)[:, None], boxes], 1)
        # sampling_ratio=0: ceil(box/size) samples per output pixel and axis, i.e. area-averaging when shrinking.
        hw = (size, size) if isinstance(size, int) else size
        return roi_align(xf, rois, output_size=hw, spatial_scale=1.0, sampling_ratio=0, aligned=True)

    def _jitter(self, xf: torch.Tensor, generator) -> torch.Tensor:
        """Brightness b, contrast c, saturation s as one per-sample affine map of (x, grey(x)).

        With g = grey(x) per pixel and m = mean grey of the image: brightness gives b*x,
        contrast (b*x - b*m)*c + b*m, saturation (y - grey(y))*s + grey(y). Grey is linear
        (its weights sum to 1), so the three compose to
            x'' = s*c*b * x + (1-s)*c*b * g + (1-c)*b*m,
        computed in one pass over the batch instead of three passes per operation.
        """
        if not (self.brightness or self.contrast or self.saturation):
            return xf
        n = xf.shape[0]

        def factor(strength: float) -> torch.Tensor:
            if not strength:
                return torch.ones(n, 1, 1, 1, device=xf.device)
            lo, hi = max(0.0, 1 - strength), 1 + strength
            return torch.empty(n, 1, 1, 1, device=xf.device).uniform_(lo, hi, generator=generator)

        b, c, s = factor(self.brightness), factor(self.contrast), factor(self.saturation)
        g = _grey(xf)                                                      # (n, 1, H, W)
        shift = (1 - c) * b * g.mean((2, 3), keepdim=True) if self.contrast else torch.zeros_like(b)
        base = torch.addcmul(shift, g, (1 - s) * c * b) if self.saturation else shift
        return torch.addcmul(base, xf, s * c * b).clamp_(0.0, 255.0)


def _grey(xf: torch.Tensor) -> torch.Tensor:
    w = _GRAY
    return (xf[:, 0:1] * w[0]).add_(xf[:, 1:2], alpha=w[1]).add_(xf[:, 2:3], alpha=w[2])


class DeviceLoader:
    """Wrap a loader of (uint8 images, labels): move each batch to `device` and run `augment` there.

    Keeps `len()` and the loader's `sampler` (so `fit` can call `set_epoch`), so it can be
    passed to `torchspeed.fit` as the training or validation loader. On CUDA the uint8 copy
    is asynchronous from pinned memory (T07) and is 4x smaller than a float batch. Under
    `torchspeed launch`, `fit` gives each process its part through `shard` (T31).

    Example:
        >>> train = DeviceLoader(DataLoader(ds, batch_size=64, num_workers=4, pin_memory=True,
        ...                                 collate_fn=uint8_collate), DeviceAugment(size=224), "cuda")
        >>> torchspeed.fit(model, train, epochs=10)
    """

    def __init__(self, loader: Iterable, augment: nn.Module, device: torch.device | str):
        self.loader = loader
        self.device = torch.device(device)
        self.augment = augment.to(self.device)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    @property
    def sampler(self):
        return getattr(self.loader, "sampler", None)

    @property
    def dataset(self):
        return getattr(self.loader, "dataset", None)

    def shard(self, rank: int, world_size: int, *, for_eval: bool = False, seed: int = 0) -> DeviceLoader:
        """Process `rank`'s part of the data, on the same device with the same augmentation.

        The loader inside is split by `torchspeed.train.parallel.shard.shard_loader` (training: a
        DistributedSampler, equal batch counts on every rank; evaluation: every world_size-th
        sample, each counted once); `shard_loader` calls this for a DeviceLoader.

        Example:
            >>> half = loader.shard(1, 2)   # rank 1 of 2
        """
        inner = shard_loader(self.loader, for_eval=for_eval, seed=seed, rank=rank, world_size=world_size)
        return self if inner is self.loader else DeviceLoader(inner, self.augment, self.device)

    def __iter__(self) -> Iterator:
        nb = self.device.type == "cuda"
        for x, y, *rest in self.loader:
            x = x.to(self.device, non_blocking=nb)
            y = y.to(self.device, non_blocking=nb)
            yield (self.augment(x), y, *rest)
