"""The GPU check: one script for one short lease on a CUDA machine (H100/H200), every part under its own limit.

Parts, cheapest evidence first, each in its own process with its own time limit (the defaults
sum to 450 s; the whole check, the wrapper's start included, is held to 465 s, inside an 8-minute
call). Seconds a part leaves unused go to the part after it. The result of each is written to
`OUT/gpu_check.json` as soon as the part ends, and a part stopped at its limit costs only
itself (what it measured before is kept: the part rewrites its result as it goes). The limits
come from the checks on fresh H200s (check_s6, check_s7), where cold kernel and compile caches cost
the tests about 40% and ResNet-50's compile trial more than 80 s over a warm machine; on check_s7's
fresh machine the tests took 101 s (35 s of it one batch-size search, since shortened), ResNet-50's
rows but the compiled hand loop 173 s, the GPT 87 s, and the digits' naive and `all` 45 s of 73:

1. `tests` (100 s): the `gpu`-marked pytest tests (GPU_TESTS); the log in `OUT/gpu_tests.txt`,
   the passed/failed counts from pytest's last line.
2. `resnet` (165 s): ResNet-50 at 224 px, batch 256 (halved on out of memory), rows naive / hand /
   lightning / all_eager (fit's defaults, no compilation), then all (fit's defaults, its compile
   trial too) interleaved in rounds; img/s, all/hand, all/lightning, MFU.
3. `gpt` (95 s): a GPT-2-small-shaped model (12 x 768, 12 heads, 1,024 context, vocabulary
   50,304), all_eager and all against the hand-written loop, eager and compiled; tokens/s, MFU, a
   measured bf16 matmul peak.
4. `tta` (90 s): time to 97% on the digits at the CPU bench's fixed step budgets, naive / all /
   auto, 2 seeds.

The measured parts live in gpu_check_parts.py and gpu_check_rows.py; docs/bench.md ("The GPU
check") says how to run this on the lent machine. `--tiny` runs the same parts on the CPU at tiny
sizes (the `tests` part is skipped without CUDA): tests/bench/test_gpu_check.py runs it.

Usage:
    OUT=gpu-out bash benchmarks/gpu_check.sh                         # from the repository root
    python benchmarks/gpu_check.py --out gpu-out [--tiny] [--parts resnet,gpt] [--limit gpt=90]
        [--set resnet.batch=128] [--total 465]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from torchspeed._io import write_json
from torchspeed.bench.runner import provenance

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "benchmarks"
PARTS = ("tests", "resnet", "gpt", "tta")
LIMITS = {"tests": 100.0, "resnet": 165.0, "gpt": 95.0, "tta": 90.0}
# The whole check, counted from GPU_CHECK_START (set by gpu_check.sh when it starts: its wheel install and this
# script's imports count) or else from this script's start; no part gets more than is left of it.
TOTAL_S = 465.0
# tests/bench/test_bench_gpu.py (54 s warm, about 70 s on a fresh machine) is left to `pytest -m gpu`: the resnet
# part measures the same rows at full size.
GPU_TESTS = ("tests/train/test_train_gpu.py", "tests/train/test_precision.py", "tests/tune/test_batch.py",
             "tests/data/test_decode.py", "tests/data/test_augment.py", "tests/doctor/test_gpu.py",
             "tests/distributed/test_launch.py")
# The CPU bench whose time-to-target search gave the step budgets (digits, 97%, 2026-11 on the AMX CPU).
TTA_SOURCE = "benchmarks/results/cpu-amx/bench_s5.json"

FULL = {
    "resnet": {"image_size": 224, "batch": 256, "steps": 6, "rounds": 5, "early_rounds": 2, "warmup": 3,
               "data_batches": 4, "all_run_steps": None, "hand_compile": "auto", "compile_reserve_s": 35,
               "profile_s": 10},
    "gpt": {"n_layer": 12, "n_embd": 768, "n_head": 12, "block": 1024, "vocab": 50304, "batch": 16, "steps": 8,
            "rounds": 5, "early_rounds": 2, "warmup": 3, "data_batches": 4, "all_run_steps": None,
            "hand_compile": "auto", "compile_reserve_s": 40, "matmul_n": 8192, "matmul_iters": 30,
            "profile_s": 10},
    "tta": {"source": TTA_SOURCE, "target": 0.97, "configs": ["naive", "all", "auto"], "seeds": 2, "budgets": None},
}
# --tiny: the same code at sizes a 2-core CPU runs in seconds; all_run_steps tells fit's compile trial the run
# is short (no compilation), budgets of a few steps stand in for the CPU bench's.
TINY = {
    "resnet": {"image_size": 64, "batch": 2, "steps": 1, "rounds": 2, "early_rounds": 1, "warmup": 1,
               "data_batches": 1, "all_run_steps": 8, "hand_compile": False},
    "gpt": {"n_layer": 2, "n_embd": 64, "n_head": 2, "block": 64, "vocab": 512, "batch": 2, "steps": 1, "rounds": 2,
            "early_rounds": 1, "warmup": 1, "data_batches": 1, "all_run_steps": 8, "hand_compile": False,
            "matmul_n": 512, "matmul_iters": 3},
    "tta": {"budgets": {"naive": 2, "all": 2, "auto": 2}, "seeds": 1},
}


def run_limited(cmd: list[str], limit_s: float, *, tick=None, every_s: float = 5.0,
                **popen) -> tuple[int | None, bool, float]:
    """Run `cmd` in its own process group for at most `limit_s`; (exit code or None, timed out?, seconds).
    `tick()` runs every `every_s` while it runs. On the limit the whole group is killed (pytest's and the
    workers' children too)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)
    rc, timed_out = None, False
    try:
        while rc is None and not timed_out:
            left = limit_s - (time.monotonic() - t0)
            try:
                rc = proc.wait(timeout=max(min(every_s, left), 0.05))
            except subprocess.TimeoutExpired:
                timed_out = left <= every_s
                if tick is not None and not timed_out:
                    tick()
    finally:  # the group, also after its leader ended: no compile worker or test process outlives its part
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return rc, timed_out, time.monotonic() - t0


def pytest_counts(text: str) -> dict:
    """The counts on pytest's last summary line ("3 failed, 14 passed, 43 deselected in 131.90s"); without one
    (stopped at the limit), the counts of its progress characters so far, marked partial."""
    lines = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|errors?|skipped|deselected)", ln)]
    if not lines:
        progress = re.compile(r"^(?:\S+\.py )?([.FEsxX]+)\s*(\[\s*\d+%\])?$")  # "..F.s   [ 40%]"
        marks = "".join(m.group(1) for ln in text.splitlines() if (m := progress.match(ln)))
        return {"passed": marks.count("."), "failed": marks.count("F"), "error": marks.count("E"),
                "skipped": marks.count("s"), "summary_line": None, "partial": True}
    last = lines[-1].strip("= \n")
    counts = {k.rstrip("s") if k.startswith("error") else k: int(n)
              for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)", last)}
    return {"passed": 0, "failed": 0, "error": 0, **counts, "summary_line": last}


