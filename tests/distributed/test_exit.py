"""A finished DDP rank ends through `exit_process`: the process group is destroyed, atexit handlers
run, output is flushed, the exit status is kept, and the interpreter teardown (where gloo's threads,
kept alive by DDP's reducer, can abort a finished rank) is skipped."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import torchspeed.cli.main as cli_main
import torchspeed.train.parallel.rank_exit as tsdist

SCRIPT = textwrap.dedent("""
    import atexit, os, sys
    import torch, torch.distributed as dist
    from torchspeed.train.parallel.distributed import wrap_ddp
    from torchspeed.train.parallel.rank_exit import exit_process

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    ddp = wrap_ddp(torch.nn.Linear(3, 2), device="cpu")
    ddp(torch.ones(4, 3)).sum().backward()
    threads = lambda: sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    print("gloo threads before:", sum(n.startswith(("gloo", "pt_gloo")) for n in threads()))
    atexit.register(lambda: print("atexit ran; process group left:", dist.is_initialized()))
    sys.stdout.write("unflushed tail")       # no newline: only a flush gets it out
    exit_process(int(sys.argv[2]))
    print("not reached")
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("code", [0, 3])
def test_exit_process_keeps_the_status_runs_atexit_and_flushes(tmp_path, code):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "store"), str(code)],
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == code, proc.stderr[-2000:]
    out = proc.stdout
    assert "gloo threads before:" in out and int(out.split("gloo threads before:")[1].split()[0]) > 0
    assert "atexit ran; process group left: False" in out  # destroyed before the handlers ran
    assert "unflushed tail" in out
    assert "not reached" not in out


def _fake_main(code):
    def main(argv=None):
        return code
    return main


def test_cli_run_ends_a_distributed_rank_through_exit_process(monkeypatch):
    calls = []

    class Done(Exception):
        pass

    def fake_exit(code):
        calls.append(code)
        raise Done

    monkeypatch.setattr(cli_main, "main", _fake_main(5))
    monkeypatch.setattr(tsdist, "exit_process", fake_exit)
    monkeypatch.setattr("torch.distributed.is_initialized", lambda: True)
    with pytest.raises(Done):
        cli_main.run([])
    assert calls == [5]


def test_cli_run_exits_normally_without_a_process_group(monkeypatch):
    calls = []
    monkeypatch.setattr(cli_main, "main", _fake_main(4))
    monkeypatch.setattr(tsdist, "exit_process", lambda code: calls.append(code))
    monkeypatch.setattr("torch.distributed.is_initialized", lambda: False)
    with pytest.raises(SystemExit) as e:
        cli_main.run([])
    assert e.value.code == 4 and calls == []
