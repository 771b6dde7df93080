"""Bad input: every expected mistake gets a clear message and a non-zero exit, never a bare traceback,
and nothing saved before is lost.

Covers the CLI (every registered command: malformed flags, bad values, missing paths), a
checkpoint of another model, damaged checkpoints, and the data inputs (missing and empty
folders, corrupt and truncated images) through `torchspeed.data`'s public classes.
"""

import subprocess
import sys

import pytest
import torch
from torch import nn

import torchspeed
from torchspeed.cli.main import COMMANDS, main
from torchspeed.train.state.checkpoint import (CheckpointManager, CheckpointMismatchError, load_checkpoint,
                                               save_checkpoint)


def _cli(capsys, *argv):
    """Run `torchspeed ARGV` in-process; return (exit code, stderr)."""
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's own errors exit with 2
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


# ---------------------------------------------------------------------- the CLI
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_rejects_an_unknown_flag(capsys, command):
    code, err = _cli(capsys, command, "--no-such-flag")
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("torchspeed") and "error:" in last
    assert "unrecognized arguments: --no-such-flag" in last or "required" in last  # a required argument comes first


def test_unknown_command(capsys):
    code, err = _cli(capsys, "no-such-command")
    assert code == 2 and "invalid choice: 'no-such-command'" in err


@pytest.mark.parametrize("argv, expected", [
    (("bench", "--batch-size", "abc"), "invalid int value: 'abc'"),
    (("bench", "--batch-size", "0"), "--batch-size must be positive, got 0"),
    (("bench", "--steps", "-3"), "--steps must be positive, got -3"),
    (("bench", "--data", "imagenet"), "invalid choice: 'imagenet'"),
    (("bench", "--configs", "bogus", "--steps", "1", "--rounds", "1", "--model", "mlp"), "unknown bench config"),
    (("launch", "--", "python", "train.py"), "--nproc N"),
    (("launch", "--nproc", "abc", "--", "python", "train.py"), "--nproc must be a positive number"),
])
def test_bad_values(capsys, tmp_path, argv, expected):
    if "--configs" in argv:
        argv = (*argv, "--json", str(tmp_path / "b.json"))
    code, err = _cli(capsys, *argv)
    last = err.strip().splitlines()[-1]  # argparse prints the usage first; the error is one line
    assert code == 2 and expected in last and "error:" in last, err


def test_bench_unknown_model(capsys, tmp_path):
    code, err = _cli(capsys, "bench", "--model", "nosuch", "--steps", "1", "--rounds", "1",
                     "--json", str(tmp_path / "b.json"))
    assert code == 2 and "nosuch" in err


def test_launch_missing_script(capsys, tmp_path):
    code, err = _cli(capsys, "launch", "--nproc", "2", "--", "python", str(tmp_path / "missing.py"))
    assert code == 2 and "no such script" in err and "missing.py" in err


def test_end_to_end_exit_code_and_one_line():
    """Through the real entry point: exit code 2, one line on stderr, no traceback."""
    p = subprocess.run([sys.executable, "-m", "torchspeed", "bench", "--batch-size", "-1"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert p.stderr.strip() == "torchspeed bench: error: --batch-size must be positive, got -1"


# ---------------------------------------------------------------------- checkpoints
def _net(width=16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


def _data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)) for _ in range(4)]


_FIT = dict(epochs=1, device="cpu", progress=False, compile=False, precision="fp32", schedule="cosine")


def test_checkpoint_of_another_model(tmp_path):
    torchspeed.fit(_net(16), _data(), checkpoint_dir=str(tmp_path), **_FIT)
    path = CheckpointManager(tmp_path).checkpoints()[0]
    saved = path.read_bytes()
    with pytest.raises(CheckpointMismatchError) as e:
        load_checkpoint(path, model=_net(32))
    msg = str(e.value)
    assert "0.weight is [16, 4] in the checkpoint but [32, 4] in the model" in msg
    assert "2.weight is [2, 16] in the checkpoint but [2, 32] in the model" in msg
    with pytest.raises(CheckpointMismatchError):  # the same through fit(resume=...)
        torchspeed.fit(_net(32), _data(), checkpoint_dir=str(tmp_path), resume="auto", **_FIT)
    assert path.read_bytes() == saved  # nothing saved before is lost or overwritten


