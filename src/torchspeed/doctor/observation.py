"""The observation schema (T02): the typed contract between the doctor's probe and its rules.

The probe writes one `Observation` per script (a JSON-ready dict); every rule reads only the keys
declared here, and `--json` reports carry it under "observation", so a reader can re-check each
verdict from the numbers it was drawn from. `undeclared.undeclared_keys(obs)` lists any key the probe
wrote that this schema does not declare (a test runs it on every gallery script), and
tests/doctor/test_observation_keys.py parses the rules and the other readers: a key they read must be
declared here. Every field is a TypedDict down to its leaves, except maps keyed by a name (a fix, a decoder,
a kind of host read). Keys several TypedDicts share in meaning are declared once, in a private base they inherit
(`_StepShares`). What the doctor measures by running candidates (`VerifyResult`, `FitPlan`, `EnvFixResult` and
their parts) is declared in `observation_runs`, the home readers import those from.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import TypedDict

from torchspeed.doctor.observation_runs import EnvFixResult, FitPlan, VerifyResult
from torchspeed.env import EnvInfo

__all__ = ["Observation", "Environment", "Breakdown", "Fractions", "FractionsMedian", "ComputeDetail", "Syncs",
           "TensorCopies", "ZeroGrad", "EvalForwards", "Memory", "LoaderInfo", "DatasetTiming", "DatasetCopies",
           "AltDecode", "ModelInfo", "ModelDesign", "InputStats", "Kernels", "DebugModes", "MathSettings",
           "CompileEvents", "CompileEvent", "CpuContention", "OptimizerInfo"]


# `obs["env"]` is `torchspeed.env.detect().to_dict()` (T01): EnvInfo's fields, read from the dataclass (no drift)
_ENV_HINTS = typing.get_type_hints(EnvInfo)
Environment = TypedDict("Environment", {f.name: _ENV_HINTS[f.name] for f in dataclasses.fields(EnvInfo)}, total=False)


class _StepShares(TypedDict, total=False):
    """Shares of the step time (0-1) by part; both sets of shares have the host's copy and sync parts."""
    copy: float
    sync: float


class Fractions(_StepShares, total=False):
    """The parts of the mean step (`Breakdown`'s `*_ms`) as shares of it."""
    data_wait: float
    compute: float
    other: float


class FractionsMedian(_StepShares, total=False):
    """The median step's own shares (`_summary`): a wait only a few steps pay does not move these."""
    data: float


class ComputeDetail(TypedDict, total=False):
    """The compute part of a step, ms per step by phase."""
    forward: float
    backward: float
    optimizer: float
    zero_grad: float


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
    compute_detail_ms: ComputeDetail
    fractions: Fractions
    fractions_median: FractionsMedian
    steps: int                   # steps the means are over
    within_warmup: bool          # the run ended within the warm-up: those steps are all there is (a rough figure)
    outlier_steps: int           # measured steps left out as start-up outliers
    outlier_step_ms: list[float]
    minor_faults_per_step: float  # mean page faults (minor) per kept step
    optimizer_ms_thirds: list[float] | None  # the optimizer's ms over the first and the last third of the kept steps


class Syncs(TypedDict, total=False):
    """Host reads (`.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `nonzero`) from user code in the loop (T13)."""
    calls: int
    by_kind: dict[str, int]      # "item" -> calls, ...
    calls_per_step: float
    ms_per_step: float
    sites: list[str]             # "train.py:42 (30x)", the three most frequent
    cuda_sync_warnings: int      # CUDA sync debug mode's count of synchronizing calls (CUDA only)


class TensorCopies(TypedDict, total=False):
    """`torch.tensor(ndarray)` from user code in the loop (T11)."""
    count: int                   # in the whole run, load time included
    per_step: float              # per measured step (after warm-up): a copy made once while loading is not in it
    ms_per_step: float
    mib: float
    float64: int                 # calls whose source array was float64
    sites: list[str]


class ZeroGrad(TypedDict, total=False):
    """`zero_grad` calls in the loop (T26)."""
    calls: int
    set_to_none_false: int
    ms_per_call: float
    sites: list[str]             # sites of the set_to_none=False calls


class EvalForwards(TypedDict, total=False):
    """Forward passes of the model in eval mode (T28); `grad_*`: those with gradients enabled."""
    calls: int
    grad_calls: int
    ms: float
    grad_ms: float


class Memory(TypedDict, total=False):
    max_rss_mib: float
    cuda_max_allocated_mib: float
    cuda_total_mib: float


