"""The script's own options come first in a fix: read from its argparse definitions (an AST scan), on gallery
scripts that define `--amp`, `-j/--workers`, `--compile`, `--channels-last`. Observations are synthetic."""

import copy
from pathlib import Path

from torchspeed.doctor import report_from_observation
from torchspeed.doctor._script_options import script_options

from test_rules import BF16_CPU, CLEAN, TRIGGERS

SCRIPTS = Path(__file__).parent / "scripts"
FLAGS = SCRIPTS / "flags_reference.py"


def _obs(script, *rules, argv=()):
    o = copy.deepcopy(CLEAN)
    for rid in rules:
        for m in TRIGGERS[rid]:
            m(o)
    o.update(script=str(script), argv=list(argv), env=BF16_CPU)  # a CPU where autocast is the advice
    return o


def test_options_are_read_from_add_argument_calls():
    opts = script_options(FLAGS.read_text())
    assert {k: (o.flags, o.takes_value) for k, o in opts.items()} == {
        "workers": (("-j", "--workers"), True), "amp": (("--amp",), False), "compile": (("--compile",), False),
        "channels_last": (("--channels-last",), False)}
    assert script_options("import argparse\np = argparse.ArgumentParser()\np.add_argument('--lr')\n") == {}
    assert script_options("def broken(:\n") == {}


def test_the_scripts_own_option_is_the_first_fix():
    r = report_from_observation(_obs(FLAGS, "no-amp", "channels-last", "dataloader-workers", "elementwise-bound"))
    fixes = {f.rule: f.fix for f in r.findings} | {a.rule: a.fix for f in r.findings for a in f.also}
    assert fixes["no-amp"].startswith("the script's own option (add_argument at line 18) offers it: "
                                      "`python flags_reference.py --amp`; or: with torch.autocast(")
    assert fixes["channels-last"].startswith("the script's own option (add_argument at line 20) offers it: "
                                             "`python flags_reference.py --channels-last`")
    assert "`python flags_reference.py --workers 2`; or: DataLoader(" in fixes["dataloader-workers"]
    assert "`python flags_reference.py --compile`" in fixes["elementwise-bound"]
    # an option already given is not suggested again; a value option is replaced, not repeated
    r = report_from_observation(_obs(FLAGS, "no-amp", "dataloader-workers", argv=("--amp", "-j", "0", "--epochs", "1")))
    assert not r.finding("no-amp").fix.startswith("the script's own option")
    assert "`python flags_reference.py --amp --epochs 1 --workers 2`" in r.finding("dataloader-workers").fix
    # without such options (or without the script file) the fix is the rule's own
    plain = report_from_observation(_obs(SCRIPTS / "clean_cnn.py", "channels-last"))
    assert not plain.finding("channels-last").fix.startswith("the script's own option")
    # where the advice is to keep fp32 (no fast bf16 here), --amp is not offered
    slow = _obs(FLAGS, "no-amp")
    slow["env"] = CLEAN["env"]
    assert report_from_observation(slow).finding("no-amp").fix.startswith("keep fp32")


def test_an_amp_option_that_only_turns_on_cuda_autocast_is_not_offered_on_a_cpu():
    # the reference form: --amp enables torch.cuda.amp.autocast, which does nothing on a CPU
    r = report_from_observation(_obs(SCRIPTS / "amp_flag_reference.py", "no-amp"))
    f = r.finding("no-amp")
    assert not f.fix.startswith("the script's own option")
    assert "the script's --amp" in f.fix and "turns on CUDA autocast only" in f.fix
