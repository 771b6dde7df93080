"""Fault test: kill -9 a training process at random points, resume each time, end bit-identical.

A child process trains a tiny MLP on CPU in deterministic mode with an EMA of its weights
(the EMA callback) and a checkpoint every optimizer step. The parent waits until the newest checkpoint passes a random step, waits
a random few milliseconds more (so kills also land inside checkpoint writes), and sends
SIGKILL; after every kill every checkpoint file on disk must load and pass its checksum.
Then it restarts the child with resume="auto". After at least 10 kills the run is let
finish, and its final weights and EMA weights must equal those of an uninterrupted run bit for bit. The
same holds with parallel="fsdp2" (sharded model, DCP checkpoint folders; fewer steps and kills; no EMA).
"""

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torchspeed.train.state.checkpoint import load_checkpoint
from torchspeed.train.state.dcp import ShardedCheckpoints, export_checkpoint

CHILD = Path(__file__).with_name("_kill_child.py")
TOTAL_STEPS = 240
KILLS = 12


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    env.pop("LD_PRELOAD", None)
    return env


def _start(ckpt: Path, final: Path, args: tuple = ()) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(CHILD), str(ckpt), str(final), "--resume", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


def _newest_step(ckpt: Path) -> int:
    # step-XXXXXXXX.pt files, or finished step-XXXXXXXX/ DCP folders (their .metadata is written last)
    steps = [int(m.group(1)) for p in ckpt.glob("step-*") if (m := re.match(r"step-(\d+)(\.pt)?$", p.name))
             and (p.suffix == ".pt" or (p / ".metadata").exists())]
    return max(steps, default=0)


def _all_checkpoints_load(ckpt: Path) -> int:
    files = sorted(ckpt.glob("*.pt"))
    for p in files:
        state = load_checkpoint(p)  # checksum + weights_only load; raises if anything is damaged
        assert state["format"].startswith("torchspeed-checkpoint"), p
    folders = ShardedCheckpoints(ckpt).checkpoints()
    for folder in folders:
        assert ShardedCheckpoints(ckpt).read(folder).state["format"].startswith("torchspeed-checkpoint")
        export_checkpoint(folder, ckpt.parent / "export.pt")  # every shard is readable
    return len(files) + len(folders)


def test_kill_nine_resume_is_bit_identical(tmp_path):
    _kill_and_resume(tmp_path, total=TOTAL_STEPS, kills=KILLS)


def test_kill_nine_resume_is_bit_identical_with_fsdp2(tmp_path):
    _kill_and_resume(tmp_path, total=60, kills=4, args=("--fsdp2", "--steps", "60"))


def _kill_and_resume(tmp_path: Path, *, total: int, kills: int,
                     args: tuple = ()) -> None:
    rng = random.Random(1234)
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref = subprocess.run([sys.executable, str(CHILD), str(ref_dir), str(tmp_path / "ref.pt"), "--resume", *args],
                         capture_output=True, text=True, env=_env(), timeout=300)
    assert ref.returncode == 0, ref.stderr[-2000:]

    targets = sorted(rng.sample(range(3, total - 10), kills))
    n_kills = kills
    kills, resumed_steps = 0, []
    final = tmp_path / "run.pt"
    for target in targets:
        before = _newest_step(run_dir)
        if target <= before:
            target = before + 1
        proc = _start(run_dir, final, args)
        deadline = time.monotonic() + 120
        while _newest_step(run_dir) < target and proc.poll() is None:
            assert time.monotonic() < deadline, "the child made no progress"
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.015))  # anywhere inside the next steps, checkpoint writes included
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the child finished or died before the kill at step {target}: {err[-2000:]}")
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        kills += 1
        assert _all_checkpoints_load(run_dir) >= 1  # nothing on disk is ever unreadable
        resumed_steps.append(_newest_step(run_dir))

    last = _start(run_dir, final, args)
    out, err = last.communicate(timeout=300)
    assert last.returncode == 0, err[-2000:]
    assert "resumed" in out, "the last run did not resume from a checkpoint"
    assert kills >= min(10, n_kills)
    assert resumed_steps == sorted(resumed_steps) and resumed_steps[-1] > resumed_steps[0]

    a = load_checkpoint(tmp_path / "ref.pt")
    b = load_checkpoint(final)
    assert a["steps"] == b["steps"] == total
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"{k} differs after {kills} kills"
    if "--fsdp2" not in args:  # the plain run trains with an EMA too
        assert int(a["ema"]["n_averaged"]) == int(b["ema"]["n_averaged"]) == total  # one EMA update per step
        for k in a["ema"]:
            assert torch.equal(a["ema"][k], b["ema"][k]), f"EMA {k} differs after {kills} kills"
        assert not torch.equal(a["ema"]["module.0.weight"], a["model"]["0.weight"])  # the EMA is not the weights
    # No temporary file from a write cut short is ever mistaken for a checkpoint.
    assert all(p.name.startswith("step-") or p.name == "best.pt" for p in run_dir.glob("*.pt"))
    assert all(p.name.startswith(("step-", "best", ".")) for p in run_dir.iterdir())
