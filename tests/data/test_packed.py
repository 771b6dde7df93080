import numpy as np
import pytest
import torch

from torchspeed.data import FastImageFolder, ImageDecodeError, LocalShuffleSampler, PackedDataset, pack_folder
from torchspeed.data.decode import decode_image
from torchspeed.data.packed import index_path


def test_round_trip_is_exact(photo_folder, tmp_path):
    r = pack_folder(photo_folder, tmp_path / "p.tspack")
    src = FastImageFolder(photo_folder, size=24, crop="center")
    ds = PackedDataset(tmp_path / "p.tspack", size=24, crop="center")
    assert r.images == len(src) == len(ds) and index_path(tmp_path / "p.tspack").is_file()
    assert ds.classes == src.classes and ds.targets == src.targets
    for i in range(len(ds)):
        assert bytes(ds.read(i)) == src.read(i)  # byte-for-byte copies
        assert torch.equal(ds[i][0], src[i][0]) and ds[i][1] == src[i][1]
    assert [n for n, _ in ds.samples][0].endswith(".jpg") and not [n for n, _ in ds.samples][0].startswith("/")


def test_max_side_resizes_and_reencodes(photo_folder, tmp_path):
    r = pack_folder(photo_folder, tmp_path / "s.tspack", max_side=48, quality=85)
    ds = PackedDataset(tmp_path / "s.tspack", size=None, crop=None)
    src = FastImageFolder(photo_folder, size=None, crop=None)
    assert r.bytes < r.source_bytes
    for i in (0, 7, 13):
        small = ds[i][0]
        assert max(small.shape[1:]) == 48
        big = src[i][0].permute(1, 2, 0).numpy()
        import cv2

        ref = cv2.resize(big, (small.shape[2], small.shape[1]), interpolation=cv2.INTER_AREA).astype(int)
        assert np.abs(small.permute(1, 2, 0).numpy() - ref).mean() < 8


def test_bad_files_in_pack(photo_folder, tmp_path):
    import shutil

    root = tmp_path / "dirty"
    shutil.copytree(photo_folder, root)
    cls = sorted(root.iterdir())[0]
    (cls / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 garbage")
    with pytest.raises(ImageDecodeError, match="broken.jpg"):
        pack_folder(root, tmp_path / "x.tspack")
    assert not (tmp_path / "x.tspack").exists()  # nothing half-written
    r = pack_folder(root, tmp_path / "x.tspack", on_error="skip")
    assert r.images == len(FastImageFolder(photo_folder)) and [b.rsplit("/", 1)[-1] for b in r.summary.bad] == ["broken.jpg"]


def test_truncated_pack_is_detected(photo_folder, tmp_path):
    pack_folder(photo_folder, tmp_path / "t.tspack")
    data = (tmp_path / "t.tspack").read_bytes()
    (tmp_path / "t.tspack").write_bytes(data[:-100])
    with pytest.raises(ValueError, match="truncated"):
        PackedDataset(tmp_path / "t.tspack")
    with pytest.raises(FileNotFoundError, match="data pack"):
        PackedDataset(tmp_path / "missing.tspack")


def test_packed_in_workers(photo_folder, tmp_path):
    from torch.utils.data import DataLoader

    from torchspeed.data import uint8_collate

    pack_folder(photo_folder, tmp_path / "w.tspack")
    ds = PackedDataset(tmp_path / "w.tspack", size=16, crop="center")
    ys = torch.cat([y for _, y in DataLoader(ds, batch_size=5, num_workers=2, collate_fn=uint8_collate)])
    assert ys.tolist() == ds.targets


def test_local_shuffle_is_a_local_permutation():
    s = LocalShuffleSampler(1000, block=10, window=4, seed=0)
    a = list(s)
    assert sorted(a) == list(range(1000)) and a != list(range(1000))
    # each run of block*window consecutive draws touches at most `window` blocks
    for k in range(0, 1000, 40):
        assert len({i // 10 for i in a[k:k + 40]}) <= 4
    s.set_epoch(1)
    b = list(s)
    assert sorted(b) == list(range(1000)) and a != b
    s.set_epoch(0)
    assert list(s) == a  # a function of (seed, epoch)


def test_decode_of_view_matches(photo_folder, tmp_path):
    pack_folder(photo_folder, tmp_path / "v.tspack")
    ds = PackedDataset(tmp_path / "v.tspack", size=None, crop=None)
    np.testing.assert_array_equal(decode_image(ds.read(3), backend="pillow"),
                                  decode_image(open(FastImageFolder(photo_folder).samples[3][0], "rb").read(),
                                               backend="pillow"))
