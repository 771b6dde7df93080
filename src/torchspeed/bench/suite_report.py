"""The suite's result shown and kept: `print_suite`, its table (each row's median seconds to target, its time
relative to the fastest row, the geometric-mean speed against naive, the targets reached and the profile score,
as AlgoPerf scores them), and `write_suite`, the JSON and the performance profile's PNG.

It implements no technique of its own: `bench/suite_run.py` runs the suite and scores it; this module reads
the result it returns.
"""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table

from torchspeed._extras import MissingExtraError
from torchspeed._io import write_json
from torchspeed.bench.suite import plot_profile

__all__ = ["print_suite", "write_suite"]


def print_suite(console: Console, result: dict) -> None:
    """The suite table: per workload each row's median seconds to target and its time relative to the fastest
    row there (with the seeds that reached it, where not all did); then the geometric-mean speed against naive,
    the targets reached and the profile score."""
    rows, sc = result["rows"], result["score"]
    table = Table(title="time to target (median over seeds " + ", ".join(map(str, result["seeds"])) + "), choosing "
                        "counted, every fit row from an empty cache but auto_warm; x: over the fastest row")
    table.add_column("workload")
    table.add_column("target")
    for r in rows:
        table.add_column(r, justify="right", style="bold" if r == "auto" else None, no_wrap=True)
    for name, w in result["workloads"].items():
        cells = []
        for r in rows:
            secs, rel, entry = result["table"][name][r], sc["relative"][name][r], w["rows"][r]
            hits = "" if entry["reached"] == entry["seeds"] else f" ({entry['reached']}/{entry['seeds']})"
            cells.append("missed" + hits if secs is None else f"{secs:.2f} s {rel:.2f}x{hits}")
        table.add_row(name, f"{w['metric'][4:]} {'>=' if w['metric'] == 'val_acc' else '<='} {w['target']:g}", *cells)
    table.add_section()
    geo = sc["geomean_vs_naive"]
    table.add_row("speed vs naive", "geo. mean", *["-" if geo.get(r) is None else f"{geo[r]:.2f}x" for r in rows])
    table.add_row("targets reached", "", *[f"{sc['targets_reached'][r]}/{len(result['workloads'])}" for r in rows])
    table.add_row("profile score", "tau 1-4", *[f"{sc['profile_score'][r]:.2f}" for r in rows])
    if not console.is_terminal:  # a log or a pipe: the table at its full width, not folded into 80 columns
        console.width = max(console.width, 40 + 21 * len(rows))
    console.print(table)
    for note in _notes(result):
        console.print(note)

def _notes(result: dict) -> list[str]:
    out = []
    if result["rows_left_out"]:
        out.append(f"left out: {', '.join(result['rows_left_out'])} (pip install 'torchspeed[schedulefree]')")
    for gap in result.get("left_out", []):
        out.append(f"left out for time: seed {gap['seed']} of {', '.join(gap['workloads'])}")
    capped = sorted({f"{n}/{r}" for n, w in result["workloads"].items() for r, e in w["rows"].items()
                     if any(x["stopped"] == "time cap" for x in e["runs"])})
    if capped:
        out.append(f"stopped at the time cap (a miss): {', '.join(capped)}")
    return out

def write_suite(result: dict, json_path: str | os.PathLike, png_path: str | os.PathLike | None) -> str | None:
    """Write the JSON, and the performance profile to `png_path`; returns a note where the PNG was skipped."""
    write_json(json_path, result)
    if not png_path:
        return None
    try:
        plot_profile(result["score"]["profile"], png_path, title="performance profile: the suite's time to target")
    except MissingExtraError as e:
        return f"no PNG: {e}"
    return None
