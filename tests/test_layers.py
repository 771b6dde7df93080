"""The package layers, as data: `LAYERS` says which torchspeed packages each package may import (lazy
imports inside functions included), docs/architecture.md shows the same table, and a function-level import
of torchspeed is allowed only where `LAZY` gives it a reason (a cycle, an optional extra, start-up time, a
test's injection point); their number only goes down. No module anywhere under src/ is in an import cycle;
inside the doctor, the probe and the rules stay light. train/'s rooms (`TRAIN_ROOMS`: loop, trial, state,
parallel) each open with a docstring naming their modules, and the docs show them too."""

import ast
import pathlib
import re

import torchspeed

ROOT = pathlib.Path(torchspeed.__file__).parent
DOCS = ROOT.parent.parent / "docs" / "architecture.md"

FLOOR = ("_io", "_extras", "_allocator", "env")
BELOW_CLI = (*FLOOR, "train", "tune", "data", "model", "plan", "distill", "fitting", "slimming", "inference")
LAYERS = {  # bottom to top: a package (or top-level module) -> what it may import besides itself
    "_io": (), "_extras": (), "_allocator": (), "env": ("_allocator",),
    "train": FLOOR,
    "tune": (*FLOOR, "train"),
    "data": (*FLOOR, "train"),
    "model": (*FLOOR, "train"),
    "plan": (*FLOOR, "train", "tune"),
    "distill": (*FLOOR, "train"),
    "fitting": (*FLOOR, "train", "plan", "distill"),
    "slimming": (*FLOOR, "train", "model", "fitting"),
    "inference": (*FLOOR, "train", "data", "model"),
    "bench": BELOW_CLI,
    "doctor": BELOW_CLI,
    "torchspeed": (*BELOW_CLI, "doctor"),  # the package face, __init__.py
    "cli": (*BELOW_CLI, "bench", "doctor", "torchspeed"),
    "__main__": ("cli",),
}
PURPOSE = {
    "_io": "atomic file writes", "_extras": "optional imports", "_allocator": "which malloc: tcmalloc found, the one in use",
    "env": "what this machine can accelerate",
    "train": "the loop and the techniques, in rooms (below)", "tune": "the tuners, measured with train's step",
    "data": "image decoding, caching, loaders", "model": "model surgery and models by name",
    "plan": "the one planner and the recipe", "distill": "distillation's loss and teacher cache",
    "fitting": "`torchspeed.fit`", "slimming": "`torchspeed.slim`, pruning measured",
    "inference": "load_model, predict",
    "bench": "the bench rows", "doctor": "the doctor", "cli": "per subcommand, its parser and its runner",
    "torchspeed": "the package face (`import torchspeed`)", "__main__": "`python -m torchspeed`",
}


def _unit(path: pathlib.Path) -> str:
    first = path.relative_to(ROOT).parts[0].removesuffix(".py")
    return "torchspeed" if first == "__init__" else first


