"""The doctor: diagnose an unmodified training script, rank the fixes, prove them (T01-T03).

`diagnose("train.py")` runs the script as `python train.py` would, under instrumentation,
for a bounded number of optimizer steps, then reports where the step time goes and what to
change, each finding with its rule ID, measured evidence, the fix and an estimated gain;
`verify=True` measures each fix torchspeed can apply on the script's own model.

Layout: `_probe` (the instrumentation), `_job` (the sandbox that runs a script under it),
`_summary` (step-time breakdown), `_model_checks`, `_kernels` and `_datasets` (what the model,
its kernels and its datasets look like), `_tree` (helpers over nested batches), `observation`
(the typed schema the rules read), `rules/` (one file per rule, registered with
`registry.register`), `verify` (measure a fix on the model), `_patches` and `fix` (`--fix`:
write each fix into the script with libcst and measure it on the script itself), `report` (the
report's data and verdict) and `render` (the report printed).

Example:
    >>> from torchspeed.doctor import diagnose
    >>> report = diagnose("train.py", steps=30)
    >>> report.write_json("doctor.json")
    >>> fix_script(report, steps=30)["end_to_end_speedup"]   # patches measured on train.py itself
"""

from torchspeed.doctor.diagnose import DoctorJob, diagnose, diagnose_many, report_from_observation
from torchspeed.doctor.fix import fix_script
from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import RULES, register, rule_ids, run_rules
from torchspeed.doctor.render import render_report
from torchspeed.doctor.report import DoctorReport, Finding, exit_code, report_verdict

__all__ = ["DoctorJob", "diagnose", "diagnose_many", "report_from_observation", "Observation", "RULES", "register",
           "rule_ids", "run_rules", "DoctorReport", "Finding", "render_report", "fix_script", "report_verdict", "exit_code"]
