"""Every key the doctor's code reads from an observation is declared in its schema (T02).

The rules and the other modules that read observations (`READERS`) are parsed, not run. A small
tracker follows the observation through each function and checks every string key taken from a
TypedDict of `torchspeed.doctor.observation` against that TypedDict's declared keys
(`typing.get_type_hints`, nested TypedDicts followed):

- where a tracked value starts: a parameter annotated with a schema type (`obs: Observation`,
  `v: VerifyResult`, `events: list[CompileEvent]`, `X | None` alike), any parameter named `obs`, a call
  to a function whose return annotation is one (`verified(obs, fix) -> VerifyResult | None`), and a
  field of a class annotated with one (`report.observation`, `report.env` for `report: DoctorReport`,
  `self.observation` inside it);
- the reads: `x["k"]`, `x.get("k", default)`, chained (`obs.get("env", {}).get("amx")`), through `or`
  and `if`-expressions (`(obs.get("loaders") or [{}])[0]`), an index into a list of TypedDicts, the
  values of a map keyed by a name (`verify`, `env_fixes`: `.get(name)`, `.values()`, `.items()`);
  writes alike (`entry["tuner"] = ...`, `entry.update(k=...)`, a dict literal assigned to an annotated
  name or returned from a function annotated with a TypedDict);
- locals bound to a tracked value by `=`, `:=`, an annotated assignment, tuple unpacking, `for` loops
  and comprehensions (`env = obs.get("env") or {}` then `env.get("amx")`).

Where it is not exact: a name is tracked per top-level function (nested functions share their
parent's names) and flow-insensitively, so a name bound to two schema types in one function is
checked against the union of their keys; keys that are not string literals (`frac(obs, key)`,
`b[m]` in a loop) are not checked; a value reaching a function through an unannotated parameter
(other than `obs`) is not followed. `test_the_tracker_follows_each_pattern` holds the patterns the
code uses, and each rule file must have reads the tracker checked.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import pathlib
import textwrap
import types
import typing
from collections import defaultdict

import pytest

from torchspeed.doctor import observation as schema
from torchspeed.doctor import observation_runs
from torchspeed.doctor.undeclared import undeclared_keys

DOCTOR = pathlib.Path(schema.__file__).parent
RULE_FILES = sorted(p for p in (DOCTOR / "rules").glob("*.py") if p.name != "__init__.py")
READERS = RULE_FILES + [DOCTOR / n for n in ("report.py", "render.py", "diagnose.py", "_fit_plan.py", "_envfix.py",
                                             "verify.py", "_script_options.py", "fix.py")]
_NS = {**vars(builtins), **vars(observation_runs), **vars(schema)}  # the schema and its measured part


# ---------------------------------------------------------------- types the tracker knows
# a TypedDict class, ("list", T) / ("iter", T): a sequence of T, ("map", T): name -> T, ("pair", T): a (name, T)
# from .items(), ("cls", name): an instance of a class whose fields are annotated with schema types


def _strip_none(tp):
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        return rest[0] if len(rest) == 1 else tp
    return tp


def norm(tp):
    """The tracked form of a type hint, or None when no TypedDict is inside it."""
    tp = _strip_none(tp)
    if _is_td(tp):
        return tp
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list and args and (e := norm(args[0])) is not None:
        return ("list", e)
    if origin is dict and len(args) == 2 and (v := norm(args[1])) is not None:
        return ("map", v)
    return None


def _is_td(t) -> bool:
    return isinstance(t, type) and typing.is_typeddict(t)


def _hints(td) -> dict:
    return typing.get_type_hints(td)


def _element(t):
    return t[1] if isinstance(t, tuple) and t[0] in ("list", "iter") else None


class Module:
    """What the tracker knows about one module: its classes' schema fields and its functions' return types."""

    def __init__(self, path: pathlib.Path, returns: dict[str, set]):
        self.path, self.tree = path, ast.parse(path.read_text())
        self.classes: dict[str, dict[str, ast.expr]] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ClassDef):
                self.classes[node.name] = {s.target.id: s.annotation for s in node.body
                                           if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
        self.returns = returns

    def annotation(self, ann: ast.expr | None, classes: dict[str, dict]):
        if ann is None:
            return None
        text = ann.value if isinstance(ann, ast.Constant) and isinstance(ann.value, str) else ast.unparse(ann)
        if text in classes:
            return ("cls", text)
        try:
            return norm(eval(text, dict(_NS)))
        except Exception:  # a name outside the schema (Captured, Callable, ...)
            return None


def all_returns(paths) -> tuple[dict[str, set], dict[str, dict]]:
    """Function name -> tracked return types, class name -> field annotations, over every reader module."""
    classes: dict[str, dict] = {}
    for p in paths:
        classes.update(Module(p, {}).classes)
    returns: dict[str, set] = defaultdict(set)
    for p in paths:
        m = Module(p, {})
        for node in ast.walk(m.tree):
            if isinstance(node, ast.FunctionDef) and (t := m.annotation(node.returns, classes)) is not None:
                returns[node.name].add(t)
    return returns, classes


# ---------------------------------------------------------------- the tracker


class Scope:
    """One top-level function (or method): the names bound to tracked values, and the reads it makes."""

    def __init__(self, func, module: Module, classes: dict[str, dict], owner: str | None):
        self.func, self.module, self.classes = func, module, classes
        self.env: dict[str, set] = defaultdict(set)
        self.env["obs"].add(schema.Observation)  # in these modules `obs` is always an observation
        self.consts: dict[str, set[str]] = {}   # a loop variable over a tuple of string literals
        self.checked: list[tuple[int, str, str]] = []   # (line, key, TypedDict)
        self.missing: list[tuple[int, str, str]] = []
        for f in [n for n in ast.walk(func) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]:
            a = f.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]:
                t = module.annotation(getattr(arg, "annotation", None), classes)
                if t is None and arg.arg == "self" and owner in classes:
                    t = ("cls", owner)
                if t is not None:
                    self.env[arg.arg].add(t)
        for _ in range(4):  # bindings reach a fixed point in a few passes (a later name built from an earlier one)
            self._bind_all()
        self._check_all()

    # -- evaluation: the tracked types of an expression (no checking here)
    def types(self, e) -> set:
        if isinstance(e, ast.Name):
            return set(self.env.get(e.id, ()))
        if isinstance(e, ast.Attribute):
            out = set()
            for t in self.types(e.value):
                if isinstance(t, tuple) and t[0] == "cls" and e.attr in self.classes.get(t[1], {}):
                    if (ft := self.module.annotation(self.classes[t[1]][e.attr], self.classes)) is not None:
                        out.add(ft)
            return out
        if isinstance(e, ast.Subscript):
            if isinstance(e.slice, ast.Slice):  # a slice of a list is a list
                return {t for t in self.types(e.value) if isinstance(t, tuple) and t[0] == "list"}
            key = e.slice.value if isinstance(e.slice, ast.Constant) else None
            return self._lookup(self.types(e.value), key)[0]
        if isinstance(e, ast.Call):
            return self._call(e)
        if isinstance(e, ast.BoolOp):
            return set().union(*(self.types(v) for v in e.values))
        if isinstance(e, ast.IfExp):
            return self.types(e.body) | self.types(e.orelse)
        if isinstance(e, ast.NamedExpr):
            return self.types(e.value)
        if isinstance(e, (ast.ListComp, ast.GeneratorExp)):
            return {("list", t) for t in self.types(e.elt)}
        if isinstance(e, ast.DictComp):
            return {("map", t) for t in self.types(e.value)}
        return set()

    def _call(self, e: ast.Call) -> set:
        f = e.func
        if isinstance(f, ast.Attribute) and f.attr == "get" and e.args:
            key = e.args[0].value if isinstance(e.args[0], ast.Constant) else None
            return self._lookup(self.types(f.value), key)[0]
        if isinstance(f, ast.Attribute) and f.attr in ("values", "items"):
            kind = "iter" if f.attr == "values" else "pair"
            vals = {t[1] for t in self.types(f.value) if isinstance(t, tuple) and t[0] == "map"}
            return {("list", (kind, v)) if kind == "pair" else ("iter", v) for v in vals}
        if isinstance(f, ast.Name) and f.id in ("next", "max", "min") and e.args:
            return {x for t in self.types(e.args[0]) if (x := _element(t)) is not None}
        if isinstance(f, ast.Name) and f.id in ("list", "sorted", "reversed") and e.args:
            return {("list", x) for t in self.types(e.args[0]) if (x := _element(t)) is not None}
        if isinstance(f, ast.Name) and f.id in self.module.returns:
            return set(self.module.returns[f.id])
        return set()

    def _lookup(self, base: set, key) -> tuple[set, list, list]:
        """(the types `base[key]` may have, the TypedDicts that declare `key`, those that do not); key None: not a
        string literal."""
        out, declared, missing = set(), [], []
        for t in base:
            if _is_td(t) and isinstance(key, str):
                hints = _hints(t)
                if key in hints:
                    declared.append(t)
                    if (nt := norm(hints[key])) is not None:
                        out.add(nt)
                else:
                    missing.append(t)
            elif isinstance(t, tuple) and t[0] == "map":
                out.add(t[1])
            elif isinstance(t, tuple) and t[0] == "list" and not isinstance(key, str):
                out.add(t[1])
        return out, declared, missing

    # -- bindings
    def _bind(self, target, types_: set) -> None:
        if isinstance(target, ast.Name):
            self.env[target.id] |= types_
        elif isinstance(target, (ast.Tuple, ast.List)) and len(target.elts) == 2:
            pairs = {t[1] for t in types_ if isinstance(t, tuple) and t[0] == "pair"}
            if pairs:
                self._bind(target.elts[1], pairs)

    def _bind_all(self) -> None:
        for node in ast.walk(self.func):
            if isinstance(node, ast.Assign):
                for tgt in node.targets:
                    if isinstance(tgt, ast.Tuple) and isinstance(node.value, ast.Tuple) and \
                            len(tgt.elts) == len(node.value.elts):
                        for t, v in zip(tgt.elts, node.value.elts):
                            self._bind(t, self.types(v))
                    else:
                        self._bind(tgt, self.types(node.value))
            elif isinstance(node, ast.AnnAssign):
                t = self.module.annotation(node.annotation, self.classes)
                self._bind(node.target, {t} if t is not None else self.types(node.value) if node.value else set())
            elif isinstance(node, ast.NamedExpr):
                self._bind(node.target, self.types(node.value))
            elif isinstance(node, (ast.For, ast.comprehension)):
                if isinstance(node.target, ast.Name) and isinstance(node.iter, (ast.Tuple, ast.List)) and all(
                        isinstance(x, ast.Constant) and isinstance(x.value, str) for x in node.iter.elts):
                    self.consts[node.target.id] = {x.value for x in node.iter.elts}
                self._bind(node.target, {x for t in self.types(node.iter) if (x := _element(t)) is not None})

    # -- checks
    def _check(self, line: int, base: set, key: str) -> None:
        """`key` taken from a value of the types `base`: declared by one of its TypedDicts (a union: any one)."""
        _, declared, missing = self._lookup(base, key)
        if declared:
            self.checked.append((line, key, declared[0].__name__))
        else:
            self.missing += [(line, key, td.__name__) for td in missing]

    def _check_dict(self, line: int, base: set, d: ast.Dict) -> None:
        for k in d.keys:
            if isinstance(k, ast.Constant) and isinstance(k.value, str):
                self._check(line, base, k.value)

    def _keys(self, e) -> list[str]:
        """The string keys an index expression stands for: a literal, or a loop variable over literals."""
        if isinstance(e, ast.Constant) and isinstance(e.value, str):
            return [e.value]
        return sorted(self.consts.get(e.id, ())) if isinstance(e, ast.Name) else []

    def _check_all(self) -> None:
        returns = self.module.annotation(getattr(self.func, "returns", None), self.classes)
        for node in ast.walk(self.func):
            if isinstance(node, ast.Subscript):
                for key in self._keys(node.slice):
                    self._check(node.lineno, self.types(node.value), key)
            elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)):
                for key in self._keys(node.left):  # `"error" in v`
                    self._check(node.lineno, self.types(node.comparators[0]), key)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                base = self.types(node.func.value)
                if node.func.attr == "get" and node.args:
                    for key in self._keys(node.args[0]):
                        self._check(node.lineno, base, key)
                elif node.func.attr in ("update", "setdefault"):
                    for kw in node.keywords:
                        if kw.arg:
                            self._check(node.lineno, base, kw.arg)
                    if node.args and isinstance(node.args[0], ast.Dict):
                        self._check_dict(node.lineno, base, node.args[0])
                    elif node.func.attr == "setdefault" and node.args and isinstance(node.args[0], ast.Constant):
                        self._check(node.lineno, base, node.args[0].value)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.value, ast.Dict):
                t = self.module.annotation(node.annotation, self.classes)
                self._check_dict(node.lineno, {t} if t is not None else set(), node.value)
            elif isinstance(node, ast.Return) and isinstance(node.value, ast.Dict) and returns is not None:
                self._check_dict(node.lineno, {returns}, node.value)


def scan(path: pathlib.Path, returns: dict[str, set], classes: dict[str, dict]) -> tuple[list, list]:
    """(checked reads, undeclared reads) of one module: each (file:line, key, TypedDict)."""
    m = Module(path, returns)
    checked, missing = [], []
    funcs = [(n, None) for n in m.tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    funcs += [(f, c.name) for c in m.tree.body if isinstance(c, ast.ClassDef)
              for f in c.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for func, owner in funcs:
        s = Scope(func, m, classes, owner)
        checked += [(f"{path.name}:{ln}", k, td) for ln, k, td in s.checked]
        missing += [(f"{path.name}:{ln}", k, td) for ln, k, td in s.missing]
    return checked, missing


@pytest.fixture(scope="module")
def scanned():
    returns, classes = all_returns(READERS)
    return {p: scan(p, returns, classes) for p in READERS}


# ---------------------------------------------------------------- the tests


def test_every_key_the_doctor_reads_is_declared(scanned):
    missing = [m for _, (_, miss) in scanned.items() for m in miss]
    assert missing == [], ("keys read from an observation that its schema (torchspeed/doctor/observation.py) "
                           f"does not declare, as (file:line, key, TypedDict): {missing}")


def test_each_rule_file_has_reads_the_tracker_checked(scanned):
    """The tracker is not checking nothing: every rule's reads are followed, down to the nested TypedDicts."""
    per_file = {p.name: {td for _, _, td in checked} for p, (checked, _) in scanned.items()}
    assert all(per_file[p.name] for p in RULE_FILES if p.name != "_common.py"), per_file
    seen = set().union(*per_file.values())
    nested = {"Environment", "Breakdown", "Fractions", "ComputeDetail", "Syncs", "TensorCopies", "ZeroGrad",
              "EvalForwards", "Memory", "LoaderInfo", "DatasetTiming", "DatasetCopies", "AltDecode", "ModelInfo",
              "ModelDesign", "InputStats", "Kernels", "DebugModes", "MathSettings", "CompileEvents", "CompileEvent",
              "CpuContention", "OptimizerInfo", "VerifyResult", "FitPlan", "BeyondGrid", "ThreadStage",
              "EnvFixResult"}
    assert nested <= seen, sorted(nested - seen)


