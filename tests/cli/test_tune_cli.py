"""`torchspeed tune` on a small folder: the batch finder leaves an epoch its steps, the loader table labels
its rows, the image size follows the images, and your own model is accepted."""

import json

import pytest

from torchspeed.cli.main import main
from torchspeed.data import make_jpeg_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """4 classes x 40 JPEGs, longer side 24 px: 160 samples."""
    return make_jpeg_folder(tmp_path_factory.mktemp("f"), n_per_class=40, classes=4, max_side=24, seed=0)


def test_batch_is_capped_so_an_epoch_keeps_its_steps(folder, tmp_path):
    assert main(["tune", "batch", "--data", str(folder), "--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "tune.json").read_text())
    assert report["workload"]["image_size"] == 32  # auto: the 16-24 px images' side, at least 32
    assert report["batch"]["largest"] <= 160 // 16  # 10 -> the multiple of 8 below
    assert main(["tune", "batch", "--data", str(folder), "--quick", "--min-steps", "1", "--max-batch", "64",
                 "--out", str(tmp_path / "nocap")]) == 0
    assert json.loads((tmp_path / "nocap" / "tune.json").read_text())["batch"]["largest"] > 8


def test_loader_rows_carry_their_labels(folder, tmp_path, capsys):
    assert main(["tune", "loader", "--data", str(folder), "--quick", "--batch-size", "16",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # several rounds end in their median; a loader that outruns the step at once is said so after one (load decides)
    assert "round 1" in out and ("median of" in out or "workers do not help" in out)
    rows = json.loads((tmp_path / "tune.json").read_text())["loader"]["table"]
    assert all(r["note"] for r in rows)  # no unlabelled row


def test_own_model(folder, tmp_path, monkeypatch):
    (tmp_path / "netdef.py").write_text(
        "import torch.nn as nn\n"
        "def net(num_classes):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))\n")
    monkeypatch.chdir(tmp_path)
    assert main(["tune", "lr", "--data", str(folder), "--model", "netdef:net", "--quick", "--batch-size", "16",
                 "--out", "o"]) == 0
    assert json.loads((tmp_path / "o" / "tune.json").read_text())["lr"]["confidence"] in ("high", "medium", "low")


def test_noise_reports_the_critical_batch_size(tmp_path, capsys):
    import json

    assert main(["tune", "noise", "--data", "digits", "--quick", "--batch-size", "32", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "gradient noise scale" in printed and "critical batch size" in printed
    noise = json.loads((tmp_path / "tune.json").read_text())["noise"]
    assert noise["batches"] == 4 and noise["batch_size"] == 32 and noise["noise_scale"] > 0
    assert noise["critical_batch_size"] == round(noise["noise_scale"]) and "batch" in noise["suggestion"]
