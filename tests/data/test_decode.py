import io

import numpy as np
import pytest
import torch
from PIL import Image

from torchspeed.data import ImageDecodeError, available_backends, decode_image, decode_jpeg, decode_jpeg_batch
from torchspeed.data.decode import pick_backend
from torchspeed.data.synthetic import load_photo


@pytest.fixture(scope="module")
def big_jpeg():
    import simplejpeg

    return simplejpeg.encode_jpeg(load_photo("coffee"), quality=90, colorspace="RGB")  # 400x600


def pillow_ref(data):
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.int16)


@pytest.mark.parametrize("backend", [b for b in available_backends()])
def test_backends_agree_with_pillow(big_jpeg, backend):
    ref = pillow_ref(big_jpeg)
    out = decode_jpeg(big_jpeg, backend=backend)
    assert out.dtype == np.uint8 and out.shape == ref.shape and out.flags.c_contiguous
    diff = np.abs(out.astype(np.int16) - ref)
    assert diff.mean() < 1.0 and np.percentile(diff, 99) <= 4  # JPEG tolerance (IDCT/upsampling rounding)


def test_fast_idct_stays_close(big_jpeg):
    ref = pillow_ref(big_jpeg)
    diff = np.abs(decode_jpeg(big_jpeg, backend="simplejpeg", fast=True).astype(np.int16) - ref)
    assert diff.mean() < 2.0


@pytest.mark.parametrize("backend", ["simplejpeg", "opencv", "pillow"])
def test_size_hint_decodes_at_reduced_scale(big_jpeg, backend):
    full = decode_jpeg(big_jpeg, backend=backend)
    half = decode_jpeg(big_jpeg, size_hint=190, backend=backend)  # 200x300 is the largest reduction >= 190
    assert half.shape == (200, 300, 3)
    quarter = decode_jpeg(big_jpeg, size_hint=(100, 150), backend=backend)
    assert quarter.shape == (100, 150, 3)
    assert decode_jpeg(big_jpeg, size_hint=201, backend=backend).shape == full.shape  # 1/2 would be too small
    # DCT-domain downscaling ~ an area-averaged resize of the full image
    ref = full.reshape(200, 2, 300, 2, 3).mean((1, 3))
    assert np.abs(half - ref).mean() < 3.0


def test_auto_picks_an_available_backend(big_jpeg):
    name = pick_backend(scaled=True)
    assert name in available_backends()
    assert np.abs(decode_jpeg(big_jpeg).astype(np.int16) - pillow_ref(big_jpeg)).mean() < 2.0


def test_png_goes_to_pillow():
    img = (np.arange(30 * 40 * 3) % 251).astype(np.uint8).reshape(30, 40, 3)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    np.testing.assert_array_equal(decode_image(buf.getvalue()), img)


@pytest.mark.parametrize("backend", ["auto", "simplejpeg", "opencv", "pillow"])
def test_truncated_and_corrupt_are_errors(big_jpeg, backend):
    with pytest.raises(ImageDecodeError, match="truncated"):
        decode_image(big_jpeg[: len(big_jpeg) // 2], backend=backend)
    broken = bytearray(big_jpeg)
    broken[200:3000] = b"\x00" * 2800  # header and entropy data destroyed, markers intact at the ends
    with pytest.raises(ImageDecodeError):
        decode_image(bytes(broken), backend=backend)
    with pytest.raises(ImageDecodeError, match="not a readable image"):
        decode_image(b"hello, I am a text file")
    with pytest.raises(ImageDecodeError, match="empty"):
        decode_image(b"")


def test_data_after_end_marker_is_accepted(big_jpeg):
    ref = decode_jpeg(big_jpeg, backend="pillow")
    for backend in ("auto", "opencv", "pillow"):
        out = decode_jpeg(big_jpeg + b"EXTRA-METADATA" * 100, backend=backend)
        assert np.abs(out.astype(int) - ref).mean() < 1.0


@pytest.mark.gpu
def test_nvjpeg_batch_matches_cpu(big_jpeg):
    out = decode_jpeg_batch([big_jpeg, big_jpeg], device="cuda")
    assert len(out) == 2 and out[0].is_cuda and out[0].shape == (3, 400, 600)
    ref = torch.from_numpy(pillow_ref(big_jpeg)).permute(2, 0, 1)
    assert (out[0].cpu().to(torch.int16) - ref).abs().float().mean() < 2.0
