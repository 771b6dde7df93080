import math

import pytest
import torch
import torch.nn.functional as F

from torchspeed.data import IMAGENET_MEAN, IMAGENET_STD, DeviceAugment, DeviceLoader, random_boxes


def _batch(n=16, h=40, w=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    # smooth content + noise, uint8
    yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    base = torch.stack([128 + 80 * torch.sin(xx / 7.0), 128 + 80 * torch.cos(yy / 5.0), (xx * 3 + yy * 2) % 256.0])
    x = base[None] + torch.randint(-20, 20, (n, 3, h, w), generator=g)
    return x.clamp(0, 255).to(torch.uint8)


def _normalize(x):
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (x.float() / 255 - mean) / std


def test_eval_mode_is_convert_and_normalize():
    x = _batch()
    out = DeviceAugment(size=None, train=False)(x)
    assert out.dtype == torch.float32 and out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, _normalize(x), rtol=1e-5, atol=1e-5)


def test_eval_resize_matches_interpolate():
    x = _batch()
    out = DeviceAugment(size=24, train=False)(x)
    ref = (F.interpolate(x.float(), size=(24, 24), mode="bilinear", antialias=True) / 255
           - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_whole_image_box_and_flip():
    """scale=1 with the image's own ratio: the crop is the whole image, so each output is x or flip(x)."""
    x = _batch(n=32, h=40, w=40)
    aug = DeviceAugment(size=40, scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=True)
    out = aug(x, generator=torch.Generator().manual_seed(0))
    ref, ref_f = _normalize(x), _normalize(x.flip(-1))
    same = [(out[i] - ref[i]).abs().max().item() < 1e-4 for i in range(32)]
    flipped = [(out[i] - ref_f[i]).abs().max().item() < 1e-4 for i in range(32)]
    assert all(a or b for a, b in zip(same, flipped))
    assert 6 < sum(flipped) < 26 and sum(same) > 6


def test_crop_matches_resized_crop():
    """One roi_align call == per-sample crop + bilinear resize (interior pixels; upsampling)."""
    from torchspeed.data.augment import DeviceAugment as DA

    x = _batch(n=4).float()
    boxes = torch.tensor([[4.0, 2.0, 20.0, 18.0], [0.0, 0.0, 16.0, 24.0], [30.0, 10.0, 46.0, 38.0], [8, 8, 24, 24]])
    out = DA._crop(x, boxes, 32)
    for i, (x1, y1, x2, y2) in enumerate(boxes.int().tolist()):
        ref = F.interpolate(x[i:i + 1, :, y1:y2, x1:x2], size=(32, 32), mode="bilinear", align_corners=False)
        torch.testing.assert_close(out[i, :, 2:-2, 2:-2], ref[0, :, 2:-2, 2:-2], rtol=1e-4, atol=1e-3)
    # shrinking is area-averaged (antialiased): a 2x reduction of the whole image is a 2x2 mean
    half = DA._crop(x, torch.tensor([[0.0, 0.0, 48.0, 40.0]] * 4), (20, 24))
    torch.testing.assert_close(half, F.avg_pool2d(x, 2), rtol=1e-5, atol=1e-4)


def test_cpu_uint8_path_matches_roi_align_path():
    from torchspeed.data.augment import DeviceAugment as DA

    x = _batch(n=6, h=40, w=48)
    boxes = torch.tensor([[4.0, 2.0, 20.0, 18.0], [0.0, 0.0, 16.0, 24.0], [30.0, 10.0, 46.0, 38.0],
                          [8, 8, 24, 24], [0, 0, 48, 40], [10, 4, 40, 36]])
    flip = torch.tensor([False, True, False, True, False, True])
    ours = DA._crop_cpu(x, boxes, 32, flip).float()
    ref = DA._crop(x.float(), boxes, 32)
    ref[flip] = ref[flip].flip(-1)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert (ours - ref)[..., 2:-2, 2:-2].abs().mean() < 2.0  # uint8 rounding + resampling filter
    assert (ours - ref.flip(-1))[..., 2:-2, 2:-2].abs().mean() > 10  # a missed flip would show


def test_random_boxes_follow_scale_and_ratio():
    b = random_boxes(4000, 300, 400, generator=torch.Generator().manual_seed(0))
    w, h = b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]
    assert (b[:, 0] >= 0).all() and (b[:, 1] >= 0).all() and (b[:, 2] <= 400).all() and (b[:, 3] <= 300).all()
    frac = w * h / (300 * 400)
    assert frac.min() >= 0.07 and frac.max() <= 1.0
    r = w / h
    assert r.min() >= 0.74 and r.max() <= 1.35
    # the same distribution as torchvision's RandomResizedCrop.get_params (mean area fraction)
    from torchvision.transforms import RandomResizedCrop

    torch.manual_seed(0)
    tv = torch.tensor([RandomResizedCrop.get_params(torch.empty(1, 300, 400), (0.08, 1.0), (3 / 4, 4 / 3))
                       for _ in range(4000)], dtype=torch.float)
    assert abs(frac.mean().item() - (tv[:, 2] * tv[:, 3]).mean().item() / 120000) < 0.03


