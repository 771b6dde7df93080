"""The probe: run a user's script under instrumentation and record where its step time goes (T02, T03).

`run_job` runs one script with `runpy.run_path` semantics (`__name__ == "__main__"`, the
script's folder first on `sys.path`, the current directory unchanged, `sys.argv` set),
with these patches in place:

- global optimizer step hooks: step boundaries; after `warmup + steps` steps a private
  `BaseException` stops the script (a script's `except Exception` cannot swallow it);
- global module forward hooks: which module is the model, its inputs, autocast and grad
  mode at each call, evaluation with gradients enabled, modules never called;
- `Tensor.backward`, `Optimizer.zero_grad` / `Module.zero_grad` (set_to_none), DataLoader
  iteration (data wait), `Tensor.to` / `.cuda` (host-device copies), `.item` / `.tolist` /
  `.numpy` / `.cpu` / `nonzero` called from user code (host-device syncs on an accelerator),
  `torch.tensor(ndarray)` (a copy where `torch.from_numpy` shares memory).

Time is attributed exclusively (a sync inside a forward counts as sync, not compute).
Every patch is undone when the script ends, whatever way it ends; a wall-clock limit
(SIGALRM) stops a script that runs too long. After the script, the captured model, batch
and datasets are examined statically (`_static`) and, with verify, timed (`verify`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import runpy
import signal
import sys
import sysconfig
import time
import traceback
from collections import defaultdict

import torch
from torch import nn

__all__ = ["Probe", "run_job", "StopScript", "TimeLimit"]


class StopScript(BaseException):
    """Raised from the optimizer step hook once enough steps were seen."""


class TimeLimit(BaseException):
    """Raised from SIGALRM when the script ran past its time limit."""


def _lib_prefixes() -> tuple[str, ...]:
    paths = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            paths.add(os.path.realpath(p))
    paths.add(os.path.dirname(os.path.realpath(torch.__file__)))
    paths.add(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))  # torchspeed itself
    for p in sys.path:
        if p and ("site-packages" in p or "dist-packages" in p):
            paths.add(os.path.realpath(p))
    return tuple(sorted(paths))


_LIBS = _lib_prefixes()


@functools.lru_cache(maxsize=4096)
def _is_user_file(filename: str) -> bool:
    if not filename or filename.startswith("<"):
        return False
    return not os.path.realpath(filename).startswith(_LIBS)


def _user_site(depth: int = 2) -> str | None:
    """'file:line' of the calling user frame, or None when the caller is library code."""
    f = sys._getframe(depth)
    if _is_user_file(f.f_code.co_filename):
        return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"
    return None


def _clone_args(args):
    def c(x):
        if isinstance(x, torch.Tensor):
            return x.detach().clone()
        if isinstance(x, (list, tuple)):
            return type(x)(c(v) for v in x) if isinstance(x, list) else tuple(c(v) for v in x)
        if isinstance(x, dict):
            return {k: c(v) for k, v in x.items()}
        return x
    return c(args)


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)):
        for v in x:
            t = _first_tensor(v)
            if t is not None:
                return t
    if isinstance(x, dict):
        for v in x.values():
            t = _first_tensor(v)
            if t is not None:
                return t
    return None


class Probe:
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
        self.copies = {"count": 0, "ms": 0.0, "bytes": 0, "sites": defaultdict(int)}
        self.zero_grads = {"calls": 0, "set_to_none_false": 0, "ms": 0.0, "sites": defaultdict(int)}
        self.unused_at_step: list[str] | None = None
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
        from torch.nn.modules import module as mm
        from torch.optim import optimizer as om
        from torch.utils.data import dataloader as dl

        probe = self
        self._handles.append(om.register_optimizer_step_pre_hook(self._on_step_pre))
        self._handles.append(om.register_optimizer_step_post_hook(self._on_step_post))
        self._handles.append(mm.register_module_forward_pre_hook(self._on_forward_pre))
        self._handles.append(mm.register_module_forward_hook(self._on_forward_post))

        def wrap_backward(orig):
            @functools.wraps(orig)
            def backward(self, *a, **k):
                return probe._timed("backward", orig, self, *a, **k)
            return backward
        self._patch(torch.Tensor, "backward", wrap_backward)

        def wrap_zero_grad(orig):
            @functools.wraps(orig)
            def zero_grad(self, set_to_none: bool = True, *a, **k):
                site = _user_site()
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

        def wrap_to(orig):
            @functools.wraps(orig)
            def to(self, *a, **k):
                if self.device.type == "cpu" and probe._moves_to_accelerator(a, k):
                    return probe._timed("copy", orig, self, *a, **k)
                return orig(self, *a, **k)
            return to
        self._patch(torch.Tensor, "to", wrap_to)

        def wrap_cuda(orig):
            @functools.wraps(orig)
            def cuda(self, *a, **k):
                return probe._timed("copy", orig, self, *a, **k)
            return cuda
        self._patch(torch.Tensor, "cuda", wrap_cuda)

        for name in ("item", "tolist", "numpy", "cpu", "nonzero"):
            self._patch(torch.Tensor, name, functools.partial(self._wrap_sync, name))
        self._patch(torch, "nonzero", functools.partial(self._wrap_sync, "nonzero"))

        def wrap_tensor(orig):
            @functools.wraps(orig)
            def tensor(data, *a, **k):
                import numpy as np
                if isinstance(data, np.ndarray) or (isinstance(data, (list, tuple)) and data
                                                    and isinstance(data[0], np.ndarray)):
                    site = _user_site()
                    if site:
                        t0 = time.perf_counter()
                        out = orig(data, *a, **k)
                        c = probe.copies
                        c["count"] += 1
                        c["ms"] += (time.perf_counter() - t0) * 1e3
                        c["bytes"] += out.numel() * out.element_size()
                        c["sites"][site] += 1
                        return out
                return orig(data, *a, **k)
            return tensor
        self._patch(torch, "tensor", wrap_tensor)
        if torch.cuda.is_available():
            # every implicit sync (also the ones we cannot patch: boolean-mask indexing,
            # Python control flow on device values) emits a warning: count them, print none
            torch.cuda.set_sync_debug_mode("warn")
            import warnings

            def wrap_showwarning(orig):
                def showwarning(message, category, *a, **k):
                    if "synchroniz" in str(message):
                        probe.cuda_sync_warnings += 1
                        return None
                    return orig(message, category, *a, **k)
                return showwarning
            self._patch(warnings, "showwarning", wrap_showwarning)

    @staticmethod
    def _moves_to_accelerator(a, k) -> bool:
        dev = k.get("device")
        if dev is None and a:
            dev = a[0]
        if isinstance(dev, torch.Tensor):
            dev = dev.device
        if isinstance(dev, (str, torch.device)):
            try:
                return torch.device(dev).type != "cpu"
            except (RuntimeError, TypeError):
                return False
        return False

    def _wrap_sync(self, kind: str, orig):
        probe = self

        @functools.wraps(orig)
        def wrapper(*a, **k):
            t = a[0] if a and isinstance(a[0], torch.Tensor) else None
            # .cpu()/.numpy() of a CPU tensor is free: not a sync, not counted.
            if t is None or (kind in ("cpu", "numpy") and t.device.type == "cpu"):
                return orig(*a, **k)
            site = _user_site()
            if site is None:
                return orig(*a, **k)
            probe.syncs[kind] += 1
            probe.sync_sites[site] += 1
            return probe._timed("sync", orig, *a, **k)
        return wrapper

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
                    self.loss_target = _clone_args(args[1])
        self._depth += 1

    def _capture_inputs(self, module, args, kwargs):
        info = self.modules.get(id(module))
        if info is not None and info["args"] is None and module.training and len(self.records) >= 1:
            info["args"], info["kwargs"] = _clone_args(tuple(args)), _clone_args(dict(kwargs))
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
                self.unused_at_step = [str(i) for g in opt.param_groups for i, p in enumerate(g["params"])
                                       if p.requires_grad and p.grad is None]
                self._unused_ids = {id(p) for g in opt.param_groups for p in g["params"]
                                    if p.requires_grad and p.grad is None}
            self._enter("optim")
        return None

    def _on_step_post(self, opt, args, kwargs):
        if opt is not self.step_opt:
            return
        self._exit()
        now = time.perf_counter()
        rec = {k: v * 1e3 for k, v in self.cur.items()}
        rec["step"] = (now - self.last_mark) * 1e3
        self.records.append(rec)
        self.cur = defaultdict(float)
        self.last_mark = now
        if len(self.records) >= self.warmup + self.steps:
            if self.on_stop is not None:
                self.on_stop()
            raise StopScript()


def _alarm(signum, frame):
    raise TimeLimit()


def run_job(job: dict) -> dict:
    """Run one script under the probe; return the observation (JSON-ready dict)."""
    from torchspeed.doctor import _static
    from torchspeed.env import detect

    script = os.path.abspath(job["script"])
    script_dir = os.path.dirname(script)
    steps, warmup = int(job.get("steps", 30)), int(job.get("warmup", 5))
    obs: dict = {"script": job["script"], "argv": list(job.get("args", [])), "steps_requested": steps,
                 "warmup": warmup, "env": detect().to_dict(), "notes": []}
    probe = Probe(steps=steps, warmup=warmup)
    saved = {"argv": sys.argv, "path": list(sys.path), "modules": set(sys.modules),
             "threads": torch.get_num_threads(), "cudnn": torch.backends.cudnn.benchmark,
             "dtype": torch.get_default_dtype(), "grad": torch.is_grad_enabled(), "cwd": os.getcwd()}
    analysed = False

    def analyse() -> None:
        # Runs inside the last optimizer step while the script is still alive (its temp files,
        # open datasets and models exist), with every patch already removed.
        nonlocal analysed
        if analysed:
            return
        analysed = True
        signal.setitimer(signal.ITIMER_REAL, 0)
        probe._restore()
        obs.setdefault("cudnn_benchmark", torch.backends.cudnn.benchmark)
        obs["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        off = [torch.autocast("cpu", enabled=False)]
        if torch.cuda.is_available():
            off.append(torch.autocast("cuda", enabled=False))
        try:
            with torch.enable_grad(), contextlib.ExitStack() as stack:
                for ctx in off:
                    stack.enter_context(ctx)
                _static.summarize(probe, obs)
                captured = _static.capture(probe)
                _static.examine_model(captured, obs)
                _static.probe_datasets(probe, obs)
                if job.get("verify"):
                    from torchspeed.doctor.verify import verify_fixes
                    obs["verify"] = verify_fixes(captured, obs, fixes=job.get("fixes"),
                                                 rounds=int(job.get("rounds", 5)))
        except Exception as e:  # a doctor failure must not look like the script's
            obs["notes"].append(f"analysis failed: {type(e).__name__}: {e}")
            obs.setdefault("analysis_traceback", traceback.format_exc())

    probe.on_stop = analyse
    old_handler = signal.signal(signal.SIGALRM, _alarm)
    t_start = time.perf_counter()
    status, tb = "finished", None
    sys.argv = [script, *obs["argv"]]
    sys.path.insert(0, script_dir)
    try:
        signal.setitimer(signal.ITIMER_REAL, float(job.get("time_limit", 300)))
        try:
            with probe:
                runpy.run_path(script, run_name="__main__")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except StopScript:
        status = "stopped"
    except TimeLimit:
        status = "timeout"
    except SystemExit as e:
        status = "finished" if e.code in (None, 0) else "exited"
        if status == "exited":
            tb = f"SystemExit: {e.code}"
    except KeyboardInterrupt:
        status, tb = "interrupted", "KeyboardInterrupt"
    except BaseException as e:  # the user's script raised: report it with its traceback
        status = "raised"
        frames = [f for f in traceback.extract_tb(e.__traceback__) if _is_user_file(f.filename)]
        tb = "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)) + \
            "".join(traceback.format_exception_only(type(e), e))
    finally:
        signal.signal(signal.SIGALRM, old_handler)
        sys.argv = saved["argv"]
        sys.path[:] = saved["path"]
        for name in set(sys.modules) - saved["modules"]:
            f = getattr(sys.modules.get(name), "__file__", None) or ""
            if f and os.path.realpath(f).startswith(os.path.realpath(script_dir) + os.sep):
                del sys.modules[name]
        torch.set_num_threads(saved["threads"])
        obs.setdefault("cudnn_benchmark", torch.backends.cudnn.benchmark)  # the script's own setting
        torch.backends.cudnn.benchmark = saved["cudnn"]
        torch.set_default_dtype(saved["dtype"])
        torch.set_grad_enabled(saved["grad"])
        if os.getcwd() != saved["cwd"]:
            os.chdir(saved["cwd"])
    obs["status"], obs["traceback"] = status, tb
    obs["wall_s"] = round(time.perf_counter() - t_start, 3)
    if not analysed:
        analyse()  # the script ended before the step limit: examine what it left behind
    return obs
