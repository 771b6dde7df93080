"""The package layers: `train` is the floor (no import of the tuners, data, bench, doctor or CLI), `tune`
builds on `train`, and `torchspeed.fit` (fitting.py) sits above both; no module anywhere under src/ is in an
import cycle (lazy imports inside functions included); inside the doctor, the probe and the rules stay light."""

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


def test_the_plan_builds_on_train_and_tune_and_fit_on_the_plan():
    from torchspeed import fitting

    deps = _imports("plan")
    assert {"train", "tune"} <= deps and not deps & {"fitting", "bench", "doctor", "cli", "data"}
    assert "plan" not in _imports("train") | _imports("tune")
    src = pathlib.Path(fitting.__file__).read_text()
    assert "torchspeed.train.trainer" in src and "torchspeed.plan" in src
    assert torchspeed.fit is fitting.fit


def _module_graph() -> dict[str, set[str]]:
    """torchspeed module -> the torchspeed modules it imports, anywhere in the file (lazy imports too)."""
    files = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for name, f in files.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torchspeed"):
                deps.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                            for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("torchspeed"))
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_anywhere_under_src():
    graph = _module_graph()
    assert "torchspeed.doctor._job" in graph and "torchspeed.doctor._probe" in graph["torchspeed.doctor._job"]
    assert _cycles(graph) == []
    # the check itself finds a cycle when there is one
    assert _cycles({**graph, "torchspeed.doctor._tree": graph["torchspeed.doctor._tree"] | {"torchspeed.doctor._job"}})


def test_doctor_layers():
    """The probe instruments and knows no analysis; rules read observations and import no analysis code."""
    graph = _module_graph()
    doctor = {m: {d for d in deps if d.startswith("torchspeed.doctor")} for m, deps in graph.items()
              if m.startswith("torchspeed.doctor")}
    assert doctor["torchspeed.doctor._probe"] <= {"torchspeed.doctor._tree"}
    light = {"torchspeed.doctor.registry", "torchspeed.doctor.report", "torchspeed.doctor.rules"}
    for m, deps in doctor.items():
        if m.startswith("torchspeed.doctor.rules."):
            assert {d for d in deps if not d.startswith("torchspeed.doctor.rules.")} <= light, (m, deps)
    assert doctor["torchspeed.doctor.registry"] <= light