def _tail(path: Path, offset: int = 0, lines: int = 40) -> list[str]:
    if not path.exists():
        return []
    with open(path, errors="replace") as f:
        f.seek(offset)
        return f.read().splitlines()[-lines:]


def tests_part(device: str, limit: float, out: Path, env: dict) -> dict:
    """The gpu-marked tests, or a skip without CUDA."""
    if device != "cuda":
        return {"status": "skipped", "reason": "skipped: no CUDA", "result": None}
    log = out / "gpu_tests.txt"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "--durations", "10"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += ["--timeout", "120"]
    with open(log, "w") as f:
        rc, timed_out, seconds = run_limited([*cmd, *GPU_TESTS], limit, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                             env=env)
    counts = pytest_counts(log.read_text(errors="replace"))
    status = "timed_out" if timed_out else "ok" if counts["summary_line"] else "error"
    return {"status": status, "seconds": seconds, "returncode": rc, "result": counts, "log": log.name,
            "log_tail": _tail(log, lines=15) if status != "ok" or rc else []}


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def child_part(name: str, opts: dict, limit: float, log: Path, env: dict, progress=None) -> dict:
    """A measured part in its own process (gpu_check_parts.py); what it wrote, however it ended.
    `progress(result so far)` every few seconds while it runs."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        result_path = Path(tmp) / f"{name}.json"
        with open(log, "a") as f:
            f.write(f"\n===== {name} (limit {limit:.0f} s)\n")
            f.flush()
            offset = f.tell()
            deadline = time.time() + limit - 2  # the part stops a round early rather than be killed mid-round
            cmd = [sys.executable, str(HERE / "gpu_check_parts.py"), name, json.dumps(opts | {"deadline": deadline}),
                   str(result_path)]
            tick = (lambda: progress(_read(result_path))) if progress else None
            rc, timed_out, seconds = run_limited(cmd, limit, tick=tick, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                                 env=env)
        data = _read(result_path)
    error = (data or {}).pop("error", None)
    tb = (data or {}).pop("traceback", None)
    if timed_out:
        status, error = "timed_out", f"timed out: stopped at its limit of {limit:.0f} s"
    elif error or rc != 0 or data is None:
        status, error = "error", error or f"its process exited with code {rc}"
    else:
        status = "ok"
    return {"status": status, "seconds": seconds, "returncode": rc, "error": error, "traceback": tb,
            "provenance": (data or {}).pop("provenance", None), "result": data,
            "log_tail": _tail(log, offset) if status != "ok" else []}


def _options(args) -> dict[str, dict]:
    opts = {p: dict(FULL[p]) | (TINY[p] if args.tiny else {}) | {"device": args.device} for p in FULL}
    for item in args.set or ():
        key, _, value = item.partition("=")
        part, _, field = key.partition(".")
        if part not in opts or not field:
            raise SystemExit(f"--set {item!r}: give part.key=value with part one of {', '.join(opts)}")
        try:
            opts[part][field] = json.loads(value)
        except json.JSONDecodeError:
            opts[part][field] = value
    return opts


def _limits(args) -> dict[str, float]:
    limits = dict(LIMITS)
    for item in args.limit or ():
        name, _, seconds = item.partition("=")
        if name not in limits:
            raise SystemExit(f"--limit {item!r}: give part=seconds with part one of {', '.join(PARTS)}")
        limits[name] = float(seconds)
    return limits


def _environment(tiny: bool) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if tiny:  # a check of structure, not speed: one thread per process, which no other load on the cores stalls
        env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    # every trial measured afresh (no decision cached by an earlier run), unless a cache is named
    env.setdefault("TORCHSPEED_CACHE_DIR", tempfile.mkdtemp(prefix="torchspeed-gpu-check-cache-"))
    return env


def _extras() -> dict:
    return {m: importlib.util.find_spec(m) is not None
            for m in ("lightning", "schedulefree", "simplejpeg", "torchvision", "pytest_timeout")}


def _rate(row: dict, unit: str) -> str:
    if row.get(unit) is None:
        why = row.get("reason") or row.get("error")
        return row.get("status", "?") + (f" ({why})" if why else "")
    mfu = "".join(f", {k} {row[k]:.1%}" for k in ("mfu", "mfu_vs_measured_peak") if row.get(k) is not None)
    return f"{row[unit]:,.0f} {unit.replace('_per_s', '/s')}{mfu}"


def summary(name: str, rec: dict) -> list[str]:
    """What a reader of the call's output sees of a part (the JSON has everything)."""
    head = f"[{name}] {rec['status']}" + (f" in {rec['seconds']:.0f} s" if rec.get("seconds") is not None else "")
    res = rec.get("result") or {}
    lines = [head + (f": {rec.get('error') or rec.get('reason')}" if rec["status"] != "ok" else "")]
    if name == "tests" and res:
        lines.append(f"  {res.get('summary_line')}")
    if name in ("resnet", "gpt") and res.get("rows"):
        unit = res["unit"]
        lines.append(f"  batch {res.get('batch')}, rounds done {res.get('rounds_done')}")
        lines += [f"  {k:>13}: {_rate(v, unit)}" for k, v in res["rows"].items()]
        lines += [f"  {k:>13}: {v['speedup']:.3f}x (quartiles {v['iqr']})"
                  for k, v in res.get("ratios", {}).items() if v]
        for row, p in (res.get("profile") or {}).items():
            if isinstance(p, dict) and "ops" in p:
                lines.append(f"  profile {row}: {p['launches_per_step']:.0f} launches/step, syncs {p['syncs_per_step']}, "
                             + ", ".join(f"{op['name'][:40]} {op['ms_per_step']:.2f} ms" for op in p["ops"][:3]))
        if res.get("measured_matmul_peak"):
            lines.append(f"  matmul peak ({res['measured_matmul_peak']['dtype']}): "
                         f"{res['measured_matmul_peak']['flops_per_s'] / 1e12:.1f} TFLOP/s")
    if name == "tta" and res.get("configs"):
        for c, v in res["configs"].items():
            lines.append(f"  {c:>8}: " + (v.get("error", "") if v["status"] != "ok" else
                                          f"{v['budget_steps']} steps, {v['mean_total_s']:.1f} s, val_acc "
                                          f"{[round(a, 4) for a in v['val_acc']]}, reached {v['reached']}"))
    return lines


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-out"), help="the folder for gpu_check.json and logs")
    p.add_argument("--tiny", action="store_true", help="tiny sizes, on the CPU unless --device says otherwise")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda where there is one; --tiny: cpu)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"which parts, in the order {','.join(PARTS)}")
    p.add_argument("--limit", action="append", help="part=seconds: that part's time limit")
    p.add_argument("--total", type=float, default=TOTAL_S, help="seconds for the whole check")
    p.add_argument("--set", action="append", help="part.key=value (JSON): a part's option, e.g. resnet.batch=128")
    args = p.parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    args.parts = [x for x in PARTS if x in args.parts.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = float(os.environ.get("GPU_CHECK_START") or time.time())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path, log, env = out / "gpu_check.json", out / "gpu_check.log", _environment(args.tiny)
    log.write_text("")
    opts, limits = _options(args), _limits(args)
    report = {"script": "benchmarks/gpu_check.py", "argv": sys.argv[1:] if argv is None else argv, "tiny": args.tiny,
              "device": args.device, "provenance": provenance(), "extras": _extras(), "total_limit_s": args.total,
              "limits_s": {p: limits[p] for p in args.parts}, "options": opts, "order": args.parts,
              "parts": {p: {"status": "pending"} for p in args.parts}, "finished": False}
    write_json(path, report)
    banked = 0.0  # seconds the parts before left unused: the next part may spend them
    for name in args.parts:
        left = args.total - (time.time() - t0)
        limit = min(limits[name] + banked, left)
        started = time.time()
        if left < 1:
            rec = {"status": "skipped", "reason": f"no time left of the total {args.total:.0f} s", "result": None}
        elif name == "tests":
            rec = tests_part(args.device, limit, out, env)
        else:  # while it runs, its result so far goes into the JSON too: a call stopped from outside keeps it
            def progress(data, name=name, limit=limit):
                report["parts"][name] = {"status": "running", "limit_s": round(limit, 1), "result": data}
                write_json(path, report)

            rec = child_part(name, opts[name], limit, log, env, progress)
        rec = {"limit_s": round(limit, 1), "banked_s": round(limit - min(limits[name], left), 1), **rec}
        banked = max(0.0, limit - (time.time() - started))
        rec.setdefault("provenance", None)
        rec["provenance"] = rec["provenance"] or report["provenance"]
        report["parts"][name] = rec
        report["elapsed_s"] = time.time() - t0
        write_json(path, report)
        print("\n".join(summary(name, rec)), flush=True)
    report["finished"] = True
    write_json(path, report)
    print(f"wrote {path} in {report['elapsed_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
