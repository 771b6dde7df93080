"""Sharded data parallelism on PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`) (T31).

What it does: DDP keeps a whole copy of the weights, gradients and optimizer state in every
process. `fully_shard` splits each of them into `world_size` pieces: a block's weights are
all-gathered just before its forward (and again before its backward), its gradients are
reduce-scattered after backward, and each process steps only its own piece. Per-process
memory for parameters, gradients and optimizer state falls to about 1/world_size of DDP's;
activations are unchanged (activation checkpointing trades them for recomputation).

How `fit` applies it: blocks are found automatically, the largest repeated composite
submodule (the layers of a transformer, the stages of a ResNet: `find_blocks`), each block
gets `fully_shard` and then the root, so every block is one all-gather. The parameter and
reduce dtypes come from the precision decision (bf16 params, fp32 gradient reduction);
`reshard_after_forward=True` frees the gathered weights after forward (less memory, one
more all-gather in backward). On CPU, offload uses `CPUOffloadPolicy(pin_memory=False)`:
pinned memory needs a GPU. `parallel="auto"` stays DDP while the model, its gradients and
optimizer state fit in half the device's memory, and shards beyond that (`choose_parallel`).

What it costs: two all-gathers and one reduce-scatter of the weights per step instead of
DDP's one all-reduce (the same bytes on the wire, in more messages). On gloo (CPU)
reduce-scatter is emulated, so CPU throughput is not the point: memory per process is.

Example:
    >>> blocks = find_blocks(model)                       # [model.layers[0], model.layers[1], ...]
    >>> shard_model(model, blocks=blocks, precision="bf16", reshard_after_forward=True)
    >>> opt = torch.optim.AdamW(model.parameters())       # after sharding: the parameters are DTensors
"""

from __future__ import annotations

import atexit
import logging
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from torchspeed.env import host_memory
from torchspeed.train.decision import Decision

__all__ = ["PARALLEL_MODES", "wrap_parallel", "wrap_fsdp2", "find_blocks", "choose_parallel", "shard_model", "single_process_group",
           "state_bytes", "full_state_dict", "is_sharded", "check_optimizer"]

log = logging.getLogger("torchspeed")

PARALLEL_MODES = ("auto", "ddp", "fsdp2")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of `model`: instances of the composite (non-leaf) submodule class that occurs
    at least twice and holds the most parameters in total, outermost instances only. [] when none repeats."""
    by_class: dict[type, list[nn.Module]] = defaultdict(list)
    for name, m in model.named_modules():
        if m is model or not any(True for _ in m.children()) or not any(True for _ in m.parameters()):
            continue
        if type(m) in (nn.ModuleList, nn.ModuleDict):
            continue  # they hold blocks and have no forward (an nn.Sequential stage can be a block)
        by_class[type(m)].append(m)
    best, best_params = [], 0
    for instances in by_class.values():
        if len(instances) < 2:
            continue
        inner = {id(s) for m in instances for s in m.modules() if s is not m}
        outer = [m for m in instances if id(m) not in inner]
        if len(outer) < 2:
            continue
        n = sum(p.numel() for m in outer for p in m.parameters())
        if n > best_params:
            best, best_params = outer, n
    return best


def state_bytes(model: nn.Module, *, optimizer_slots: int = 2) -> int:
    """Bytes of parameters + gradients + optimizer state (`optimizer_slots` tensors per parameter: AdamW 2)."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) * (2 + optimizer_slots)


def _device_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    available, _ = host_memory()
    return available // max(1, _world())


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def choose_parallel(mode: str, model: nn.Module, device: torch.device, *, world_size: int,
                    device_bytes: int | None = None) -> Decision:
    """"ddp" or "fsdp2", with the reason. "auto" shards once weights, gradients and optimizer state would
    take more than half the device's memory (the other half is left for activations)."""
    if mode not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {', '.join(map(repr, PARALLEL_MODES))}, got {mode!r}")
    if mode != "auto":
        return Decision(mode, "asked for")
    need = state_bytes(model)
    have = device_bytes if device_bytes is not None else _device_bytes(device)
    gib = f"{need / 2**30:.2f} GiB of weights, gradients and optimizer state vs {have / 2**30:.1f} GiB"
    if world_size > 1 and need > have / 2:
        return Decision("fsdp2", f"rule: {gib} per device: sharded over {world_size} processes")
    return Decision("ddp", f"rule: {gib} per device: a full replica fits with room for activations")


def single_process_group(device=None):
    """A 1-process gloo group (FSDP2 and DCP need one) when none exists; returns its `DistInfo`."""
    from torchspeed.train.parallel.distributed import cleanup_distributed, init_distributed

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        atexit.register(cleanup_distributed)
    return init_distributed(device=device)