READ_PATTERNS = {  # each reads the undeclared key "nope" in one of the ways the doctor's code reads keys
    "subscript": 'def check(obs):\n    return obs["nope"]',
    "get": 'def check(obs):\n    return obs.get("nope")',
    "chained get": 'def check(obs):\n    return obs.get("env", {}).get("nope")',
    "chained subscript": 'def check(obs):\n    return obs["breakdown"]["fractions"]["nope"]',
    "local sub-dict": 'def check(obs):\n    env = obs.get("env") or {}\n    return env.get("nope")',
    "tuple of locals": 'def check(obs):\n    m, k = obs.get("model") or {}, obs.get("kernels") or {}\n'
                       '    return k.get("nope")',
    "nested local": 'def check(obs):\n    m = obs.get("model", {})\n    d = m.get("design") or {}\n'
                    '    return d["nope"]',
    "optional sub-dict": 'def check(obs):\n    for ds in obs["datasets"]:\n        alt = ds.get("alt_decode")\n'
                         '        return alt["nope"]',
    "for loop": 'def check(obs):\n    for ld in obs.get("loaders", []):\n        return ld["nope"]',
    "comprehension": 'def check(obs):\n    return [ld for ld in obs.get("loaders", []) if ld["nope"]]',
    "list index": 'def check(obs):\n    ld = (obs.get("loaders") or [{}])[0]\n    return ld.get("nope")',
    "comprehension, then index": 'def check(obs):\n    lds = [ld for ld in obs.get("loaders", []) if ld]\n'
                                 '    return lds[0]["nope"]',
    "map by name": 'def check(obs):\n    v = (obs.get("verify") or {}).get("workers")\n    return v["nope"]',
    "map values": 'def check(obs):\n    for e in (obs.get("env_fixes") or {}).values():\n        return e["nope"]',
    "loop over literals": 'def check(obs):\n    d = obs.get("debug") or {}\n'
                          '    return [k for k in ("profiler", "nope") if d.get(k)]',
    "in": 'def check(obs):\n    v = (obs.get("verify") or {}).get("compile") or {}\n    return "nope" in v',
    "slice": 'def fmt(events: list[CompileEvent], n: int = 3):\n    return [e["nope"] for e in events[:n]]',
    "walrus": 'def check(obs):\n    if (p := obs.get("fit_plan")) is not None:\n        return p["nope"]',
    "annotated parameter": 'def fmt(events: list[CompileEvent]):\n    return events[0]["nope"]',
    "returned helper": 'def helper(obs) -> VerifyResult | None:\n    return None\n\n'
                       'def check(obs):\n    v = helper(obs)\n    return v["nope"]',
    "class field": 'class DoctorReport:\n    observation: Observation\n\n'
                   'def show(report: DoctorReport):\n    return report.observation.get("cpu", {}).get("nope")',
    "update": 'def write(entry: EnvFixResult):\n    entry.update(nope=1)',
    "annotated literal": 'def write():\n    entry: VerifyResult = {"fix": "x", "nope": 1}',
    "returned literal": 'def write() -> FitPlan:\n    return {"chosen": "x", "nope": 1}',
}


