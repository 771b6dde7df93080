import pytest

from torchspeed.data import make_jpeg_folder


@pytest.fixture(scope="session")
def photo_folder(tmp_path_factory):
    """4 classes x 6 JPEGs of real photos, 96-128 px (small, so tests are fast)."""
    return make_jpeg_folder(tmp_path_factory.mktemp("photos"), n_per_class=6, classes=4, max_side=(96, 128))


@pytest.fixture(scope="session")
def photo_bytes(photo_folder):
    p = sorted(photo_folder.glob("*/*.jpg"))[0]
    return p.read_bytes()
