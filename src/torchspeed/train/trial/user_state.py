"""The user's own state that a step can change besides the model's parameters, buffers and gradients, put back
or cast back around what only measures (T21: the switch trial; T18: its candidates in another precision).

A switch-trial turn timed apart (shadow.py) runs a candidate's forward and backward, then the plain step on the
same batch. The RNG, the module's buffers and the gradients it puts back itself. What a user's code keeps between
steps it could not see: PyTorch's word-language-model example ported to `fit` carries its LSTM's hidden state in the
`step_fn`'s own state, so a bf16 turn left a bf16 hidden state there, the fp32 step after it handed that to the
fp32 LSTM, and oneDNN refused ("could not create a primitive descriptor for the LSTM forward propagation
primitive"): the run died in its first steps. Even where the dtypes agree, the plain step read the hidden state the
candidate's pass had advanced, not its own: not the plain run's numbers.

`UserState(module, step_fn).snapshot()` walks what such code can reach and keep, from these roots:

- the attributes a forward writes on the model's own modules (classes not torch's: a carried hidden state, a
  KV cache, a step counter, a list of past outputs), and the public ones a user's code set on torch's own (an
  `nn.Sequential` model's `model.ema`, `model.seen`: torch's own bookkeeping is left to torch);
- the weights an optimizer the step reaches steps, the model's own included (a GAN's `step_fn` steps its
  discriminator inside: its weights, gradients and moments);
- the model's parameters that need no gradient (a BYOL or mean-teacher target network the step moves towards
  the online one in place: a pass that only measures moved it once more);
- the `step_fn`: its closure, the globals its code names, the object it is bound to (a method, a callable
  object), a `functools.partial`'s arguments, its default arguments;
- the hooks of the user's own code on the model (forward, forward-pre and backward hooks of its modules, the
  parameters' gradient hooks, torch's global module hooks), walked as the `step_fn` is: a forward hook that keeps
  activations in a list, a gradient hook that sums a Fisher information, a backward hook that logs a norm (a
  pass that only measures had run them once more; torch's and torchspeed's own hooks are theirs);
- and what those reach: dicts, lists, tuples, plain objects, other modules (a GAN's discriminator: its
  parameters, buffers and gradients) and optimizers (their moments and step counts);
- Python's and NumPy's global random generators (torch's the trial forks itself): Hugging Face's wav2vec2 draws
  its time masks from NumPy, so a measuring pass moved the plain run's masks; and any `torch.Generator` the walk
  reaches (a noise layer that draws from a generator of its own, `torch.randn(..., generator=self.gen)`).

`Snapshot.restore()` puts back every reference, container and tensor that changed (a tensor by its version
counter: only what was written is copied back). `Snapshot.cast_back()` is for a turn that trained in a half
precision (its numbers stay): the floating tensors it left in the user's state in bf16/fp16, where the state held
another dtype (or nothing), are cast back to that dtype (or the model's), so the plain step after it runs.

What it cannot see: state held outside these roots (a cache in another module's globals, a C extension's
object, a NumPy array written in place) or tensors past `CLONE_BYTES` (their writes are detected, not undone:
`Snapshot.unrestored`). The trial does not rely on this alone: a step that fails after a candidate's turn drops
that candidate and trains the batch in settings that work (autoswitch.py, docs/models.md).

Example:
    >>> snap = UserState(model, step_fn).snapshot()
    >>> step_fn(model, batch)            # a pass that only measures
    >>> snap.restore()                   # the step_fn's hidden state, the model's attributes: as they were
"""

from __future__ import annotations

import builtins
import functools
import random
import types
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

__all__ = ["UserState", "Snapshot", "CLONE_BYTES"]

CLONE_BYTES = 256 << 20  # tensors past this many bytes in all are watched (their version), not copied
MAX_DEPTH = 6  # how deep the walk follows containers and objects from its roots
MAX_OBJECTS = 20000  # and how many it visits at most
_HALF = (torch.bfloat16, torch.float16)
_TORCH_ATTRS = frozenset(vars(nn.Module()))  # a module's own bookkeeping (parameters, buffers, hooks, training)
_LEAVES = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, range, slice)
_NOT_STATE = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, type,
              types.CodeType, functools.partial, torch.utils.data.DataLoader, torch.utils.data.Dataset)


