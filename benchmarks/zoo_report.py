"""The zoo's numbers: provenance, the summary a sweep's JSON carries, one progress line a model, docs/zoo.md."""

from __future__ import annotations

import json
import math
from pathlib import Path

FIT_FLOOR = 0.97  # fit as ported at this share of the plain loop's speed or more counts as "not slower"


def provenance(profile: str, steps: int, command: str) -> dict:
    from torchspeed.bench.runner import provenance as base

    meta = base()
    versions = {"torch": meta.pop("torch"), "torchvision": meta.pop("torchvision"), "python": meta.pop("python")}
    for mod in ("timm", "transformers"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            versions[mod] = None
    return {"commit": meta.pop("commit"), "versions": versions, "device": meta.pop("device"), "cpu": meta.pop("cpu"),
            "profile": profile, "K": steps, "command": command, "host": meta}


def _geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def _share(k: int, n: int) -> float | None:
    return round(k / n, 3) if n else None


def reaches(run: dict, plain: dict) -> bool:
    """auto reached the plain loop's K-step loss no slower. A sweep that recorded auto's loss curve
    (`reach_vs_plain`): its training loss, averaged over a tenth of the run, fell to the loop's last tenth's
    average in no more seconds than the loop's whole run took (the median round). An older sweep's: its K-step
    loss at most the loop's, in a run no slower."""
    if not run.get("finished"):
        return False
    if "reach_seconds" in run:
        return (run.get("reach_vs_plain") or 0.0) >= 1.0
    return run["loss"] <= plain["loss"] and run["vs_plain"] >= 1.0


def way_summary(models: dict, way: str) -> dict:
    rows = {n: m["runs"][way] for n, m in models.items() if way in m["runs"]}
    done = {n: r for n, r in rows.items() if r.get("finished")}
    ratios = [r["vs_plain"] for r in done.values()]
    kept = {n: r for n, r in done.items() if r.get("kept_plain")}
    out = {"runs": len(rows), "errors": len(rows) - len(done),
           "error_models": sorted(n for n in rows if n not in done),
           "geomean_vs_plain": _geomean(ratios),
           "share_at_least_0.97": _share(sum(x >= FIT_FLOOR for x in ratios), len(rows)),
           "share_at_least_1.0": _share(sum(x >= 1.0 for x in ratios), len(rows)),
           "kept_plain": len(kept),
           "kept_plain_loss_equal": sum(bool(r.get("loss_equal")) for r in kept.values()),
           "kept_plain_loss_differs": sorted(n for n, r in kept.items() if not r.get("loss_equal")),
           "slower_than_0.97": sorted(n for n, r in done.items() if r["vs_plain"] < FIT_FLOOR)}
    if way == "auto":
        hit = [n for n, r in done.items() if reaches(r, models[n]["runs"]["plain"])]
        out["share_reaches_plain_loss_no_slower"] = _share(len(hit), len(rows))
        out["share_loss_no_worse"] = _share(sum(r["loss"] <= models[n]["runs"]["plain"]["loss"]
                                                for n, r in done.items()), len(rows))
        learn = [n for n in rows if models[n].get("data") == "learnable"]
        if learn:  # a sweep on batches a model can learn from (the curve's sweeps): the share on those
            out["learnable_runs"] = len(learn)
            out["share_reaches_learnable"] = _share(sum(n in hit for n in learn), len(learn))
            out["reach_geomean_learnable"] = _geomean([done[n].get("reach_vs_plain") for n in learn if n in done])
            out["never_reached"] = sorted(n for n in learn if n in done and done[n].get("reach_seconds") is None)
            out["missed"] = sorted(n for n in learn if n not in hit)
    return out


def summarize(models: dict, plain_fails: dict) -> dict:
    """The sweep's counts: errors where the plain loop trains, fit's speed shares and geometric mean, auto's reach."""
    loads = sorted(x for m in models.values() for x in m.get("load", []))
    out = {"models": len(models) + len(plain_fails), "plain_trains": len(models), "plain_fails": len(plain_fails),
           "load_median": loads[len(loads) // 2] if loads else None,
           "fit": way_summary(models, "fit"), "auto": way_summary(models, "auto"), "by_source": {}}
    for src in sorted({m["source"] for m in models.values()}):
        sub = {n: m for n, m in models.items() if m["source"] == src}
        f, a = way_summary(sub, "fit"), way_summary(sub, "auto")
        out["by_source"][src] = {"models": len(sub), "fit_errors": f["errors"], "auto_errors": a["errors"],
                                 "fit_geomean": f["geomean_vs_plain"], "fit_share_0.97": f["share_at_least_0.97"],
                                 "auto_reaches": a.get("share_reaches_plain_loss_no_slower")}
    return out


def _cell(run: dict | None, plain: dict | None = None) -> str:
    if run is None:
        return "-"
    if not run.get("finished"):
        return "**error**"
    cell = f"{run['vs_plain']:.2f}x"
    if plain is not None and "loss" in run:
        cell += " =" if run.get("loss_equal") else (" <" if run["loss"] < plain["loss"] else " >")
    return cell


def _setting(run: dict | None) -> str:
    s = (run or {}).get("settings") or {}
    if not s:
        return ""
    parts = [str(s.get("precision", ""))]
    if s.get("channels_last"):
        parts.append("CL")
    if s.get("compile"):
        parts.append("compiled")
    return "+".join(p for p in parts if p)


def line(i: int, n: int, profile: str, name: str, row: dict) -> str:
    runs = row["runs"]
    plain = runs.get("plain", {})
    head = f"[{i}/{n}] {profile} {name}:"
    if not plain.get("finished"):
        return f"{head} plain loop fails: {plain.get('error')}"
    parts = [f"plain {plain['seconds']:.2f}s loss {plain['loss']:.4g}"]
    for way in ("fit", "auto"):
        r = runs.get(way)
        if r is None:
            continue
        parts.append(f"{way} {r['vs_plain']:.2f}x {_setting(r)} loss {r['loss']:.4g}" if r.get("finished")
                     else f"{way} ERROR {r.get('error')}")
        if r.get("finished") and "reach_seconds" in r:
            parts[-1] += (" never reached the loop's loss" if r["reach_seconds"] is None else
                          f" reached the loop's loss {r['reach_vs_plain']:.2f}x" +
                          (f" (step {r['reach_step']})" if r.get("reach_step") is not None else ""))
    return f"{head} " + "; ".join(parts) + f" ({row.get('process_s', 0):.0f}s)"


def summary_text(profile: str, s: dict) -> str:
    f, a = s["fit"], s["auto"]
    g = f["geomean_vs_plain"]
    return (f"{profile}: {s['plain_trains']} models the plain loop trains ({s['plain_fails']} it cannot); "
            f"fit errors {f['errors']}, auto errors {a['errors']}; fit >= 0.97x plain on {f['share_at_least_0.97']}, "
            f"geomean {g if g is None else round(g, 3)}; kept plain settings {f['kept_plain']}, loss equal on "
            f"{f['kept_plain_loss_equal']}; auto reaches plain's loss no slower on "
            f"{a.get('share_reaches_plain_loss_no_slower')}")


def _fmt(x) -> str:
    if x is None:
        return "-"
    return f"{x:.0%}" if isinstance(x, float) and x <= 1.0 and not isinstance(x, bool) else str(x)


def _summary_table(datas: list[dict]) -> list[str]:
    rows = ["| profile | K | models (plain trains / cannot) | fit errors | auto errors | fit >= 0.97x plain | "
            "fit geomean | fit kept plain settings: loss equal | auto reaches plain's loss no slower |",
            "|---|---|---|---|---|---|---|---|---|"]
    for d in datas:
        s = d["summary"]
        f, a = s["fit"], s["auto"]
        g = f["geomean_vs_plain"]
        rows.append(f"| {d['profile']} | {d['K']} | {s['models']} ({s['plain_trains']} / {s['plain_fails']}) | "
                    f"{f['errors']} | {a['errors']} | {_fmt(f['share_at_least_0.97'])} | "
                    f"{'-' if g is None else f'{g:.3f}x'} | {f['kept_plain_loss_equal']} of {f['kept_plain']} | "
                    f"{_fmt(a.get('share_reaches_plain_loss_no_slower'))} |")
    return rows


def _errors(datas: list[dict]) -> list[str]:
    rows = ["| profile | model | run | error |", "|---|---|---|---|"]
    for d in datas:
        for name, m in sorted(d["models"].items()):
            for way in ("fit", "auto"):
                r = m["runs"].get(way)
                if r is not None and not r.get("finished"):
                    rows.append(f"| {d['profile']} | {name} | {way} | `{str(r.get('error'))[:160]}` |")
    return rows if len(rows) > 2 else ["None."]


def _plain_fails(datas: list[dict]) -> list[str]:
    rows = ["| profile | model | reason |", "|---|---|---|"]
    for d in datas:
        for name, f in sorted(d.get("plain_fails", {}).items()):
            rows.append(f"| {d['profile']} | {name} | `{str(f.get('reason'))[:160]}` |")
    return rows if len(rows) > 2 else ["None."]


def _per_model(datas: list[dict]) -> list[str]:
    first = datas[0]
    head = "| model | source | plain s | fit settings | " + " | ".join(
        f"fit {d['profile']} | auto {d['profile']}" for d in datas) + " |"
    rows = [head, "|" + "---|" * (4 + 2 * len(datas))]
    for name in sorted(first["models"]):
        m = first["models"][name]
        cells = []
        for d in datas:
            md = d["models"].get(name)
            plain = md["runs"]["plain"] if md else None
            cells += [_cell(md["runs"].get("fit") if md else None, plain),
                      _cell(md["runs"].get("auto") if md else None, plain)]
        rows.append(f"| {name} | {m['source']} | {m['runs']['plain']['seconds']:.2f} | "
                    f"{_setting(m['runs'].get('fit'))} | " + " | ".join(cells) + " |")
    return rows


def _later_table(later: list[tuple[Path, dict]]) -> list[str]:
    """One row a later sweep (its own JSON, often the plain and fit ways alone, more rounds): what it measured."""
    if not later:
        return []
    rows = ["Sweeps run after the one above, each its own JSON (the ways it ran have figures, the others `-`; a "
            "way's time is its fastest round, or the median of its rounds where the rounds cell says so: those sweeps "
            "alternate the order of the ways round by round, and give a short run more rounds). Each is counted "
            "again by this code. K: the steps of each run; `12-400, >= 1 s`: a model whose 12-step plain run is shorter "
            "than 1 s trains more steps, up to 400 (`--min-run-s`, `--max-steps`).", "",
            "| JSON | profile | commit | K | rounds | models trained | fit errors | fit >= 0.97x plain | fit geomean | "
            "loss equal (kept plain) | auto errors | auto reaches plain's loss no slower | load (median) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for path, d in later:
        s, f, a = d["summary"], d["summary"]["fit"], d["summary"]["auto"]
        g = f["geomean_vs_plain"]
        rounds = d.get("rounds", 1)
        if d.get("statistic", "").startswith("median"):
            rounds = f"{rounds}-{d['max_rounds']}, median" if d.get("min_seconds") else f"{rounds}, median"
        fit = (f"{f['errors']} | {_fmt(f['share_at_least_0.97'])} | {'-' if g is None else f'{g:.3f}x'} | "
               f"{f['kept_plain_loss_equal']} of {f['kept_plain']}") if f["runs"] else "- | - | - | -"
        auto = f"{a['errors']} | {_reach_cell(a)}" if a["runs"] else "- | -"
        k = f"{d['K']}-{d['max_steps']}, >= {d['min_run_s']:g} s" if d.get("min_run_s") else d.get("K", "-")
        rows.append(f"| `{path.name}` | {d['profile']} | `{str(d['commit'])[:7]}` | {k} | {rounds} | "
                    f"{s['plain_trains']} | {fit} | {auto} | {s['load_median']} |")
    return ["## Later sweeps", "", *rows, ""]


def _reach_cell(a: dict) -> str:
    cell = _fmt(a["share_reaches_plain_loss_no_slower"])
    if a.get("learnable_runs"):
        g = a.get("reach_geomean_learnable")
        cell += (f" (curve; learnable data: {_fmt(a['share_reaches_learnable'])} of {a['learnable_runs']}, "
                 f"geomean {'-' if g is None else f'{g:.2f}x'})")
    return cell


def _auto_misses(later: list[tuple[Path, dict]]) -> list[str]:
    """The latest curve sweep's auto rows where it did not reach the loop's loss no slower, what it chose: the host
    CPU's where one ran there, else the latest emulated profile's."""
    curve = [(p, d) for p, d in later if d["summary"]["auto"].get("learnable_runs")]
    if not curve:
        return []
    path, d = ([(p, d) for p, d in curve if d.get("profile") == "host"] or curve)[-1]
    rows = [f"From `{path.name}`: each model whose batches are learnable where `fit(recipe=\"auto\")` did not "
            "reach the plain loop's training loss (last tenth's average) in the loop's time: when it got there "
            "(seconds, step of the run), its whole run against the loop's, and what it chose.", "",
            "| model | steps | reached at | reach vs plain | whole run vs plain | optimizer | lr | precision |",
            "|---|---|---|---|---|---|---|---|"]
    for n in d["summary"]["auto"]["missed"]:
        r = d["models"][n]["runs"].get("auto", {})
        if not r.get("finished"):
            rows.append(f"| {n} | {d['models'][n].get('steps')} | error | - | - | - | - | - |")
            continue
        s = r.get("settings") or {}
        at = "never" if r.get("reach_seconds") is None else f"{r['reach_seconds']:.2f} s" + (
            f", step {r['reach_step']}" if r.get("reach_step") is not None else "")  # the step: the first round's
        rv = "-" if r.get("reach_vs_plain") is None else f"{r['reach_vs_plain']:.2f}x"
        lr = s.get("lr")
        rows.append(f"| {n} | {d['models'][n].get('steps')} | {at} | {rv} | {r['vs_plain']:.2f}x | "
                    f"{s.get('optimizer')} | {lr if not isinstance(lr, float) else f'{lr:.3g}'} | "
                    f"{_setting(r)} |")
    return ["## Where auto did not reach the plain loop's loss no slower", "", *rows, ""]


def write_docs(paths: list[Path], doc: Path, later: list[Path] = ()) -> None:
    """docs/zoo.md from the sweep's JSON files (`paths`, one a profile) and the later sweeps' (`later`)."""
    datas = [json.loads(p.read_text()) for p in paths if p.exists()]
    extra = [(p, json.loads(p.read_text())) for p in later if p.exists()]
    for _, d in extra:
        d["summary"] = summarize(d["models"], d.get("plain_fails", {}))
    if not datas:
        return
    for d in datas:  # the summary as this code counts it, whatever wrote the file
        d["summary"] = summarize(d["models"], d.get("plain_fails", {}))
    d0 = datas[0]
    v = d0["versions"]
    text = [
        "# The model zoo: every model under `fit`, three ways",
        "",
        "<!-- generated by benchmarks/bench_zoo.py (zoo_report.write_docs) from its JSON: do not edit by hand -->",
        "",
        "`benchmarks/bench_zoo.py` trains each model of the zoo for K steps three ways, each model in its own "
        "process: the plain loop (forward, loss, backward, `optimizer.step()`, `zero_grad()`), `fit` as ported "
        "(the loop's own optimizer object and LR) and `fit(recipe=\"auto\")`, on the same batches from the same "
        "seeds, the switch trial live (an empty decision cache each run). Every model is randomly initialised; "
        "nothing is downloaded. The sources: every torchvision classification model at a small input and "
        "detection and segmentation models (`benchmarks/zoo_torchvision.py`), one small timm model per family "
        "(`zoo_timm.py`), Hugging Face architectures from small configs fed dict batches (`zoo_hf.py`), and the "
        "hand-written forms people train (`zoo_hand.py`).",
        "",
        "- **vs plain**: the plain loop's whole-run seconds over the run's (above 1: faster than the loop). "
        "Timed once a run, after a 2-step warm-up of each way on a throwaway model, on shared cores: single "
        "ratios are noisy; the counts of errors and of equal losses are not.",
        "- **loss**: the loss on the first batch after the K steps (train mode, no grad, seeded), computed by the "
        "plain loop's own loss function for every way. `=` equal to the plain loop's to the last bit, `<` lower, "
        "`>` higher.",
        "- **auto reaches plain's loss no slower**: on the sweeps marked `curve`, `fit(recipe=\"auto\")` records its "
        "loss at every step (`log_every=1`, free on a CPU); it counts where its training loss, averaged over a "
        "tenth of the run, fell to the plain loop's average over its last tenth (both see the same batches in the "
        "same order) in no more seconds than the loop's whole run, its choosing and trial included (the median of "
        "the rounds; a round that never got there counts as infinitely slow). Those sweeps feed batches a model "
        "can learn from (an image its class's fixed prototype under unit noise, tokens a fixed successor table "
        "with 10% noise: `zoo_cases.py`); the share is also given over those alone, with the geometric mean of "
        "the loop's seconds over auto's seconds to that loss. A few hand-written forms draw their own batches at "
        "random (nothing to learn: a loss there is noise's). Older sweeps fed random labels and counted auto's "
        "K-step loss at most the loop's in a run no slower.",
        "- **load**: the machine's 1-minute load average (2 cores) at each model's start and end, median over the "
        "sweep: " + ", ".join(f"{d['profile']} {d['summary']['load_median']}" for d in datas) + ". Above 2, other "
        "work shared the cores and the ratios measure it as much as `fit`.",
        "- **rechecked**: a sweep's 3 rounds of a 12-step run of a large model move by 10-20% on 2 busy cores, so "
        "where a sweep read `fit` under 0.97x, `benchmarks/bench_zoo_recheck.py` re-runs that model in its own "
        "process, 9 interleaved rounds, and gives the ratio with its 95% bootstrap interval: `slower` only where "
        "the whole interval lies under 0.97 (docs/results.md, `zoo_recheck_*.json`).",
        "",
        "Produced by " + "; ".join(f"`{d['command']}` at commit `{str(d['commit'])[:7]}` ({d['profile']})"
                                   for d in datas) + f" on {d0['cpu']} "
        f"(torch {v['torch']}, torchvision {v['torchvision']}, timm {v.get('timm')}, transformers "
        f"{v.get('transformers')}); JSON: " + ", ".join(f"`{p.as_posix().split('benchmarks/', 1)[-1]}`"
                                                         for p in paths if p.exists()) + " under `benchmarks/`.",
        "",
        "## Summary", "", *_summary_table(datas), "", *_later_table(extra),
        *_auto_misses(extra),
        "## Runs that ended in an error where the plain loop trains", "", *_errors(datas), "",
        "## Models left out: the plain loop cannot train them here, or over the sweep's size limit", "",
        "A `SizeLimit` model was not trained at all (`--max-params`: on 2 shared cores its runs would take "
        "longer than the sweep's time for it); the others failed in the plain loop itself.", "",
        *_plain_fails(datas), "",
        "## Every model", "",
        "fit settings: what `fit` as ported chose on the first profile (precision, `CL` channels_last).", "",
        *_per_model(datas), "",
    ]
    doc.write_text("\n".join(text))
