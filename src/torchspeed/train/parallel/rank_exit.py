"""Ending a rank of a data-parallel run (T31): `exit_process` destroys the process group, runs what a normal
exit runs, and leaves without the interpreter teardown that can abort a finished gloo rank.

`torchspeed`'s own commands and rank processes end this way (cli/main.py, cli/_rank.py, the bench workers);
the process group itself is built and destroyed in distributed.py.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import NoReturn

from torchspeed.train.parallel.distributed import cleanup_distributed

__all__ = ["exit_process"]


def exit_process(code: int = 0) -> NoReturn:
    """End a torchrun rank with exit status `code`, without the interpreter teardown that can
    abort it after its work is done.

    Why: a `DistributedDataParallel` model keeps its gloo process group alive in a C++
    reference cycle (its reducer), so `destroy_process_group()` cannot join gloo's threads
    (`gloo_tcp_loop`, `pt_gloo_runloop`) and they still run while Python finalises and C++
    static objects are destroyed. Now and then a rank then dies of SIGABRT ("terminate called
    without an active exception") after it finished, and torchrun reports the whole job as
    failed. This runs what a normal exit runs while the interpreter is still whole (the
    process group's destruction, every `atexit` handler, flushing stdout, stderr and the
    logging handlers) and then leaves with `os._exit`, skipping only the teardown.

    `torchspeed`'s own commands and rank processes end this way; a script of your own that
    ends a DDP run under `torchspeed launch` can do the same as its last line.

    Example:
        >>> exit_process(main())   # under `torchspeed launch --nproc 2 -- python train.py`
    """
    try:
        cleanup_distributed()
        atexit._run_exitfuncs()  # what interpreter shutdown would run first, in the same order
        logging.shutdown()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):  # closed or replaced: nothing left to flush
                pass
        os._exit(code)
