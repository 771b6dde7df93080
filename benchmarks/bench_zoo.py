"""Claim: every model people train runs under `fit` as it runs in its own loop: `fit` as ported never ends in an
error where the plain loop trains, keeps the loop's K-step loss where its switch trial keeps the plain settings,
and is no slower; `fit(recipe="auto")` reaches the loop's K-step loss no slower.

The zoo (all randomly initialised, nothing downloaded): every torchvision classification model at a small input
and detection and segmentation models (benchmarks/zoo_torchvision.py), one small timm model per family
(zoo_timm.py), Hugging Face architectures from small configs fed dict batches (zoo_hf.py), and the hand-written
forms people train (zoo_hand.py: carried-hidden LSTM/GRU step_fns, Transformer LMs, nn.Transformer seq2seq,
sparse embeddings, float64, Python-side state, a KV cache on self, a GAN, tuple/dict/dataclass outputs).

Each model runs in its own process (benchmarks/zoo_run.py): the plain loop, `fit` as ported (the loop's
optimizer object and LR) and `fit(recipe="auto")`, K steps each, same batches and seeds, the switch trial live
(an empty decision cache each run; precision and trial left on "auto"), on the host CPU and under each emulated
CPU profile (TORCHSPEED_CPU_PROFILE). `vs_plain` is the plain loop's whole-run seconds over the run's.

Run:
    python benchmarks/bench_zoo.py --profiles host avx2            # the whole zoo: zoo.json, zoo_avx2.json
    python benchmarks/bench_zoo.py --sample 12 --steps 12          # a quick sampled subset
    python benchmarks/bench_zoo.py --report-only                   # docs/zoo.md from the JSON files
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import zoo_report  # noqa: E402
from zoo_run import SOURCES, WAYS, registry  # noqa: E402

DEFAULT_OUT = HERE / "results" / "cpu-avx512-bf16"
OMP_WAIT_POLICY = "PASSIVE"
PROFILES = ("host", "avx2", "avx512", "avx512_bf16", "amx")


def select(names_by_source: dict[str, list[str]], models: list[str] | None, sample: int | None,
           seed: int = 0) -> list[str]:
    """The models to run: those named in `models` (or containing one of its other words), then `sample` of them, spread over the
    sources in turn (each source's own order shuffled with `seed`)."""
    every = {n for names in names_by_source.values() for n in names}
    parts = [m for m in models or () if m not in every]  # a model's own name matches it alone; other words: substrings

    def wanted(n: str) -> bool:
        return not models or n in models or any(m in n for m in parts)
    pools = {s: [n for n in names if wanted(n)] for s, names in names_by_source.items()}
    if sample is None:
        return [n for names in pools.values() for n in names]
    rng = random.Random(seed)
    for names in pools.values():
        rng.shuffle(names)
    picked: list[str] = []
    while len(picked) < sample and any(pools.values()):
        for names in pools.values():
            if names and len(picked) < sample:
                picked.append(names.pop(0))
    return picked


def _env(profile: str) -> dict:
    env = dict(os.environ)
    env.pop("TORCHSPEED_CPU_PROFILE", None)
    if profile != "host":
        env["TORCHSPEED_CPU_PROFILE"] = profile
    env.setdefault("PYTHONWARNINGS", "ignore")
    # OpenMP's threads sleep while they wait, not spin: on cores other work shares, a spinning wait makes a
    # depthwise conv net's step 20x slower (timm/repvit_m1: 57.7 s for 3 steps against 2.4 s at load 12); the
    # same for every way, so the ratios keep their meaning
    env.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
    return env


def _lines(proc, q: queue.Queue) -> None:
    for line in proc.stdout:
        q.put(line)
    q.put(None)


def run_chunk(names: list[str], steps: int, ways: list[str], profile: str, timeout: float, rounds: int = 1,
              max_params: float | None = None, extra: tuple[str, ...] = ()):
    """Yield (name, row) for `names`, run one after another in one fresh process. A model that runs over
    `timeout` seconds, or in whose runs the process dies, gets its way in flight recorded as the error; the
    models after it go on in a new process."""
    pending = list(names)
    while pending:
        cmd = [sys.executable, str(HERE / "zoo_run.py"), *pending, "--steps", str(steps), "--rounds", str(rounds),
               "--ways", *ways, *extra] + (["--max-params", str(max_params)] if max_params else [])
        err = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=_env(profile), cwd=_scratch())
        q: queue.Queue = queue.Queue()
        threading.Thread(target=_lines, args=(proc, q), daemon=True).start()
        partial, t0, why = {}, time.perf_counter(), None
        while True:
            try:
                line = q.get(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
            except queue.Empty:
                proc.kill()
                why = f"Timeout: the model ran over {timeout:.0f} s"
                break
            if line is None:
                proc.wait()
                err.seek(0)
                why = _tail(err.read()) or f"exit code {proc.returncode}"
                break
            if line.startswith("ZOO_WAY "):
                way, _, row = line[len("ZOO_WAY "):].partition(" ")
                partial[way] = json.loads(row)
                partial[way].pop("model", None)
            elif line.startswith("ZOO_RESULT "):
                row = json.loads(line[len("ZOO_RESULT "):])
                row["process_s"] = round(time.perf_counter() - t0, 1)
                yield row.pop("model"), row
                pending.pop(0)
                partial, t0 = {}, time.perf_counter()
        proc.wait()
        if pending:
            name = pending.pop(0)
            yield name, _broken(name, partial, ways, why, time.perf_counter() - t0)


def _broken(name: str, partial: dict, ways: list[str], why: str | None, sec: float) -> dict:
    row = {"source": registry_source(name), "runs": partial, "process_s": round(sec, 1)}
    for way in ways:
        if way not in partial:
            partial[way] = {"finished": False, "error": why or "no result", "where": []}
            break
    return row


def run_child(name: str, steps: int, ways: list[str], profile: str, timeout: float, rounds: int = 1,
              max_params: float | None = None) -> dict:
    """One model in a fresh process."""
    return next(run_chunk([name], steps, ways, profile, timeout, rounds, max_params))[1]


def _tail(text: str) -> str:
    lines = [ln for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1][:400] if lines else ""


def _scratch() -> str:
    return tempfile.mkdtemp(prefix="zoo-run-")


_SOURCE_OF: dict[str, str] = {}


def registry_source(name: str) -> str:
    return _SOURCE_OF.get(name, "?")


def out_path(out_dir: Path, stem: str, profile: str) -> Path:
    return out_dir / (f"{stem}.json" if profile == "host" else f"{stem}_{profile}.json")


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def sweep(names: list[str], args, profile: str, command: str) -> dict:
    """Run `names` under `profile`, writing the JSON after every model (a stopped sweep keeps what it ran)."""
    path = out_path(Path(args.out_dir), args.name, profile)
    data = load(path) if args.resume else {}
    models, plain_fails = data.get("models", {}), data.get("plain_fails", {})
    swept = set(_SOURCE_OF.values())
    for kept in (models, plain_fails):  # a model the zoo no longer holds (of the sources swept) leaves the file
        for gone in [n for n in kept if n not in _SOURCE_OF and kept[n].get("source") in swept]:
            del kept[gone]
    meta = dict(zoo_report.provenance(profile, args.steps, command), max_params=args.max_params, rounds=args.rounds,
                min_seconds=args.min_seconds, max_rounds=args.max_rounds, statistic="median of interleaved rounds",
                min_run_s=args.min_run_s, max_steps=args.max_steps,
                per_process=args.per_process, omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", OMP_WAIT_POLICY))
    named = set(args.models or ())  # a model named in --models runs again, whatever the file holds
    todo = [n for n in names if n in named or not (args.resume and (n in models or n in plain_fails)
                                                   and not _failed(models.get(n)))]
    data = dict(meta, models=models, plain_fails=plain_fails)
    chunks = [todo[i:i + args.per_process] for i in range(0, len(todo), args.per_process)]
    done = len(names) - len(todo)
    extra = ("--min-seconds", str(args.min_seconds), "--max-rounds", str(args.max_rounds),
             "--min-run-s", str(args.min_run_s), "--max-steps", str(args.max_steps))
    for chunk in chunks:
        for name, row in run_chunk(chunk, args.steps, args.ways, profile, args.timeout, args.rounds, args.max_params,
                                   extra):
            done += 1
            plain = row["runs"].get("plain", {})
            models.pop(name, None)
            plain_fails.pop(name, None)
            if plain.get("finished"):
                models[name] = row
            else:
                plain_fails[name] = {"source": row.get("source"), "reason": plain.get("error"),
                                     "where": plain.get("where")}
            print(zoo_report.line(done, len(names), profile, name, row), flush=True)
            data = dict(meta, models=models, plain_fails=plain_fails,
                        summary=zoo_report.summarize(models, plain_fails))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(data, indent=1, default=str))
    return data


def _failed(row: dict | None) -> bool:
    return bool(row) and any(not r.get("finished") for r in row["runs"].values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sources", nargs="+", default=list(SOURCES), choices=SOURCES)
    ap.add_argument("--models", nargs="+", help="run only the models whose name contains one of these")
    ap.add_argument("--sample", type=int, help="a quick subset of N models, spread over the sources")
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed")
    ap.add_argument("--steps", type=int, default=20, help="K: steps in each run")
    ap.add_argument("--per-process", type=int, default=1,
                    help="models run one after another in one process (1: a fresh process each)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time each run at least this many times, the order alternating; the median counts")
    ap.add_argument("--min-seconds", type=float, default=0.0,
                    help="more rounds (up to --max-rounds) until each way of a model is timed this long in all")
    ap.add_argument("--max-rounds", type=int, default=15)
    ap.add_argument("--min-run-s", type=float, default=0.0,
                    help="a model whose K-step plain run is shorter trains more steps, up to --max-steps")
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--max-params", type=float, help="list a model with more parameters apart, untrained")
    ap.add_argument("--profiles", nargs="+", default=["host"], choices=PROFILES)
    ap.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    ap.add_argument("--out-dir", default=str(DEFAULT_OUT))
    ap.add_argument("--name", default="zoo", help="file stem: <out-dir>/<name>.json, <name>_<profile>.json")
    ap.add_argument("--timeout", type=float, default=900, help="seconds for one model's process")
    ap.add_argument("--resume", action="store_true", help="keep the models already in the JSON; rerun failed ones")
    ap.add_argument("--docs", default=str(HERE.parent / "docs" / "zoo.md"), help="the table to write ('' for none)")
    ap.add_argument("--report-only", action="store_true", help="write the docs table from the JSON files, run nothing")
    ap.add_argument("--later", nargs="*", default=[], help="JSON files of later sweeps: a row each in the docs")
    ap.add_argument("--list", action="store_true", help="print the selected models and stop")
    args = ap.parse_args()
    command = "python benchmarks/bench_zoo.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    reg = registry(tuple(args.sources))
    by_source: dict[str, list[str]] = {}
    for n, c in reg.items():
        by_source.setdefault(c.source, []).append(n)
        _SOURCE_OF[n] = c.source
    names = select(by_source, args.models, args.sample, args.seed)
    if args.list:
        print("\n".join(names), f"\n{len(names)} models", sep="")
        return
    paths = [out_path(Path(args.out_dir), args.name, p) for p in args.profiles]
    if not args.report_only:
        for profile in args.profiles:
            data = sweep(names, args, profile, command)
            print(zoo_report.summary_text(profile, data["summary"]), flush=True)
    if args.report_only:  # the summary in each file, counted again by this code
        for path in (p for p in paths if p.exists()):
            data = load(path)
            data["summary"] = zoo_report.summarize(data["models"], data.get("plain_fails", {}))
            path.write_text(json.dumps(data, indent=1, default=str))
            print(zoo_report.summary_text(data["profile"], data["summary"]))
    if args.docs:
        zoo_report.write_docs(paths, Path(args.docs), [Path(p) for p in args.later])
        print(f"wrote {args.docs}")


if __name__ == "__main__":
    main()