class LoaderInfo(TypedDict, total=False):
    num_workers: int
    pin_memory: bool
    batch_size: int | None
    persistent_workers: bool
    prefetch_factor: int         # batches each worker loads ahead (0 without workers)
    dataset: str
    wait_ms_total: float
    map_style: bool
    in_memory: bool              # a TensorDataset: rows of tensors already in memory
    own_batching: list[str]      # "collate_fn", "sampler", "batch_sampler": the loader's own (no batched_index patch)


class DatasetCopies(TypedDict, total=False):
    """`torch.tensor(ndarray)` per `dataset[i]` (T11): seen also where the loop's probe cannot (workers)."""
    per_item: float
    ms_per_item: float
    float64: bool
    sites: list[str]


class AltDecode(TypedDict, total=False):
    """The script's JPEG files decoded by Pillow and by the faster decoders installed here (T04)."""
    best: str                    # the fastest decoder other than Pillow
    speedup: float               # Pillow's median time / the best one's
    ms_per_image: dict[str, float]  # decoder -> median ms per image


class DatasetTiming(TypedDict, total=False):
    dataset: str
    getitem_ms: float
    decode_ms: float
    transform_ms: float
    other_ms: float
    decode_share: float
    decoders: dict[str, int]
    batch_size: int | None
    alt_decode: AltDecode | None
    tensor_copies: DatasetCopies


class ModelDesign(TypedDict, total=False):
    """Grouped/depthwise convolutions: their share of the leaf modules' time against their share of FLOPs (T36)."""
    grouped_convs: int
    grouped_time_share: float
    grouped_flops_share: float
    leaf_modules: int


class InputStats(TypedDict, total=False):
    """The model's first input tensor on the captured batch (T30)."""
    shape: list[int]
    dtype: str                   # "torch.float32", ...
    mean: float
    std: float
    min: float
    max: float
    channels_last: bool


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
    design: ModelDesign
    design_timing: str
    input: InputStats
    params: int
    norm_layers: int
    optimizer: str | None
    train_calls: int


class Kernels(TypedDict, total=False):
    """Shares of the aten self time of forward + backward on the captured batch (profiler)."""
    matmul_share: float
    elementwise_share: float
    layout_share: float          # copies that contiguous/reshape/flatten make of permuted tensors (T39)
    ms_per_step: float
    matmul_us_per_call: float | None  # the products' mean time a call (cpu-bf16-math: small ones cannot gain)
    top: list[str]


class DebugModes(TypedDict, total=False):
    anomaly_detection: bool
    profiler: bool
    deterministic: bool


class MathSettings(TypedDict, total=False):
    mkldnn_matmul: str           # torch.backends.mkldnn.matmul.fp32_precision: "none" | "ieee" | "bf16" | "tf32"
    mkldnn_conv: str
    float32_matmul_precision: str


class CompileEvent(TypedDict, total=False):
    site: str                    # "train.py:42"
    reason: str
    count: int


class CompileEvents(TypedDict, total=False):
    graph_breaks: list[CompileEvent]
    recompiles: list[CompileEvent]


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
                                            "fused_available": bool, "param_tensors": int,
                                            "sparse_momentum": int}, total=False)


class Observation(TypedDict, total=False):
    script: str
    loop: str | None  # the framework whose loop trains the model: "lightning" | "transformers" (its setting is the fix)
    argv: list[str]
    job: int
    status: str
    traceback: str | None
    analysis_traceback: str
    wall_s: float
    steps_requested: int
    warmup: int
    steps_observed: int
    step_boundary: str  # "optimizer": a step ends at optimizer.step; "backward": no torch optimizer, updates by hand
    optimizers_made: int  # torch optimizers the script constructed (one made but never stepped: no step to measure)
    processes_spawned: int  # training processes the script started itself (mp.spawn): stopped before they start
    steps_measured: int
    env: Environment
    notes: list[str]
    cudnn_benchmark: bool
    cuda_devices: int
    cpu_cores: int
    threads: int
    machine_cores: int; kernel: str  # os.cpu_count() beside the usable cores; the Linux kernel's release (T45, T21)
    breakdown: Breakdown
    syncs: Syncs
    tensor_copies: TensorCopies
    zero_grad: ZeroGrad
    eval: EvalForwards
    loaders: list[LoaderInfo]
    datasets: list[DatasetTiming]
    memory: Memory
    model: ModelInfo
    kernels: Kernels
    debug: DebugModes
    math: MathSettings
    compile: CompileEvents
    cpu: CpuContention
    optimizer: OptimizerInfo
    verify: dict[str, VerifyResult]       # fix name -> its measurement
    fit_plan: FitPlan
    env_fixes: dict[str, EnvFixResult]    # fix name -> its re-run of the script

