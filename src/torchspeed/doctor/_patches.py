"""Source patches for `--fix` (T06, T10, T21, T23, T25, T26, T45): each finding that can be applied
automatically becomes a change of the user's own script, written with libcst so comments and
formatting stay as they were.

Each patch is a function `(source, ctx) -> new source`, registered under its fix name with `@patch`;
`ctx` says what the doctor saw (the model's device, the worker count the tuner chose, the cores).
A patch that finds nothing to change raises `NotApplicable` with the reason. The model is the name
whose `.parameters()` the script passes to its optimizer; a script that builds its model elsewhere
(an attribute, a factory inside a class) gets no model patches, and the report says why.

    autocast        retarget the script's own autocast blocks to the device it runs on, enabled
                    (`_patches_amp`); wrap each statement that calls the model outside one
    fused_optimizer Adam/AdamW/SGD/Adagrad(..., fused=True) where torch has a fused kernel (`_patches_amp`)
    bf16_math       torch.backends.mkldnn.{matmul,conv}.fp32_precision = "bf16" after the imports
    channels_last   model.to(memory_format=torch.channels_last) and each model input made channels_last
    compile         model = torch.compile(model) after the model is built
    set_to_none     zero_grad(set_to_none=False) -> zero_grad()
    workers         DataLoader(num_workers=N, persistent_workers=N > 0), pin_memory on CUDA
    threads         torch.set_num_threads(N) (the script's own call, else one after the imports)
    batched_index   DataLoader over a TensorDataset indexes whole batches (BatchSampler, batch_size=None): the same
                    order from the same generator; a loader with its own sampler or collate_fn is left
    cudnn           torch.backends.cudnn.benchmark = True after the imports (CUDA)
    debug_off       set_detect_anomaly(True) / use_deterministic_algorithms(True) -> False
"""

from __future__ import annotations

# fmt: off
from torchspeed.doctor._patch_base import (NotApplicable, PatchContext, patch, _cst, _last_name, _set_kwargs, _model_name, _after_imports, _after_model, _transform_calls)
# fmt: on


# -- the patches ---------------------------------------------------------------------------------
@patch("set_to_none")
def _set_to_none(source: str, ctx: PatchContext) -> str:
    cst = _cst()

    def want(c):
        return _last_name(c.func) == "zero_grad" and any(
            a.keyword is not None and a.keyword.value == "set_to_none" for a in c.args) or (
            _last_name(c.func) == "zero_grad" and len(c.args) == 1 and c.args[0].keyword is None
            and isinstance(c.args[0].value, cst.Name) and c.args[0].value.value == "False")

    def change(c):
        return c.with_changes(args=[])
    return _transform_calls(source, want, change)


@patch("workers")
def _workers(source: str, ctx: PatchContext) -> str:
    n = int(ctx.workers)
    values = {"num_workers": str(n), "persistent_workers": "True" if n > 0 else None}
    if n == 0:
        values["prefetch_factor"] = None
    if ctx.pin_memory:
        values["pin_memory"] = "True"
    return _transform_calls(source, lambda c: _last_name(c.func) == "DataLoader", lambda c: _set_kwargs(c, values))


@patch("threads")
def _threads(source: str, ctx: PatchContext) -> str:
    cst = _cst()
    n = max(1, int(ctx.threads))
    try:
        return _transform_calls(source, lambda c: _last_name(c.func) == "set_num_threads",
                                lambda c: c.with_changes(args=[cst.Arg(cst.Integer(str(n)))]))
    except NotApplicable:
        return _after_imports(source, [f"torch.set_num_threads({n})  # workers + threads within the cores"])


@patch("bf16_math")
def _bf16_math(source: str, ctx: PatchContext) -> str:
    return _after_imports(source, ['torch.backends.mkldnn.matmul.fp32_precision = "bf16"  # bf16 math, fp32 weights',
                                   'torch.backends.mkldnn.conv.fp32_precision = "bf16"'])


@patch("cudnn")
def _cudnn(source: str, ctx: PatchContext) -> str:
    return _after_imports(source, ["torch.backends.cudnn.benchmark = True  # fixed input shapes: time the kernels"])


@patch("compile")
def _compile(source: str, ctx: PatchContext) -> str:
    return _after_model(source, lambda name: f"{name} = torch.compile({name})")


@patch("channels_last")
def _channels_last(source: str, ctx: PatchContext) -> str:
    cst = _cst()
    name = _model_name(source)
    out = _after_model(source, lambda n: f"{n} = {n}.to(memory_format=torch.channels_last)")

    def change(c):
        if not c.args or c.args[0].keyword is not None:
            return c
        v = c.args[0].value
        text = cst.Module([]).code_for_node(v)
        if not isinstance(v, (cst.Name, cst.Attribute, cst.Subscript, cst.Call)):
            text = f"({text})"
        x = cst.parse_expression(f"{text}.contiguous(memory_format=torch.channels_last)")
        return c.with_changes(args=[c.args[0].with_changes(value=x), *c.args[1:]])
    return _transform_calls(out, lambda c: isinstance(c.func, cst.Name) and c.func.value == name, change)