def test_damaged_newest_checkpoint_falls_back_to_previous(tmp_path, caplog):
    model = _net()
    torchspeed.fit(model, _data(), checkpoint_dir=str(tmp_path), checkpoint_every=1, **dict(_FIT, epochs=2))
    newest, previous = CheckpointManager(tmp_path).checkpoints()[:2]
    newest.write_bytes(newest.read_bytes()[:1000])  # cut short, as by a full disk or a bad copy
    r = torchspeed.fit(_net(), _data(), checkpoint_dir=str(tmp_path), checkpoint_every=1, resume="auto",
                       **dict(_FIT, epochs=2))
    assert previous.name in str(r.decisions["resumed_from"])
    assert "passing over step-00000008.pt" in caplog.text and "cannot be read" in caplog.text


def test_not_a_checkpoint(tmp_path):
    bad = tmp_path / "notes.pt"
    bad.write_text("these are my notes, not weights")
    with pytest.raises(torchspeed.train.state.checkpoint.CorruptCheckpointError, match="cannot be read"):
        load_checkpoint(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(IsADirectoryError, match="is a folder"):
        load_checkpoint(tmp_path)
    save_checkpoint(tmp_path / "weights.pt", _net().state_dict())  # plain weights are not a training state
    with pytest.raises(torchspeed.train.state.checkpoint.CheckpointError, match="only weights"):
        torchspeed.fit(_net(), _data(), resume=str(tmp_path / "weights.pt"), **_FIT)


# ---------------------------------------------------------------------- data inputs
@pytest.fixture
def folder_api():
    import torchspeed.data.folder

    return torchspeed.data.folder


def test_missing_and_empty_folders(tmp_path, folder_api):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        folder_api.FastImageFolder(tmp_path / "nope", size=32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no class subfolders"):
        folder_api.FastImageFolder(tmp_path / "empty", size=32)
    (tmp_path / "noimg" / "cat").mkdir(parents=True)
    (tmp_path / "noimg" / "cat" / "readme.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="no image files"):
        folder_api.FastImageFolder(tmp_path / "noimg", size=32)


def _jpeg() -> bytes:
    import cv2
    import numpy as np
    ok, buf = cv2.imencode(".jpg", np.full((40, 48, 3), 120, np.uint8))
    assert ok
    return buf.tobytes()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_image_is_named(tmp_path, folder_api, damage):
    good = _jpeg()
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "a.jpg").write_bytes(good)
    bad = {"garbage": b"GIF89a not really", "truncated": good[: len(good) // 2], "empty": b""}[damage]
    (tmp_path / "cat" / "b.jpg").write_bytes(bad)
    ds = folder_api.FastImageFolder(tmp_path, size=32, crop="center")
    assert ds[0][0].shape == (3, 32, 32)
    with pytest.raises(ValueError, match=r"b\.jpg.*on_error='skip'"):
        ds[1]
    skip = folder_api.FastImageFolder(tmp_path, size=32, crop="center", on_error="skip")
    x, y = skip[1]  # replaced by the next good item, and reported
    assert x.shape == (3, 32, 32) and skip.summary().bad == (str(tmp_path / "cat" / "b.jpg"),)
    assert (tmp_path / "cat" / "b.jpg").read_bytes() == bad  # the input is never modified


def test_cli_reports_missing_path_as_one_line(capsys, monkeypatch):
    """The CLI turns a FileNotFoundError from any command into one line and exit 2."""
    import torchspeed.cli.env_run as env_cmd

    def boom(args):
        raise FileNotFoundError("data/train is not a directory: expected an ImageFolder")
    monkeypatch.setattr(env_cmd, "run", boom)
    code, err = _cli(capsys, "env")
    assert code == 2 and err.strip() == "torchspeed env: error: data/train is not a directory: expected an ImageFolder"


@pytest.mark.parametrize("case, expected", [
    ("missing", "does not exist"),
    ("empty", "has no class subfolders"),
    ("batch", "--batch-size must be positive"),
])
def test_train_command_bad_data(capsys, tmp_path, case, expected):
    (tmp_path / "empty").mkdir()
    data = str(tmp_path / ("nope" if case == "missing" else "empty"))
    extra = ("--batch-size", "0") if case == "batch" else ()
    code, err = _cli(capsys, "train", "--data", data, *extra)
    last = err.strip().splitlines()[-1]
    assert code == 2 and expected in last and last.startswith("torchspeed train: error:"), err


# ---------------------------------------------------------------------- fit's own arguments
def _fit_data(n=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)


@pytest.mark.parametrize("frozen", ["model", "optimizer"])
def test_nothing_to_train_is_named_before_any_work(frozen):
    model = nn.Linear(8, 2)
    model.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if frozen == "optimizer" else "sgd"
    with pytest.raises(ValueError, match="nothing to train.*none requires grad"):
        torchspeed.fit(model, _fit_data(), optimizer=opt, progress=False)


def test_an_optimizer_built_on_another_model_object_is_named_before_any_work():
    """An optimizer over none of the model's parameters (made for a model since re-created or copied) would train
    nothing while the run looked fine; part of them (a frozen backbone, a head alone) is a port's right."""
    model, other = nn.Linear(8, 2), nn.Linear(8, 2)
    with pytest.raises(ValueError, match="none is this model's.*torch.optim.SGD\\(model.parameters"):
        torchspeed.fit(model, _fit_data(), optimizer=torch.optim.SGD(other.parameters(), lr=0.1), progress=False)
    head = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    res = torchspeed.fit(head, _fit_data(), optimizer=torch.optim.SGD(head[1].parameters(), lr=0.1), progress=False)
    assert res.steps == 4


def test_resume_true_means_the_newest_checkpoint(tmp_path):
    torch.manual_seed(0)
    torchspeed.fit(nn.Linear(8, 2), _fit_data(), epochs=1, checkpoint_dir=str(tmp_path), progress=False)
    r = torchspeed.fit(nn.Linear(8, 2), _fit_data(), epochs=2, checkpoint_dir=str(tmp_path), resume=True,
                       progress=False)
    assert "resumed_from" in r.decisions and r.steps == 8  # 4 steps from the checkpoint, 4 trained
    with pytest.raises(ValueError, match=r"resume='auto' \(or True\) needs checkpoint_dir"):
        torchspeed.fit(nn.Linear(8, 2), _fit_data(), resume=True, progress=False)
    with pytest.raises(TypeError, match="resume must be None, True/'auto'"):
        torchspeed.fit(nn.Linear(8, 2), _fit_data(), checkpoint_dir=str(tmp_path), resume=3, progress=False)
    assert torchspeed.fit(nn.Linear(8, 2), _fit_data(), checkpoint_dir=str(tmp_path / "new"), resume=False,
                          progress=False).steps == 4  # False: a fresh run


def test_skipped_steps_are_reported_at_the_end(caplog):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    x[16:32] = float("nan")  # the second of four batches (no shuffle)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)
    with caplog.at_level("WARNING", logger="torchspeed"):
        r = torchspeed.fit(nn.Linear(8, 2), loader, epochs=1, progress=False)
    assert r.skipped_steps == 1
    assert "1 of 4 optimizer steps had a NaN/inf loss and were skipped" in caplog.text


class _LogitsAndStat(nn.Module):
    """Returns (logits, a 0-dim statistic of the input): the contract reads the 0-dim tensor as the model's loss."""

    def __init__(self):
        super().__init__()
        self.f = nn.Linear(8, 2)

    def forward(self, x):
        return self.f(x), x.mean()


def test_a_loss_that_does_not_require_grad_is_named_with_the_fix():
    with pytest.raises(ValueError, match=r"a tuple of 2 holding a 0-dim loss.*does not require grad.*loss_fn="):
        torchspeed.fit(_LogitsAndStat(), _fit_data(), epochs=1, progress=False)
    r = torchspeed.fit(_LogitsAndStat(), _fit_data(), epochs=1, loss_fn=nn.CrossEntropyLoss(), progress=False)
    assert r.steps == 4  # the fix it names trains: loss_fn scores the logits
    assert r.decisions["batch_contract"].reason.startswith("loss_fn(logits, target); the output's 0-dim tensor is not")


def test_integer_class_indices_of_any_dtype_train_as_int64_ones():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = (x[:, 0] > 0).long()
    runs = {}
    for dtype in (torch.int64, torch.int32, torch.int16, torch.bool):
        torch.manual_seed(0)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y.to(dtype)), batch_size=16)
        runs[dtype] = [r["train_loss"] for r in torchspeed.fit(nn.Linear(8, 2), loader, epochs=2, lr=0.1,
                                                                  progress=False, trial=False).history]
    assert runs[torch.int32] == runs[torch.int16] == runs[torch.bool] == runs[torch.int64]


def _bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def test_a_last_batch_of_one_that_batchnorm_cannot_train_on_is_left_out_and_said(caplog):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(65, 8, generator=g)  # 4 batches of 16 and one of 1
    data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
    with caplog.at_level("WARNING", logger="torchspeed"):
        r = torchspeed.fit(_bn_model(), loader, epochs=2, lr=0.1, progress=False, val_loader=loader)
    assert r.steps == 8 and caplog.text.count("last batch holds 1 sample") == 1  # said once, the run went on
    assert "drop_last=True" in caplog.text
    with pytest.raises(ValueError, match="more than 1 value per channel") as e:  # every batch holds one: the fix
        torchspeed.fit(_bn_model(), torch.utils.data.DataLoader(data, batch_size=1), epochs=1, progress=False)
    assert any("use a batch size over 1" in n for n in e.value.__notes__)


def test_an_unknown_option_names_fits_own_for_other_trainers_names_and_typos():
    from torchspeed.fitting import _ALIASES
    from torchspeed.train.config import TrainConfig

    for given, ours in (("scheduler", "schedule"), ("max_epochs", "epochs"), ("precison", "precision"),
                        ("gradient_accumulation_steps", "grad_accum")):
        hint = rf"unknown option\(s\) \['{given}'\] \(did you mean: {given} -> {ours}\?\)"
        with pytest.raises(TypeError, match=hint):
            torchspeed.fit(nn.Linear(8, 2), _fit_data(), progress=False, **{given: 1})
    with pytest.raises(TypeError, match=r"\['zzz'\]; valid:"):  # nothing close: no guess
        torchspeed.fit(nn.Linear(8, 2), _fit_data(), progress=False, zzz=1)
    options = set(TrainConfig.__dataclass_fields__) | {"epochs"}
    named = {v: [part.split("=")[0].strip() for part in v.split(" or ")] for v in _ALIASES.values()}  # "a=V or b=V"
    assert all(v.startswith("callbacks=") or all(n in options for n in names) for v, names in named.items())


def test_an_lr_that_is_no_number_or_a_callback_class_is_named_and_one_callback_alone_is_a_list():
    with pytest.raises(ValueError, match=r"lr must be a number >= 0, 'auto' \(measured\) or None.*got '0.01'"):
        torchspeed.fit(nn.Linear(8, 2), _fit_data(), progress=False, lr="0.01")  # had been "Unknown format code 'g'"
    with pytest.raises(ValueError, match="got -1"):
        torchspeed.fit(nn.Linear(8, 2), _fit_data(), progress=False, lr=-1)
    with pytest.raises(TypeError, match=r"the class EarlyStopping: pass an instance, EarlyStopping\(...\)"):
        torchspeed.fit(nn.Linear(8, 2), _fit_data(), progress=False, callbacks=[torchspeed.EarlyStopping])
    seen = []

    class Count(torchspeed.Callback):
        def on_step_end(self, trainer):
            seen.append(trainer.step)
    r = torchspeed.fit(nn.Linear(8, 2), _fit_data(), progress=False, callbacks=Count())  # not in a list
    assert seen == list(range(1, r.steps + 1))
