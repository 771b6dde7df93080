"""What the doctor learns after the script stopped: the step-time breakdown, the captured
model (static checks, T24/T27/T30/T31/T36/T37) and its datasets (decode vs transform split).
"""

from __future__ import annotations

import resource
import statistics
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from torchspeed.model.conv_bias import find_conv_bn_pairs

_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm2d)


@dataclass
class Captured:
    """Objects taken from the running script for the static checks and `--verify`."""

    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    args: tuple | None = None
    kwargs: dict = field(default_factory=dict)
    loss_module: nn.Module | None = None
    target: object = None
    loaders: list = field(default_factory=list)
    set_to_none: bool = True
    unused_ids: set = field(default_factory=set)
    called: set = field(default_factory=set)
    model_info: dict | None = None


def _mean(xs):
    return statistics.fmean(xs) if xs else 0.0


def summarize(probe, obs: dict) -> None:
    recs = probe.records
    if len(recs) > probe.warmup:
        use = recs[probe.warmup:]
    else:
        use = recs[1:] or recs
    obs["steps_observed"] = len(recs)
    obs["steps_measured"] = len(use)

    def m(key):
        return round(_mean([r.get(key, 0.0) for r in use]), 4)

    step = m("step")
    data, copy, sync = m("data"), m("copy"), m("sync")
    fwd, bwd, opt, zg = m("forward"), m("backward"), m("optim"), m("zero_grad")
    compute = fwd + bwd + opt + zg
    other = max(0.0, step - data - copy - compute - sync)
    frac = (lambda v: round(v / step, 4) if step > 0 else 0.0)
    obs["breakdown"] = {
        "step_ms": round(step, 3),
        "step_ms_median": round(statistics.median([r["step"] for r in use]), 3) if use else 0.0,
        "data_wait_ms": round(data, 3), "copy_ms": round(copy, 3), "compute_ms": round(compute, 3),
        "sync_ms": round(sync, 3), "other_ms": round(other, 3),
        "compute_detail_ms": {"forward": round(fwd, 3), "backward": round(bwd, 3), "optimizer": round(opt, 3),
                              "zero_grad": round(zg, 3)},
        "fractions": {"data_wait": frac(data), "copy": frac(copy), "compute": frac(compute), "sync": frac(sync),
                      "other": frac(other)},
        "steps": len(use),
    }
    n_steps = max(1, len(recs))
    obs["syncs"] = {"calls": int(sum(probe.syncs.values())), "by_kind": dict(probe.syncs),
                    "calls_per_step": round(sum(probe.syncs.values()) / n_steps, 3), "ms_per_step": round(sync, 4),
                    "sites": _top(probe.sync_sites), "cuda_sync_warnings": probe.cuda_sync_warnings}
    c = probe.copies
    obs["tensor_copies"] = {"count": c["count"], "per_step": round(c["count"] / n_steps, 3),
                            "ms_per_step": round(c["ms"] / n_steps, 4), "mib": round(c["bytes"] / 2**20, 3),
                            "sites": _top(c["sites"])}
    z = probe.zero_grads
    obs["zero_grad"] = {"calls": z["calls"], "set_to_none_false": z["set_to_none_false"],
                        "ms_per_call": round(z["ms"] / z["calls"], 4) if z["calls"] else 0.0, "sites": _top(z["sites"])}
    obs["eval"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in probe.eval.items()}
    obs["loaders"] = []
    for lid, loader in probe.loaders.items():
        ds = getattr(loader, "dataset", None)
        obs["loaders"].append({
            "num_workers": int(getattr(loader, "num_workers", 0)), "pin_memory": bool(getattr(loader, "pin_memory", False)),
            "batch_size": getattr(loader, "batch_size", None), "persistent_workers": bool(getattr(loader, "persistent_workers", False)),
            "dataset": type(ds).__name__, "wait_ms_total": round(probe.loader_wait.get(lid, 0.0) * 1e3, 3),
            "map_style": hasattr(ds, "__getitem__") and hasattr(ds, "__len__"),
        })
    obs["loaders"].sort(key=lambda d: -d["wait_ms_total"])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    obs["memory"] = {"max_rss_mib": round(rss, 1)}
    if torch.cuda.is_available():
        obs["memory"]["cuda_max_allocated_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        obs["memory"]["cuda_total_mib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**20, 1)


