"""What each process `torchspeed launch` starts runs first: your script or module, unchanged, then a clean exit (T31).

`torchspeed launch -- python train.py ARGS` starts `python -m torchspeed.cli._rank train.py
ARGS` in every process. It runs the script as `python train.py ARGS` would (as `__main__`,
with the same `sys.argv` and the script's folder first on `sys.path`; `-m pkg.mod` runs a
module the same way), and then ends the process through `exit_process`: the process group is
destroyed, `atexit` handlers run and the streams are flushed, and only the interpreter's C++
teardown is skipped. That teardown can abort a finished DDP rank (gloo's threads outlive the
process group, "terminate called without an active exception") and make torchrun report a
run that finished as failed; a script of your own needs no change for this.

The exit status is the script's: 0, its `sys.exit` code, or 1 after an uncaught exception (its
traceback printed first, as Python prints it).
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback


def main(argv: list[str]) -> int:
    """Run `script ARGS` or `-m module ARGS` as `__main__`; return its exit status."""
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        print("usage: python -m torchspeed.cli._rank (SCRIPT | -m MODULE) [ARGS...]", file=sys.stderr)
        return 2
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in argv[0]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = argv[0]
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` sets it
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
        return 1
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, then a clean exit with status 1
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    from torchspeed.train.parallel.rank_exit import exit_process

    exit_process(main(sys.argv[1:]))
