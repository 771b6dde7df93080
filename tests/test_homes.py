"""One home per helper: a device sync, the wrapper attribute names, /proc/meminfo parsing, the
DataLoader rebuild, timing candidates in interleaved rounds and reading a loader's batches each live in
one module. A copy elsewhere fails here, naming the file and the home."""

import ast
import pathlib
import re
import textwrap

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


# ---------------------------------------------------------------- interleaved rounds and batch readers (AST)
# What a textual pattern cannot see, the shape of the code can: a loop over rounds (or passes) with a loop
# over the candidates inside, or a loop over a literal count whose inner loop reads a clock or a timer, is a
# private copy of train/rounds.py; a `while` around a `for b in data` that yields or keeps `b` itself (a
# reader that cycles), or `islice(iter(loader), n)`, is a private copy of train/sampler.py's batch reader.
ROUNDS_HOME, READER_HOME = "train/rounds.py", "train/sampler.py"
# The doctor's measurements still run their own rounds (doctor/diagnose.measure_variants and the two below);
# they move to train/rounds.py with the doctor's next rework, and this list shrinks to nothing.
ROUNDS_ELSEWHERE = {"doctor/diagnose.py", "doctor/verify.py", "doctor/_datasets.py"}
_ROUND_NAME = re.compile(r"round|pass", re.I)
_TIMER = re.compile(r"perf_counter|monotonic|^_?time")


def _names(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def _called(node) -> set[str]:
    return {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            for n in ast.walk(node) if isinstance(n, ast.Call)}


def _inner(loop) -> list:
    return [n for b in loop.body for n in ast.walk(b)]


def round_loops(source: str) -> list[int]:
    """Lines of loops that time candidates in rounds by themselves."""
    hits = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.For):
            over_rounds = any(_ROUND_NAME.search(n) for n in _names(node.iter))
            if over_rounds and any(isinstance(n, (ast.For, ast.comprehension)) for n in _inner(node)):
                hits.add(node.lineno)
            counted = isinstance(node.iter, ast.Call) and getattr(node.iter.func, "id", "") == "range"
            if counted and any(isinstance(n, ast.For) and any(_TIMER.search(c) for c in _called(n))
                               for n in _inner(node)):
                hits.add(node.lineno)
        if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp, ast.DictComp)) and len(node.generators) > 1:
            if any(_ROUND_NAME.search(n) for g in node.generators for n in _names(g.iter)):
                hits.add(node.lineno)
    return sorted(hits)


def batch_readers(source: str) -> list[int]:
    """Lines of private batch readers: a cycling `for b in data` keeping `b`, or `islice(iter(...))`."""
    hits = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "islice" \
                and node.args and isinstance(node.args[0], ast.Call) and getattr(node.args[0].func, "id", "") == "iter":
            hits.add(node.lineno)
        if not isinstance(node, ast.While):
            continue
        for loop in (n for n in _inner(node) if isinstance(n, ast.For) and isinstance(n.target, ast.Name)):
            kept = [n.value for n in _inner(loop) if isinstance(n, ast.Yield)] + \
                [n.args[0] for n in _inner(loop) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "append"
                 and len(n.args) == 1]
            if any(isinstance(v, ast.Name) and v.id == loop.target.id for v in kept):
                hits.add(loop.lineno)
    return sorted(hits)


def _offenders(check, home: str, allowed: set[str] = frozenset()) -> dict[str, list[int]]:
    found = {str(f.relative_to(ROOT)): check(f.read_text()) for f in ROOT.rglob("*.py")}
    return {f: lines for f, lines in found.items() if lines and f != home and f not in allowed}


def test_candidates_are_timed_in_rounds_only_in_their_home():
    assert _offenders(round_loops, ROUNDS_HOME, ROUNDS_ELSEWHERE) == {}, \
        f"time candidates with {ROUNDS_HOME} (interleaved, turns, run_for), not a loop of your own"


def test_batches_are_read_only_by_the_one_reader():
    assert _offenders(batch_readers, READER_HOME) == {}, \
        f"read batches with {READER_HOME} (iter_batches, take_batches), not a reader of your own"


