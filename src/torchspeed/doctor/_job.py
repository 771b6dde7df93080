"""The job sandbox (T02): run one user script as `python train.py args` would, under the probe, for a
bounded number of optimizer steps, and leave the calling process as it found it.

`run_job` uses `runpy.run_path` semantics (`__name__ == "__main__"`, the script's folder first on
`sys.path`, the current directory unchanged, `sys.argv` set). A private `BaseException` from the probe
stops the script after `warmup + steps` steps (a script's `except Exception` cannot swallow it);
SIGALRM stops a script that runs past its time limit. Just before the stop, with the script still
alive, the doctor reads what the script set (threads, debug modes, math precision), summarises the
steps (`_summary`), checks the model (`_model_checks`, `_kernels`), times the datasets (`_datasets`)
and, when asked, measures each fix (`verify`) and what fit's plan would choose (`_fit_plan`). Afterwards every global the script may have changed
(argv, sys.path, its modules, threads, cudnn, default dtype, grad mode, anomaly detection,
deterministic algorithms, the current directory) is put back.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import sys
import time
import traceback

import torch

from torchspeed.doctor._compile_log import CompileLog
from torchspeed.doctor import _datasets, _kernels, _model_checks, _summary
from torchspeed.doctor._capture import capture
from torchspeed.doctor._fit_plan import fit_plan
from torchspeed.doctor.verify import measure_contention, verify_fixes
from torchspeed.env import detect, usable_cores
from torchspeed.doctor._probe import Probe, StopScript
from torchspeed.doctor._sites import is_user_file

__all__ = ["run_job", "TimeLimit", "outermost_autocast_off"]


class TimeLimit(BaseException):
    """Raised from SIGALRM when the script ran past its time limit."""


def _alarm(signum, frame):
    raise TimeLimit()


def read_settings(obs: dict) -> None:
    """What the script left switched on: debug modes, CPU math precision, threads (read while it runs)."""
    mk = torch.backends.mkldnn
    obs["debug"] = {"anomaly_detection": bool(torch.is_anomaly_enabled()),
                    "profiler": bool(torch._C._autograd._profiler_enabled()),
                    "deterministic": bool(torch.are_deterministic_algorithms_enabled())}
    try:  # raises once a script has used the per-backend API (torch.backends.*.fp32_precision)
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:
        legacy = "per-backend"
    obs["math"] = {"mkldnn_matmul": str(getattr(getattr(mk, "matmul", None), "fp32_precision", "none")),
                   "mkldnn_conv": str(getattr(getattr(mk, "conv", None), "fp32_precision", "none")),
                   "float32_matmul_precision": legacy}
    obs["threads"] = torch.get_num_threads()
    obs["cpu_cores"] = usable_cores()
    obs["machine_cores"] = os.cpu_count() or obs["cpu_cores"]
    obs["kernel"] = os.uname().release if hasattr(os, "uname") else ""


def _precision_settings() -> list[tuple[object, str]]:
    """(backend object, fp32_precision) for every backend with the per-backend precision setting."""
    b = torch.backends
    objs = [b, b.mkldnn, getattr(b.mkldnn, "matmul", None), getattr(b.mkldnn, "conv", None), getattr(b.mkldnn, "rnn", None),
            b.cuda.matmul, b.cudnn, getattr(b.cudnn, "conv", None), getattr(b.cudnn, "rnn", None)]
    return [(o, o.fp32_precision) for o in objs if o is not None and hasattr(o, "fp32_precision")]


def _restore_precision(saved: list[tuple[object, str]]) -> None:
    for o, value in saved:
        try:
            o.fp32_precision = value
        except Exception:  # a backend that refuses a value it reported: leave it
            pass


def _compile_events(records: list[dict]) -> dict:
    out: dict = {"graph_breaks": [], "recompiles": []}
    counts: dict[tuple, int] = {}
    for r in records:
        key = (r["kind"], r["site"], r["reason"])
        counts[key] = counts.get(key, 0) + 1
    for (kind, site, reason), n in counts.items():
        out["graph_breaks" if kind == "graph_break" else "recompiles"].append({"site": site, "reason": reason,
                                                                               "count": n})
    return out


def _run_script(script: str, source: str | None) -> None:
    """`python script` semantics; with `source`, that text runs in place of the file's (a --fix candidate:
    same path, folder, imports and `__file__`, so nothing is copied into the user's folder)."""
    if source is None:
        runpy.run_path(script, run_name="__main__")
        return
    import types

    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__ = script, __builtins__
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(compile(source, script, "exec"), main.__dict__)
    finally:
        sys.modules["__main__"] = saved


