"""Model checks (T24, T27, T30, T31, T36, T37): what the captured model looks like, re-run on its
captured batch after the script stopped.

Records the layout (Conv2d, channels_last, DataParallel, compiled), the precision the script used,
parameters that get no gradient and modules that are never used, sizes that are not multiples of 8,
Conv+BatchNorm pairs with a bias, the input statistics, and the time per leaf module (forward and
backward) against its FLOPs for grouped/depthwise convolutions. A module counts as used when its
forward ran or when its parameters received gradients: `nn.MultiheadAttention` calls its `out_proj`
weights functionally, without ever calling `out_proj.forward`.
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch
from torch import nn

from torchspeed.doctor._capture import Captured
from torchspeed.doctor._tree import call_model, first_tensor, generic_loss
from torchspeed.model.conv_bias import find_conv_bn_pairs
from torchspeed.train.optim import sparse_weights
from torchspeed.train.wrappers import is_compiled, unwrap_model

__all__ = ["examine_model", "leaf_trace", "optimizer_info", "FUSED_OPTIMIZERS"]

FUSED_OPTIMIZERS = ("Adam", "AdamW", "SGD", "Adagrad")  # torch's optimizers with a `fused` kernel (T51)


def optimizer_info(opt, model: nn.Module | None = None) -> dict:
    """The script's optimizer: its class, `fused`/`foreach` as it runs, and whether torch has a fused
    kernel for it on its parameters' device (T51); and how many of `model`'s sparse-gradient weights (an embedding
    with `sparse=True`) torch's SGD steps with momentum (`sparse_momentum`: rule sparse-momentum)."""
    if opt is None:
        return {}
    import inspect

    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    params = [p for g in opt.param_groups for p in g["params"]]
    g = opt.param_groups[0] if opt.param_groups else {}
    device = params[0].device.type if params else "cpu"
    name = type(opt).__name__
    exact = any(type(opt) is getattr(torch.optim, n, None) for n in FUSED_OPTIMIZERS)  # a subclass may own its step
    available = (exact and "fused" in inspect.signature(type(opt)).parameters
                 and device in _get_fused_kernels_supported_devices()
                 and all(p.is_floating_point() and p.device.type == device for p in params))
    sparse = sparse_weights(model) if model is not None and isinstance(opt, torch.optim.SGD) else set()
    return {"class": name, "fused": g.get("fused"), "foreach": g.get("foreach"), "device": device,
            "fused_available": bool(available), "param_tensors": len(params),
            "sparse_momentum": sum(id(p) in sparse for grp in opt.param_groups if grp.get("momentum")
                                   for p in grp["params"])}

_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm2d)


def _unwrap(model: nn.Module) -> nn.Module:

    return unwrap_model(model)


def leaf_trace(model: nn.Module, args, reps: int = 5, train: bool = True, kwargs=None):
    """Leaf modules in call order, their time per training step (ms, forward + backward, median
    over `reps` steps on a copy of the model) and output shapes. `train=False`: forward only."""
    import copy

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
                out = call_model(m, args, kwargs)
                if train:
                    generic_loss(out).backward()
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


def _layout(model: nn.Module, inner: nn.Module) -> dict:
    """What the model is: its class, size, device, Conv2d and channels_last weights, norm layers,
    DataParallel (T31), compiled."""
    params = list(inner.parameters())
    return {
        "class": type(model).__name__, "inner_class": type(inner).__name__,
        "params": int(sum(p.numel() for p in params)),
        "data_parallel": isinstance(model, nn.DataParallel),
        "device": str(params[0].device) if params else "cpu",
        "has_conv2d": any(isinstance(m, nn.Conv2d) for m in inner.modules()),
        "channels_last_weights": any(isinstance(m, nn.Conv2d) and m.weight.dim() == 4 and m.weight.shape[1] > 1
                                     and m.weight.is_contiguous(memory_format=torch.channels_last)
                                     and not m.weight.is_contiguous() for m in inner.modules()),
        "norm_layers": sum(isinstance(m, _NORMS) for m in inner.modules()),
        "compiled": is_compiled(model),
    }


def _unused(cap: Captured, inner: nn.Module, n_params: int) -> dict:
    """Unused parameters (T37): in the optimizer but no gradient at a step, or in a module that is never
    used. A module whose own forward never ran is still used when its parameters got gradients
    (nn.MultiheadAttention reads out_proj.weight functionally): only report modules with neither."""
    names = {id(p): n for n, p in inner.named_parameters()}
    unused = sorted({names[i] for i in cap.unused_ids if i in names})
    never_called = [n for n, m in inner.named_modules()
                    if not any(True for _ in m.children()) and any(True for _ in m.parameters(recurse=False))
                    and id(m) not in cap.called and not any(id(p) in cap.grad_ids for p in m.parameters())]
    n_unused = sum(p.numel() for n, p in inner.named_parameters() if n in set(unused))
    return {"unused_params": unused[:20], "unused_param_count": len(unused),
            "unused_param_fraction": round(n_unused / max(1, n_params), 4), "never_called_modules": never_called[:20]}


