"""The observation schema (T02): the typed contract between the doctor's probe and its rules.

The probe writes one `Observation` per script (a JSON-ready dict); every rule reads only the keys
declared here, and `--json` reports carry it under "observation", so a reader can re-check each
verdict from the numbers it was drawn from. `undeclared_keys(obs)` lists any key the probe wrote
that this schema does not declare (a test runs it on every gallery script).
"""

from __future__ import annotations

import typing
from typing import Any, TypedDict

__all__ = ["Observation", "Breakdown", "LoaderInfo", "DatasetTiming", "ModelInfo", "Kernels", "DebugModes",
           "MathSettings", "CompileEvents", "CpuContention", "OptimizerInfo", "undeclared_keys"]


class Fractions(TypedDict, total=False):
    data_wait: float
    copy: float
    compute: float
    sync: float
    other: float


class Breakdown(TypedDict, total=False):
    """Per optimizer step, trimmed mean over the measured steps (start-up outliers left out)."""
    step_ms: float
    step_ms_median: float
    step_ms_mean_all: float      # mean over every measured step, outliers included
    data_wait_ms: float
    copy_ms: float
    compute_ms: float
    compute_ms_iqr: list[float]  # first and third quartiles of the kept steps' compute times
    sync_ms: float
    other_ms: float
    compute_detail_ms: dict[str, float]
    fractions: Fractions
    fractions_median: dict[str, float]  # per-step shares of data, copy, sync: their median over the steps
    steps: int                   # steps the means are over
    outlier_steps: int           # measured steps left out as start-up outliers
    outlier_step_ms: list[float]
    minor_faults_per_step: float  # median page faults (minor) per step


class LoaderInfo(TypedDict, total=False):
    num_workers: int
    pin_memory: bool
    batch_size: int | None
    persistent_workers: bool
    dataset: str
    wait_ms_total: float
    map_style: bool
    in_memory: bool              # a TensorDataset: rows of tensors already in memory


class DatasetTiming(TypedDict, total=False):
    dataset: str
    getitem_ms: float
    decode_ms: float
    transform_ms: float
    other_ms: float
    decode_share: float
    decoders: dict[str, int]
    batch_size: int | None
    alt_decode: dict[str, Any] | None
    tensor_copies: dict[str, Any]  # torch.tensor(ndarray) per `dataset[i]`: per_item, ms_per_item, float64, sites


_ClassNames = TypedDict("_ClassNames", {"class": str, "inner_class": str}, total=False)  # `class`: a keyword


class ModelInfo(_ClassNames, total=False):
    found: bool
    data_parallel: bool
    device: str
    has_conv2d: bool
    channels_last_weights: bool
    autocast: bool
    autocast_dtype: str | None
    compiled: bool
    conv_bias_before_bn: list[str]
    conv_bn_pairs: int
    odd_sizes: list[str]
    batch_size: int | None
    unused_params: list[str]
    unused_param_count: int
    unused_param_fraction: float
    never_called_modules: list[str]   # leaf modules never called whose parameters got no gradient either
    design: dict[str, Any]
    design_timing: str
    input: dict[str, Any]
    params: int
    norm_layers: int
    optimizer: str | None
    train_calls: int


class Kernels(TypedDict, total=False):
    """Shares of the aten self time of forward + backward on the captured batch (profiler)."""
    matmul_share: float
    elementwise_share: float
    ms_per_step: float
    top: list[str]


class DebugModes(TypedDict, total=False):
    anomaly_detection: bool
    profiler: bool
    deterministic: bool


class MathSettings(TypedDict, total=False):
    mkldnn_matmul: str           # torch.backends.mkldnn.matmul.fp32_precision: "none" | "ieee" | "bf16" | "tf32"
    mkldnn_conv: str
    float32_matmul_precision: str


class CompileEvents(TypedDict, total=False):
    graph_breaks: list[dict[str, Any]]   # {site: "train.py:42", reason, count}
    recompiles: list[dict[str, Any]]


class CpuContention(TypedDict, total=False):
    """The model's step in the script against the same step with nothing else running (T45)."""
    workers: int
    threads: int
    cores: int
    compute_ms_in_script: float
    compute_ms_alone: float | None
    compute_ms_in_script_iqr: list[float]     # quartiles of the script's per-step compute times
    compute_ms_alone_iqr: list[float] | None  # quartiles of the timed steps alone
    workers_busy_during_alone: float | None   # the workers' CPU time / wall time while the model ran alone
    worker_ms_per_batch: float   # `dataset[i]` x batch size: the CPU work the workers do per step


# the optimizer whose steps the doctor counted (T51); `class`: a keyword, hence the functional form
OptimizerInfo = TypedDict("OptimizerInfo", {"class": str, "fused": bool | None, "foreach": bool | None, "device": str,
                                            "fused_available": bool, "param_tensors": int}, total=False)


class Observation(TypedDict, total=False):
    script: str
    argv: list[str]
    job: int
    status: str
    traceback: str | None
    analysis_traceback: str
    wall_s: float
    steps_requested: int
    warmup: int
    steps_observed: int
    steps_measured: int
    env: dict[str, Any]
    notes: list[str]
    cudnn_benchmark: bool
    cuda_devices: int
    cpu_cores: int
    threads: int
    breakdown: Breakdown
    syncs: dict[str, Any]
    tensor_copies: dict[str, Any]
    zero_grad: dict[str, Any]
    eval: dict[str, Any]
    loaders: list[LoaderInfo]
    datasets: list[DatasetTiming]
    memory: dict[str, float]
    model: ModelInfo
    kernels: Kernels
    debug: DebugModes
    math: MathSettings
    compile: CompileEvents
    cpu: CpuContention
    optimizer: OptimizerInfo
    verify: dict[str, dict[str, Any]]
    fit_plan: dict[str, Any]               # `_fit_plan` (--verify): fit's choice of switches, measured
    env_fixes: dict[str, dict[str, Any]]   # `_envfix`: each environment fix re-run on the script, interleaved


def _typed_dict(tp) -> type | None:
    return tp if isinstance(tp, type) and typing.is_typeddict(tp) else None


def undeclared_keys(obs: dict, schema: type = Observation, prefix: str = "") -> list[str]:
    """Keys in `obs` (recursively through nested TypedDicts and lists of them) the schema does not declare."""
    hints = typing.get_type_hints(schema)
    out = []
    for k, v in obs.items():
        if k not in hints:
            out.append(prefix + k)
            continue
        tp = hints[k]
        sub = _typed_dict(tp)
        if sub is None and typing.get_origin(tp) is list:
            sub = _typed_dict(typing.get_args(tp)[0])
            if sub is not None and isinstance(v, list):
                for i, item in enumerate(v):
                    if isinstance(item, dict):
                        out += undeclared_keys(item, sub, f"{prefix}{k}[{i}].")
            continue
        if sub is not None and isinstance(v, dict):
            out += undeclared_keys(v, sub, f"{prefix}{k}.")
    return out
