"""What every `--fix` source patch builds on: the registry (`@patch`, `PATCHES`, `apply_patch`), the
`NotApplicable` refusal, the context a patch reads (`PatchContext`), and libcst helpers that find the
model, its calls and the statements to patch after. The patches themselves are `_patches.py` and
`_patches_amp.py` (T06, T10, T21, T23, T25, T26, T45).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["PATCHES", "PatchContext", "NotApplicable", "patch", "apply_patch", "libcst_missing"]

INSTALL_HINT = "pip install 'torchspeed[fix]' (or: pip install libcst)"


class NotApplicable(Exception):
    """The patch has nothing to change in this script (the message says why)."""


@dataclass(frozen=True)
class PatchContext:
    device: str = "cpu"
    workers: int = 0          # the worker count to write (the tuner's choice when --verify measured it)
    threads: int = 1
    pin_memory: bool = False


PATCHES: dict[str, Callable[[str, PatchContext], str]] = {}


def patch(name: str):
    def deco(fn):
        PATCHES[name] = fn
        return fn
    return deco


def libcst_missing() -> str | None:
    """None when libcst imports, else the one-line install hint."""
    try:
        import libcst  # noqa: F401
    except ImportError:
        return f"--fix needs libcst: {INSTALL_HINT}"
    return None


def apply_patch(name: str, source: str, ctx: PatchContext) -> str:
    out = PATCHES[name](source, ctx)
    if out == source:
        raise NotApplicable("nothing to change")
    return out


# -- helpers -------------------------------------------------------------------------------------
def _cst():
    import libcst as cst
    return cst


def _last_name(node) -> str | None:
    cst = _cst()
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return node.attr.value
    return None


def _kwarg(name: str, code: str):
    return _cst().parse_expression(f"f({name}={code})").args[0]


def _set_kwargs(call, values: dict[str, str | None]):
    """`call` with keyword arguments set (None: removed), commas kept tidy."""
    cst = _cst()
    args = [a for a in call.args if not (a.keyword is not None and a.keyword.value in values)]
    for k, v in values.items():
        if v is not None:
            args.append(_kwarg(k, v))
    fixed = []
    for i, a in enumerate(args):
        last = i == len(args) - 1
        if last:
            a = a.with_changes(comma=cst.MaybeSentinel.DEFAULT)
        elif a.comma is cst.MaybeSentinel.DEFAULT:
            a = a.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        fixed.append(a)
    return call.with_changes(args=fixed)


def model_names(source: str) -> set[str]:
    """Names whose `.parameters()` the script passes to something (its optimizer): the model. `self` is not one:
    a module's own method reading `self.parameters()` (an LSTM LM's `init_hidden`) names no script variable."""
    cst = _cst()
    names: set[str] = set()

    class Find(cst.CSTVisitor):
        def visit_Call(self, node):
            f = node.func
            if isinstance(f, cst.Attribute) and f.attr.value == "parameters" and isinstance(f.value, cst.Name) \
                    and f.value.value != "self":
                names.add(f.value.value)

    cst.parse_module(source).visit(Find())
    return names


def _model_name(source: str) -> str:
    names = model_names(source)
    if len(names) != 1:
        raise NotApplicable("cannot tell which variable is the model (no single `name.parameters()` call)")
    return names.pop()


def _calls_name(node, name: str) -> bool:
    cst = _cst()
    found = []

    class Find(cst.CSTVisitor):
        def visit_Call(self, c):
            if isinstance(c.func, cst.Name) and c.func.value == name:
                found.append(c)

    node.visit(Find())
    return bool(found)


def _after_statements(source: str, match: Callable, make: Callable[[], list], *, first_only=True) -> str:
    """Insert `make()` statements after each (or the first) top-level or nested statement where `match` holds."""
    cst = _cst()
    done = []

    class Insert(cst.CSTTransformer):
        def _body(self, body):
            out = []
            for st in body:
                out.append(st)
                if (not done or not first_only) and match(st):
                    out.extend(make())
                    done.append(st)
            return out

        def leave_Module(self, orig, upd):
            return upd.with_changes(body=self._body(upd.body))

        def leave_IndentedBlock(self, orig, upd):
            return upd.with_changes(body=self._body(upd.body))

    out = cst.parse_module(source).visit(Insert())
    if not done:
        raise NotApplicable("no place to insert the change")
    return out.code


def _is_import(st) -> bool:
    cst = _cst()
    return isinstance(st, cst.SimpleStatementLine) and any(isinstance(s, (cst.Import, cst.ImportFrom)) for s in st.body)


def _after_imports(source: str, lines: list[str]) -> str:
    """`lines` after the last top-level import."""
    cst = _cst()
    mod = cst.parse_module(source)
    idx = max((i for i, st in enumerate(mod.body) if _is_import(st)), default=-1)
    if idx < 0:
        raise NotApplicable("no top-level import to put the setting after")
    new = [cst.parse_statement(line + "\n") for line in lines]
    return mod.with_changes(body=[*mod.body[:idx + 1], *new, *mod.body[idx + 1:]]).code


def _assigns(st, name: str) -> bool:
    cst = _cst()
    if not isinstance(st, cst.SimpleStatementLine):
        return False
    return any(isinstance(s, cst.Assign) and any(isinstance(t.target, cst.Name) and t.target.value == name
                                                  for t in s.targets) for s in st.body)


def _after_model(source: str, line_for: Callable[[str], str]) -> str:
    cst = _cst()
    name = _model_name(source)
    # after the last assignment of the model that comes before its first use in a loop: the model as built
    return _after_statements(source, lambda st: _assigns(st, name), lambda: [cst.parse_statement(line_for(name) + "\n")])


def _transform_calls(source: str, want: Callable, change: Callable) -> str:
    cst = _cst()
    hits = []

    class T(cst.CSTTransformer):
        def leave_Call(self, orig, upd):
            if want(orig):
                hits.append(orig)
                return change(upd)
            return upd

    out = cst.parse_module(source).visit(T())
    if not hits:
        raise NotApplicable("no matching call")
    return out.code




def _binds_torch(st) -> bool:
    """A top-level `import torch` (or `import torch.nn`, which binds `torch` too)."""
    cst = _cst()
    return isinstance(st, cst.SimpleStatementLine) and any(
        isinstance(s, cst.Import) and not isinstance(s.names, cst.ImportStar) and any(
            (a.asname is None and cst.Module([]).code_for_node(a.name).split(".")[0] == "torch") or
            (a.asname is not None and cst.Module([]).code_for_node(a.name) == "torch" and
             cst.Module([]).code_for_node(a.asname.name) == "torch") for a in s.names) for s in st.body)


def with_torch_imported(patched: str, original: str) -> str:
    """`patched` with an `import torch` after the imports where a patch wrote `torch.` into a script that never
    binds the name (`from torch import nn` only, say); else `patched` as it is."""
    if patched == original or "torch." not in patched:
        return patched
    cst = _cst()
    mod = cst.parse_module(patched)
    if any(_binds_torch(st) for st in mod.body):
        return patched
    try:
        return _after_imports(patched, ["import torch"])
    except NotApplicable:
        return "import torch\n" + patched