def _top(counter: dict, n: int = 3) -> list[str]:
    return [f"{k} ({v}x)" for k, v in sorted(counter.items(), key=lambda kv: -kv[1])[:n]]


def capture(probe) -> Captured:
    cap = Captured()
    opt = probe.step_opt
    cap.optimizer = opt
    opt_ids = {id(p) for g in opt.param_groups for p in g["params"]} if opt is not None else set()
    best, best_score = None, (-1, -1)
    for mid, mod in probe.module_objs.items():
        params = list(mod.parameters())
        score = (sum(1 for p in params if id(p) in opt_ids), sum(p.numel() for p in params))
        if probe.modules[mid]["train_calls"] == 0:
            score = (score[0] - 10**9, score[1])
        if score > best_score:
            best, best_score = mid, score
    if best is not None:
        cap.model = probe.module_objs[best]
        info = probe.modules[best]
        cap.args = info["args"]
        cap.kwargs = info.get("kwargs") or {}
        cap.model_info = info
    cap.loss_module, cap.target = probe.loss_module, probe.loss_target
    cap.loaders = list(probe.loaders.values())
    cap.set_to_none = probe.zero_grads["set_to_none_false"] == 0
    cap.unused_ids = getattr(probe, "_unused_ids", set())
    cap.called = probe.called
    return cap


def _unwrap(model: nn.Module) -> nn.Module:
    from torchspeed.train.distributed import unwrap_model

    return unwrap_model(model)


def _run(model, args, kwargs=None):
    kwargs = kwargs or {}
    return model(*args, **kwargs) if isinstance(args, (tuple, list)) else model(args, **kwargs)


def _leaf_trace(model: nn.Module, args, reps: int = 5, train: bool = True, kwargs=None):
    """Leaf modules in call order, their time per training step (ms, forward + backward, median
    over `reps` steps on a copy of the model) and output shapes. `train=False`: forward only."""
    import copy

    from torchspeed.doctor.verify import _generic_loss
    m = copy.deepcopy(model)
    order: list[nn.Module] = []
    times: dict[int, list[float]] = {}
    shapes: dict[int, tuple] = {}
    starts: dict[tuple[int, str], float] = {}
    handles = []

    def add(mod, key):
        t0 = starts.pop((id(mod), key), None)
        if t0 is not None:
            times.setdefault(id(mod), []).append((time.perf_counter() - t0) * 1e3)

    def pre(mod, a):
        starts[(id(mod), "f")] = time.perf_counter()

    def post(mod, a, out):
        add(mod, "f")
        if id(mod) not in shapes:
            order.append(mod)
            shapes[id(mod)] = tuple(out.shape) if isinstance(out, torch.Tensor) else ()

    def bpre(mod, grad_out):
        starts[(id(mod), "b")] = time.perf_counter()

    def bpost(mod, grad_in, grad_out):
        add(mod, "b")

    for leaf in m.modules():
        if not any(True for _ in leaf.children()):
            handles.append(leaf.register_forward_pre_hook(pre))
            handles.append(leaf.register_forward_hook(post))
            if train:
                handles.append(leaf.register_full_backward_pre_hook(bpre))
                handles.append(leaf.register_full_backward_hook(bpost))
    try:
        m.train(train)
        with torch.set_grad_enabled(train), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "full backward hook ... no inputs require gradients"
            for _ in range(reps):
                out = _run(m, args, kwargs)
                if train:
                    _generic_loss(out).backward()
                    m.zero_grad(set_to_none=True)
    finally:
        for h in handles:
            h.remove()
    # a leaf's samples are forward, backward, forward, backward...: sum pairs per step
    per_step = {}
    for k, v in times.items():
        chunk = 2 if train and len(v) >= 2 * reps else 1
        steps = [sum(v[i:i + chunk]) for i in range(0, len(v) - chunk + 1, chunk)]
        per_step[k] = statistics.median(steps) if steps else 0.0
    return order, {id(mod): per_step.get(id(mod), 0.0) for mod in order}, shapes, m


