"""The public paths from before train/ had rooms still import: `torchspeed.train.switches` is the module in
train/trial/, the same object (train/__init__.py registers the old paths), and every `torchspeed.train.X` the
docs and the README name resolves. The old paths are imported here through importlib and strings: the
project's own imports name each module in its room (tests/test_homes.py)."""

import importlib
import pathlib
import re
import subprocess
import sys

import pytest

import torchspeed.train
from torchspeed.train.loop import callbacks
from torchspeed.train.parallel import distributed
from torchspeed.train.trial import memory_format, switches

ROOT = pathlib.Path(__file__).resolve().parents[2]
MOVED = {  # old path under torchspeed.train -> (the module in its room, a public name it defines)
    "callbacks": (callbacks, "EMA"),
    "distributed": (distributed, "wrap_ddp"),
    "memory_format": (memory_format, "apply_channels_last"),
    "switches": (switches, "LiveTrial"),
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_public_path_is_the_module_in_its_room(old):
    module, name = MOVED[old]
    path = f"torchspeed.train.{old}"
    assert importlib.import_module(path) is module
    assert sys.modules[path] is module and getattr(torchspeed.train, old) is module
    scope: dict = {}
    exec(f"import {path}\nfrom {path} import {name}", scope)  # the two forms users write
    assert scope[name] is getattr(module, name)
    assert scope["torchspeed"].train.__dict__[old] is module


def test_the_old_paths_import_first_in_a_fresh_process():
    """An old path as a program's first torchspeed import (the parent package loads, then the alias)."""
    lines = [f"from torchspeed.train.{old} import {name}" for old, (_, name) in sorted(MOVED.items())]
    code = "\n".join([*lines, "import torchspeed.train.switches as s, torchspeed.train.trial.switches as t",
                      "assert s is t"])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_every_train_path_the_docs_name_resolves():
    text = "\n".join(f.read_text() for f in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    named = set(re.findall(r"\btorchspeed\.train\.([a-z_]+)\b", text))
    missing = []
    for name in sorted(named):
        if hasattr(torchspeed.train, name):
            continue
        try:
            importlib.import_module(f"torchspeed.train.{name}")
        except ImportError:
            missing.append(name)
    assert missing == [], "a `torchspeed.train.X` in the docs that does not import"
