import random

import numpy as np
import pytest
import torch
from torchvision import datasets

from torchspeed.data import FastImageFolder, ImageDecodeError, load_image, random_resized_crop_box, uint8_collate
from torchspeed.data.decode import decode_image


def test_same_index_as_torchvision(photo_folder):
    tv = datasets.ImageFolder(photo_folder)
    ds = FastImageFolder(photo_folder, size=32)
    assert ds.classes == tv.classes and ds.class_to_idx == tv.class_to_idx
    assert ds.samples == tv.samples and ds.targets == tv.targets


def test_transforms_like_torchvision(photo_folder):
    ds = FastImageFolder(photo_folder, size=16, crop="center", transform=lambda x: x.flip(-1),
                         target_transform=lambda y: y + 100)
    plain = FastImageFolder(photo_folder, size=16, crop="center")
    x, y = ds[7]
    assert torch.equal(x, plain[7][0].flip(-1)) and y == plain.targets[7] + 100


def test_uint8_tensor_without_copy(photo_folder):
    ds = FastImageFolder(photo_folder, size=40, crop="center")
    x, y = ds[3]
    assert x.dtype == torch.uint8 and x.shape == (3, 40, 40) and y == ds.targets[3]
    assert x.permute(1, 2, 0).is_contiguous()  # a CHW view of the decoded HWC memory (from_numpy, T11)


@pytest.fixture(scope="module")
def smooth_jpegs():
    """Smooth colour patterns (so a sub-pixel box difference is small, a wrong box is not), 200-360 px."""
    import simplejpeg

    out = []
    for k, (h, w) in enumerate([(200, 260), (360, 240), (240, 320), (300, 300)]):
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        img = np.stack([128 + 100 * np.sin(xx / 50 + k), 128 + 100 * np.cos(yy / 60 - k),
                        128 + 90 * np.sin((xx + yy) / 80)], -1)
        out.append(simplejpeg.encode_jpeg(img.astype(np.uint8), quality=95, colorspace="RGB"))
    return out


def _ref_crop(data, box, size):
    import cv2

    full = decode_image(data, backend="pillow")
    top, left, ch, cw = box
    return cv2.resize(full[top:top + ch, left:left + cw], (size, size), interpolation=cv2.INTER_AREA).astype(int)