def examine_model(cap: Captured, obs: dict) -> None:
    info: dict = {"found": cap.model is not None}
    obs["model"] = info
    if cap.model is None:
        obs["notes"].append("no module with parameters was called in training mode: model checks skipped")
        return
    model = cap.model
    inner = _unwrap(model)
    pinfo = cap.model_info
    params = list(inner.parameters())
    info.update({
        "class": type(model).__name__, "inner_class": type(inner).__name__,
        "params": int(sum(p.numel() for p in params)),
        "data_parallel": isinstance(model, nn.DataParallel),
        "device": str(params[0].device) if params else "cpu",
        "has_conv2d": any(isinstance(m, nn.Conv2d) for m in inner.modules()),
        "channels_last_weights": any(isinstance(m, nn.Conv2d) and m.weight.dim() == 4 and m.weight.shape[1] > 1
                                     and m.weight.is_contiguous(memory_format=torch.channels_last)
                                     and not m.weight.is_contiguous() for m in inner.modules()),
        "norm_layers": sum(isinstance(m, _NORMS) for m in inner.modules()),
        "compiled": hasattr(model, "_orig_mod"),
    })
    # unused parameters (T37): in the optimizer but no gradient at a step, or in a module never called
    names = {id(p): n for n, p in inner.named_parameters()}
    unused = sorted({names[i] for i in cap.unused_ids if i in names})
    never_called = [n for n, m in inner.named_modules()
                    if not any(True for _ in m.children()) and any(True for _ in m.parameters(recurse=False))
                    and id(m) not in cap.called]
    n_unused = sum(p.numel() for n, p in inner.named_parameters() if n in set(unused))
    info["unused_params"] = unused[:20]
    info["unused_param_count"] = len(unused)
    info["unused_param_fraction"] = round(n_unused / max(1, info["params"]), 4)
    info["never_called_modules"] = never_called[:20]
    info["optimizer"] = type(cap.optimizer).__name__ if cap.optimizer is not None else None
    if pinfo is not None:
        info["autocast"] = pinfo["autocast_calls"] > 0
        info["autocast_dtype"] = pinfo["autocast_dtype"]
        env = obs.get("env", {})
        if info["autocast"] and info["device"] == "cpu" and not env.get("bf16_supported", True):
            obs["notes"].append(f"autocast ({info['autocast_dtype']}) is on, but this CPU has no AVX512-BF16/AMX: "
                                "bf16 is emulated here and usually much slower than fp32")
        info["train_calls"] = pinfo["train_calls"]
    args = cap.args
    if args is None:
        obs["notes"].append("no training-mode forward after the first step was captured: input checks skipped")
        return
    from torchspeed.doctor._probe import _first_tensor
    x = _first_tensor(list(args) + list(cap.kwargs.values()))
    if x is not None:
        xf = x.float()
        info["input"] = {"shape": list(x.shape), "dtype": str(x.dtype), "mean": round(xf.mean().item(), 4),
                         "std": round(xf.std().item(), 4) if xf.numel() > 1 else 0.0,
                         "min": round(xf.min().item(), 4), "max": round(xf.max().item(), 4),
                         "channels_last": x.dim() == 4 and x.shape[1] > 1 and x.is_contiguous(memory_format=torch.channels_last)
                         and not x.is_contiguous()}
        info["batch_size"] = int(x.shape[0]) if x.dim() > 0 else None
    try:
        pairs = find_conv_bn_pairs(inner, example_input=args, example_kwargs=cap.kwargs)
        info["conv_bias_before_bn"] = [f"{p.conv} -> {p.bn}" for p in pairs if p.has_bias]
        info["conv_bn_pairs"] = len(pairs)
        try:
            order, times, shapes, copy_ = _leaf_trace(inner, args, kwargs=cap.kwargs)
            info["design_timing"] = "forward+backward"
        except Exception:  # e.g. in-place ops that backward hooks cannot wrap: time forward only
            order, times, shapes, copy_ = _leaf_trace(inner, args, train=False, kwargs=cap.kwargs)
            info["design_timing"] = "forward"
    except Exception as e:  # a model that cannot rerun on its captured input: skip these checks
        obs["notes"].append(f"re-running the model on its captured input failed ({type(e).__name__}: {e}); "
                            "structure checks skipped")
        return
    mod_names = {id(m): n for n, m in copy_.named_modules()}
    weighted = [m for m in order if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))]
    # a last Linear as wide as an embedding table is an LM head over the vocabulary: its width is
    # a choice (padded vocabularies, as GPT-2's 50257 -> 50304), unlike a classifier's class count
    vocab = {m.num_embeddings for m in order if isinstance(m, nn.Embedding)}
    odd = []
    for i, m in enumerate(weighted):
        n = mod_names.get(id(m), "?")
        if isinstance(m, nn.Linear):
            sizes = [("in_features", m.in_features, i > 0),
                     ("out_features", m.out_features, i < len(weighted) - 1 or m.out_features in vocab)]
        else:
            sizes = [("in_channels", m.in_channels, i > 0 and m.in_channels > 4),
                     ("out_channels", m.out_channels, i < len(weighted) - 1)]
        for attr, v, check in sizes:
            if check and v % 8:
                odd.append(f"{n}.{attr}={v}")
    info["odd_sizes"] = sorted(set(odd))[:20]
    # model design (T36): share of forward time vs share of FLOPs in grouped / depthwise convs
    total_t = sum(times.values()) or 1e-9
    flops, g_flops, g_time, n_grouped = 0.0, 0.0, 0.0, 0
    for m in order:
        if isinstance(m, nn.Conv2d) and id(m) in shapes:
            out = shapes[id(m)]
            f = float(torch.Size(out).numel()) * (m.in_channels // m.groups) * m.kernel_size[0] * m.kernel_size[1]
            flops += f
            if m.groups > 1:
                n_grouped += 1
                g_flops += f
                g_time += times.get(id(m), 0.0)
        elif isinstance(m, nn.Linear) and id(m) in shapes:
            flops += float(torch.Size(shapes[id(m)]).numel()) * m.in_features
    info["design"] = {"grouped_convs": n_grouped, "grouped_time_share": round(g_time / total_t, 4),
                      "grouped_flops_share": round(g_flops / flops, 4) if flops else 0.0,
                      "leaf_modules": len(order)}


# -- datasets: decode vs transforms --------------------------------------------------------
class _DatasetTimers:
    def __init__(self):
        self.decode = 0.0
        self.transform = 0.0
        self.decoders: dict[str, int] = {}
        self.jpeg_files: list[str] = []
        self._patches = []
        self._depth = 0
        self._decode_depth = 0

    def _patch(self, owner, name, make):
        orig = getattr(owner, name)
        self._patches.append((owner, name, orig, name in vars(owner)))
        setattr(owner, name, make(orig))

    def __enter__(self):
        timers = self
        try:
            from PIL import Image, ImageFile

            def wrap_load(orig):
                def load(img, *a, **k):
                    fmt = getattr(img, "format", None) or "image"
                    fn = getattr(img, "filename", None)
                    if fmt == "JPEG" and fn and len(timers.jpeg_files) < 8 and fn not in timers.jpeg_files:
                        timers.jpeg_files.append(fn)
                    return timers._decode_call(f"PIL {fmt}", orig, img, *a, **k)
                return load

            def wrap_open(orig):
                def open_(*a, **k):
                    return timers._decode_call(None, orig, *a, **k)
                return open_
            self._patch(ImageFile.ImageFile, "load", wrap_load)
            self._patch(Image, "open", wrap_open)
        except ImportError:
            pass
        for modname, fnames, label in (("cv2", ("imread", "imdecode"), "OpenCV"),
                                       ("torchvision.io", ("decode_jpeg", "decode_image", "read_image"), "torchvision.io"),
                                       ("simplejpeg", ("decode_jpeg",), "simplejpeg")):
            try:
                mod = __import__(modname, fromlist=["_"])
            except Exception:
                continue
            for fname in fnames:
                if hasattr(mod, fname):
                    self._patch(mod, fname, self._timed_decoder(label))
        try:
            import torchvision.transforms as T
            import torchvision.transforms.v2 as V2
            self._patch(T.Compose, "__call__", self._timed_transform)
            self._patch(V2.Compose, "forward", self._timed_transform)
        except ImportError:
            pass
        return self

    def _decode_call(self, label, orig, *a, **k):
        """Time a decoder call; nested calls (open -> load) and calls inside transforms count once."""
        outer = self._decode_depth == 0 and self._depth == 0
        self._decode_depth += 1
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            self._decode_depth -= 1
            if outer:
                self.decode += time.perf_counter() - t0
            if label:
                self.decoders[label] = self.decoders.get(label, 0) + 1

    def _timed_decoder(self, label):
        timers = self

        def make(orig):
            def fn(*a, **k):
                return timers._decode_call(label, orig, *a, **k)
            return fn
        return make

    def _timed_transform(self, orig):
        timers = self

        def call(*a, **k):
            t0 = time.perf_counter()
            timers._depth += 1
            try:
                return orig(*a, **k)
            finally:
                timers._depth -= 1
                if timers._depth == 0:
                    timers.transform += time.perf_counter() - t0
        return call

    def __exit__(self, *exc):
        for owner, name, orig, existed in reversed(self._patches):
            if existed:
                setattr(owner, name, orig)
            else:
                delattr(owner, name)
        return False


def _alt_jpeg_speedup(files: list[str]) -> dict | None:
    """Median PIL decode time vs simplejpeg / OpenCV on the script's own JPEG files."""
    import numpy as np
    from PIL import Image
    blobs = []
    for f in files[:4]:
        try:
            with open(f, "rb") as fh:
                blobs.append(fh.read())
        except OSError:
            continue
    if not blobs:
        return None
    import io

    def pil(b):
        with Image.open(io.BytesIO(b)) as im:
            return np.asarray(im.convert("RGB"))
    cands = {"PIL": pil}
    try:
        import simplejpeg
        cands["simplejpeg"] = lambda b: simplejpeg.decode_jpeg(b, colorspace="RGB")
    except ImportError:
        pass
    try:
        import cv2
        cands["OpenCV"] = lambda b: cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_COLOR)
    except ImportError:
        pass
    times = {k: [] for k in cands}
    for _ in range(7):  # interleaved rounds
        for k, fn in cands.items():
            t0 = time.perf_counter()
            for b in blobs:
                fn(b)
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = min((k for k in med if k != "PIL"), key=lambda k: med[k], default=None)
    if best is None:
        return None
    return {"best": best, "speedup": round(med["PIL"] / med[best], 3),
            "ms_per_image": {k: round(v / len(blobs) * 1e3, 4) for k, v in med.items()}}


