"""The light install: torchspeed's core (torch, numpy, rich) runs `fit`, `doctor` and `env`; a missing extra
fails with one line naming the `pip install`.

The optional packages are blocked in a child process by a `sys.meta_path` finder installed from a
`sitecustomize.py` on PYTHONPATH, so the processes the doctor starts are blocked too. A real
fresh venv with `pip install .` (no extras) is the slow test at the end.
"""

import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from torchspeed._extras import EXTRAS, MissingExtraError, require

ROOT = Path(__file__).resolve().parents[1]
# Every optional package (and the big ones they pull in): none may be needed by the core.
BLOCKED = ("torchvision", "PIL", "simplejpeg", "cv2", "skimage", "scipy", "matplotlib", "sklearn", "timm",
           "tensorboard", "lightning", "lightning_fabric", "pytorch_lightning", "kornia", "torchdata", "torch_pruning",
           "einops")

# Hides the packages as if they were not installed: the path finder answers None for them, so
# `import` raises ModuleNotFoundError and `importlib.util.find_spec` returns None (torch._dynamo
# probes optional packages that way; a finder that raised would break it where a real absence does not).
BLOCKER = f"""
import sys
from importlib.machinery import PathFinder
BLOCKED = {BLOCKED!r}
class _HideOptional(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        return PathFinder.find_spec(name, path, target)
sys.meta_path[:] = [_HideOptional if f is PathFinder else f for f in sys.meta_path]
"""

TINY_SCRIPT = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(512, 16), torch.randint(0, 4, (512,))
for step in range(40):
    i = torch.randint(0, 512, (32,))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x[i]), y[i]).backward()
    opt.step()
"""

CHILD = """
import sys
import torch
from torch.utils.data import DataLoader, TensorDataset
import torchspeed
from torchspeed.cli.main import main

torch.manual_seed(0)
x = torch.randn(256, 8)
y = (x[:, 0] > 0).long()
loader = DataLoader(TensorDataset(x, y), batch_size=32)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
r = torchspeed.fit(model, loader, epochs=3, val_loader=loader, device="cpu", progress=False,
                   callbacks=[torchspeed.EMA(0.9), torchspeed.EarlyStopping("val_loss", patience=5)])