def _torch_class(obj) -> bool:
    return type(obj).__module__.split(".")[0] == "torch"


class Snapshot:
    """What a `UserState` walk saw: containers' contents, cells, named globals, tensors (copied) and gradients."""

    def __init__(self, model_dtype: torch.dtype):
        self.model_dtype = model_dtype
        self.dicts: list[tuple[dict, dict]] = []  # a dict (or an object's __dict__) and its items then
        self.public: list[tuple[dict, dict]] = []  # a torch module's __dict__ and its public names' values then
        self.names: list[tuple[dict, str, object]] = []  # a step_fn's globals: (globals, name, value or _MISSING)
        self.lists: list[tuple[list, list]] = []
        self.cells: list[tuple[object, object]] = []
        self.tensors: list[tuple[torch.Tensor, int, torch.Tensor | None]] = []  # (tensor, version, copy or None)
        self.grads: list[tuple[torch.Tensor, torch.Tensor | None, int, torch.Tensor | None]] = []
        self.unrestored: list[str] = []  # what restore() found written and could not put back
        self.rngs = (random.getstate(), np.random.get_state())  # Python's and NumPy's global generators
        self.generators: list[tuple[torch.Generator, torch.Tensor]] = []  # torch generators of the user's own
        self.frozen: list[tuple[torch.Tensor, torch.Tensor]] = []  # the model's parameters no optimizer trains

    def restore(self) -> None:
        """Everything the walk saw, as it was: references first, then the tensors written in place; and Python's
        and NumPy's global generators (a model that draws from NumPy: Hugging Face's wav2vec2 masks time steps)."""
        random.setstate(self.rngs[0])
        np.random.set_state(self.rngs[1])
        for gen, state in self.generators:
            gen.set_state(state)
        with torch.no_grad():  # copied back whatever wrote them (`p.mul_()`, `p.data = ...`: no version to read)
            for p, copy in self.frozen:
                p.copy_(copy)
        for d, saved in self.dicts:
            if d.keys() != saved.keys() or any(d[k] is not v for k, v in saved.items()):
                d.clear()
                d.update(saved)
        for d, saved in self.public:  # only the names a user may set: torch's bookkeeping is torch's
            for k in [k for k in d if _public(k) and k not in saved]:
                del d[k]
            for k, v in saved.items():
                if d.get(k, _MISSING) is not v:
                    d[k] = v
        for g, name, value in self.names:
            if value is _MISSING:
                g.pop(name, None)
            elif g.get(name, _MISSING) is not value:
                g[name] = value
        for lst, saved in self.lists:
            if len(lst) != len(saved) or any(a is not b for a, b in zip(lst, saved)):
                lst[:] = saved
        for cell, value in self.cells:
            if cell.cell_contents is not value:
                cell.cell_contents = value
        with torch.no_grad():
            for t, version, copy in self.tensors:
                if _version(t) == version:
                    continue
                if copy is None or copy.shape != t.shape:
                    self.unrestored.append(f"a {t.dtype} tensor of shape {tuple(t.shape)} written in place")
                else:
                    t.copy_(copy)
            for p, grad, version, copy in self.grads:
                if p.grad is not grad:
                    p.grad = grad
                if grad is not None and copy is not None and _version(grad) != version:
                    grad.copy_(copy)

    def cast_back(self) -> int:
        """A turn that trained in a half precision: each floating tensor it put into the user's state in bf16/fp16,
        where the state held another dtype (or nothing), goes back to that dtype (the model's where none). Only what
        changed since the snapshot is looked at. Returns how many tensors were cast."""
        count = [0]

        def back(value, then):
            if value is then:
                return value
            if isinstance(value, torch.Tensor):
                want = then.dtype if isinstance(then, torch.Tensor) and then.is_floating_point() else self.model_dtype
                if value.dtype in _HALF and want != value.dtype:
                    count[0] += 1
                    return value.detach().to(want)
                return value
            if isinstance(value, tuple):
                olds = then if isinstance(then, tuple) and len(then) == len(value) else (None,) * len(value)
                items = [back(v, o) for v, o in zip(value, olds)]
                return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
            if isinstance(value, list):
                olds = then if isinstance(then, list) and len(then) == len(value) else [None] * len(value)
                value[:] = [back(v, o) for v, o in zip(value, olds)]
            elif isinstance(value, dict):
                for k in list(value):
                    value[k] = back(value[k], then.get(k) if isinstance(then, dict) else None)
            return value

        for d, saved in self.dicts:
            for k in list(d):
                d[k] = back(d[k], saved.get(k))
        for d, saved in self.public:
            for k in [k for k in d if _public(k)]:
                d[k] = back(d[k], saved.get(k))
        for lst, saved in self.lists:
            lst[:] = [back(v, saved[i] if i < len(saved) else None) for i, v in enumerate(lst)]
        for g, name, value in self.names:
            if name in g:
                g[name] = back(g[name], None if value is _MISSING else value)
        for cell, value in self.cells:
            cell.cell_contents = back(cell.cell_contents, value)
        return count[0]