COPIES = {  # the shapes of the copies these checks replaced: each must still be found
    "rounds": """
        for r in range(self.rounds):
            for b in cands:
                times[b].append(self._rate(b))""",
    "passes": """
        for _ in range(passes):
            for s in grid:
                times[s].append(_time_candidate(s))""",
    "literal rounds": """
        for _ in range(2):
            for w, out in ((workers, with_w), (0, without)):
                out.append(self._time(self._loader(w), n)[1])""",
    "clocked": """
        for _ in range(7):
            for k, fn in cands.items():
                t0 = time.perf_counter()
                fn()""",
    "schedule": "queue = [(s, True) for _ in range(self.rounds) for s in cands]",
}
READERS = {
    "cycling generator": """
        def batches(data):
            while True:
                for b in data:
                    yield b""",
    "cycling list": """
        while len(out) < n:
            for b in data:
                out.append(b)""",
    "first batches": "out = list(itertools.islice(iter(loader), n))",
}
NOT_COPIES = """
    for epoch in range(epochs):        # a training loop is neither
        for batch in loader:
            step(batch)
    while True:
        for x, y in loader:
            yield x.to(device), y      # a plain loop's own feed: transforms its batches
"""


@pytest.mark.parametrize("name", sorted(COPIES))
def test_the_rounds_check_finds_a_private_copy(name):
    assert round_loops(textwrap.dedent(COPIES[name])), name


@pytest.mark.parametrize("name", sorted(READERS))
def test_the_reader_check_finds_a_private_copy(name):
    assert batch_readers(textwrap.dedent(READERS[name])), name


def test_the_checks_leave_training_loops_alone():
    assert round_loops(textwrap.dedent(NOT_COPIES)) == [] and batch_readers(textwrap.dedent(NOT_COPIES)) == []


# ---------------------------------------------------------------- one home per name (AST)
# `from torchspeed.X import n` names the module that defines `n` (a def, a class or an assignment at its
# top level), or a package whose `__init__` lists `n` in `__all__` (the package's face), or a submodule of
# X. An import through another module's namespace (a re-export, a shim) fails, naming the home; a module
# other than a package `__init__` lists in `__all__` only what it defines.
TESTS = ROOT.parent.parent / "tests"


def _modules() -> dict[str, pathlib.Path]:
    """torchspeed module name -> its file (a package by its `__init__.py`)."""
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def defined_names(source: str) -> set[str]:
    """The names a module defines at its top level (under `if`/`try`/`with` too), not those it imports."""
    out: set[str] = set()

    def scan(body):
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
            elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                    out.update(x.id for x in ast.walk(t) if isinstance(x, ast.Name))
            elif isinstance(n, (ast.If, ast.Try, ast.With)):
                for part in (n.body, getattr(n, "orelse", []), getattr(n, "finalbody", []),
                             *[h.body for h in getattr(n, "handlers", [])]):
                    scan(part)

    scan(ast.parse(source).body)
    return out


def exported_names(source: str, modules: dict[str, str] | None = None) -> list[str]:
    """The string literals of a module's `__all__`; a starred `*x`, where `x` is another module's
    `__all__` imported under that name, adds that module's (when `modules` has its text)."""
    tree = ast.parse(source)
    alls = {a.asname: n.module for n in tree.body if isinstance(n, ast.ImportFrom)
            for a in n.names if a.name == "__all__" and a.asname}
    for n in tree.body:
        if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets) \
                and isinstance(n.value, (ast.List, ast.Tuple)):
            out = [e.value for e in n.value.elts if isinstance(e, ast.Constant)]
            for e in n.value.elts:
                m = alls.get(getattr(getattr(e, "value", None), "id", None)) if isinstance(e, ast.Starred) else None
                if m and modules and m in modules:
                    out += exported_names(modules[m], modules)
            return out
    return []


def misplaced_imports(sources: dict[str, str], modules: dict[str, str], packages: set[str]) -> list[str]:
    """`file:line: from X import n` for each import of `n` through a module that does not define it.
    `sources`: file -> text to check; `modules`: module name -> its text; `packages`: the module names
    that are packages (their `__all__` is their face)."""
    defined = {m: defined_names(s) for m, s in modules.items()}
    face = {m: set(exported_names(modules[m], modules)) for m in packages if m in modules}
    homes: dict[str, list[str]] = {}
    for m, names in defined.items():
        for n in names:
            homes.setdefault(n, []).append(m)
    out = []
    for path, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.split(".")[0] == "torchspeed"):
                continue
            m = node.module
            for a in node.names:
                n = a.name
                if n == "*" or n in defined.get(m, ()) or n in face.get(m, ()) or f"{m}.{n}" in modules \
                        or any(k.startswith(f"{m}.{n}.") for k in modules):
                    continue
                out.append(f"{path}:{node.lineno}: from {m} import {n} (defined in {homes.get(n, '?')})")
    return out