assert r.final["val_acc"] > 0.8, r.final
assert main(["env"]) == 0
assert main(["doctor", sys.argv[1], "--steps", "5", "--warmup", "2"]) == 0
# a feature whose extra is missing: the CLI's one line
assert main(["tune", "lr", "--data", "digits", "--quick"]) == 2
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {blocked!r})
assert not loaded, loaded
print("CORE-OK")
"""


def _blocked_env(tmp_path: Path) -> dict:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT / "src")]), OMP_NUM_THREADS="1")
    env.pop("LD_PRELOAD", None)
    return env


def test_core_runs_fit_doctor_env_without_optional_packages(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TINY_SCRIPT)
    child = tmp_path / "child.py"
    child.write_text(CHILD.format(blocked=BLOCKED))
    p = subprocess.run([sys.executable, str(child), str(script)], capture_output=True, text=True,
                       env=_blocked_env(tmp_path), cwd=tmp_path, timeout=600)
    assert p.returncode == 0 and "CORE-OK" in p.stdout, (p.stdout[-3000:], p.stderr[-3000:])
    assert "precision='auto' picks" in p.stdout          # env printed its table
    assert "step time" in p.stdout.lower()               # the doctor printed its report
    # The missing extra: one line on stderr, naming the pip install.
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("torchspeed tune: error:")]
    assert len(lines) == 1, p.stderr[-3000:]
    assert "pip install 'torchspeed[bench]'" in lines[0] and "sklearn (scikit-learn)" in lines[0]


def test_blocker_really_blocks(tmp_path):
    """Control: the same child environment cannot import an optional package (so the test above means something)."""
    p = subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True, text=True,
                       env=_blocked_env(tmp_path), timeout=120)
    assert p.returncode != 0 and "No module named 'torchvision'" in p.stderr


def test_require_message_is_one_line_naming_the_extra():
    with pytest.raises(MissingExtraError) as e:
        require("torchspeed_no_such_module_xyz", "plot", feature="find_lr(plot=...)")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == ("find_lr(plot=...) needs torchspeed_no_such_module_xyz, which is not installed; it comes with "
                   "torchspeed's `plot` extra: pip install 'torchspeed[plot]'")
    assert isinstance(e.value, ImportError)
    assert require("json").dumps([1]) == "[1]"


def test_require_lets_a_broken_installed_package_raise_its_own_error(tmp_path, monkeypatch):
    (tmp_path / "tsbroken_pkg").mkdir()
    (tmp_path / "tsbroken_pkg" / "__init__.py").write_text("import tsbroken_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as e:
        require("tsbroken_pkg", "data")
    assert not isinstance(e.value, MissingExtraError) and e.value.name == "tsbroken_missing_dependency"


def test_each_feature_names_its_extra(monkeypatch):
    """The library calls (not only the CLI) raise MissingExtraError naming the right extra."""
    import importlib

    from torch import nn

    from torchspeed.bench.workloads import create_model, digits
    from torchspeed.data.decode import _opencv
    from torchspeed.model.prune import prune_channels
    from torchspeed.train.optim import create_optimizer

    real = importlib.import_module

    def fake_import(name, *a, **k):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, *a, **k)
    monkeypatch.setattr(importlib, "import_module", fake_import)
    cases = [(lambda: digits(), "bench"), (lambda: create_model("resnet18"), "bench"),
             (lambda: _opencv(b"", 0, 0), "data"), (lambda: create_optimizer("lamb", nn.Linear(2, 2), lr=0.1), "timm"),
             (lambda: prune_channels(nn.Linear(2, 2), None, ratio=0.5), "slim")]
    for call, extra in cases:
        with pytest.raises(MissingExtraError, match=re.escape(f"pip install 'torchspeed[{extra}]'")):
            call()


def test_extras_table_matches_pyproject():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = meta["optional-dependencies"]
    core = {re.split(r"[<>=\[]", d)[0] for d in meta["dependencies"]}
    assert core == {"torch", "numpy", "rich"}
    pip_names = {"torchvision": "torchvision", "PIL": "pillow", "simplejpeg": "simplejpeg",
                 "cv2": "opencv-python-headless", "skimage": "scikit-image", "matplotlib": "matplotlib",
                 "sklearn": "scikit-learn", "timm": "timm", "tensorboard": "tensorboard", "schedulefree": "schedulefree",
                 "torch_pruning": "torch-pruning", "einops": "einops"}
    for module, extra in EXTRAS.items():
        assert any(d.startswith(pip_names[module]) for d in extras[extra]), (module, extra)
    assert set(extras) >= {"data", "plot", "bench", "timm", "all", "dev"}
    assert "[all,dev]" in (ROOT / "Makefile").read_text()


@pytest.mark.slow
def test_fresh_venv_pip_install_without_extras(tmp_path):
    """`pip install .` into a new venv (core only, from the package index), then fit, doctor and env."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", str(ROOT)], check=True, timeout=3000)
    freeze = subprocess.run([str(py), "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout
    for pkg in ("torchvision", "scikit-learn", "scikit-image", "opencv", "matplotlib", "timm", "simplejpeg", "schedulefree"):
        assert pkg not in freeze.lower(), pkg
    script = tmp_path / "train.py"
    script.write_text(TINY_SCRIPT)
    child = tmp_path / "child.py"
    child.write_text(CHILD.format(blocked=()))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    p = subprocess.run([str(py), str(child), str(script)], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=900)
    assert p.returncode == 0 and "CORE-OK" in p.stdout, (p.stdout[-3000:], p.stderr[-3000:])
    assert "pip install 'torchspeed[bench]'" in p.stderr
