"""What this machine can accelerate (T01).

`detect()` reads versions (torch, torchvision, CUDA, cuDNN), the accelerator (name,
memory, compute capability), the CPU's vector features (AVX-512, AVX512-BF16, AMX) and
the process set-up a hand-written loop usually forgets (allocator, thread count; which malloc: _allocator.py). The
result says which precision pays on this machine, and the training loop, the bench and
the doctor all read their defaults from it.

Example:
    >>> from torchspeed.env import detect
    >>> info = detect()
    >>> info.best_precision  # "bf16" on a CPU with AVX512-BF16/AMX or a CUDA sm80+ GPU
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import platform
import time
from dataclasses import asdict, dataclass, field

import torch

from torchspeed._allocator import allocator_in_use, find_tcmalloc

__all__ = ["EnvInfo", "detect", "cpu_flags", "format_env", "parallel_speedup", "other_runnable", "GLIBC_MALLOC_ENV",
           "usable_cores", "default_device", "CPU_PROFILES", "cpu_profile", "DeviceCaps", "sync", "host_memory"]


@dataclass(frozen=True)
class EnvInfo:
    python: str
    torch: str
    torchvision: str | None
    cuda_available: bool
    cuda_version: str | None
    cudnn_version: int | None
    device: str
    device_name: str
    device_memory_gib: float | None
    compute_capability: tuple[int, int] | None  # (major, minor): a list once through JSON
    cpu_model: str
    cpu_cores: int
    torch_threads: int
    avx512: bool
    avx512_bf16: bool
    amx: bool
    bf16_supported: bool
    fp16_supported: bool
    best_precision: str
    allocator: str  # "glibc" | "glibc (tuned)" | "tcmalloc" | "jemalloc" | "unknown"
    tcmalloc_path: str | None
    compile_available: bool
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        return asdict(self)


# The CPU kinds this project's machines come in, by the flags that change a decision. The
# environment variable TORCHSPEED_CPU_PROFILE=<name> makes `cpu_flags()` (and so `detect()`,
# `precision="auto"`, the bench's hand search and the doctor) see that kind of CPU, whatever
# this one is: the suite's capability tests run under each (tests/conftest.py, docs/architecture.md).
_VECTOR_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16", "avx512_vnni",
                           "amx_bf16", "amx_tile", "amx_int8"})
CPU_PROFILES: dict[str, frozenset[str]] = {
    "avx2": frozenset({"avx", "avx2", "fma"}),
    "avx512": frozenset({"avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}),
    "avx512_bf16": frozenset({"avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd",
                              "avx512_bf16", "avx512_vnni"}),
    "amx": frozenset({"avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd",
                      "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8"}),
}


def cpu_profile() -> str | None:
    """The injected CPU kind (TORCHSPEED_CPU_PROFILE), or None for this machine's own."""
    name = os.environ.get("TORCHSPEED_CPU_PROFILE") or None
    if name is not None and name not in CPU_PROFILES:
        raise ValueError(f"TORCHSPEED_CPU_PROFILE={name!r} is not one of {sorted(CPU_PROFILES)}; unset it to "
                         "use this machine's CPU flags")
    return name


def cpu_flags() -> frozenset[str]:
    """CPU feature flags from /proc/cpuinfo (empty set where that file does not exist); with
    TORCHSPEED_CPU_PROFILE set, the vector flags are that profile's instead."""
    flags = _proc_cpu_flags()
    profile = cpu_profile()
    if profile is not None:
        return (flags - _VECTOR_FLAGS) | CPU_PROFILES[profile]
    return flags


@functools.lru_cache(maxsize=1)
def _proc_cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def default_device(device=None):
    """`device` as a torch.device; None means the GPU when torch sees one, else the CPU. A CUDA device asked for
    where torch sees none is an error that says why and what to do (torch's own, at the first tensor moved, names
    the driver only)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError as e:  # "gpu", "GPU:0": torch lists every device type it knows
        raise ValueError(f"device={device!r} is no torch device: pass 'cuda' (or 'cuda:0') for the GPU, 'cpu', "
                         f"'mps', or leave device out to train on what this machine has (torch: "
                         f"{str(e).splitlines()[0][:80]}...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
        raise RuntimeError(f"device={str(device)!r} was asked for, but torch sees no CUDA GPU here ({build}; "
                           "torch.cuda.is_available() is False): leave device out to train on what this machine has, "
                           "or install a CUDA build of torch on a machine with an NVIDIA GPU and its driver")
    return device


def sync(device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on the CPU. The one home of
    `torch.cuda.synchronize` in the package: timings end with it so queued GPU work is counted."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory (/proc/meminfo's MemAvailable and MemTotal; sysconf elsewhere).
    The one home of /proc/meminfo parsing."""
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                info[k] = int(v.split()[0]) * 1024
        return info.get("MemAvailable", 0), info.get("MemTotal", 0)
    except (OSError, ValueError, IndexError):
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
        except (ValueError, OSError, AttributeError):
            return 0, 0


