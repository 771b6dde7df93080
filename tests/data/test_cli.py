import json

import pytest
import torch

from torchspeed.cli.main import main
from torchspeed.data import PackedDataset, make_jpeg_folder
from torchspeed.model.spec import create_classifier


def test_pack_command(photo_folder, tmp_path, capsys):
    assert main(["data", "pack", str(photo_folder), str(tmp_path / "p.tspack"), "--max-side", "64"]) == 0
    assert "packed 24 images" in capsys.readouterr().out
    assert len(PackedDataset(tmp_path / "p.tspack")) == 24


def test_pack_errors_are_one_line(tmp_path, capsys):
    assert main(["data", "pack", str(tmp_path / "nope"), str(tmp_path / "p.tspack")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_bench_command_writes_rows(photo_folder, tmp_path):
    out = tmp_path / "b.json"
    assert main(["data", "bench", str(photo_folder), "--size", "32", "--rounds", "1", "--limit", "8",
                 "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert [r["pipeline"] for r in d["rows"]] == ["torchvision", "torchspeed", "decode-only"]
    assert all(r["img_per_s"] > 0 for r in d["rows"]) and "torch" in d["meta"]
    assert "torchspeed/torchvision" in d["ratios"]


@pytest.fixture(scope="module")
def learnable(tmp_path_factory):
    """4 photos -> 4 classes; small crops of each, 40-48 px: learnable from colour and texture."""
    root = tmp_path_factory.mktemp("learn")
    make_jpeg_folder(root, n_per_class=40, classes=4, max_side=(40, 48), seed=1)
    # one broken file: skipped and reported, nothing else lost
    (root / "coffee" / "zz_broken.jpg").write_bytes(b"\xff\xd8\xff garbage, no image here")
    return root


def test_train_end_to_end_learns(learnable, tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["train", "--data", str(learnable), "--model", "simple_cnn", "--size", "32", "--batch-size", "32",
               "--epochs", "4", "--lr", "0.05", "--workers", "0", "--compile", "off", "--val-fraction", "0.2",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    run = json.loads((out / "run.json").read_text())
    assert run["final"]["val_acc"] >= 0.7  # chance is 0.25
    assert [b.rsplit("/", 1)[-1] for b in run["bad_files"]] == ["zz_broken.jpg"]
    state = torch.load(out / "model.pt", weights_only=True)
    assert state["classes"] == sorted(p.name for p in learnable.iterdir())
    model = create_classifier("simple_cnn", num_classes=4)
    model.load_state_dict(state["model"])
    assert (out / "metrics.csv").is_file() and any((out / "checkpoints").glob("*.pt"))


def test_train_on_packed_file(learnable, tmp_path):
    pk = tmp_path / "l.tspack"
    assert main(["data", "pack", str(learnable), str(pk), "--on-error", "skip"]) == 0
    rc = main(["train", "--data", str(pk), "--model", "simple_cnn", "--size", "32", "--batch-size", "32",
               "--epochs", "2", "--max-steps", "6", "--workers", "0", "--compile", "off", "--augment", "device",
               "--cache-gb", "0.01", "--jitter", "0.2", "--out", str(tmp_path / "run"), "--no-progress"])
    assert rc == 0 and (tmp_path / "run" / "model.pt").is_file()
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["pipeline"]["augment"] == "device" and run["pipeline"]["cache_bytes"] > 0


def test_train_errors(learnable, tmp_path, capsys):
    assert main(["train", "--data", str(tmp_path / "nothing"), "--out", str(tmp_path / "r")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["train", "--data", str(learnable), "--model", "resnet_18", "--workers", "0",
                 "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    assert "did you mean" in capsys.readouterr().err
    rc = main(["train", "--data", str(learnable), "--model", "simple_cnn", "--size", "32", "--batch-size", "16",
               "--max-steps", "50", "--workers", "0", "--compile", "off", "--on-error", "raise",
               "--val-fraction", "0", "--out", str(tmp_path / "r"), "--no-progress"])
    assert rc == 2 and "zz_broken.jpg" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["resnet18", "test_resnet"])
def test_torchvision_and_timm_names(name):
    m = create_classifier(name, num_classes=7)
    assert m.eval()(torch.rand(1, 3, 32, 32)).shape == (1, 7)
