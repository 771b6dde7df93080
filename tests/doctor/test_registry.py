"""Registration alone defines the rule set, its order and the fix table; a new rule is one file.

A throwaway rule is written to a temporary folder appended to the rules package's `__path__`: it is
loaded, ordered by its priority, run by `run_rules`, and nothing else in the source tree names it.
"""

import sys
import textwrap
from pathlib import Path

import pytest

import torchspeed
import torchspeed.doctor.rules as rules_pkg
from torchspeed.cli.main import main
from torchspeed.doctor import RULES, rule_ids, run_rules
from torchspeed.doctor.registry import RuleError, fix_rules, load_rules, register
from torchspeed.doctor.verify import IMPLEMENTED

SRC = Path(torchspeed.__file__).parent
SCRIPTS = Path(__file__).parent / "scripts"

THROWAWAY = '''
"""`throwaway-check`: a rule that exists only in this test."""
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import finding


@register("throwaway-check", priority=1, techniques=("T02",), summary="fires on obs['throwaway']")
def check(obs):
    if not obs.get("throwaway"):
        return None
    return finding("throwaway-check", evidence="planted", fix="remove it", est_gain=1.5, obs=obs)
'''


@pytest.fixture
def extra_rules_folder(tmp_path):
    """A folder appended to the rules package's path; everything loaded from it is removed afterwards."""
    before_rules, before_mods = dict(RULES), set(sys.modules)
    rules_pkg.__path__.append(str(tmp_path))
    try:
        yield tmp_path
    finally:
        rules_pkg.__path__.remove(str(tmp_path))
        RULES.clear()
        RULES.update(before_rules)
        for name in set(sys.modules) - before_mods:
            del sys.modules[name]


def test_a_new_rule_is_one_file(extra_rules_folder):
    (extra_rules_folder / "throwaway_check.py").write_text(textwrap.dedent(THROWAWAY))
    ids = rule_ids()
    assert ids[0] == "throwaway-check"  # priority 1: first of the ties
    found = run_rules({"throwaway": True, "notes": []})
    assert [f.rule for f in found] == ["throwaway-check"] and found[0].est_gain == 1.5
    # the files a new rule needs in the source tree: its own, and nothing else names it
    naming = [p for p in SRC.rglob("*.py") if "throwaway-check" in p.read_text()]
    assert naming == []  # no list of IDs, counts or fixes to keep in step anywhere under src/
    needed = [p for p in extra_rules_folder.glob("*.py")]
    assert [p.name for p in needed] == ["throwaway_check.py"]


def test_a_rule_file_that_registers_nothing_is_an_error(extra_rules_folder):
    (extra_rules_folder / "forgotten.py").write_text("def check(obs):\n    return None\n")
    with pytest.raises(RuleError, match=r"forgotten\.py .* registers no rule"):
        load_rules()


def test_priorities_are_unique_and_ids_kebab_case():
    load_rules()
    with pytest.raises(RuleError, match="both have priority 10"):
        register("another-rule", priority=10, techniques=(), summary="x")(lambda obs: None)
    with pytest.raises(RuleError, match="kebab-case"):
        register("Bad_Name", priority=12345, techniques=(), summary="x")
    assert "another-rule" not in RULES


def test_one_table_of_fixes_declared_by_the_rules(capsys):
    table = fix_rules()
    assert set(table) == set(IMPLEMENTED)  # every fix a rule declares can be measured, and no other
    assert table["compile"] == ("elementwise-bound", "layout-copies") and "cpu-oversubscribed" in table["workers"]
    assert main(["doctor", str(SCRIPTS / "crashes.py"), "--verify", "--fixes", "warp_drive"]) == 2
    err = capsys.readouterr().err
    assert "warp_drive" in err and all(name in err for name in table)
