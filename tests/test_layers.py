"""The package layers: `train` is the floor (no import of the tuners, data, bench, doctor or CLI), `tune`
builds on `train`, and `torchspeed.fit` (fitting.py) sits above both, so there is no import cycle."""

import ast
import pathlib

import torchspeed

ROOT = pathlib.Path(torchspeed.__file__).parent


def _imports(package: str) -> set[str]:
    found = set()
    for f in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found.update(n.split(".")[1] for n in names if n.startswith("torchspeed."))
    return found - {package}


def test_train_imports_nothing_above_it():
    assert _imports("train") <= {"_io", "_extras", "env"}  # _extras: the optional-import helper, below all


def test_tune_builds_on_train_and_never_on_fit():
    deps = _imports("tune")
    assert "train" in deps and not deps & {"fitting", "bench", "doctor", "cli"}


def test_fit_is_above_train_and_tune():
    from torchspeed import fitting

    src = pathlib.Path(fitting.__file__).read_text()
    assert "torchspeed.train.trainer" in src and "torchspeed.tune.auto" in src
    assert torchspeed.fit is fitting.fit
