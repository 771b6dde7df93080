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
from torchspeed.doctor._probe import Probe, StopScript, is_user_file

__all__ = ["run_job", "TimeLimit"]


class TimeLimit(BaseException):
    """Raised from SIGALRM when the script ran past its time limit."""


def _alarm(signum, frame):
    raise TimeLimit()


def read_settings(obs: dict) -> None:
    """What the script left switched on: debug modes, CPU math precision, threads (read while it runs)."""
    from torchspeed.env import usable_cores

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


def _analyse(probe: Probe, job: dict, obs: dict) -> None:
    from torchspeed.doctor import _datasets, _kernels, _model_checks, _summary
    from torchspeed.doctor._capture import capture

    if job.get("measure_only"):  # --fix timing runs: the step-time breakdown only
        _summary.summarize(probe, obs)
        return

    off = [torch.autocast("cpu", enabled=False)]
    if torch.cuda.is_available():
        off.append(torch.autocast("cuda", enabled=False))
    try:
        with torch.enable_grad(), contextlib.ExitStack() as stack:
            for ctx in off:
                stack.enter_context(ctx)
            _summary.summarize(probe, obs)
            captured = capture(probe)
            _model_checks.examine_model(captured, obs)
            _kernels.profile_kernels(captured, obs)
            _datasets.probe_datasets(probe, obs)
            from torchspeed.doctor.verify import measure_contention
            measure_contention(captured, obs)
            if job.get("verify"):
                from torchspeed.doctor.verify import verify_fixes
                obs["verify"] = verify_fixes(captured, obs, fixes=job.get("fixes"), rounds=int(job.get("rounds", 5)))
                if not job.get("fixes") or {"autocast", "channels_last", "fused_optimizer"} & set(job["fixes"]):
                    from torchspeed.doctor._fit_plan import fit_plan  # the gap to fit, explained
                    obs["fit_plan"] = fit_plan(captured, obs, rounds=int(job.get("rounds", 5)))
    except Exception as e:  # a doctor failure must not look like the script's
        obs["notes"].append(f"analysis failed: {type(e).__name__}: {e}")
        obs.setdefault("analysis_traceback", traceback.format_exc())


def run_job(job: dict) -> dict:
    """Run one script under the probe; return the observation (JSON-ready dict)."""
    from torchspeed.env import detect

    script = os.path.abspath(job["script"])
    script_dir = os.path.dirname(script)
    steps, warmup = int(job.get("steps", 30)), int(job.get("warmup", 5))
    obs: dict = {"script": job["script"], "argv": list(job.get("args", [])), "steps_requested": steps,
                 "warmup": warmup, "env": detect().to_dict(), "notes": []}
    probe = Probe(steps=steps, warmup=warmup)
    compile_log = CompileLog()
    saved = {"argv": sys.argv, "path": list(sys.path), "modules": set(sys.modules),
             "threads": torch.get_num_threads(), "cudnn": torch.backends.cudnn.benchmark,
             "dtype": torch.get_default_dtype(), "grad": torch.is_grad_enabled(), "cwd": os.getcwd(),
             "anomaly": torch.is_anomaly_enabled(), "deterministic": torch.are_deterministic_algorithms_enabled(),
             "precision": _precision_settings()}
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
        read_settings(obs)
        obs["compile"] = _compile_events(compile_log.records)
        _analyse(probe, job, obs)

    probe.on_stop = analyse
    old_handler = signal.signal(signal.SIGALRM, _alarm)
    t_start = time.perf_counter()
    status, tb = "finished", None
    sys.argv = [script, *obs["argv"]]
    sys.path.insert(0, script_dir)
    try:
        signal.setitimer(signal.ITIMER_REAL, float(job.get("time_limit", 300)))
        try:
            with compile_log, probe:
                _run_script(script, job.get("source"))
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
        frames = [f for f in traceback.extract_tb(e.__traceback__) if is_user_file(f.filename)]
        tb = "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)) + \
            "".join(traceback.format_exception_only(type(e), e))
    finally:
        signal.signal(signal.SIGALRM, old_handler)
        sys.argv = saved["argv"]
        sys.path[:] = saved["path"]
        env_dirs = tuple(os.path.realpath(p) + os.sep for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})
        for name in set(sys.modules) - saved["modules"]:  # the script's own modules, not the packages it imported
            f = os.path.realpath(getattr(sys.modules.get(name), "__file__", None) or "") if name in sys.modules else ""
            # A virtual environment inside the script's folder (project/.venv) holds torch: its modules register
            # C++ libraries once per process and must never be imported twice.
            if f and f.startswith(os.path.realpath(script_dir) + os.sep) and not f.startswith(env_dirs):
                del sys.modules[name]
        if not analysed:  # the script ended before the step limit: read its settings before they are reset
            read_settings(obs)
            obs["compile"] = _compile_events(compile_log.records)
        torch.set_num_threads(saved["threads"])
        obs.setdefault("cudnn_benchmark", torch.backends.cudnn.benchmark)  # the script's own setting
        torch.backends.cudnn.benchmark = saved["cudnn"]
        torch.set_default_dtype(saved["dtype"])
        torch.set_grad_enabled(saved["grad"])
        torch.autograd.set_detect_anomaly(saved["anomaly"])
        torch.use_deterministic_algorithms(saved["deterministic"])
        _restore_precision(saved["precision"])
        if os.getcwd() != saved["cwd"]:
            os.chdir(saved["cwd"])
    obs["status"], obs["traceback"] = status, tb
    obs["wall_s"] = round(time.perf_counter() - t_start, 3)
    if not analysed:
        analysed = True
        obs.setdefault("cuda_devices", torch.cuda.device_count() if torch.cuda.is_available() else 0)
        _analyse(probe, job, obs)  # examine what the script left behind
    return obs