def probe_datasets(probe, obs: dict, *, samples: int = 12) -> None:
    out = []
    seen = set()
    for loader in probe.loaders.values():
        ds = getattr(loader, "dataset", None)
        if ds is None or id(ds) in seen or not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
            continue
        seen.add(id(ds))
        try:
            n = min(samples, len(ds))
        except TypeError:
            continue
        if n == 0:
            continue
        timers = _DatasetTimers()
        try:
            ds[0]  # untimed: first-call costs (imports, plugin registration, file caches)
            with timers:
                t0 = time.perf_counter()
                for i in range(n):
                    ds[i]
                total = time.perf_counter() - t0
        except Exception as e:
            obs["notes"].append(f"timing {type(ds).__name__}[i] failed: {type(e).__name__}: {e}")
            continue
        entry = {"dataset": type(ds).__name__, "getitem_ms": round(total / n * 1e3, 4),
                 "decode_ms": round(timers.decode / n * 1e3, 4), "transform_ms": round(timers.transform / n * 1e3, 4),
                 "decoders": timers.decoders, "batch_size": getattr(loader, "batch_size", None)}
        entry["other_ms"] = round(max(0.0, entry["getitem_ms"] - entry["decode_ms"] - entry["transform_ms"]), 4)
        entry["decode_share"] = round(timers.decode / total, 4) if total > 0 else 0.0
        if timers.jpeg_files:
            entry["alt_decode"] = _alt_jpeg_speedup(timers.jpeg_files)
        out.append(entry)
    obs["datasets"] = out
    from torchspeed.env import usable_cores

    obs["cpu_cores"] = usable_cores()