def test_every_import_names_the_module_that_defines_it():
    modules = _modules()
    texts = {m: f.read_text() for m, f in modules.items()}
    packages = {m for m, f in modules.items() if f.name == "__init__.py"}
    files = [*ROOT.rglob("*.py"), *TESTS.rglob("*.py")]
    sources = {str(f.relative_to(ROOT.parent.parent)): f.read_text() for f in files}
    assert misplaced_imports(sources, texts, packages) == [], "import each name from its home"


# Re-exports still listed in `__all__` (module -> names): none are left, and none may come back.
SHIMS_LEFT: dict[str, list[str]] = {}


def test_a_module_exports_only_what_it_defines():
    """A re-export (a name imported from elsewhere and listed in `__all__`) is a shim; only a package's
    `__init__` may gather names from its modules."""
    shims = {}
    for m, f in _modules().items():
        if f.name != "__init__.py":
            source = f.read_text()
            extra = sorted(set(exported_names(source)) - defined_names(source))
            if extra:
                shims[m] = extra
    assert shims == SHIMS_LEFT, "drop these from __all__ and import them from their home (and from SHIMS_LEFT)"


def test_the_home_check_finds_a_re_export():
    modules = {"torchspeed.a": "def f(): pass\nX = 1\n", "torchspeed.b": "from torchspeed.a import f as g, X\n",
               "torchspeed.p": "from torchspeed.a import f\n__all__ = ['f']\n"}
    sources = {"good.py": "from torchspeed.a import f, X\nfrom torchspeed.p import f\nfrom torchspeed import a\n",
               "bad.py": "def h():\n    from torchspeed.b import X\n"}
    assert misplaced_imports(sources, modules, {"torchspeed", "torchspeed.p"}) == [
        "bad.py:2: from torchspeed.b import X (defined in ['torchspeed.a'])"]
    assert set(exported_names(modules["torchspeed.p"])) - defined_names(modules["torchspeed.p"]) == {"f"}


# ---------------------------------------------------------------- the homes table's rules without a pattern
# The tuners' step: a function that calls `.backward()` and steps an optimizer (`opt.step()`, or a
# GradScaler's `scale`/`unscale_`) is a training step of its own; train/loop/step.py's `backward` and
# `optimizer_step` are that step, and the tuners take it through tune/_common.TrainStep.
STEP_HOME = "train/loop/step.py"
STEPS_ELSEWHERE = {  # loops that are plain PyTorch on purpose
    "bench/hand.py": "the hand-written ceiling: plain PyTorch, no torchspeed code in the step",
    "bench/peers.py": "the peers' loops (plain PyTorch, Lightning Fabric) as their users write them",
    "bench/small.py": "a small model's own ~15-line loop (`shuffled_epochs`, the suite's too): the baseline `fit` "
                      "is measured against",
}
# The half-precision rule: comparing a CUDA compute capability with a version tuple, asking torch whether
# bf16 is supported, or reading the device's capability is env.DeviceCaps' job (`.half`, `.of`).
HALF_HOME = "env.py"
HALF_ELSEWHERE = {  # shrinks to nothing
    "doctor/rules/no_amp.py": "reads the observed compute capability; goes when observations carry DeviceCaps.half",
}


def private_steps(source: str) -> list[int]:
    """Lines of functions that run a backward and an optimizer step (or GradScaler scaling) themselves."""
    hits = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        calls = [(c.func.attr, ast.unparse(c.func.value)) for c in ast.walk(fn)
                 if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)]
        backward = any(a == "backward" for a, _ in calls)
        steps = any(a == "step" and re.search("opt", who, re.I) for a, who in calls)
        scales = any(a in ("scale", "unscale_") and re.search("scaler", who, re.I) for a, who in calls)
        if backward and steps or scales:
            hits.append(fn.lineno)
    return hits


def half_rules(source: str) -> list[int]:
    """Lines that decide a half precision from the hardware: a compute capability (`cc`, `*capab*`) compared
    with a (major, minor) tuple, `is_bf16_supported()`, `get_device_capability()`."""
    hits = set()
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Compare) and re.search(r"capab|\bcc\b", ast.unparse(n)) and any(
                isinstance(t, ast.Tuple) and len(t.elts) == 2 and all(isinstance(e, ast.Constant) and type(e.value) is int
                                                                      for e in t.elts)
                for t in [n.left, *n.comparators]):
            hits.add(n.lineno)
        if isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", "")) in (
                "is_bf16_supported", "get_device_capability"):
            hits.add(n.lineno)
    return sorted(hits)