def _scan_source(tmp_path, source: str):
    p = tmp_path / "reader.py"
    p.write_text(textwrap.dedent(source))
    returns, classes = all_returns([p])
    return scan(p, returns, classes)


@pytest.mark.parametrize("pattern", sorted(READ_PATTERNS))
def test_the_tracker_follows_each_pattern(tmp_path, pattern):
    """An undeclared key read in each pattern is caught; the same code with a declared key passes."""
    source = READ_PATTERNS[pattern]
    _, missing = _scan_source(tmp_path, source)
    assert [k for _, k, _ in missing] == ["nope"], (pattern, missing)


def test_declared_reads_pass_and_other_dicts_are_left_alone(tmp_path):
    checked, missing = _scan_source(tmp_path, '''
        def check(obs, other: dict):
            env = obs.get("env") or {}
            by_kind = obs["syncs"]["by_kind"]        # a map keyed by name: any key
            v = (obs.get("verify") or {}).get("workers") or {}
            return env.get("amx"), by_kind["item"], v.get("speedup"), other["anything"], obs["model"]["class"]
    ''')
    assert missing == []
    assert {(k, td) for _, k, td in checked} == {("env", "Observation"), ("amx", "Environment"),
                                                 ("syncs", "Observation"), ("by_kind", "Syncs"),
                                                 ("verify", "Observation"), ("speedup", "VerifyResult"),
                                                 ("model", "Observation"), ("class", "ModelInfo")}


