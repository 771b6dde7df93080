"""`torchspeed launch --nproc 2 -- torchspeed train --data FOLDER`: the CLI trainer as a 2-process DDP run (gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from torchspeed.data import make_jpeg_folder
from torchspeed.data.pipeline import build_loaders
from torchspeed.train.parallel.shard import shard_loader


@pytest.mark.timeout(600)
def test_launch_train_splits_the_folder_and_writes_once(tmp_path):
    data, out = make_jpeg_folder(tmp_path / "photos", n_per_class=10, classes=4, max_side=(24, 32)), tmp_path / "out"
    # --standalone (what launch uses on one machine) lets torchrun pick a free port itself.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "torchspeed", "launch", "--nproc", "2", "--threads", "1", "--",
                           "torchspeed", "train", "--data", str(data), "--model", "simple_cnn", "--size", "16",
                           "--epochs", "2", "--batch-size", "8", "--device", "cpu", "--workers", "0",
                           "--compile", "off", "--out", str(out)],
                          capture_output=True, text=True, timeout=570, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    # 40 images, 4 held out: 36 to train, 18 per rank -> 2 batches of 8 per epoch (36 // 8 = 4 in one process)
    whole = build_loaders(data, size=16, batch_size=8, workers=0, device="cpu", progress=False)
    per_rank = [len(shard_loader(whole.train, rank=r, world_size=2)) for r in (0, 1)]
    assert per_rank == [2, 2] and len(whole.train) == 4
    run = json.loads((out / "run.json").read_text())
    assert run["world_size"] == 2 and "DDP, 2 processes (gloo)" in run["fit_decisions"]["distributed"]["value"]
    assert run["final"]["step"] == 2 * per_rank[0]  # every rank trained on its half, in step with the other
    assert run["final"]["val_acc"] is not None
    history = json.loads((out / "metrics.json").read_text())["history"]
    assert [row["epoch"] for row in history] == [1, 2]
    state = torch.load(out / "model.pt", weights_only=True)
    assert state["classes"] == sorted(p.name for p in data.iterdir()) and state["size"] == 16
    assert (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir())
    # rank 0 alone prints and writes; rank 1 returns before the writing block
    assert log.count("done: 4 steps") == 1 and log.count("wrote ") == 1 and "Traceback" not in log


def test_train_refuses_a_packed_file_under_launch_in_one_line(tmp_path, monkeypatch, capsys):
    from torchspeed.cli.main import main
    from torchspeed.data.packed import pack_folder

    data = make_jpeg_folder(tmp_path / "photos", n_per_class=2, classes=2, max_side=24)
    pack_folder(data, tmp_path / "photos.tspack")
    monkeypatch.setenv("RANK", "0")  # what torchrun sets; the check runs before any process group exists
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "--data", str(tmp_path / "photos.tspack"), "--out", str(tmp_path / "out")]) == 2
    assert "packed file cannot be split" in capsys.readouterr().err
