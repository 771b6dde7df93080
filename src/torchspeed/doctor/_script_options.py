"""The script's own options that already offer a fix (T02, T43): `--amp`, `--workers`/`-j`, `--compile`, `--channels-last`.

Reference training scripts expose the common speed switches as command-line options. When the
doctor finds a problem such an option fixes, the first thing to say is "run it with `--amp`",
not "edit the script". The options are read from the script's argparse definitions by an AST
scan of its `add_argument(...)` calls (nothing is imported or run); the run's own arguments tell
whether the option was already given. Each kind of option maps to the rules whose fix it is:

- amp (`--amp`, `--use-amp`, `--mixed-precision`, `--bf16`, `--autocast`): no-amp, cpu-bf16-math;
  on a CPU, an option that only turns on CUDA autocast (`torch.cuda.amp.autocast`, `autocast("cuda")`)
  is named as not reaching this device instead (`--fix` retargets the block);
- workers (`--workers`, `--num-workers`, `-j`, ...): dataloader-workers, cpu-oversubscribed (the
  worker count the finding names);
- compile (`--compile`, `--torch-compile`): elementwise-bound, layout-copies;
- channels_last (`--channels-last`): channels-last.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, replace

from torchspeed.doctor.observation import Observation

__all__ = ["ScriptOption", "script_options", "with_script_options", "OPTION_RULES"]

_NAMES = {
    "amp": ("--amp", "--use-amp", "--use_amp", "--mixed-precision", "--mixed_precision", "--bf16", "--autocast"),
    "workers": ("--workers", "--num-workers", "--num_workers", "--nworkers", "--dataloader-workers", "-j"),
    "compile": ("--compile", "--torch-compile", "--torch_compile", "--use-compile"),
    "channels_last": ("--channels-last", "--channels_last"),
}
OPTION_RULES = {"no-amp": "amp", "cpu-bf16-math": "amp", "dataloader-workers": "workers",
                "cpu-oversubscribed": "workers", "elementwise-bound": "compile", "layout-copies": "compile",
                "channels-last": "channels_last"}
_CUDA_ONLY_AMP = re.compile(r"cuda\.amp\.autocast|autocast\(\s*['\"]cuda['\"]|device_type\s*=\s*['\"]cuda['\"]")


@dataclass(frozen=True)
class ScriptOption:
    kind: str            # amp | workers | compile | channels_last
    flags: tuple[str, ...]
    takes_value: bool    # False for store_true/store_false/store_const/BooleanOptionalAction
    line: int

    @property
    def flag(self) -> str:
        """The spelling to suggest: the long one when there is one."""
        return next((f for f in self.flags if f.startswith("--")), self.flags[0])


def _takes_value(call: ast.Call) -> bool:
    for kw in call.keywords:
        if kw.arg == "action":
            v = kw.value
            name = v.value if isinstance(v, ast.Constant) else getattr(v, "attr", getattr(v, "id", ""))
            return str(name) not in ("store_true", "store_false", "store_const", "BooleanOptionalAction", "count")
    return True


def script_options(source: str) -> dict[str, ScriptOption]:
    """{kind: option} for each add_argument(...) the script defines whose flag names a known fix."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    out: dict[str, ScriptOption] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        flags = tuple(a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                      and a.value.startswith("-"))
        for kind, names in _NAMES.items():
            if kind not in out and set(flags) & set(names):
                out[kind] = ScriptOption(kind, flags, _takes_value(node), node.lineno)
    return out


def _given(opt: ScriptOption, argv: list[str]) -> bool:
    return any(a == f or a.startswith(f + "=") for a in argv for f in opt.flags if f.startswith("--")) or \
        any(a == f or (a.startswith(f) and len(f) == 2) for a in argv for f in opt.flags if not f.startswith("--"))


def _without(opt: ScriptOption, argv: list[str]) -> list[str]:
    """The run's arguments without the option (and its value), so the suggestion replaces it."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in opt.flags:
            skip = opt.takes_value
            continue
        if any(a.startswith(f + "=") for f in opt.flags):
            continue
        out.append(a)
    return out


def _advice(f, opt: ScriptOption, script: str, argv: list[str], source: str, device: str, workers: int) -> str | None:
    """The fix text with the script's option first, or None when the option does not give this fix."""
    where = f"the script's own option (add_argument at line {opt.line})"
    if (f.measured_gain is not None and f.measured_gain < 1.0) or f.fix.startswith("keep "):
        return None  # the advice here is not to switch it on
    if opt.kind == "amp" and device == "cpu" and _CUDA_ONLY_AMP.search(source):
        return (f"{f.fix}; note: the script's {opt.flag} ({where}) turns on CUDA autocast only, which does "
                "nothing on this CPU")
    if _given(opt, argv) and not opt.takes_value:
        return None  # already on: the problem is elsewhere
    value = ""
    if opt.takes_value:
        n = (f.patch_args or {}).get("workers") if f.rule == "dataloader-workers" else None
        if f.rule == "cpu-oversubscribed":
            n = max(0, workers - 1)  # fewer workers; the thread count is the other half of its fix
        value = f" {n if n is not None else 'N'}"
    run = " ".join(["python", script, *_without(opt, argv), opt.flag + value])
    return f"{where} offers it: `{run}`; or: {f.fix}"


def with_script_options(findings, obs: Observation, source: str | None) -> list:
    """Findings whose fix an option of the script offers, with that option as their first fix."""
    if not source:
        return list(findings)
    opts = script_options(source)
    if not opts:
        return list(findings)
    import os

    script = os.path.basename(obs.get("script") or "train.py")
    argv = [str(a) for a in obs.get("argv") or []]
    workers = int((obs.get("cpu") or {}).get("workers", 0))
    device = "cuda" if str((obs.get("model") or {}).get("device", "cpu")).startswith("cuda") else "cpu"

    def one(f):
        opt = opts.get(OPTION_RULES.get(f.rule, ""))
        text = _advice(f, opt, script, argv, source, device, workers) if opt else None
        return replace(f, fix=text) if text else f

    return [replace(one(f), also=tuple(one(a) for a in f.also)) for f in findings]