def _type_only(tree) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (never run)."""
    return {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for b in node.body for n in ast.walk(b) if isinstance(n, (ast.Import, ast.ImportFrom))}


def _targets(node) -> list[str]:
    """The torchspeed units an import statement reaches (`from torchspeed import x`: x's unit, or the face)."""
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        parts = node.module.split(".")
        if parts[0] != "torchspeed":
            return []
        if len(parts) > 1:
            return [parts[1]]
        return [a.name if a.name in LAYERS else "torchspeed" for a in node.names]
    if isinstance(node, ast.Import):
        return [(a.name.split(".") + ["torchspeed"])[1] for a in node.names if a.name.split(".")[0] == "torchspeed"]
    return []


def layer_imports() -> dict[str, set[str]]:
    """unit -> the other torchspeed units it imports, anywhere in its files."""
    found: dict[str, set[str]] = {}
    for f in ROOT.rglob("*.py"):
        tree = ast.parse(f.read_text())
        skip = _type_only(tree)
        unit = _unit(f)
        for node in ast.walk(tree):
            if id(node) not in skip:
                found.setdefault(unit, set()).update(t for t in _targets(node) if t != unit)
    return found


def test_every_package_imports_only_its_layers():
    found = layer_imports()
    assert set(found) <= set(LAYERS), f"add {sorted(set(found) - set(LAYERS))} to LAYERS"
    wrong = {u: sorted(deps - set(LAYERS[u])) for u, deps in found.items() if deps - set(LAYERS[u])}
    assert wrong == {}, "an import across the layers (tests/test_layers.py LAYERS, docs/architecture.md)"


def test_the_layers_are_a_stack():
    """Each unit may import only units listed before it: the table has no cycle, and reads bottom to top."""
    order = list(LAYERS)
    assert all(order.index(d) < order.index(u) for u, deps in LAYERS.items() for d in deps)


def test_the_layer_check_sees_lazy_and_face_imports():
    lazy = ast.parse("def f():\n    from torchspeed.tune.loader import tune_loader\n")
    assert [t for n in ast.walk(lazy) for t in _targets(n)] == ["tune"]
    face = ast.parse("from torchspeed import fit, data\nimport torchspeed.plan.budget\n")
    assert [t for n in ast.walk(face) for t in _targets(n)] == ["torchspeed", "data", "plan"]


def render_layers() -> str:
    """The markdown table of LAYERS, top to bottom, as docs/architecture.md shows it."""
    rows = ["| layer | what it is | may import |", "|---|---|---|"]
    for unit in reversed(LAYERS):
        name = f"`{unit}/`" if (ROOT / unit).is_dir() else f"`{unit}`" if unit == "torchspeed" else f"`{unit}.py`"
        name = "`__init__.py`" if unit == "torchspeed" else name
        deps = ", ".join(f"`{d}`" for d in LAYERS[unit]) or "nothing"
        rows.append(f"| {name} | {PURPOSE[unit]} | {deps} |")
    return "\n".join(rows)


def test_the_docs_show_the_layers_table():
    assert render_layers() in DOCS.read_text(), \
        "docs/architecture.md's layers table differs from LAYERS; paste tests.test_layers.render_layers()"


# ---------------------------------------------------------------- train/'s rooms
# train/ keeps its modules in sub-packages that name the architecture; the techniques that stand alone stay at
# its top level. Each room opens with a docstring naming its modules, gathers nothing (its `__init__` imports
# nothing, so it adds no cycle and no re-export), and stays under ROOM_LINES; docs/architecture.md shows them.
TRAIN_ROOMS = {  # room -> what it holds
    "loop": "the step and the loop: `Trainer`, the optimizer step (lean too), the batch contract, guards, "
            "callbacks, progress and metrics, the run's length",
    "trial": "the switch trial and what it switches: precision, channels_last, torch.compile, backends; a close "
             "cached choice pooled over runs",
    "state": "state and checkpoints: atomic files, the step store, DCP, exact resume, RNG state, flat moments",
    "parallel": "DDP and FSDP2, and each rank's share of the data",
}
TRAIN_TOP = ("the techniques that stand alone, and what the rooms share: the config, decisions and the result, "
             "timing in interleaved rounds, "
             "optimizers and schedules, data order, in-memory batches and transfer, evaluation and validation, "
             "BatchNorm statistics, the batch ramp, the noise scale, loggers, losses, the wrappers")
ROOM_LINES = 3000


def _room_modules(room: str) -> list[str]:
    return sorted(f.stem for f in (ROOT / "train" / room).glob("*.py") if f.name != "__init__.py")


def render_train_rooms() -> str:
    """The markdown table of TRAIN_ROOMS (and train/'s top level), with each room's modules, as
    docs/architecture.md shows it."""
    rows = ["| room | what it holds | modules |", "|---|---|---|"]
    for room, what in [*TRAIN_ROOMS.items(), ("", TRAIN_TOP)]:
        where = f"`train/{room}/`" if room else "`train/` (top level)"
        rows.append(f"| {where} | {what} | {', '.join(f'`{m}`' for m in _room_modules(room))} |")
    return "\n".join(rows)


def test_train_has_its_rooms_each_opening_with_what_it_holds():
    rooms = {f.parent.name for f in (ROOT / "train").glob("*/__init__.py")}
    assert rooms == set(TRAIN_ROOMS), "a sub-package of train/ is a room: add it to TRAIN_ROOMS (and the docs)"
    for room in TRAIN_ROOMS:
        tree = ast.parse((ROOT / "train" / room / "__init__.py").read_text())
        doc = ast.get_docstring(tree) or ""
        assert doc, f"train/{room}/__init__.py opens with a docstring saying what the room holds"
        assert [m for m in _room_modules(room) if f"`{m}`" not in doc] == [], f"train/{room}: name each module"
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], \
            f"train/{room}/__init__.py gathers nothing: import each name from its module"