def test_jitter_brightness_contrast_saturation():
    x = _batch(n=64, h=24, w=24)
    ident = dict(size=24, scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=False)
    g = torch.Generator().manual_seed(1)
    gray = torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)

    def raw(out):  # undo the normalization: back to 0..255
        return (out * std + mean) * 255

    # contrast alone keeps each image's mean grey level (up to clamping) and changes its spread
    out = raw(DeviceAugment(contrast=0.5, **ident)(x, generator=g))
    xf = x.float()
    m_in, m_out = (xf * gray).sum(1).mean((1, 2)), (out * gray).sum(1).mean((1, 2))
    assert (m_in - m_out).abs().median() < 2.0
    spread = (out.std((1, 2, 3)) / xf.std((1, 2, 3)))
    assert spread.min() < 0.8 and spread.max() > 1.2
    # saturation 0..: grey stays grey; with strength 1 some images lose all colour
    out = raw(DeviceAugment(saturation=1.0, **ident)(x, generator=g))
    chroma_in = (xf - (xf * gray).sum(1, keepdim=True)).abs().mean((1, 2, 3))
    chroma_out = (out - (out * gray).sum(1, keepdim=True)).abs().mean((1, 2, 3))
    ratio = chroma_out / chroma_in
    assert ratio.min() < 0.3 and ratio.max() > 1.3
    # brightness: each output is the input times one factor in [0.5, 1.5] (then clamped)
    out = raw(DeviceAugment(brightness=0.5, **ident)(x, generator=g))
    kept = (out < 254.0).float()  # pixels the final clamp did not touch
    f = (out * kept).sum((1, 2, 3)) / (xf * kept).sum((1, 2, 3))
    assert f.min() >= 0.49 and f.max() <= 1.51 and f.max() - f.min() > 0.5
    torch.testing.assert_close(out, (xf * f.view(-1, 1, 1, 1)).clamp(0, 255), atol=0.5, rtol=0.02)


def test_crop_false_only_jitters_and_normalizes():
    x = _batch(n=8, h=20, w=20)
    out = DeviceAugment(size=None, crop=False, brightness=0.5)(x, generator=torch.Generator().manual_seed(0))
    assert out.shape == (8, 3, 20, 20)
    plain = _normalize(x)
    assert not torch.allclose(out, plain, atol=1e-3)  # brightness applied
    # no crop and no flip: the brightness factor is the only change (where nothing was clamped)
    corr = [torch.corrcoef(torch.stack([out[i].flatten(), plain[i].flatten()]))[0, 1] for i in range(8)]
    assert min(corr) > 0.99


def test_rejects_float_input():
    with pytest.raises(ValueError, match="uint8"):
        DeviceAugment()(torch.rand(2, 3, 8, 8))


def test_device_loader_keeps_len_and_sampler():
    from torch.utils.data import DataLoader, TensorDataset

    ds = TensorDataset(_batch(n=10), torch.arange(10))
    dl = DataLoader(ds, batch_size=4)
    wrapped = DeviceLoader(dl, DeviceAugment(size=16), "cpu")
    assert len(wrapped) == 3 and wrapped.sampler is dl.sampler
    xs = [x for x, _ in wrapped]
    assert xs[0].shape == (4, 3, 16, 16) and xs[0].dtype == torch.float32 and xs[-1].shape[0] == 2


@pytest.mark.gpu
def test_cuda_matches_cpu_eval():
    x = _batch()
    aug = DeviceAugment(size=24, train=False)
    torch.testing.assert_close(aug.to("cuda")(x.cuda()).cpu(), DeviceAugment(size=24, train=False)(x),
                               rtol=1e-4, atol=1e-4)
    out = DeviceAugment(size=24, brightness=0.2).to("cuda")(x.cuda())
    assert out.is_cuda and out.shape == (16, 3, 24, 24) and math.isfinite(out.sum().item())