def test_keys_inherited_from_a_base_are_declared(tmp_path):
    """A TypedDict's keys include those of the bases it inherits (`CompileStage`'s `speedup` from `_StageFigure`,
    `EnvFixResult`'s `within_noise` from `_RoundRatios`): the readers' side and the writers' side both see them."""
    checked, missing = _scan_source(tmp_path, '''
        def check(obs):
            comp = obs["fit_plan"]["beyond_grid"]["compile"]
            e = (obs.get("env_fixes") or {}).get("malloc") or {}
            return comp["measured"], comp["speedup"], comp["compile_s"], e["within_noise"], e["fix"], e["nope"]
    ''')
    assert [k for _, k, _ in missing] == ["nope"]
    assert {(k, td) for _, k, td in checked} >= {("measured", "CompileStage"), ("speedup", "CompileStage"),
                                                 ("compile_s", "CompileStage"), ("within_noise", "EnvFixResult"),
                                                 ("fix", "EnvFixResult")}
    plan = {"speedup": 1.1, "ratios": [1.1], "beyond_grid": {"allocator": {"measured": True, "how": "re-run",
                                                                           "iqr": None, "spedup": 1.0}}}
    assert undeclared_keys({"fit_plan": plan}) == ["fit_plan.beyond_grid.allocator.spedup"]