def test_no_room_of_train_over_its_limit():
    lines = {room: sum(len(f.read_text().splitlines()) for f in (ROOT / "train" / room).glob("*.py"))
             for room in TRAIN_ROOMS}
    assert {r: n for r, n in lines.items() if n > ROOM_LINES} == {}, "split the room along an idea"


def test_the_docs_show_the_train_rooms():
    assert render_train_rooms() in DOCS.read_text(), \
        "docs/architecture.md's table of train/'s rooms differs; paste tests.test_layers.render_train_rooms()"


def test_the_plan_builds_on_train_and_tune_and_fit_on_the_plan():
    from torchspeed import fitting

    found = layer_imports()
    assert {"train", "tune"} <= found["plan"] and "plan" not in found["train"] | found["tune"]
    src = pathlib.Path(fitting.__file__).read_text()
    assert "torchspeed.train.loop.trainer" in src and "torchspeed.plan" in src
    assert torchspeed.fit is fitting.fit


# ---------------------------------------------------------------- function-level imports
# A torchspeed import inside a function hides a dependency from the reader and from the layer picture. Each
# file that keeps some says why here, with how many it keeps; the total only goes down.
CYCLE, EXTRA, STARTUP, INJECT, REWORK = (
    "a cycle", "an optional extra", "start-up time", "a test's injection point (read when called)",
    "file under rework: its imports move with it")
LAZY = {  # file -> (function-level torchspeed imports, why)
    "cli/main.py": (1, STARTUP + ": the entry point loads a rank's exit (torch.distributed) only to end its process "
                    "group"),
    "data/bench.py": (4, STARTUP),
    "data/decode.py": (1, CYCLE + ": decode <-> synthetic"),
    "doctor/registry.py": (1, CYCLE + ": the rules register themselves with the registry"),
    "inference.py": (6, STARTUP),
    "train/bnstats.py": (3, CYCLE + ": bnstats <-> batch, transfer, decision"),
    "train/parallel/fsdp.py": (2, CYCLE + ": fsdp <-> distributed"),
    "train/parallel/shard.py": (1, CYCLE + ": shard <-> sampler"),
    "tune/auto.py": (1, INJECT + ": tests patch the tuners in their modules"),
    "tune/batch_choice.py": (2, INJECT + ": tests patch tune.batch.find_batch_size"),
    "tune/loader.py": (1, INJECT + ": tests patch env.usable_cores"),
}
LAZY_TOTAL = 23


def lazy_imports(source: str) -> list[int]:
    """Lines of torchspeed imports inside a function."""
    out = []

    def visit(node, inside):
        for ch in ast.iter_child_nodes(node):
            if inside and _targets(ch):
                out.append(ch.lineno)
            visit(ch, inside or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), False)
    return out


