"""Every subcommand, given bad input, ends with one line `torchspeed <command>: error: ...` and exit code 2:
never a traceback. A new subcommand must add its case here (the first test checks the list is complete)."""

import pytest

from torchspeed.cli.main import COMMANDS, main
from torchspeed.data import make_jpeg_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_jpeg_folder(tmp_path_factory.mktemp("f"), n_per_class=4, classes=2, max_side=40, seed=0)


BAD = {  # command -> [(argv after the command, what the line must say)]
    "env": [(["--json=yes"], "argument --json: ignored explicit argument 'yes'")],
    "bench": [(["--model", "nosuch"], "--model nosuch: not one of"),
              (["--model", "nomod:make"], "no module named 'nomod'")],
    "launch": [(["--nproc", "abc", "--", "python", "x.py"], "--nproc must be a positive number")],
    "doctor": [(["{tmp}/missing.py"], "no such script")],
    "data": [(["pack", "{tmp}/nope", "{tmp}/p.tspack"], "not a directory"),
             (["bench", "{folder}", "--size", "huge"], "--size must be a number of pixels or auto")],
    "train": [(["--data", "{folder}", "--size", "abc"], "--size must be a number of pixels or auto"),
              (["--data", "{folder}", "--lr", "fast"], "--lr must be 1 number"),
              (["--data", "{folder}", "--crop-scale", "2,1"], "--crop-scale 2,1: need 0 < LO <= HI <= 1"),
              (["--data", "{folder}", "--betas", "0.9"], "--betas must be 2 numbers"),
              (["--data", "{folder}", "--init-from", "{tmp}/none.pt"], "--init-from {tmp}/none.pt does not exist"),
              (["--data", "{folder}", "--resume", "--init-from", "{folder}"], "pass one of them"),
              (["--data", "{folder}", "--model", "resnet_18", "--workers", "0", "--size", "32", "--batch-size", "4"], "did you mean"),
              (["--data", "{tmp}/nothing"], "does not exist")],
    "tune": [(["--data", "{tmp}/nope"], "no such folder"),
             (["--data", "{folder}", "--image-size", "x"], "--image-size must be a number of pixels or auto"),
             (["--model", "vgg"], "--model vgg: not one of")],
    "predict": [(["{tmp}/norun", "{folder}"], "no model.pt here"),
                (["{tmp}", "{tmp}/missing.jpg"], "no such image file or folder")],
}


def test_every_command_has_a_bad_input_case():
    assert set(BAD) == set(COMMANDS)


@pytest.mark.parametrize("command, argv, says", [(c, a, s) for c, cases in BAD.items() for a, s in cases],
                         ids=lambda v: v if isinstance(v, str) and " " not in v else None)
def test_bad_input_is_one_line(command, argv, says, folder, tmp_path, capsys):
    fill = {"tmp": str(tmp_path), "folder": str(folder)}
    argv = [a.format(**fill) for a in argv]
    try:
        code = main([command, *argv])
    except SystemExit as e:  # argparse's own errors: usage, then one error line
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    last = lines[-1]
    assert code == 2 and last.startswith(f"torchspeed {command}") and "error:" in last, err
    assert says.format(**fill) in last, err
    usage = [ln for ln in lines if not ln.startswith(" ")][:-1]  # argparse: its usage lines, then the error
    assert len(lines) == 1 or usage[0].startswith("usage: torchspeed"), err