def test_the_tuners_train_with_the_loops_own_step():
    assert _offenders(private_steps, STEP_HOME, set(STEPS_ELSEWHERE)) == {}, \
        f"take the step from {STEP_HOME} (backward, optimizer_step; tune/_common.TrainStep for a tuner)"
    assert private_steps((ROOT / STEP_HOME).read_text())
    train_step = next(n for n in ast.walk(ast.parse((ROOT / "tune/_common.py").read_text()))
                      if isinstance(n, ast.ClassDef) and n.name == "TrainStep")
    assert {"backward", "optimizer_step"} <= _called(train_step)
    assert all(private_steps((ROOT / f).read_text()) for f in STEPS_ELSEWHERE), "an exception is no longer needed"


def test_the_half_precision_rule_lives_in_device_caps():
    assert _offenders(half_rules, HALF_HOME, set(HALF_ELSEWHERE)) == {}, \
        "read env.DeviceCaps(...).half (train/trial/precision.half_precision), not the capability"
    assert half_rules((ROOT / HALF_HOME).read_text())
    assert all(half_rules((ROOT / f).read_text()) for f in HALF_ELSEWHERE), "an exception is no longer needed"


STEP_COPIES = {
    "plain": """
        def trial(model, opt, batches):
            for x, y in batches:
                loss = model(x).sum()
                loss.backward()
                opt.step()""",
    "scaled": """
        def step(self, loss):
            self.scaler.scale(loss).backward()""",
}
HALF_COPIES = {
    "capability": "dtype = torch.bfloat16 if cc >= (8, 0) else torch.float16",
    "bf16 supported": "half = 'bf16' if torch.cuda.is_bf16_supported() else 'fp16'",
}


@pytest.mark.parametrize("name", sorted(STEP_COPIES))
def test_the_step_check_finds_a_private_step(name):
    assert private_steps(textwrap.dedent(STEP_COPIES[name])), name


@pytest.mark.parametrize("name", sorted(HALF_COPIES))
def test_the_half_check_finds_a_private_rule(name):
    assert half_rules(HALF_COPIES[name]), name


def test_the_step_and_half_checks_leave_other_code_alone():
    ok = """
        def measure(self, b):
            loss = self.step.loss(batch)
            loss.backward()                 # counts saved bytes, steps nothing
            self.scheduler.step()"""
    assert private_steps(textwrap.dedent(ok)) == []
    assert half_rules("precision = caps.half or 'fp32'\nfull = (rounds, steps) == (3, 2)") == []


# ---------------------------------------------------------------- rich progress bars (AST)
# rich's Progress is built in train/loop/progress.py alone (progress_bar, status_bar, track, TrainProgress): a bar
# elsewhere imports rich.progress or calls a `Progress`, under any alias. A file listed here may keep its own,
# for the reason given; the list only shrinks (a listed file that no longer builds one fails the test).
PROGRESS_HOME = "train/loop/progress.py"
PROGRESS_ELSEWHERE: dict[str, str] = {}


def rich_progress_uses(source: str) -> list[int]:
    """Lines that import rich.progress (any alias) or call something named Progress."""
    hits = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.startswith("rich.progress") or (module == "rich" and any(a.name == "progress" for a in node.names)):
                hits.add(node.lineno)
        elif isinstance(node, ast.Import) and any(a.name.startswith("rich.progress") for a in node.names):
            hits.add(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "Progress":
            hits.add(node.lineno)
    return sorted(hits)


def test_rich_progress_is_built_only_in_its_home():
    assert rich_progress_uses((ROOT / PROGRESS_HOME).read_text()), "the home builds the bars"
    assert _offenders(rich_progress_uses, PROGRESS_HOME, set(PROGRESS_ELSEWHERE)) == {}, \
        f"build progress bars with {PROGRESS_HOME} (progress_bar, status_bar, track), not rich.progress"
    back_home = [f for f in PROGRESS_ELSEWHERE if not rich_progress_uses((ROOT / f).read_text())]
    assert back_home == [], f"{back_home} no longer build their own bar: take them off PROGRESS_ELSEWHERE"


PROGRESS_COPIES = {
    "tuner": """
        from rich.progress import Progress
        with Progress(disable=not progress, transient=True) as bar:
            pass""",
    "alias": "from rich.progress import Progress as P",
    "module": "import rich.progress as rp",
    "submodule": "from rich import progress",
    "attribute": "bar = rich.progress.Progress()",
    "track": "from rich.progress import track",
}


@pytest.mark.parametrize("name", sorted(PROGRESS_COPIES))
def test_the_progress_check_finds_a_private_bar(name):
    assert rich_progress_uses(textwrap.dedent(PROGRESS_COPIES[name])), name
    assert rich_progress_uses("with progress_bar(enabled=progress) as bar:\n    bar.track(xs)") == []