def test_function_level_imports_only_with_a_reason():
    found = {str(f.relative_to(ROOT)): len(lazy_imports(f.read_text())) for f in sorted(ROOT.rglob("*.py"))}
    found = {f: n for f, n in found.items() if n}
    listed = {f: n for f, (n, _) in LAZY.items()}
    more = {f: (n, listed.get(f, 0)) for f, n in found.items() if n > listed.get(f, 0)}
    assert more == {}, "import at the top of the module, or give the function-level import a reason in LAZY"
    fewer = {f: (found.get(f, 0), n) for f, n in listed.items() if found.get(f, 0) < n}
    assert fewer == {}, "fewer function-level imports than LAZY says: lower the count (or drop the file)"
    assert sum(found.values()) == sum(listed.values()) == LAZY_TOTAL, "LAZY_TOTAL only goes down"


def test_the_plan_imports_everything_at_the_top_with_no_type_only_circle():
    """plan/ is out of LAZY, and none of its modules imports another under `if TYPE_CHECKING:` (a hidden circle)."""
    for f in sorted((ROOT / "plan").glob("*.py")):
        text = f.read_text()
        assert not lazy_imports(text) and "TYPE_CHECKING" not in text, f.name
    assert not [f for f in LAZY if f.startswith("plan/")]


def test_the_lazy_check_counts_imports_inside_functions_only():
    source = "from torchspeed.env import sync\ndef f():\n    import torchspeed.tune\n    x = lambda: 1\n" \
             "class C:\n    def m(self):\n        from torchspeed import fit\n"
    assert lazy_imports(source) == [3, 7]


def test_each_subcommand_parser_leaves_its_runner_to_main():
    """The CLI's imports are at the top of its modules: a subcommand's parser (cli/X.py) imports no runner, and
    cli/main.py's RUNNERS names, for each subcommand, the runner it imports when that subcommand runs, which defines
    the functions the parser names in `entry` (`run` unless it names others)."""
    from torchspeed.cli.main import COMMANDS, RUNNERS

    assert list(RUNNERS) == list(COMMANDS)
    runners = {f"torchspeed.cli.{m}" for m in RUNNERS.values() if m not in COMMANDS}
    for name, runner in RUNNERS.items():
        tree = ast.parse((ROOT / "cli" / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
                   {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not imported & runners, f"cli/{name}.py builds the parser only: main imports its runner"
        entries = {k.value.value for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords
                   if k.arg == "entry" and isinstance(k.value, ast.Constant) and k.value.value} or {"run"}
        defined = {n.name for n in ast.parse((ROOT / "cli" / f"{runner}.py").read_text()).body
                   if isinstance(n, ast.FunctionDef)}
        assert entries <= defined, (runner, entries - defined)


def _module_graph() -> dict[str, set[str]]:
    """torchspeed module -> the torchspeed modules it imports, anywhere in the file (lazy imports too; not the
    type-only ones under `if TYPE_CHECKING:`, which never run)."""
    files = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for name, f in files.items():
        deps = set()
        tree = ast.parse(f.read_text())
        skip = _type_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
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
    assert doctor["torchspeed.doctor._probe"] <= {"torchspeed.doctor._tree", "torchspeed.doctor._sites",
                                                  "torchspeed.doctor._probe_sync"}
    assert doctor["torchspeed.doctor._probe_sync"] <= {"torchspeed.doctor._sites"}  # the probe's copy/sync patches
    assert doctor["torchspeed.doctor._sites"] == set()  # where a call comes from: instrumentation's own helpers
    # the schema the rules annotate with: TypedDicts, importing nothing of the doctor (and of torchspeed only env,
    # whose EnvInfo fields `Environment` is read from), so a rule that imports it loads no analysis code
    schema, runs = "torchspeed.doctor.observation", "torchspeed.doctor.observation_runs"  # runs: its measured part
    assert graph[schema] <= {"torchspeed.env", runs}, graph[schema]
    assert graph[runs] == set(), graph[runs]
    light = {"torchspeed.doctor.registry", "torchspeed.doctor.report", "torchspeed.doctor.rules", schema, runs}
    for m, deps in doctor.items():
        if m.startswith("torchspeed.doctor.rules."):
            assert {d for d in deps if not d.startswith("torchspeed.doctor.rules.")} <= light, (m, deps)
    assert doctor["torchspeed.doctor.registry"] <= light
