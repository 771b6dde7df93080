"""The probe: instrumentation that records where a training script's step time goes (T02, T03, T13).

`Probe` is a context manager; inside it these patches are in place (`_job.run_job` runs the
script inside one):

- global optimizer step hooks: step boundaries; after `warmup + steps` steps a private
  `BaseException` stops the script (a script's `except Exception` cannot swallow it); a script
  that makes no torch optimizer and updates its weights by hand (`p.data.add_(p.grad, alpha=-lr)`,
  PyTorch's word-language-model example) has its steps bounded by `Tensor.backward` instead;
- `torch.multiprocessing.start_processes` (`mp.spawn`): a script that trains in processes it starts
  itself is stopped before they start (the probe sees one process);
- global module forward hooks: which module is the model, its inputs, autocast and grad
  mode at each call, evaluation with gradients enabled, modules never called;
- `Tensor.backward`, `Optimizer.zero_grad` / `Module.zero_grad` (set_to_none), DataLoader
  iteration (data wait), `Tensor.to` / `.cuda` (host-device copies), `.item` / `.tolist` /
  `.numpy` / `.cpu` / `nonzero` called from user code (host-device syncs on an accelerator),
  `torch.tensor(ndarray)` (a copy where `torch.from_numpy` shares memory); the copy and sync patches live
  in `_probe_sync.SyncPatches`, a base of `Probe`.

Time is attributed exclusively (a sync inside a forward counts as sync, not compute). Each
step record also holds the minor page faults of the step (the allocator rule reads them) and its
`torch.tensor(ndarray)` copies (count and ms: the summary reads the measured steps' own, so a copy
made once while loading, before the first step, falls in the first step, never measured). At
the first measured step the probe notes which optimizer parameters have a gradient and which
do not. Every patch is undone on exit, whatever way the block ends.
"""

from __future__ import annotations

import functools
import importlib
import resource
import time
from collections import defaultdict

import torch
from torch import nn

from torchspeed.doctor._probe_sync import SyncPatches
from torchspeed.doctor._sites import count_tensor_copies, new_copy_counts, user_site
from torchspeed.doctor._tree import clone_args

__all__ = ["Probe", "StopScript"]