_LOADER_CARRIED = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor", "timeout", "worker_init_fn",
                   "multiprocessing_context", "pin_memory_device", "in_order")  # kept as they are
_LOADER_OWN = ("batch_size", "shuffle", "drop_last", "generator")  # rewritten into the BatchSampler


@patch("batched_index")
def _batched_index(source: str, ctx: PatchContext) -> str:
    """Only a loader whose batching is the DataLoader's default (no sampler, batch_sampler or collate_fn, at most
    dataset and batch size by position): the same order from the same generator, the same batches, indexed at once."""
    cst = _cst()
    code = cst.Module([]).code_for_node
    datasets, refused = set(), []

    class FindDatasets(cst.CSTVisitor):
        def visit_Assign(self, node):
            if isinstance(node.value, cst.Call) and _last_name(node.value.func) == "TensorDataset":
                datasets.update(t.target.value for t in node.targets if isinstance(t.target, cst.Name))

    cst.parse_module(source).visit(FindDatasets())

    def want(c):
        if _last_name(c.func) != "DataLoader" or not c.args or c.args[0].keyword is not None:
            return False
        ds = c.args[0].value
        if not ((isinstance(ds, cst.Call) and _last_name(ds.func) == "TensorDataset") or
                (isinstance(ds, cst.Name) and ds.value in datasets)):
            return False
        other = [f"{a.star}{code(a.value)}" if a.star else a.keyword.value if a.keyword is not None else
                 f"argument {i + 1} by position"
                 for i, a in enumerate(c.args[1:], 1) if a.star or (a.keyword is None and i > 1) or
                 (a.keyword is not None and a.keyword.value not in _LOADER_CARRIED + _LOADER_OWN)]
        refused.extend(other)
        return not other

    def change(c):
        kw = {a.keyword.value: code(a.value) for a in c.args if a.keyword is not None}
        ds, bound = c.args[0].value, {}  # expressions evaluated once, bound by a lambda (a walrus is not allowed
        ref = ds.value if isinstance(ds, cst.Name) else "_ds"  # in a comprehension's iterable)
        if ref == "_ds":
            bound["_ds"] = code(ds)
        if "generator" in kw and not isinstance(next(a.value for a in c.args if a.keyword and a.keyword.value ==
                                                      "generator"), cst.Name):
            bound["_gen"], kw["generator"] = kw["generator"], "_gen"  # one generator: the sampler's and the seed's
        bs = kw.get("batch_size") or (code(c.args[1].value) if len(c.args) > 1 and c.args[1].keyword is None else "1")
        gen = f", generator={kw['generator']}" if "generator" in kw else ""
        rand, seq = f"torch.utils.data.RandomSampler({ref}{gen})", f"torch.utils.data.SequentialSampler({ref})"
        shuffle = kw.get("shuffle", "False")
        sampler = seq if shuffle == "False" else rand if shuffle == "True" else f"({rand} if {shuffle} else {seq})"
        keep = "".join(f", {k}={v}" for k, v in kw.items() if k in _LOADER_CARRIED + ("generator",))  # base seed
        call = (f"{code(c.func)}({ref}, batch_size=None, sampler=torch.utils.data.BatchSampler("
                f"{sampler}, {bs}, drop_last={kw.get('drop_last', 'False')}){keep})")
        if bound:
            call = f"(lambda {', '.join(bound)}: {call})({', '.join(bound.values())})"
        return cst.parse_expression(call)
    try:
        return _transform_calls(source, want, change)  # a TensorDataset indexes whole batches at once
    except NotApplicable:
        if refused:
            raise NotApplicable(f"the DataLoader batches its own way ({', '.join(sorted(set(refused)))}): "
                                "indexing whole batches would drop it") from None
        raise


@patch("debug_off")
def _debug_off(source: str, ctx: PatchContext) -> str:
    cst = _cst()

    def want(c):
        return _last_name(c.func) in ("set_detect_anomaly", "use_deterministic_algorithms") and c.args and \
            isinstance(c.args[0].value, cst.Name) and c.args[0].value.value == "True"

    def change(c):
        return c.with_changes(args=[c.args[0].with_changes(value=cst.Name("False")), *c.args[1:]])
    return _transform_calls(source, want, change)


from torchspeed.doctor import _patches_amp  # noqa: E402,F401  (registers autocast and fused_optimizer)
