"""Source patches for precision and the optimizer kernel (T21, T26): `autocast` and `fused_optimizer`,
registered in `_patch_base.PATCHES` like the others.

`autocast` handles the forms real scripts have. Most training scripts written for a GPU already wrap
their forward in an autocast block that does nothing on a CPU: `torch.cuda.amp.autocast(enabled=flag)`,
`torch.amp.autocast("cuda", ...)`, `torch.autocast(device_type=args.device, enabled=args.amp)`, or a
context chosen as `nullcontext() if device == "cpu" else torch.amp.autocast(...)`. Each such call is
rewritten to `torch.autocast(device_type="<the device the doctor saw>", dtype=torch.bfloat16,
enabled=True)`; statements in a loop that call the model outside any `with` block are wrapped in one.

`fused_optimizer` sets `fused=True` on the optimizer calls (`foreach` removed: the two exclude each
other). A call that passes `**kwargs` gets `**{**kwargs, "fused": True, "foreach": None}`, which is
right whether or not the script's dict already holds `fused`.
"""

from __future__ import annotations

from torchspeed.doctor._patch_base import NotApplicable, PatchContext, _calls_name, _cst, _model_name, _set_kwargs, patch

__all__ = ["AUTOCAST_CALLS", "FUSED_OPTIMIZERS", "is_autocast_call"]

AUTOCAST_CALLS = ("torch.autocast", "torch.amp.autocast", "torch.cuda.amp.autocast", "torch.cpu.amp.autocast",
                  "amp.autocast", "autocast")
FUSED_OPTIMIZERS = ("Adam", "AdamW", "SGD", "Adagrad")


def _dotted(node) -> str | None:
    cst = _cst()
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr.value}" if head else None
    return None


def is_autocast_call(node) -> bool:
    cst = _cst()
    return isinstance(node, cst.Call) and _dotted(node.func) in AUTOCAST_CALLS


def _is_nullcontext(node) -> bool:
    cst = _cst()
    return isinstance(node, cst.Call) and (_dotted(node.func) or "").split(".")[-1] == "nullcontext"


def _retarget(source: str, ctx: PatchContext) -> str:
    """Every autocast call (and `nullcontext() if ... else autocast(...)`) -> bf16 autocast on ctx.device."""
    cst = _cst()
    new = cst.parse_expression(f'torch.autocast(device_type="{ctx.device}", dtype=torch.bfloat16, enabled=True)')

    class T(cst.CSTTransformer):
        def leave_IfExp(self, orig, upd):
            branches = (orig.body, orig.orelse)
            if any(_is_nullcontext(b) for b in branches) and any(is_autocast_call(b) for b in branches):
                return new  # the device test picks a no-op on this device: autocast on it instead
            return upd

        def leave_Call(self, orig, upd):
            return new if is_autocast_call(orig) else upd

    return cst.parse_module(source).visit(T()).code


def _wrap_model_calls(source: str, ctx: PatchContext) -> str:
    """Wrap each statement in a loop that calls the model outside a `with` block in bf16 autocast."""
    cst = _cst()
    name = _model_name(source)
    header = f'with torch.autocast("{ctx.device}", dtype=torch.bfloat16):\n    pass\n'
    wrapped = []

    class Wrap(cst.CSTTransformer):
        def __init__(self):
            self.loop = 0
            self.inside_with = 0

        def visit_For(self, node):
            self.loop += 1

        def leave_For(self, orig, upd):
            self.loop -= 1
            return upd

        def visit_While(self, node):
            self.loop += 1

        def leave_While(self, orig, upd):
            self.loop -= 1
            return upd

        def visit_With(self, node):
            self.inside_with += 1

        def leave_With(self, orig, upd):
            self.inside_with -= 1
            return upd

        def leave_SimpleStatementLine(self, orig, upd):
            if self.loop and not self.inside_with and _calls_name(orig, name):
                wrapped.append(orig)
                w = cst.parse_statement(header)
                return w.with_changes(body=w.body.with_changes(body=[upd]), leading_lines=upd.leading_lines)
            return upd

    out = cst.parse_module(source).visit(Wrap())
    if not wrapped:
        raise NotApplicable(f"no statement in a loop calls `{name}(...)` outside a `with` block")
    return out.code


@patch("autocast")
def _autocast(source: str, ctx: PatchContext) -> str:
    out = _retarget(source, ctx)
    try:
        return _wrap_model_calls(out, ctx)
    except NotApplicable as e:
        if out != source:
            return out  # the script's own autocast blocks now run on this device
        raise NotApplicable(f"no autocast block to retarget, and {e}") from None


@patch("fused_optimizer")
def _fused_optimizer(source: str, ctx: PatchContext) -> str:
    cst = _cst()
    hits = []

    def change(c):
        star = [i for i, a in enumerate(c.args) if a.star == "**"]
        if star:
            i = star[-1]
            inner = cst.Module([]).code_for_node(c.args[i].value)
            value = cst.parse_expression(f'{{**{inner}, "fused": True, "foreach": None}}')
            args = list(c.args)
            args[i] = args[i].with_changes(value=value)
            return _set_kwargs(c.with_changes(args=args), {"fused": None, "foreach": None})
        return _set_kwargs(c, {"foreach": None, "fused": "True"})

    class T(cst.CSTTransformer):
        def leave_Call(self, orig, upd):
            if (_dotted(orig.func) or "").split(".")[-1] in FUSED_OPTIMIZERS and orig.args:
                hits.append(orig)
                return change(upd)
            return upd

    out = cst.parse_module(source).visit(T())
    if not hits:
        raise NotApplicable(f"no {'/'.join(FUSED_OPTIMIZERS)}(...) call in the script")
    return out.code
