"""One home per helper: a device sync, the wrapper attribute names, /proc/meminfo parsing and the
DataLoader rebuild each live in one module. A copy elsewhere fails here, naming the file and the home."""

import pathlib
import re

import pytest

import torchspeed

ROOT = pathlib.Path(torchspeed.__file__).parent

HOMES = {
    r"cuda\.synchronize": "env.py",                   # torchspeed.env.sync
    r"_orig_mod": "train/wrappers.py",                # unwrap_model, strip_wrapper_prefixes, is_compiled
    r"/proc/meminfo": "env.py",                       # torchspeed.env.host_memory
    r"def rebuild_loader|DataLoader\(loader\.dataset": "train/sampler.py",  # rebuild_loader
    r"def usable_cores|sched_getaffinity": "env.py",  # torchspeed.env.usable_cores
    r"def unwrap_model": "train/wrappers.py",
}


@pytest.mark.parametrize("pattern", sorted(HOMES))
def test_helper_lives_in_its_home_only(pattern):
    home = HOMES[pattern]
    found = sorted(str(f.relative_to(ROOT)) for f in ROOT.rglob("*.py") if re.search(pattern, f.read_text()))
    assert found == [home], f"{pattern!r} belongs in {home} alone; also in {[f for f in found if f != home]}"


def test_nothing_below_the_cli_imports_the_cli():
    offenders = [str(f.relative_to(ROOT)) for f in ROOT.rglob("*.py")
                 if "cli" not in f.relative_to(ROOT).parts and f.name != "__main__.py" and re.search(r"from torchspeed\.cli|import torchspeed\.cli",
                                                                         f.read_text())]
    assert offenders == []