@contextlib.contextmanager
def outermost_autocast_off():
    """Autocast off, at the outermost level, for the analysis; the script's autocast state back afterwards.

    The analysis runs inside the script's last optimizer step, which may sit inside the script's own autocast
    block. Autocast clears its cache of cast weights only when the outermost block exits (nesting 0). Were the
    analysis nested (inside the script's block, or inside `torch.autocast(enabled=False)`), a candidate's
    autocast step would never clear it: its next steps would reuse the first step's bf16 weights, skipping
    the casts (too fast) and training on stale weights (its losses off the script's). So the nesting count is
    taken to 0 here, as at a script's top level, and put back after."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    enabled = {d: torch.is_autocast_enabled(d) for d in devices}
    depth = torch.autocast_increment_nesting() - 1
    for _ in range(depth + 1):
        torch.autocast_decrement_nesting()
    torch.clear_autocast_cache()
    for d in devices:
        torch.set_autocast_enabled(d, False)
    try:
        yield
    finally:
        torch.clear_autocast_cache()
        for d, on in enabled.items():
            torch.set_autocast_enabled(d, on)
        for _ in range(depth):
            torch.autocast_increment_nesting()


def _analyse(probe: Probe, job: dict, obs: dict) -> None:

    if job.get("measure_only"):  # --fix timing runs: the step-time breakdown only
        _summary.summarize(probe, obs)
        return

    try:
        with torch.enable_grad(), outermost_autocast_off():
            _summary.summarize(probe, obs)
            captured = capture(probe)
            _model_checks.examine_model(captured, obs)
            _kernels.profile_kernels(captured, obs)
            _datasets.probe_datasets(probe, obs)
            measure_contention(captured, obs)
            if job.get("verify"):
                obs["verify"] = verify_fixes(captured, obs, fixes=job.get("fixes"), rounds=int(job.get("rounds", 5)))
                if not job.get("fixes") or {"autocast", "channels_last", "fused_optimizer"} & set(job["fixes"]):
                    obs["fit_plan"] = fit_plan(captured, obs, rounds=int(job.get("rounds", 5)))
    except Exception as e:  # a doctor failure must not look like the script's
        obs["notes"].append(f"analysis failed: {type(e).__name__}: {e}")
        obs.setdefault("analysis_traceback", traceback.format_exc())


class _Run:
    """One script's run: the job, its observation, the probe and compile log it runs under, and whether
    the analysis ran (once: inside the last step while the script is alive, or after it ended)."""

    def __init__(self, job: dict, obs: dict):
        self.job, self.obs = job, obs
        self.probe = Probe(steps=obs["steps_requested"], warmup=obs["warmup"])
        self.compile_log = CompileLog()
        self.analysed = False
        self.probe.on_stop = self.analyse_live

    def analyse_live(self) -> None:
        """The probe's stop, inside the last optimizer step while the script is still alive (its temp files,
        open datasets and models exist): the time limit and every patch come off, then the analysis runs."""
        if self.analysed:
            return
        self.analysed = True
        signal.setitimer(signal.ITIMER_REAL, 0)
        self.probe._restore()
        obs = self.obs
        obs.setdefault("cudnn_benchmark", torch.backends.cudnn.benchmark)
        obs["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        read_settings(obs)
        obs["compile"] = _compile_events(self.compile_log.records)
        _analyse(self.probe, self.job, obs)

    def read_before_reset(self) -> None:
        """The script ended before the step limit: read its settings before they are reset."""
        if not self.analysed:
            read_settings(self.obs)
            self.obs["compile"] = _compile_events(self.compile_log.records)

    def analyse_after(self) -> None:
        """The script ended before the step limit: examine what it left behind."""
        if not self.analysed:
            self.analysed = True
            self.obs.setdefault("cuda_devices", torch.cuda.device_count() if torch.cuda.is_available() else 0)
            _analyse(self.probe, self.job, self.obs)


def _start(job: dict) -> dict:
    """The observation a run starts from: the script, its arguments, the step counts, the machine."""
    steps, warmup = int(job.get("steps", 30)), int(job.get("warmup", 5))
    return {"script": job["script"], "argv": list(job.get("args", [])), "steps_requested": steps,
            "warmup": warmup, "env": detect().to_dict(), "notes": []}


def _save_globals() -> dict:
    """Every global the script may change, to put back after it (`_stop`)."""
    return {"argv": sys.argv, "path": list(sys.path), "modules": set(sys.modules),
            "threads": torch.get_num_threads(), "cudnn": torch.backends.cudnn.benchmark,
            "dtype": torch.get_default_dtype(), "grad": torch.is_grad_enabled(), "cwd": os.getcwd(),
            "anomaly": torch.is_anomaly_enabled(), "deterministic": torch.are_deterministic_algorithms_enabled(),
            "precision": _precision_settings()}


def _probe_script(script: str, run: _Run) -> tuple[str, str | None]:
    """The probe phase: run the script under the probe and the time limit; (status, traceback) of how it
    ended: stopped at the step limit, finished, exited, raised, timed out or interrupted."""
    try:
        signal.setitimer(signal.ITIMER_REAL, float(run.job.get("time_limit", 300)))
        try:
            with run.compile_log, run.probe:
                _run_script(script, run.job.get("source"))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except StopScript:
        return "stopped", None
    except TimeLimit:
        return "timeout", None
    except SystemExit as e:
        return ("finished", None) if e.code in (None, 0) else ("exited", f"SystemExit: {e.code}")
    except KeyboardInterrupt:
        return "interrupted", "KeyboardInterrupt"
    except BaseException as e:  # the user's script raised: report it with its traceback
        frames = [f for f in traceback.extract_tb(e.__traceback__) if is_user_file(f.filename)]
        return "raised", "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)) + \
            "".join(traceback.format_exception_only(type(e), e))
    return "finished", None


def _drop_script_modules(before: set, script_dir: str) -> None:
    """Forget the script's own modules (imported from its folder), not the packages it imported."""
    env_dirs = tuple(os.path.realpath(p) + os.sep for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})
    for name in set(sys.modules) - before:
        f = os.path.realpath(getattr(sys.modules.get(name), "__file__", None) or "") if name in sys.modules else ""
        # A virtual environment inside the script's folder (project/.venv) holds torch: its modules register
        # C++ libraries once per process and must never be imported twice.
        if f and f.startswith(os.path.realpath(script_dir) + os.sep) and not f.startswith(env_dirs):
            del sys.modules[name]


