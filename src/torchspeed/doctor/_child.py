"""Child process entry: `python -m torchspeed.doctor._child SPEC.json OUT.jsonl`.

Runs each job of the spec (one script each) under the probe, one after another in this
process, and appends one JSON line per job to OUT as soon as it is done, so a parent that
has to kill a hung child still gets the jobs that finished.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from torchspeed.doctor._job import run_job


def main(argv: list[str]) -> int:
    spec_path, out_path = argv[1], argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("threads"):
        import torch
        torch.set_num_threads(int(spec["threads"]))

    for i, job in enumerate(spec["jobs"]):
        try:
            obs = run_job(job)
        except BaseException as e:  # a doctor bug must not lose the other jobs' results
            obs = {"script": job["script"], "status": "doctor-error",
                   "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__)), "notes": []}
        obs["job"] = i
        with open(out_path, "a") as f:
            f.write(json.dumps(obs, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