_MISSING = object()


def _public(name: str) -> bool:
    """A module attribute a user may set: not private, not nn.Module's own (`training`)."""
    return not name.startswith("_") and name not in _TORCH_ATTRS


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor keeps no version counter
        return None


class UserState:
    """The roots of the user's own state for one run: the model's modules and the `step_fn` (see the module
    docstring). `known`: objects the caller restores itself (the run's optimizer), not walked."""

    def __init__(self, module: nn.Module, step_fn: Callable | None = None, *, known: tuple = ()):
        self.module, self.step_fn = module, step_fn
        self._skip = {id(module), *map(id, known)}
        self._owned = {id(t) for t in (*module.parameters(), *module.buffers())}
        floats = [p.dtype for p in module.parameters() if p.is_floating_point()]
        self.model_dtype = floats[0] if floats else torch.float32

    def snapshot(self) -> Snapshot:
        snap = Snapshot(self.model_dtype)
        walk = _Walk(snap, skip=set(self._skip), owned=self._owned)
        for m in self.module.modules():  # the model's own modules: what a forward writes on self
            walk.module_attributes(m, depth=1)
        for fn in (self.step_fn, *_user_hooks(self.module)):
            walk.callable(fn)
        walk.frozen(self.module)  # last: a large frozen backbone must not take the copies a carried state needs
        return snap


