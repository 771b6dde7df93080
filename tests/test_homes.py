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


# ---------------------------------------------------------------- rich progress bars (AST)
# rich's Progress is built in train/progress.py alone (progress_bar, status_bar, track, TrainProgress): a bar
# elsewhere imports rich.progress or calls a `Progress`, under any alias. A file listed here may keep its own,
# for the reason given; the list only shrinks (a listed file that no longer builds one fails the test).
PROGRESS_HOME = "train/progress.py"
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