def shard_model(model: nn.Module, *, blocks: list[nn.Module], precision: str = "fp32",
                reshard_after_forward: bool | int = True, mesh=None, cpu_offload: bool = False,
                checkpoint_blocks: tuple[str, ...] = ()) -> nn.Module:
    """`fully_shard` on each block, then on the root (in place; build the optimizer afterwards), after
    broadcasting rank 0's weights.

    `precision` "bf16"/"fp16" sets the parameter dtype for compute with fp32 gradient reduction;
    `checkpoint_blocks` names block classes whose activations are recomputed in backward
    (non-reentrant activation checkpointing); `mesh` is a 1-D DeviceMesh (or 2-D: hybrid sharding).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    param_dtype = _DTYPES.get(precision)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    on_cpu = next(model.parameters()).device.type == "cpu"
    offload = CPUOffloadPolicy(pin_memory=not on_cpu and torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    if checkpoint_blocks:
        from torch.distributed._composable import checkpoint

        wanted = set(checkpoint_blocks)
        known = {type(m).__name__ for m in model.modules()}
        if wanted - known:
            raise ValueError(f"activation_checkpointing names {sorted(wanted - known)}, which are not module "
                             f"classes of this model; pick from the block classes, e.g. {sorted(known)[:6]}")
        for m in model.modules():
            if type(m).__name__ in wanted:
                checkpoint(m)
    if dist.is_initialized() and dist.get_world_size() > 1:
        # As DDP does: every rank starts from rank 0's weights (fully_shard keeps each rank's own slice).
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)
    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=offload)
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def check_optimizer(optimizer, *, sharded: bool) -> None:
    """`optimizer=` is a name or an optimizer built over the model (a class is a TypeError saying so); FSDP2
    replaces the parameters by shards, so there the optimizer must be built afterwards, by name."""
    if isinstance(optimizer, type):
        name = optimizer.__name__
        where = "torch.optim." if optimizer.__module__.startswith("torch.optim") else ""
        raise TypeError(f"optimizer= takes a name like 'adamw' or an instance like {where}{name}(model.parameters(), "
                        f"lr=...); got the class {name}")
    if isinstance(optimizer, (list, tuple)):
        raise TypeError(f"optimizer= takes one optimizer; got a {type(optimizer).__name__} of {len(optimizer)}. Two "
                        "models trained in turn (a GAN): pass the one fit steps and step the other inside your "
                        "step_fn (docs/models.md); parts of one model at different LRs: one optimizer with param "
                        "groups")
    if isinstance(optimizer, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError(f"optimizer= got an LR scheduler ({type(optimizer).__name__}): pass its optimizer "
                        "(optimizer=sched.optimizer) and the scheduler as schedule=sched")
    if not isinstance(optimizer, str) and not (hasattr(optimizer, "param_groups") and hasattr(optimizer, "step")):
        raise TypeError(f"optimizer= takes a name like 'adamw' or a torch.optim.Optimizer built over the model; "
                        f"got {type(optimizer).__name__}")
    if sharded and not isinstance(optimizer, str):
        raise ValueError("parallel='fsdp2' replaces the model's parameters by shards: pass the optimizer by "
                         "name (optimizer='adamw') so that it is built over the shards")


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state_dict(model: nn.Module) -> dict:
    """The whole model's weights as plain CPU tensors on every rank (collective under FSDP2)."""
    if not is_sharded(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # cpu_offload=True would leave the other ranks empty: gather everywhere, then copy to the host.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu() for k, v in full.items()}


def wrap_fsdp2(model: nn.Module, *, config, world_size: int, backend: str, precision: str, mesh=None) -> dict:
    """Shard `model` in place the way the Trainer does (blocks found automatically, then the root) and
    return the decisions to record."""
    blocks = find_blocks(model)
    names = sorted({type(b).__name__ for b in blocks})  # before fully_shard renames the classes (FSDP...)
    shard_model(model, blocks=blocks, precision=precision, reshard_after_forward=config.reshard_after_forward,
                mesh=mesh, cpu_offload=config.cpu_offload, checkpoint_blocks=tuple(config.activation_checkpointing))
    dtype = _DTYPES.get(precision)
    return {
        "fsdp_blocks": Decision(f"{len(blocks)} x {', '.join(names)} + root" if blocks else "root only",
                                "rule: the largest repeated submodule, one all-gather each" if blocks
                                else "rule: no repeated submodule found: the whole model is one unit"),
        "distributed": Decision(f"FSDP2, {world_size} processes ({backend}), "
                                f"reshard_after_forward={config.reshard_after_forward}, "
                                f"params {str(dtype or torch.float32).removeprefix('torch.')}, "
                                f"reduce {'float32' if dtype else 'as params'}, cpu_offload={config.cpu_offload}, "
                                f"mesh={'given' if mesh is not None else 'default 1-D'}",
                                "each rank holds a shard of the weights, gradients and optimizer state"),
    }


def wrap_parallel(module: nn.Module, config, info, *, precision: str, mesh=None,
                  decisions: dict) -> tuple[nn.Module, nn.Module, bool]:
    """The Trainer's data-parallel wrap: (plain module, module that trains, sharded?), choices in `decisions` (the
    plan's "parallel" decision applied where it made one).

    DDP: the module wrapped (it broadcasts rank 0's weights now; after .to(device) and channels_last).
    FSDP2: the module sharded in place (it is both).
    """
    from torchspeed.train.parallel.distributed import wrap_for_training

    choice = decisions.get("parallel")  # fit: the plan's "parallel" stage chose it
    if choice is None:
        choice = decisions["parallel"] = choose_parallel(config.parallel, module, info.device,
                                                         world_size=info.world_size)
    if choice.value == "fsdp2":
        decisions.update(wrap_fsdp2(module, config=config, world_size=info.world_size, backend=info.backend,
                                    precision=precision, mesh=mesh))
        return module, module, True
    module, ddp, how = wrap_for_training(module, dist=info, static_graph=config.static_graph,
                                         sync_batchnorm=config.sync_batchnorm, grad_accum=config.grad_accum)
    decisions["distributed"] = Decision(how, "each rank trains a copy on its own shard of the data; the gradients "
                                        "are averaged in buckets during the backward")
    return module, ddp, False