class _Walk:
    """One walk over the user's state, recording into a Snapshot (each object once, bounded)."""

    def __init__(self, snap: Snapshot, *, skip: set, owned: set):
        self.snap, self.seen, self.owned, self.cloned = snap, skip, owned, 0

    def callable(self, fn) -> None:
        """A step_fn's or a hook's roots, through what wraps it (a partial of a method of ...: each layer's)."""
        hops = 0
        while fn is not None and hops < 4:
            fn, hops = self.function(fn), hops + 1

    def function(self, fn):
        """A step_fn's roots; returns the function it wraps (a partial's, a method's), if any."""
        if isinstance(fn, functools.partial):
            for v in (*fn.args, *fn.keywords.values()):
                self.value(v, 1)
            return fn.func
        if isinstance(fn, types.MethodType):
            self.value(fn.__self__, 1)
            return fn.__func__
        if not isinstance(fn, types.FunctionType):  # a callable object: its attributes, then its __call__
            self.value(fn, 0)
            call = getattr(type(fn), "__call__", None)
            return call if isinstance(call, types.FunctionType) else None
        for v in (*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()):  # `def hook(m, i, o, seen=[])`
            self.value(v, 1)
        for cell in fn.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell (a name assigned later)
                continue
            self.snap.cells.append((cell, contents))
            self.value(contents, 1)
        g = fn.__globals__
        for name in _names(fn.__code__):
            value = g.get(name, _MISSING)
            if value is _MISSING and name in _BUILTINS or isinstance(value, _NOT_STATE):
                continue
            self.snap.names.append((g, name, value))  # a global the step writes (`global hidden`) included
            self.value(value, 1)
        return None

    def frozen(self, module: nn.Module) -> None:
        """The model's parameters that need no gradient, copied: a step may move them in place outside any optimizer
        (BYOL's and the mean teacher's momentum target, `p.mul_(tau).add_(online, alpha=1 - tau)`); past
        CLONE_BYTES they are watched instead (a write found is reported, not undone)."""
        for p in module.parameters():
            if p.requires_grad:
                continue
            copy = self.copy(p)
            if copy is not None:
                self.snap.frozen.append((p, copy))
            else:
                self.snap.tensors.append((p, _version(p), None))

    def module_attributes(self, m: nn.Module, depth: int) -> None:
        """What a forward may write on a module of the user's own class; on one of torch's own classes (an
        `nn.Sequential` model), what a user's code set on it: its public names outside torch's bookkeeping (a step
        counter, an EMA kept as `model.ema`)."""
        d = vars(m)
        if not _torch_class(m):
            self.dict_items(d, {k: v for k, v in d.items() if k not in _TORCH_ATTRS}, depth)
            return
        public = {k: v for k, v in d.items() if _public(k)}
        self.snap.public.append((d, public))
        for v in public.values():
            self.value(v, depth + 1)

    def dict_items(self, d: dict, items: dict, depth: int) -> None:
        self.snap.dicts.append((d, dict(d)))
        for v in items.values():
            self.value(v, depth + 1)

    def value(self, v, depth: int) -> None:
        if depth > MAX_DEPTH or v is _MISSING or isinstance(v, _LEAVES) or id(v) in self.seen \
                or len(self.seen) > MAX_OBJECTS:
            return
        self.seen.add(id(v))
        if isinstance(v, torch.Tensor):
            self.tensor(v)
        elif isinstance(v, torch.Generator):  # a torch generator of the user's own (a noise layer's): its state
            self.snap.generators.append((v, v.get_state()))
        elif isinstance(v, _NOT_STATE):
            return
        elif isinstance(v, dict):
            self.dict_items(v, v, depth)
        elif isinstance(v, list):
            self.snap.lists.append((v, list(v)))
            for x in v:
                self.value(x, depth + 1)
        elif isinstance(v, (tuple, set, frozenset)):
            for x in v:
                self.value(x, depth + 1)
        elif isinstance(v, torch.optim.Optimizer):  # another optimizer: its moments, its step counts, and the
            self.value(v.state, depth + 1)  # weights it steps, the model's own too (a GAN's step_fn steps its D)
            for group in v.param_groups:
                for p in group["params"]:
                    if id(p) not in self.seen:
                        self.seen.add(id(p))
                        self.tensor(p, force=True)
            self.value(v.param_groups, depth + 1)
        elif isinstance(v, nn.Module):  # another model the step trains (a GAN's discriminator)
            for t in (*v.parameters(), *v.buffers()):
                self.value(t, depth + 1)
            for m in v.modules():
                self.module_attributes(m, depth + 1)
        elif hasattr(v, "__dict__") and not _torch_class(v):  # a plain object: its attributes
            self.dict_items(vars(v), vars(v), depth)

    def copy(self, t: torch.Tensor) -> torch.Tensor | None:
        """A copy of `t` while the walk's copies stay within CLONE_BYTES (a strided tensor); else None."""
        nbytes = t.numel() * t.element_size() if t.layout == torch.strided else CLONE_BYTES + 1
        if self.cloned + nbytes > CLONE_BYTES:
            return None
        self.cloned += nbytes
        return t.detach().clone()

    def tensor(self, t: torch.Tensor, force: bool = False) -> None:
        version = _version(t)
        if (id(t) in self.owned and not force) or version is None:
            return
        self.snap.tensors.append((t, version, self.copy(t)))
        if t.requires_grad and t.is_leaf:  # a parameter of another model: its gradient too
            grad = t.grad
            self.snap.grads.append((t, grad, _version(grad) if grad is not None else 0,
                                    None if grad is None else grad.detach().clone()))


_BUILTINS = frozenset(dir(builtins))
_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def _user_hooks(module: nn.Module) -> list[Callable]:
    """The hooks the user's code put on `module` (its modules', its parameters', torch's global module hooks), not
    those torch or torchspeed registered (pruning's, quantization observers', the doctor's probe)."""
    from torch.nn.modules import module as torch_module

    found = [h for name in _MODULE_HOOKS for h in getattr(torch_module, "_global" + name, {}).values()]
    for m in module.modules():
        found += [h for name in _MODULE_HOOKS for h in (getattr(m, name, None) or {}).values()]
    for p in module.parameters():
        found += [h for name in _TENSOR_HOOKS for h in (getattr(p, name, None) or {}).values()]
    return [h for h in found if str(getattr(h, "__module__", None) or "").split(".")[0] not in ("torch", "torchspeed")]


def _names(code: types.CodeType) -> set[str]:
    """The global names a function's code (and the functions defined in it) reads or writes."""
    out = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _names(c)
    return out