class StopScript(BaseException):
    """Raised from the optimizer step hook once enough steps were seen."""


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class Probe(SyncPatches):
    """Installs the instrumentation on enter and removes all of it on exit."""

    def __init__(self, *, steps: int, warmup: int):
        self.steps, self.warmup = steps, warmup
        self._patches: list[tuple[object, str, object, bool]] = []
        self._handles: list = []
        self._stack: list[list] = []  # [category, start] for exclusive timing
        self._depth = 0
        self._top_start: list[float] = []
        self.cur: dict[str, float] = defaultdict(float)
        self.records: list[dict] = []
        self.last_mark = time.perf_counter()
        self.step_opt = None  # the optimizer whose steps we count
        self.optimizers_made = 0  # none made: each backward ends a step (a loop that updates by hand)
        self.spawned: tuple[int, str] | None = None  # (processes, function) the script spawned (mp.spawn)
        self.modules: dict[int, dict] = {}  # top-level modules with parameters, by id
        self.module_objs: dict[int, nn.Module] = {}
        self.called: set[int] = set()
        self.last_output_id: int | None = None
        self.loss_module: nn.Module | None = None
        self.loss_target = None
        self.loaders: dict[int, object] = {}
        self.loader_wait: dict[int, float] = defaultdict(float)
        self.syncs: dict[str, int] = defaultdict(int)
        self.sync_sites: dict[str, int] = defaultdict(int)
        self.sync_in_steps = 0
        self.copies = new_copy_counts()
        self._copies_seen = (0, 0.0)  # the copy count and ms at the last step's end
        self.zero_grads = {"calls": 0, "set_to_none_false": 0, "ms": 0.0, "sites": defaultdict(int)}
        self.unused_at_step: list[str] | None = None
        self.unused_ids: set[int] = set()
        self.grad_ids: set[int] = set()
        self._faults = _minor_faults()
        self.eval = {"calls": 0, "grad_calls": 0, "ms": 0.0, "grad_ms": 0.0}
        self.cuda_sync_warnings = 0
        self.on_stop = None  # called once, with the script still alive, right before StopScript

    # -- exclusive timers ---------------------------------------------------------------
    def _enter(self, cat: str) -> None:
        now = time.perf_counter()
        if self._stack:
            top = self._stack[-1]
            self.cur[top[0]] += now - top[1]
        self._stack.append([cat, now])

    def _exit(self) -> None:
        now = time.perf_counter()
        if not self._stack:
            return
        cat, t0 = self._stack.pop()
        self.cur[cat] += now - t0
        if self._stack:
            self._stack[-1][1] = now

    def _timed(self, cat: str, fn, *args, **kwargs):
        self._enter(cat)
        try:
            return fn(*args, **kwargs)
        finally:
            self._exit()

    # -- patch bookkeeping --------------------------------------------------------------
    def _patch(self, owner, name: str, make) -> None:
        orig = getattr(owner, name)
        existed = name in vars(owner)
        setattr(owner, name, make(orig))
        self._patches.append((owner, name, orig, existed))

    def __enter__(self):
        try:
            self._install()
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc):
        self._restore()
        return False

    def _restore(self) -> None:
        for owner, name, orig, existed in reversed(self._patches):
            if existed:
                setattr(owner, name, orig)
            else:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
        self._patches.clear()
        for h in reversed(self._handles):
            h.remove()
        self._handles.clear()
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)

    # -- instrumentation ----------------------------------------------------------------
    def _install(self) -> None:
        """Every hook family, in this order (`_restore` undoes them in reverse)."""
        self._install_step_and_forward_hooks()
        self._install_backward_and_zero_grad()
        self._install_data_loader()
        self._install_host_device_copies()
        self._install_sync_counters()
        self._patch(torch, "tensor", functools.partial(count_tensor_copies, self.copies))  # numpy copies
        self._install_spawn()
        if torch.cuda.is_available():
            self._install_cuda_sync_warnings()

    def _install_spawn(self) -> None:
        """`torch.multiprocessing.start_processes` (what `mp.spawn` calls): the script would train in processes the
        probe cannot see, out of its time limit; it is stopped there, before they start (the report says why)."""
        probe = self

        def wrap(orig):
            @functools.wraps(orig)
            def start_processes(fn, args=(), nprocs=1, *a, **k):
                probe.spawned = (nprocs, getattr(fn, "__name__", "the function"))
                raise StopScript()
            return start_processes
        self._patch(importlib.import_module("torch.multiprocessing.spawn"), "start_processes", wrap)
        self._patch(torch.multiprocessing, "start_processes", wrap)

    def _install_step_and_forward_hooks(self) -> None:
        """Global optimizer step and module forward hooks: step boundaries, the model and its inputs."""
        from torch.nn.modules import module as mm
        from torch.optim import optimizer as om

        self._handles.append(om.register_optimizer_step_pre_hook(self._on_step_pre))
        self._handles.append(om.register_optimizer_step_post_hook(self._on_step_post))
        self._handles.append(mm.register_module_forward_pre_hook(self._on_forward_pre))
        self._handles.append(mm.register_module_forward_hook(self._on_forward_post))

    def _install_backward_and_zero_grad(self) -> None:
        """`Tensor.backward` timed; `zero_grad` (optimizer and module) timed, counted, with its
        set_to_none=False call sites."""
        probe = self

        def wrap_backward(orig):
            @functools.wraps(orig)
            def backward(self, *a, **k):
                out = probe._timed("backward", orig, self, *a, **k)
                if probe.optimizers_made == 0:  # no torch optimizer: the weights are updated by hand
                    probe._end_step()
                return out
            return backward
        self._patch(torch.Tensor, "backward", wrap_backward)

        def wrap_optimizer_init(orig):
            @functools.wraps(orig)
            def __init__(self, *a, **k):
                probe.optimizers_made += 1
                return orig(self, *a, **k)
            return __init__
        self._patch(torch.optim.Optimizer, "__init__", wrap_optimizer_init)

        def wrap_zero_grad(orig):
            @functools.wraps(orig)
            def zero_grad(self, set_to_none: bool = True, *a, **k):
                site = user_site()
                t0 = time.perf_counter()
                try:
                    return probe._timed("zero_grad", orig, self, set_to_none, *a, **k)
                finally:
                    z = probe.zero_grads
                    z["calls"] += 1
                    z["ms"] += (time.perf_counter() - t0) * 1e3
                    if not set_to_none:
                        z["set_to_none_false"] += 1
                        if site:
                            z["sites"][site] += 1
            return zero_grad
        self._patch(torch.optim.Optimizer, "zero_grad", wrap_zero_grad)
        self._patch(nn.Module, "zero_grad", wrap_zero_grad)

    def _install_data_loader(self) -> None:
        """DataLoader iteration timed as data time: each loader, its iterator's set-up and each batch's wait."""
        from torch.utils.data import dataloader as dl

        probe = self

        def wrap_iter(orig):
            @functools.wraps(orig)
            def __iter__(self):
                probe.loaders.setdefault(id(self), self)
                it = probe._timed("data", orig, self)  # iterator set-up (worker start-up) is data time too
                it._torchspeed_loader = id(self)
                return it
            return __iter__
        self._patch(dl.DataLoader, "__iter__", wrap_iter)

        def wrap_next(orig):
            @functools.wraps(orig)
            def __next__(self):
                t0 = time.perf_counter()
                try:
                    return probe._timed("data", orig, self)
                finally:
                    probe.loader_wait[getattr(self, "_torchspeed_loader", 0)] += time.perf_counter() - t0
            return __next__
        self._patch(dl._BaseDataLoaderIter, "__next__", wrap_next)

    # -- hooks ----------------------------------------------------------------------------
    def _on_forward_pre(self, module, args):
        self.called.add(id(module))
        if self._depth == 0:
            self._top_start.append(time.perf_counter())
            self._enter("forward")
            mid = id(module)
            has_params = mid in self.modules or any(True for _ in module.parameters())
            if has_params:
                info = self.modules.get(mid)
                if info is None:
                    info = self.modules[mid] = {"calls": 0, "train_calls": 0, "autocast_calls": 0,
                                                "autocast_dtype": None, "args": None, "kwargs": None}
                    self.module_objs[mid] = module
                    # global hooks do not see keyword arguments: capture inputs with a module hook
                    self._handles.append(module.register_forward_pre_hook(self._capture_inputs, with_kwargs=True))
                info["calls"] += 1
                grad = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
                if module.training:
                    info["train_calls"] += 1
                else:
                    self.eval["calls"] += 1
                    if grad:
                        self.eval["grad_calls"] += 1
                dev = "cuda" if torch.cuda.is_available() else "cpu"
                if torch.is_autocast_enabled(dev) or torch.is_autocast_enabled("cpu"):
                    info["autocast_calls"] += 1
                    info["autocast_dtype"] = str(torch.get_autocast_dtype(dev if torch.is_autocast_enabled(dev)
                                                                          else "cpu"))
                module._torchspeed_eval = (not module.training, grad)
            elif self.last_output_id is not None and args and id(args[0]) == self.last_output_id:
                if self.loss_module is None and len(self.records) >= 1 and len(args) >= 2:
                    self.loss_module = module
                    self.loss_target = clone_args(args[1])
        self._depth += 1

    def _capture_inputs(self, module, args, kwargs):
        info = self.modules.get(id(module))
        if info is not None and info["args"] is None and module.training and len(self.records) >= 1:
            info["args"], info["kwargs"] = clone_args(tuple(args)), clone_args(dict(kwargs))
        return None

    def _on_forward_post(self, module, args, output):
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self._exit()
            t0 = self._top_start.pop() if self._top_start else time.perf_counter()
            dt = time.perf_counter() - t0
            flags = module.__dict__.pop("_torchspeed_eval", None)
            if flags is not None:
                self.last_output_id = id(output) if isinstance(output, torch.Tensor) else None
                if flags[0]:
                    self.eval["ms"] += dt * 1e3
                    if flags[1]:
                        self.eval["grad_ms"] += dt * 1e3
        return None

    def _on_step_pre(self, opt, args, kwargs):
        if self.step_opt is None:
            self.step_opt = opt
        if opt is self.step_opt:
            if self.unused_at_step is None and len(self.records) >= 1:
                params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
                self.unused_at_step = [str(i) for i, p in enumerate(params) if p.grad is None]
                self.unused_ids = {id(p) for p in params if p.grad is None}
                self.grad_ids = {id(p) for p in params if p.grad is not None}
            self._enter("optim")
        return None

    def _on_step_post(self, opt, args, kwargs):
        if opt is not self.step_opt:
            return
        self._exit()
        self._end_step()

    def _end_step(self) -> None:
        """One step's record (since the last), and the stop once `warmup + steps` were seen."""
        now = time.perf_counter()
        rec = {k: v * 1e3 for k, v in self.cur.items()}
        rec["step"] = (now - self.last_mark) * 1e3
        faults = _minor_faults()
        rec["minflt"], self._faults = faults - self._faults, faults
        c = self.copies  # this step's torch.tensor(ndarray) copies (load-time ones: the first, unmeasured step)
        rec["tensor_copies"], rec["tensor_copy_ms"] = c["count"] - self._copies_seen[0], c["ms"] - self._copies_seen[1]
        self._copies_seen = (c["count"], c["ms"])
        self.records.append(rec)
        self.cur = defaultdict(float)
        self.last_mark = now
        if len(self.records) >= self.warmup + self.steps:
            if self.on_stop is not None:
                self.on_stop()
            raise StopScript()
