"""`torchspeed doctor` end to end, the --json format, usage errors, and patch restoration."""

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from torch.utils.data import dataloader as dl_mod

from torchspeed.cli.main import main
from torchspeed.doctor import diagnose

SCRIPTS = Path(__file__).parent / "scripts"


def test_cli_json_format(tmp_path, capsys):
    out = tmp_path / "report.json"
    rc = main(["doctor", str(SCRIPTS / "zero_grad_false.py"), "--steps", "3", "--warmup", "1", "--json", str(out),
               "--", "--epochs", "2", "--lr", "0.1"])
    assert rc == 0
    d = json.loads(out.read_text())
    assert {"breakdown", "findings"} <= set(d)
    for key in ("step_ms", "data_wait_ms", "copy_ms", "compute_ms", "sync_ms", "other_ms"):
        assert isinstance(d["breakdown"][key], float)
    assert d["findings"]
    for f in d["findings"]:
        assert set(f) == {"rule", "severity", "evidence", "fix", "est_gain", "measured_gain", "patch", "basis", "also",
                          "interval", "inconclusive", "ceiling"}
        assert f["basis"] in ("measured", "timed", "estimated") and isinstance(f["also"], list)
        assert f["severity"] in ("high", "medium", "low")
        assert f["est_gain"] is None or isinstance(f["est_gain"], float)
    assert "zero-grad-memset" in {f["rule"] for f in d["findings"]}
    assert d["env"]["device"] in ("cpu", "cuda") and d["status"] == "stopped"
    assert d["verdict"]["verdict"] in ("pass", "regression", "inconclusive") and "fixes" in d["verdict"]
    printed = capsys.readouterr().out
    assert "zero-grad-memset" in printed and "step time" in printed


def test_cli_reports_a_crashing_script(capsys):
    rc = main(["doctor", str(SCRIPTS / "crashes.py"), "--steps", "5"])
    assert rc == 1
    out = capsys.readouterr().out
    assert "planted failure in step 3" in out and "raised" in out


def test_cli_splits_doctor_options_from_script_arguments():
    from torchspeed.cli.doctor import split_rest
    from torchspeed.cli.main import build_parser
    p = build_parser()
    cases = {("t.py", "--", "--steps", "2"): ("t.py", 30, ["--steps", "2"]),
             ("t.py", "--steps", "3", "--", "--epochs", "2"): ("t.py", 3, ["--epochs", "2"]),
             ("--steps", "4", "t.py", "--", "--x"): ("t.py", 4, ["--x"]),
             ("t.py",): ("t.py", 30, [])}
    for argv, (script, steps, script_args) in cases.items():
        a = p.parse_args(["doctor", *argv])
        assert split_rest(a) == script_args and a.script == script and a.steps == steps, argv


def test_cli_usage_errors(capsys):
    assert main(["doctor"]) == 2
    assert "give the training script" in capsys.readouterr().err
    assert main(["doctor", "no_such_script.py"]) == 2
    assert "no such script" in capsys.readouterr().err
    assert main(["doctor", str(SCRIPTS / "crashes.py"), "--epochs", "3"]) == 2
    assert "after `--`" in capsys.readouterr().err
    assert main(["doctor", str(SCRIPTS / "crashes.py"), "--verify", "--fixes", "warp_drive"]) == 2


def test_in_process_run_restores_every_patch(tmp_path):
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "numpy", "cpu", "nonzero", "to",
                                                                   "cuda", "backward")}
    own = {name for name in originals if name in vars(torch.Tensor)}
    tensor_fn, nonzero_fn = torch.tensor, torch.nonzero
    zg, it, nxt = torch.optim.Optimizer.zero_grad, DataLoader.__iter__, dl_mod._BaseDataLoaderIter.__next__
    argv, path = list(sys.argv), list(sys.path)
    r = diagnose(str(SCRIPTS / "host_sync_loop.py"), steps=4, warmup=1, isolate=False)
    assert r.status == "stopped" and "host-sync" in r.rules
    for name, fn in originals.items():
        assert getattr(torch.Tensor, name) is fn or (name not in own and name not in vars(torch.Tensor))
    assert torch.tensor is tensor_fn and torch.nonzero is nonzero_fn
    assert torch.optim.Optimizer.zero_grad is zg and DataLoader.__iter__ is it
    assert dl_mod._BaseDataLoaderIter.__next__ is nxt
    from torch.nn.modules import module as mm
    from torch.optim import optimizer as om
    assert not mm._global_forward_hooks and not mm._global_forward_pre_hooks
    assert not om._global_optimizer_post_hooks and not om._global_optimizer_pre_hooks
    assert sys.argv == argv and sys.path == path