def test_center_crop_matches_reference(smooth_jpegs):
    for data in smooth_jpegs:
        out = load_image(data, size=48, crop="center", fast=False)  # decoded at 1/4 scale: 200x260 -> 50x65
        h, w = decode_image(data).shape[:2]
        s = min(h, w)
        ref = _ref_crop(data, ((h - s) // 2, (w - s) // 2, s, s), 48)
        wrong = _ref_crop(data, (0, 0, s, s), 48)
        assert np.abs(out - ref).mean() < 3.0
        if h != w:
            assert np.abs(out - wrong).mean() > 3 * np.abs(out - ref).mean()


@pytest.mark.parametrize("seed", range(8))
def test_dct_scaled_random_crop_matches_full_resolution_crop(smooth_jpegs, seed):
    data = smooth_jpegs[seed % len(smooth_jpegs)]
    out = load_image(data, size=24, crop="random", rng=random.Random(seed), fast=False)
    h, w = decode_image(data).shape[:2]
    box = random_resized_crop_box(h, w, rng=random.Random(seed))
    assert out.shape == (24, 24, 3) and out.dtype == np.uint8
    assert np.abs(out - _ref_crop(data, box, 24)).mean() < 4.0  # the same box: only resampling differs
    other = random_resized_crop_box(h, w, rng=random.Random(seed + 100))
    assert np.abs(out - _ref_crop(data, other, 24)).mean() > 6.0


def test_random_crop_box_matches_torchvision_distribution():
    from torchvision.transforms import RandomResizedCrop

    rng = random.Random(0)
    ours = np.array([random_resized_crop_box(300, 400, rng=rng) for _ in range(3000)], float)
    torch.manual_seed(0)
    img = torch.empty(1, 300, 400)
    tv = np.array([RandomResizedCrop.get_params(img, (0.08, 1.0), (3 / 4, 4 / 3)) for _ in range(3000)], float)
    for a in (ours, tv):
        assert (a[:, 0] + a[:, 2] <= 300).all() and (a[:, 1] + a[:, 3] <= 400).all()
    area = lambda a: (a[:, 2] * a[:, 3]).mean() / (300 * 400)  # noqa: E731
    assert abs(area(ours) - area(tv)) < 0.03


def test_flip_flips_about_half(photo_folder):
    data = sorted(photo_folder.glob("*/*.jpg"))[0].read_bytes()
    base = load_image(data, size=32, crop="center")
    outs = [load_image(data, size=32, crop="center", flip=True, rng=random.Random(s)) for s in range(40)]
    flipped = sum(np.array_equal(o, base[:, ::-1]) for o in outs)
    same = sum(np.array_equal(o, base) for o in outs)
    assert flipped + same == 40 and 8 < flipped < 32


def test_uint8_collate_is_channels_last(photo_folder):
    ds = FastImageFolder(photo_folder, size=16, crop="center")
    items = [ds[i] for i in range(4)]
    x, y = uint8_collate(items)
    assert x.shape == (4, 3, 16, 16) and x.dtype == torch.uint8 and x.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(x, torch.stack([it[0] for it in items])) and y.tolist() == [it[1] for it in items]


@pytest.fixture()
def dirty_folder(photo_folder, tmp_path):
    import shutil

    root = tmp_path / "dirty"
    shutil.copytree(photo_folder, root)
    cls = sorted(p for p in root.iterdir())[1]
    good = sorted(cls.glob("*.jpg"))[0].read_bytes()
    (cls / "zz_truncated.jpg").write_bytes(good[: len(good) // 2])
    (cls / "zz_text.jpg").write_bytes(b"not an image at all")
    (cls / "notes.txt").write_text("ignored")
    return root


def test_bad_files_raise_naming_the_file(dirty_folder):
    ds = FastImageFolder(dirty_folder, size=16, crop="center")
    bad = {p.rsplit("/", 1)[-1]: i for i, (p, _) in enumerate(ds.samples) if "zz_" in p}
    assert len(bad) == 2 and len(ds.ignored) == 1  # notes.txt is not an image file: ignored, listed
    with pytest.raises(ImageDecodeError, match="zz_truncated.jpg: truncated"):
        ds[bad["zz_truncated.jpg"]]
    with pytest.raises(ImageDecodeError, match="zz_text.jpg: not"):
        ds[bad["zz_text.jpg"]]


def test_skip_replaces_and_counts(dirty_folder, photo_folder):
    ds = FastImageFolder(dirty_folder, size=16, crop="center", on_error="skip")
    clean = FastImageFolder(photo_folder, size=16, crop="center")
    items = [ds[i] for i in range(len(ds))]
    s = ds.summary()
    assert s.total == len(clean) + 2 and s.ok == len(clean)
    assert sorted(p.rsplit("/", 1)[-1] for p in s.bad) == ["zz_text.jpg", "zz_truncated.jpg"]
    # every good image is still there (nothing else lost)
    good = {(x.numpy().tobytes(), y) for x, y in (clean[i] for i in range(len(clean)))}
    assert good <= {(x.numpy().tobytes(), y) for x, y in items}


def test_check_drops_bad_files(dirty_folder):
    ds = FastImageFolder(dirty_folder, size=16, crop="center", on_error="skip")
    s = ds.check()
    assert len(s.bad) == 2 and len(ds) == s.total - 2
    assert all("zz_" not in p for p, _ in ds.samples)
    strict = FastImageFolder(dirty_folder, size=16, crop="center")
    with pytest.raises(ImageDecodeError, match="zz_t"):
        strict.check()


def test_skip_counts_across_workers(dirty_folder):
    from torch.utils.data import DataLoader

    ds = FastImageFolder(dirty_folder, size=16, crop="center", on_error="skip")
    n = sum(len(y) for _, y in DataLoader(ds, batch_size=4, num_workers=2, collate_fn=uint8_collate))
    assert n == len(ds) and len(ds.summary().bad) == 2


def test_errors_for_bad_options(photo_folder, tmp_path):
    with pytest.raises(ValueError, match="crop"):
        FastImageFolder(photo_folder, crop="middle")
    with pytest.raises(ValueError, match="needs a size"):
        FastImageFolder(photo_folder, size=None, crop="random")
    with pytest.raises(FileNotFoundError, match="class subfolders"):
        FastImageFolder(tmp_path)


def test_random_crop_decodes_at_reduced_scale(smooth_jpegs, monkeypatch):
    """The speed of crop="random" comes from the DCT-domain reduction: check it is used."""
    import torchspeed.data.folder as folder

    shapes = []
    real = folder.decode_image

    def spy(data, **kw):
        img = real(data, **kw)
        shapes.append(img.shape[:2])
        return img

    monkeypatch.setattr(folder, "decode_image", spy)
    data = smooth_jpegs[3]  # 300x300
    for s in range(20):
        load_image(data, size=32, crop="random", scale=(0.5, 1.0), rng=random.Random(s))
        load_image(data, size=32, crop="center")
    assert all(max(hw) <= 150 for hw in shapes)  # crops >= 212 px for a 32 px output: at least 1/2 scale
    assert any(max(hw) <= 75 for hw in shapes)   # and often 1/4