def _stop(run: _Run, saved: dict, script_dir: str) -> None:
    """The stop phase: put back every global the script may have changed (`_save_globals`), after
    reading the settings it left (and its own cudnn.benchmark) into the observation."""
    sys.argv = saved["argv"]
    sys.path[:] = saved["path"]
    _drop_script_modules(saved["modules"], script_dir)
    run.read_before_reset()
    torch.set_num_threads(saved["threads"])
    run.obs.setdefault("cudnn_benchmark", torch.backends.cudnn.benchmark)  # the script's own setting
    torch.backends.cudnn.benchmark = saved["cudnn"]
    torch.set_default_dtype(saved["dtype"])
    torch.set_grad_enabled(saved["grad"])
    torch.autograd.set_detect_anomaly(saved["anomaly"])
    torch.use_deterministic_algorithms(saved["deterministic"])
    _restore_precision(saved["precision"])
    if os.getcwd() != saved["cwd"]:
        os.chdir(saved["cwd"])


def run_job(job: dict) -> dict:
    """Run one script under the probe; return the observation (JSON-ready dict). The phases: start (the
    observation, the saved globals), probe (the script runs), stop (the globals put back), report (the
    analysis, when the probe's stop did not run it inside the last step)."""
    script = os.path.abspath(job["script"])
    run = _Run(job, _start(job))
    saved = _save_globals()
    old_handler = signal.signal(signal.SIGALRM, _alarm)
    t_start = time.perf_counter()
    sys.argv = [script, *run.obs["argv"]]
    sys.path.insert(0, os.path.dirname(script))
    try:
        status, tb = _probe_script(script, run)
    finally:
        signal.signal(signal.SIGALRM, old_handler)
        _stop(run, saved, os.path.dirname(script))
    run.obs["status"], run.obs["traceback"] = status, tb
    run.obs["wall_s"] = round(time.perf_counter() - t_start, 3)
    run.analyse_after()
    return run.obs