def usable_cores() -> int:
    """Cores this process may run on (respects taskset/cgroup affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def _spin(n: int) -> float:
    t = time.perf_counter()
    x = 0
    for i in range(n):
        x += i * i
    return time.perf_counter() - t


def other_runnable(*, samples: int = 20, interval_s: float = 0.05, stat_path: str = "/proc/stat") -> float | None:
    """How many tasks other than this one are running or waiting for a core, on average over
    `samples` readings of the kernel's run queue (`procs_running` in /proc/stat), `interval_s`
    apart; None where the kernel does not report it (not Linux).

    About 0 on idle cores; about 1 per other busy job. Unlike a timing probe it is not moved by
    the jitter of a virtual machine's host, which on a 2-core VM here spread `parallel_speedup`
    from 1.1 to 2.4 on idle cores; it sees only jobs inside this machine, which are the ones
    this process's threads compete with.
    """
    counts = []
    for i in range(samples):
        try:
            with open(stat_path) as f:
                running = next((int(line.split()[1]) for line in f if line.startswith("procs_running ")), None)
        except (OSError, ValueError, IndexError):
            return None
        if running is None:
            return None
        counts.append(max(0, running - 1))  # this reader is one of them
        if i + 1 < samples:
            time.sleep(interval_s)
    return sum(counts) / len(counts)


def parallel_speedup(n: int = 2_000_000) -> float:
    """How much faster 2 processes finish 2 units of CPU work than 1 process does 1.

    About 2.0 on 2 idle cores, about 1.0 when other jobs hold the cores: benchmarks record
    it next to their results (a measurement, so no test asserts anything that depends on it).
    """
    import multiprocessing

    one = _spin(n)
    with multiprocessing.get_context("fork").Pool(2) as pool:
        pool.map(_spin, [1000, 1000])  # start-up, not timed
        t = time.perf_counter()
        pool.map(_spin, [n, n])
        return 2 * one / (time.perf_counter() - t)


# glibc malloc settings for a training process, read when the process starts (LD_PRELOAD-free,
# nothing to install). By default glibc serves every block above its (dynamic) mmap threshold
# with a fresh mmap and unmaps it on free, so each step's activations come back as new pages
# that the kernel must fault in and zero: about 6,700 page faults per step for ResNet-20 at
# batch 64 and 10,300 for the bench GPT, measured here. A fixed 32 MiB threshold (glibc's
# 64-bit maximum) keeps those blocks in the heap for reuse, and a 1 GiB trim threshold keeps
# freed heap memory instead of returning it after every step: about 200 and 0 faults per step.
# The cost is that the process keeps its peak heap (what tcmalloc and jemalloc do too).
GLIBC_MALLOC_ENV = (("MALLOC_MMAP_THRESHOLD_", str(32 << 20)), ("MALLOC_TRIM_THRESHOLD_", str(1 << 30)))


def _cpu_bf16_fast(flags: frozenset[str]) -> bool:
    return "avx512_bf16" in flags or "amx_bf16" in flags


def detect() -> EnvInfo:
    """Describe this machine and what it can accelerate (cached per injected CPU profile: the
    machine does not change)."""
    return _detect(cpu_profile())


def _device_facts(cuda: bool, flags: frozenset[str], notes: list[str]) -> tuple:
    """(device, its name, memory in GiB, compute capability, bf16 fast, fp16, the best precision) of GPU 0 or
    this CPU; what the CPU lacks goes into `notes`."""
    if cuda:
        props = torch.cuda.get_device_properties(0)
        cc: tuple[int, int] | None = (props.major, props.minor)
        bf16 = cc >= (8, 0)
        return "cuda", props.name, round(props.total_memory / 2**30, 1), cc, bf16, True, "bf16" if bf16 else "fp16"
    bf16 = _cpu_bf16_fast(flags)
    if not bf16:
        notes.append("CPU has no AVX512-BF16/AMX: bf16 autocast would be emulated and slow, so fp32 is used")
    if torch.version.cuda:
        notes.append("this torch build has CUDA support but no GPU is visible")
    return "cpu", _cpu_model(), None, None, bf16, False, "bf16" if bf16 else "fp32"


@functools.lru_cache(maxsize=8)
def _detect(profile: str | None) -> EnvInfo:
    flags = cpu_flags()
    try:  # the installed version, without importing it (an import costs seconds: every fit reads this)
        from importlib.metadata import version

        tv_version: str | None = version("torchvision")
    except Exception:  # torchvision is optional for the loop itself
        tv_version = None
    notes: list[str] = []
    cuda = torch.cuda.is_available()
    cudnn = torch.backends.cudnn.version() if cuda else None
    device, name, mem, cc, bf16, fp16, best = _device_facts(cuda, flags, notes)
    tcm = find_tcmalloc()
    alloc = allocator_in_use()
    if device == "cpu" and alloc == "glibc":
        if tcm:
            notes.append(f"tcmalloc found at {tcm} but not loaded: start with LD_PRELOAD={tcm} (the bench does this itself)")
        else:
            notes.append("no tcmalloc: `apt-get install libtcmalloc-minimal4` gives about +10% on CPU training")
    try:  # present, without importing it (torch._dynamo's import takes seconds)
        compile_ok = importlib.util.find_spec("torch._dynamo") is not None and hasattr(torch, "compile")
    except Exception:
        compile_ok = False
    return EnvInfo(
        python=platform.python_version(),
        torch=torch.__version__,
        torchvision=tv_version,
        cuda_available=cuda,
        cuda_version=torch.version.cuda,
        cudnn_version=cudnn,
        device=device,
        device_name=name,
        device_memory_gib=mem,
        compute_capability=cc,
        cpu_model=_cpu_model(),
        cpu_cores=usable_cores(),
        torch_threads=torch.get_num_threads(),
        avx512="avx512f" in flags,
        avx512_bf16="avx512_bf16" in flags,
        amx="amx_bf16" in flags or "amx_tile" in flags,
        bf16_supported=bf16,
        fp16_supported=fp16,
        best_precision=best,
        allocator=alloc,
        tcmalloc_path=tcm,
        compile_available=compile_ok,
        notes=tuple(notes),
    )


@dataclass(frozen=True)
class DeviceCaps:
    """What a device can accelerate, as the decisions read it: every automatic choice that depends on
    the hardware is a pure function of one of these, so a test injects a CUDA sm_80 GPU or a bf16 CPU
    on any machine (`DeviceCaps(device_type="cuda", cuda_capability=(8, 0))`)."""

    device_type: str = "cpu"
    cpu_bf16: bool = False                      # AVX512-BF16 or AMX: bf16 matmuls and convs run natively
    amx: bool = False
    cuda_capability: tuple[int, int] | None = None
    cores: int = 1

    @classmethod
    def of(cls, device: "torch.device | str") -> "DeviceCaps":
        """This machine's capabilities for `device` (the CPU flags follow TORCHSPEED_CPU_PROFILE)."""
        device = torch.device(device)
        flags = cpu_flags()  # not detect(): that reads the whole environment, and every fit asks for this
        cc = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        return cls(device_type=device.type, cpu_bf16=_cpu_bf16_fast(flags), amx="amx_bf16" in flags or "amx_tile" in flags,
                   cuda_capability=cc, cores=usable_cores())

    @property
    def half(self) -> str | None:
        """The half precision this device runs natively: "bf16" (CUDA sm80+, CPUs with AVX512-BF16/AMX),
        "fp16" (older CUDA GPUs: Tensor Cores, no fast bf16), or None (a CPU without bf16 units, where
        emulated bf16 runs slower than fp32)."""
        if self.device_type == "cuda":
            return "bf16" if (self.cuda_capability or (0, 0)) >= (8, 0) else "fp16"
        if self.device_type == "cpu" and self.cpu_bf16:
            return "bf16"
        return None


