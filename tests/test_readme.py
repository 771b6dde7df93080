"""The README leads with the answer: at most 120 lines, and every figure in its table is the one in the suite's JSON
for the machine it names; the other tables of that machine (docs/results.md) are their JSON too."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RESULTS_MD = (ROOT / "docs" / "results.md").read_text()
RESULTS = ROOT / "benchmarks" / "results" / "cpu-avx512-bf16"


def _table(name: str, text: str = README, kind: str = "readme") -> list[list[str]]:
    block = text.split(f"<!-- {kind}-table: {name} -->")[1].split(f"<!-- /{kind}-table -->")[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in block.strip().splitlines()]
    return rows[2:]  # after the header and its rule


def test_the_readme_is_short_and_names_the_machine_its_tables_come_from():
    assert len(README.splitlines()) <= 120
    prov = json.loads((RESULTS / "suite.json").read_text())["provenance"]
    assert prov["cpu"] in README and prov["cpu_flags"]["avx512_bf16"] and "AVX512-BF16" in README
    assert prov["torch"].split("+")[0] in README
    assert README.count("-table: ") == 1, "the README has one table of figures: the suite's"


@pytest.mark.parametrize("kind", ["cpu-avx512-bf16", "cpu-avx2"])
def test_the_time_to_target_table_is_the_results_json(kind):
    name = "time_to_target" if kind == RESULTS.name else "time_to_target_" + kind.removeprefix("cpu-").replace("-", "_")
    rows = _table(name, RESULTS_MD, "results")
    assert [r[0] for r in rows] == ["0.97", "0.90"]
    for row in rows:
        data = json.loads((RESULTS.parent / kind / f"time_to_target_0{row[0][2:]}_fit.json").read_text())
        for cell, config in zip(row[1:5], ("naive", "all", "auto", "schedulefree")):
            c = data["configs"][config]
            assert cell == f"{c['budget_steps']} steps, {c['median_total_s']:.2f} s", (row[0], config)
        assert row[5] == f"{data['ratios']['auto_vs_naive']:.2f}x" and row[6] == f"{data['ratios']['auto_vs_all']:.2f}x"


@pytest.mark.parametrize("kind", ["cpu-avx512-bf16", "cpu-amx", "cpu-avx2"])
def test_the_plain_loop_table_is_the_results_json(kind):
    data = json.loads((RESULTS.parent / kind / "plain_loop.json").read_text())["workloads"]
    name = "plain_loop" if kind == RESULTS.name else "plain_loop_" + kind.removeprefix("cpu-").replace("-", "_")
    rows = _table(name, RESULTS_MD, "results")
    assert [r[0] for r in rows] == list(data)
    for model, step, vs_plain, vs_loader in rows:
        w = data[model]
        assert step == f"{w['step_ms_plain']:.2f} ms"
        assert vs_plain == f"{w['fit_speed_vs_plain']['speedup']:.2f}x"
        assert vs_loader == f"{w['fit_speed_vs_plain_loader']['speedup']:.2f}x"


def test_every_doc_the_readme_points_at_exists():
    for doc in set(re.findall(r"`(docs/[a-z_]+\.md)`", README)):
        assert (ROOT / doc).exists(), doc


def _check_suite_table(data: dict, text: str, kind: str, name: str) -> None:
    header = text.split(f"<!-- {kind}-table: {name} -->")[1].strip().splitlines()[0]
    assert [c.strip() for c in header.strip().strip("|").split("|")][1:] == data["rows"]
    rows = _table(name, text, kind)
    assert [r[0] for r in rows] == [*data["workloads"], "speed vs naive", "targets reached"]
    for row in rows[:-2]:
        for cell, row_name in zip(row[1:], data["rows"], strict=True):
            secs = data["table"][row[0]][row_name]
            assert cell == ("missed" if secs is None else f"{secs:.2f} s"), (row[0], row_name)
    score, n = data["score"], len(data["workloads"])
    assert rows[-2][1:] == [f"{score['geomean_vs_naive'][r]:.2f}x" for r in data["rows"]]
    assert rows[-1][1:] == [f"{score['targets_reached'][r]}/{n}" for r in data["rows"]]


def test_the_suite_table_is_the_suites_json():
    data = json.loads((RESULTS / "suite.json").read_text())
    prov = data["provenance"]
    assert prov["cpu"] in README and prov["cpu_flags"]["avx512_bf16"] and prov["torch"].split("+")[0] in README
    _check_suite_table(data, README, "readme", "suite")


@pytest.mark.parametrize("kind", ["cpu-amx", "cpu-avx2"])
def test_each_machines_suite_table_in_the_results_page_is_its_json(kind):
    data = json.loads((RESULTS.parent / kind / "suite.json").read_text())
    name = "suite_" + kind.removeprefix("cpu-").replace("-", "_")
    _check_suite_table(data, RESULTS_MD, "results", name)
    section = RESULTS_MD.split(f"<!-- results-table: {name} -->")[0].rsplit("\n## ", 1)[1]
    assert data["provenance"]["commit"][:7] in section and data["provenance"]["time"][:10] in section
