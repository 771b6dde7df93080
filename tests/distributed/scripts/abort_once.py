"""A torchrun job for `_torchrun`'s tests: rank 1 fails as asked, rank 0 writes the result.

usage: abort_once.py MODE RESULT   (MODE: a marker path -- abort in the first attempt only,
"always" -- abort in every attempt, "error" -- exit with an error)
"""

import json
import os
import sys

mode, result = sys.argv[1], sys.argv[2]
if os.environ["RANK"] == "1":
    if mode == "error":
        sys.exit("planted error exit")
    if mode == "always" or not os.path.exists(mode):
        if mode != "always":
            open(mode, "w").close()
        print("planted abort", file=sys.stderr, flush=True)
        os.abort()  # SIGABRT, as an uncaught C++ exception in a gloo thread ends a rank
else:
    with open(result, "w") as f:
        json.dump({"world": int(os.environ["WORLD_SIZE"])}, f)
