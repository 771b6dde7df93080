"""`torchspeed launch --nproc 2 -- python script.py` end to end: a plain script becomes a 2-process DDP run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchspeed.cli.launch import torchrun_command
from torchspeed.cli.main import CLIError

SCRIPT = Path(__file__).parent / "scripts" / "tiny_fit.py"


# A few seconds on an idle machine; the limits leave room for a loaded one.
@pytest.mark.timeout(600)
def test_launch_runs_an_unchanged_fit_script_in_two_processes(tmp_path):
    # The CPU (gloo) job on every machine: with GPUs visible, fit would pick NCCL, one GPU per rank.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "torchspeed", "launch", "--nproc", "2", "--threads", "1", "--",
                           "python", str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=570,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0["world"] == r1["world"] == 2 and r0["threads"] == 1
    assert "DDP, 2 processes (gloo)" in r0["decisions"]["distributed"]["value"]
    # 96 samples / 2 ranks / batch 8 = 6 micro-batches per epoch, grad_accum 2 -> 3 steps x 2 epochs
    assert r0["steps"] == r1["steps"] == 6
    # the replicas started from different weights and end identical (DDP broadcast + all-reduce)
    assert r0["weights"] == pytest.approx(r1["weights"], abs=1e-6)
    assert r0["history"][-1]["train_loss"] == pytest.approx(r1["history"][-1]["train_loss"])
    written = json.loads((tmp_path / "metrics" / "metrics.json").read_text())
    assert [row["epoch"] for row in written["history"]] == [1, 2]
    # progress on rank 0 only: one "epoch 1" summary line, not one per process
    assert (proc.stdout + proc.stderr).count("epoch 1  train_loss") == 1


def test_torchrun_command_shapes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("train.py", "t.py"):
        (tmp_path / name).write_text("")
    argv = torchrun_command(["python", "train.py", "--lr", "0.1"], nproc=4)
    # a python command's script runs through the rank entry (unchanged, then a clean exit: cli/_rank.py)
    assert argv[1:] == ["-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone",
                        "-m", "torchspeed.cli._rank", "train.py", "--lr", "0.1"]
    assert torchrun_command(["python", "-m", "pkg.train"], nproc=2)[-4:] == ["-m", "torchspeed.cli._rank", "-m",
                                                                             "pkg.train"]
    # torchspeed itself runs on launch's interpreter (no bin/ on PATH needed); other executables as they are
    assert torchrun_command(["torchspeed", "bench"], nproc=2)[-3:] == ["-m", "torchspeed", "bench"]
    assert torchrun_command(["mytool", "--x"], nproc=2)[-3:] == ["--no-python", "mytool", "--x"]
    multi = torchrun_command(["python", "t.py"], nproc=8, nnodes="2", rdzv_endpoint="head:29500", rdzv_id="j1")
    assert multi[multi.index("--rdzv-endpoint") + 1] == "head:29500" and "--standalone" not in multi
    static = torchrun_command(["python", "t.py"], nproc=8, nnodes="2", node_rank=1, master_addr="10.0.0.1")
    assert static[static.index("--node-rank") + 1] == "1"
    for bad in (dict(cmd=[], nproc=2), dict(cmd=["python", "t.py"], nproc="0"),
                dict(cmd=["python", "t.py"], nproc=2, nnodes="2"), dict(cmd=["python", "missing.py"], nproc=2)):
        with pytest.raises(CLIError):
            torchrun_command(bad.pop("cmd"), **bad)


def test_launch_cli_errors_are_one_line():
    proc = subprocess.run([sys.executable, "-m", "torchspeed", "launch", "--", "python", "t.py"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--nproc" in proc.stderr and "Traceback" not in proc.stderr


def test_more_processes_than_gpus_is_refused_with_the_fix(monkeypatch):
    from torchspeed.train.parallel import distributed as D

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(D.torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match=r"2 processes on this machine but 1 GPU.*--nproc 1.*device='cpu'"):
        D._check_one_gpu_per_process()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    D._check_one_gpu_per_process()  # one process per GPU: fine


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_launch_with_more_processes_than_gpus_fails_with_one_clear_message(tmp_path):
    import torch

    n = torch.cuda.device_count() + 1
    proc = subprocess.run([sys.executable, "-m", "torchspeed", "launch", "--nproc", str(n), "--threads", "1", "--",
                           "python", str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=570)
    assert proc.returncode != 0
    assert f"{n} processes on this machine but {n - 1} GPU(s) visible" in proc.stderr


@pytest.mark.timeout(600)
def test_launch_runs_an_fsdp2_script_with_dcp_checkpoints_and_export(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    script = Path(__file__).parent / "scripts" / "fsdp_fit.py"
    proc = subprocess.run([sys.executable, "-m", "torchspeed", "launch", "--nproc", "2", "--threads", "1", "--",
                           "python", str(script), str(tmp_path)], capture_output=True, text=True, timeout=570,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert "FSDP2, 2 processes (gloo)" in r0["decisions"]["distributed"]  # this script writes str(decision)
    assert r0["decisions"]["fsdp_blocks"].startswith("2 x Sequential + root")
    # 64 samples / 2 ranks / batch 8 = 4 steps per epoch; a checkpoint at each epoch end, hook on both ranks
    assert r0["steps"] == r1["steps"] == 8 and r0["checkpoints"] == r1["checkpoints"] == [4, 8]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["best", "step-00000004", "step-00000008"]
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(weights) == {"0.weight", "0.bias", "1.0.weight", "1.0.bias", "2.0.weight", "2.0.bias",
                            "3.weight", "3.bias"}


def _rank(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "torchspeed.cli._rank", *args], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)


def test_the_rank_entry_runs_a_script_as_python_would_and_keeps_its_exit_status(tmp_path):
    """`python -m torchspeed.cli._rank script ARGS` == `python script ARGS`: __main__, argv, sys.path[0], atexit,
    the exit status (ended through exit_process, so the teardown that aborts gloo ranks is skipped)."""
    sub = tmp_path / "proj"
    sub.mkdir()
    (sub / "helper.py").write_text("VALUE = 41\n")
    (sub / "train.py").write_text(
        "import atexit, sys\nimport helper\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "if __name__ == '__main__':\n"
        "    print('main', sys.argv, helper.VALUE + 1)\n"
        "    sys.exit(int(sys.argv[1]))\n")
    ok = _rank(tmp_path, "proj/train.py", "0", "--lr", "0.1")
    assert ok.returncode == 0, ok.stderr
    assert "main ['proj/train.py', '0', '--lr', '0.1'] 42" in ok.stdout and "atexit ran" in ok.stdout
    assert _rank(tmp_path, "proj/train.py", "3").returncode == 3
    (sub / "boom.py").write_text("raise RuntimeError('the script failed')\n")
    bad = _rank(tmp_path, "proj/boom.py")
    assert bad.returncode == 1 and "RuntimeError: the script failed" in bad.stderr and "Traceback" in bad.stderr
    (sub / "msg.py").write_text("import sys\nsys.exit('stopped: bad config')\n")
    msg = _rank(tmp_path, "proj/msg.py")
    assert msg.returncode == 1 and "stopped: bad config" in msg.stderr


def test_the_rank_entry_runs_a_module(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text("import sys\nif __name__ == '__main__':\n    print('module', sys.argv[1:])\n")
    out = _rank(tmp_path, "-m", "mypkg.train", "--x", "1")
    assert out.returncode == 0 and "module ['--x', '1']" in out.stdout, out.stderr
    assert _rank(tmp_path).returncode == 2