def format_env(info: EnvInfo | None = None):
    """A rich Table of `detect()`'s facts."""
    from rich.table import Table

    info = info or detect()
    table = Table(title="torchspeed env: what this machine can accelerate", show_header=True)
    table.add_column("fact")
    table.add_column("value")

    def yes(b: bool) -> str:
        return "[green]yes[/]" if b else "[red]no[/]"

    rows = [
        ("python", info.python),
        ("torch", info.torch),
        ("torchvision", info.torchvision or "not installed"),
        ("CUDA available", yes(info.cuda_available)),
        ("CUDA (build)", info.cuda_version or "-"),
        ("cuDNN", str(info.cudnn_version) if info.cudnn_version else "-"),
        ("device", f"{info.device}: {info.device_name}"),
        ("device memory", f"{info.device_memory_gib} GiB" if info.device_memory_gib else "-"),
        ("compute capability", ".".join(map(str, info.compute_capability)) if info.compute_capability else "-"),
        ("CPU", info.cpu_model),
        ("usable cores / torch threads", f"{info.cpu_cores} / {info.torch_threads}"),
        ("AVX-512", yes(info.avx512)),
        ("AVX512-BF16", yes(info.avx512_bf16)),
        ("AMX", yes(info.amx)),
        ("bf16 fast", yes(info.bf16_supported)),
        ("fp16 fast", yes(info.fp16_supported)),
        ("precision='auto' picks", f"[bold]{info.best_precision}[/]"),
        ("allocator in use", info.allocator + (" (tcmalloc available)" if info.tcmalloc_path and info.allocator != "tcmalloc" else "")),
        ("torch.compile", yes(info.compile_available)),
    ]
    for k, v in rows:
        table.add_row(k, v)
    return table
