"""`torchspeed train` runs that go on (--resume extends, --init-from), inference from a run, your own model,
and the output a new user reads (summary with --no-progress, run.json counts, the auto defaults)."""

import json
import re

import pytest
import torch

import torchspeed
from torchspeed.cli.main import main
from torchspeed.data import make_jpeg_folder
from torchspeed.data.pipeline import build_loaders
from torchspeed.model.spec import simple_cnn
from torchspeed.train.state.checkpoint import save_checkpoint
from torchspeed.train.result import FitResult

FAST = ["--model", "simple_cnn", "--size", "32", "--batch-size", "16", "--lr", "0.05", "--workers", "0",
        "--compile", "off", "--precision", "fp32", "--no-progress"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """4 classes x 20 JPEGs of 48 px (72 train / 8 val with the default split)."""
    return make_jpeg_folder(tmp_path_factory.mktemp("f48"), n_per_class=20, classes=4, max_side=48, seed=3)


@pytest.fixture(scope="module")
def run2(folder, tmp_path_factory):
    """A 2-epoch run, shared by the tests that read a finished run."""
    out = tmp_path_factory.mktemp("runs") / "r"
    assert main(["train", "--data", str(folder), "--epochs", "2", "--out", str(out), *FAST]) == 0
    return out


def _history(out):
    return [row["epoch"] for row in json.loads((out / "metrics.json").read_text())["history"]]


def test_resume_extends_a_finished_run(folder, run2, tmp_path, capsys):
    import shutil

    out = tmp_path / "r"
    shutil.copytree(run2, out)
    capsys.readouterr()
    assert main(["train", "--data", str(folder), "--epochs", "4", "--out", str(out), "--resume", *FAST]) == 0
    printed = capsys.readouterr().out
    assert _history(out) == [1, 2, 3, 4]
    run = json.loads((out / "run.json").read_text())
    assert "extended" in run["fit_decisions"] and "extended" in printed
    assert run["fit_decisions"]["resumed_from"]["value"].startswith(str(out / "checkpoints"))
    # asking a finished 4-epoch run for 3 is a one-line error, not a traceback
    assert main(["train", "--data", str(folder), "--epochs", "3", "--out", str(out), "--resume", *FAST]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ask for more epochs" in err


def test_init_from_loads_the_weights(folder, tmp_path, monkeypatch):
    torch.manual_seed(7)
    given = simple_cnn(4)
    save_checkpoint(tmp_path / "w.pt", {"model": given.state_dict()})
    seen = {}

    def fake_fit(model, *a, **kw):
        seen.update({k: v.clone() for k, v in model.state_dict().items()})
        return FitResult(history=[], config={}, decisions={}, steps=0, skipped_steps=0)

    monkeypatch.setattr(torchspeed, "fit", fake_fit)
    assert main(["train", "--data", str(folder), "--out", str(tmp_path / "r"), "--init-from",
                 str(tmp_path / "w.pt"), *FAST]) == 0
    assert seen and all(torch.equal(seen[k], v) for k, v in given.state_dict().items())


def test_init_from_another_model_is_one_line(folder, tmp_path, capsys):
    save_checkpoint(tmp_path / "w.pt", {"model": torch.nn.Linear(3, 2).state_dict()})
    assert main(["train", "--data", str(folder), "--out", str(tmp_path / "r"), "--init-from",
                 str(tmp_path / "w.pt"), *FAST]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchspeed train: error: --init-from") and err.count("\n") == 1


def test_predict_gives_the_classes_evaluate_scores(folder, run2, capsys):
    m = torchspeed.load_model(run2, device="cpu")
    pipe = build_loaders(folder, size=32, batch_size=16, workers=0, device="cpu", seed=0)  # the run's split
    val = pipe.val.dataset
    paths = [val.dataset.samples[i][0] for i in val.indices]
    labels = [val.dataset.samples[i][1] for i in val.indices]
    expected = []
    with torch.no_grad():
        for x, _ in pipe.val:
            expected += m.model(x).argmax(1).tolist()
    ev = torchspeed.evaluate(m.model, pipe.val, device="cpu", precision="fp32")
    assert [p.index for p in m.predict(paths)] == expected
    assert ev["val_acc"] == pytest.approx(sum(e == y for e, y in zip(expected, labels)) / len(labels))
    capsys.readouterr()
    assert main(["predict", str(run2), *paths]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split("\t")[1] for ln in lines] == [m.classes[k] for k in expected]


def test_own_model_from_a_module_and_a_file(folder, tmp_path, monkeypatch):
    (tmp_path / "mymod.py").write_text(
        "import torch.nn as nn\n"
        "def make_net(num_classes):\n"
        "    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),\n"
        "                         nn.Flatten(), nn.Linear(8, num_classes))\n")
    monkeypatch.chdir(tmp_path)
    fast = [a for a in FAST if a != "simple_cnn" and a != "--model"]
    assert main(["train", "--data", str(folder), "--model", "mymod:make_net", "--max-steps", "2",
                 "--out", "r1", *fast]) == 0
    assert main(["train", "--data", str(folder), "--model", "mymod.py:make_net", "--max-steps", "2",
                 "--out", "r2", *fast]) == 0
    monkeypatch.chdir(folder)  # the file spec is saved absolute: the run loads from anywhere
    m = torchspeed.load_model(tmp_path / "r2")
    assert m.model[-1].out_features == 4


@pytest.mark.parametrize("spec, says", [("mymod:nothing", "has no function 'nothing'"),
                                        ("nomod:make_net", "no module named 'nomod'"),
                                        ("missing.py:make_net", "no such file")])
def test_own_model_mistakes_are_one_line(folder, tmp_path, monkeypatch, capsys, spec, says):
    (tmp_path / "mymod.py").write_text("def make_net(num_classes):\n    return None\n")
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--data", str(folder), "--model", spec, "--out", "r", *FAST[2:]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


def test_no_progress_still_prints_the_summary_and_counts_are_right(run2, capsys):
    run = json.loads((run2 / "run.json").read_text())
    assert (run["data"]["train_images"], run["data"]["val_images"]) == (72, 8)
    assert run["lr"] == 0.05 and "restored_best" in run["fit_decisions"]


def test_no_progress_summary(folder, tmp_path, capsys):
    assert main(["train", "--data", str(folder), "--max-steps", "1", "--out", str(tmp_path / "r"), *FAST]) == 0
    out = capsys.readouterr().out
    assert re.search(r"done: 1 steps", out) and "72 training / 8 validation" in out
    assert "validation set has 8 images" in out  # too few to read a few points


def test_size_auto_and_crop_scale(folder, tmp_path, capsys):
    from torchspeed.cli._auto import auto_size, parse_crop_scale

    from PIL import Image

    sides = sorted(min(Image.open(f).size) for f in folder.glob("*/*.jpg"))
    size = sides[len(sides) // 2] // 8 * 8
    assert 32 <= size < 48 and auto_size(folder) == size  # the shorter side's median, not upscaled to 224
    assert parse_crop_scale("off") is None and parse_crop_scale("0.25,1") == (0.25, 1.0)
    argv = [a for a in FAST if a not in ("--size", "32")]
    assert main(["train", "--data", str(folder), "--max-steps", "1", "--crop-scale", "off",
                 "--out", str(tmp_path / "r"), *argv]) == 0
    run = json.loads((tmp_path / "r" / "run.json").read_text())
    assert run["pipeline"]["size"] == size and run["pipeline"]["crop_scale"] == "off"
    pipe = build_loaders(folder, size=32, batch_size=16, workers=0, device="cpu", scale=None)
    assert pipe.datasets["train"].crop == "center" and pipe.datasets["train"].flip


def test_lr_auto_runs_the_range_test_with_the_chosen_optimizer(folder, tmp_path, monkeypatch):
    import torchspeed.tune.lr_peak as lr_mod  # the one LR chooser reads find_lr there

    seen = {}
    real = lr_mod.find_lr

    def spy(model, data, **kw):
        seen["optimizer"] = type(kw["optimizer"]).__name__
        seen["precision"] = kw["precision"]
        return real(model, data, **{**kw, "num_steps": 12})

    monkeypatch.setattr(lr_mod, "find_lr", spy)
    argv = [a for a in FAST if a not in ("--lr", "0.05")]
    assert main(["train", "--data", str(folder), "--max-steps", "1", "--optimizer", "adamw",
                 "--out", str(tmp_path / "r"), *argv]) == 0
    assert seen == {"optimizer": "AdamW", "precision": "fp32"}
    run = json.loads((tmp_path / "r" / "run.json").read_text())
    assert run["lr"] > 0 and "lr_find" in run["fit_decisions"]


def test_model_name_hints_are_not_repeated():
    from torchspeed.model.spec import create_classifier

    with pytest.raises(ValueError, match="did you mean") as e:
        create_classifier("resnet_18", num_classes=2)
    names = str(e.value).split("did you mean ")[1].rstrip("?").split(", ")
    assert len(names) == len(set(names)) and "resnet18" in names


def test_bench_builds_your_model(tmp_path):
    from torchspeed.bench.workloads import create_model

    (tmp_path / "benchnet.py").write_text("import torch.nn as nn\ndef net(num_classes=10):\n"
                                          "    return nn.Sequential(nn.Flatten(), nn.Linear(12, num_classes))\n")
    assert create_model(f"{tmp_path}/benchnet.py:net", num_classes=3)[1].out_features == 3