def test_environment_declares_every_field_of_env_info():
    """`obs["env"]` is `torchspeed.env.EnvInfo.to_dict()`: the two lists of fields agree."""
    from torchspeed.env import EnvInfo

    assert {f.name for f in dataclasses.fields(EnvInfo)} == set(typing.get_type_hints(schema.Environment))


def test_no_field_of_the_schema_is_an_untyped_dict():
    """Every dict in the schema is a TypedDict or a map keyed by a name to a TypedDict or a number."""
    def loose(tp, path):
        tp = _strip_none(tp)
        if _is_td(tp):
            return [x for k, h in typing.get_type_hints(tp).items() for x in loose(h, f"{path}.{k}")]
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if tp is dict or (origin is dict and (not args or args[1] is typing.Any)):
            return [path]
        return [x for a in args for x in loose(a, path)] if origin in (list, dict) else []
    assert loose(schema.Observation, "obs") == []


def test_undeclared_keys_looks_inside_maps_lists_and_optional_dicts():
    """The writers' side: a key the schema does not declare is found at any depth of a real observation's shape."""
    obs = {"verify": {"workers": {"fix": "workers", "spedup": 1.2}},
           "datasets": [{"dataset": "D", "alt_decode": {"best": "simplejpeg", "sped": 2.0}}, {"alt_decode": None}],
           "fit_plan": {"chosen": "bf16", "beyond_grid": {"threads": {"choices": [1, 2], "chosn": 1}}},
           "env_fixes": {"malloc": {"fix": "malloc", "env": {"MALLOC_X": "1"}}},
           "syncs": {"by_kind": {"item": 3}}, "model": {"class": "Net", "design": {"grouped": 1}}}
    assert undeclared_keys(obs) == ["verify['workers'].spedup", "datasets[0].alt_decode.sped",
                                           "fit_plan.beyond_grid.threads.chosn", "model.design.grouped"]