def _precision(pinfo: dict, info: dict, obs: dict) -> None:
    """The precision the script trained in: autocast and its dtype; a note when it is bf16 emulated on a
    CPU without bf16 instructions."""
    info["autocast"] = pinfo["autocast_calls"] > 0
    info["autocast_dtype"] = pinfo["autocast_dtype"]
    env = obs.get("env", {})
    if info["autocast"] and info["device"] == "cpu" and not env.get("bf16_supported", True):
        obs["notes"].append(f"autocast ({info['autocast_dtype']}) is on, but this CPU has no AVX512-BF16/AMX: "
                            "bf16 is emulated here and usually much slower than fp32")
    info["train_calls"] = pinfo["train_calls"]


def _input_stats(x: torch.Tensor) -> dict:
    """The captured batch's first tensor: shape, dtype, value range (unnormalised inputs, T30), layout."""
    xf = x.float()
    return {"shape": list(x.shape), "dtype": str(x.dtype), "mean": round(xf.mean().item(), 4),
            "std": round(xf.std().item(), 4) if xf.numel() > 1 else 0.0,
            "min": round(xf.min().item(), 4), "max": round(xf.max().item(), 4),
            "channels_last": x.dim() == 4 and x.shape[1] > 1 and x.is_contiguous(memory_format=torch.channels_last)
            and not x.is_contiguous()}


def _rerun(cap: Captured, inner: nn.Module, info: dict):
    """Conv+BatchNorm pairs (T27) and the leaf trace, both from re-running the model on its captured
    batch: forward and backward, or forward only where backward hooks cannot wrap the model."""
    pairs = find_conv_bn_pairs(inner, example_input=cap.args, example_kwargs=cap.kwargs)
    info["conv_bias_before_bn"] = [f"{p.conv} -> {p.bn}" for p in pairs if p.has_bias]
    info["conv_bn_pairs"] = len(pairs)
    try:
        trace = leaf_trace(inner, cap.args, kwargs=cap.kwargs)
        info["design_timing"] = "forward+backward"
    except Exception:  # e.g. in-place ops that backward hooks cannot wrap: time forward only
        trace = leaf_trace(inner, cap.args, train=False, kwargs=cap.kwargs)
        info["design_timing"] = "forward"
    return trace


def _odd_sizes(order: list[nn.Module], copy_: nn.Module) -> list[str]:
    """Linear/Conv widths between layers that are not multiples of 8 (T24); the first layer's input and
    the last layer's output are the data's, except a last Linear as wide as an embedding table."""
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
    return sorted(set(odd))[:20]


def _design(order: list[nn.Module], times: dict, shapes: dict) -> dict:
    """Model design (T36): share of forward time vs share of FLOPs in grouped / depthwise convs."""
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
    return {"grouped_convs": n_grouped, "grouped_time_share": round(g_time / total_t, 4),
            "grouped_flops_share": round(g_flops / flops, 4) if flops else 0.0, "leaf_modules": len(order)}


def examine_model(cap: Captured, obs: dict) -> None:
    """Every model check on the captured model into `obs["model"]` (and `obs["optimizer"]`); a check that
    needs what was not captured (a batch, a model that re-runs) is skipped with a note."""
    info: dict = {"found": cap.model is not None}
    obs["model"] = info
    if cap.model is None:
        obs["notes"].append("no module with parameters was called in training mode: model checks skipped")
        return
    inner = _unwrap(cap.model)
    info.update(_layout(cap.model, inner))
    info.update(_unused(cap, inner, info["params"]))
    info["optimizer"] = type(cap.optimizer).__name__ if cap.optimizer is not None else None
    obs["optimizer"] = optimizer_info(cap.optimizer, inner)
    if cap.model_info is not None:
        _precision(cap.model_info, info, obs)
    if cap.args is None:
        obs["notes"].append("no training-mode forward after the first step was captured: input checks skipped")
        return
    x = first_tensor(list(cap.args) + list(cap.kwargs.values()))
    if x is not None:
        info["input"] = _input_stats(x)
        info["batch_size"] = int(x.shape[_batch_dim(inner, x)]) if x.dim() > 0 else None
    try:
        order, times, shapes, copy_ = _rerun(cap, inner, info)
    except Exception as e:  # a model that cannot rerun on its captured input: skip these checks
        obs["notes"].append(f"re-running the model on its captured input failed ({type(e).__name__}: {e}); "
                            "structure checks skipped")
        return
    info["odd_sizes"] = _odd_sizes(order, copy_)
    info["design"] = _design(order, times, shapes)


def _batch_dim(model, x) -> int:
    """The input's batch dimension: 1 for a sequence-first model (its RNNs, attention and transformer layers all
    `batch_first=False`, as in PyTorch's word-language-model example: inputs (T, B)), else 0."""
    flags = [m.batch_first for m in model.modules() if isinstance(getattr(m, "batch_first", None), bool)]
    return 1 if flags and not any(flags) and x.dim() >= 2 else 0
