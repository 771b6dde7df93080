"""Each bench config in a process of its own (its own allocator, compile cache and thread pool):
`config_env`, the environment it starts with (tcmalloc through LD_PRELOAD, glibc malloc's thresholds
`env.GLIBC_MALLOC_ENV`, OpenMP's wait policy: the rows `tcmalloc`, `malloc_tuned` and `omp_passive`), and
`ConfigProcess`, the worker (bench/_worker.py) that runs its steps and answers on stdout.

bench/runner.py builds the configs and times them in interleaved rounds; bench/time_to_target.py starts its
runs with `config_env` too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING

from torchspeed.bench._protocol import read_reply
from torchspeed.env import GLIBC_MALLOC_ENV, detect

if TYPE_CHECKING:  # annotations only: bench/runner.py builds the configs and imports this module
    from torchspeed.bench.runner import BenchConfig

__all__ = ["config_env", "ConfigProcess"]


def config_env(cfg: BenchConfig) -> dict[str, str]:
    """The environment a config's process starts with: its allocator (LD_PRELOAD) and OpenMP settings."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    for name in ("OMP_WAIT_POLICY", *dict(GLIBC_MALLOC_ENV)):  # a row gets only the settings it is about
        if name not in dict(cfg.env):
            env.pop(name, None)
    env.update(dict(cfg.env))
    if cfg.allocator == "tcmalloc":
        lib = detect().tcmalloc_path
        if lib:
            env["LD_PRELOAD"] = lib
    return env

class ConfigProcess:
    """A bench config running in its own Python process (its own allocator, caches, threads)."""

    def __init__(self, cfg: BenchConfig, spec: dict):
        self.cfg = cfg
        self.proc = subprocess.Popen([sys.executable, "-m", "torchspeed.bench._worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env=config_env(cfg), bufsize=1)
        self.spec = spec | {"train": asdict(cfg.train), "num_workers": cfg.num_workers, "kind": cfg.kind}
        if cfg.hand_settings:
            self.spec["hand"] = spec.get("hand", {}) | {"settings": dict(cfg.hand_settings)}
        self.times: list[float] = []
        self.send({"op": "setup", "spec": self.spec}, wait=False)

    def send(self, cmd: dict, *, wait: bool = True) -> dict | None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.receive() if wait else None

    def receive(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            answer = read_reply(line, f"bench config {self.cfg.name!r}")
            if answer is not None:
                return answer
        raise RuntimeError(f"bench config {self.cfg.name!r}: its process exited (code {self.proc.wait()})")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "exit"})
            except (RuntimeError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
