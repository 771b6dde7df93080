"""torch's foreach ops for Adam/AdamW and SGD on kept lists (`lean_step`), over the whole lists or a piece at a time
(T51).

- `adam_foreach`, `sgd_foreach`: what torch's foreach paths (`_multi_tensor_adam`, `_multi_tensor_sgd`) run for one
  device and dtype; on the CPU the for-loop's per-tensor kernels in its order, so its numbers too;
- `adam_chunked`: Adam's ops a piece of about `lean_schedulefree.CHUNK` numbers at a time (`chunks_for`,
  `lean_schedulefree.Chunks`), for a large float32 group. Each op over the whole lists streams every parameter and
  moment through memory (eight ops: eight passes over a ResNet-18's 45 MB of parameters and 90 MB of moments); a
  piece stays in the cache across them. 30 updates timed alone on a 2-core Zen 4: 27-33 -> 15-17 ms a step on
  ResNet-18 (torch's for-loop: 33-38), 14-19 -> 10.7 on a 6.3M-parameter GERNet. Each number goes through the same
  ops with the same scalars, so the numbers are the whole lists' wherever this CPU's kernels give a number the same
  value at any position (`flat_state.lean_chunks_agree`, checked once a process; else the whole lists). A step whose
  gradients are laid out otherwise than their parameters, or whose parameters were given new memory since the pieces
  were cut, runs on the whole lists.

Example:
    >>> chunks = chunks_for(group, flags, params, (exp_avgs, exp_avg_sqs, [], steps))
    >>> adam_chunked((group, flags, params, exp_avgs, exp_avg_sqs, [], steps, chunks), grads)
"""

from __future__ import annotations

import torch

from torchspeed.train.lean_schedulefree import Chunks
from torchspeed.train.state.flat_state import lean_chunks_agree

__all__ = ["adam_chunked", "adam_foreach", "chunks_for", "sgd_foreach"]


def _adam_scalars(group: dict, steps: list) -> tuple[list[float], list[float]]:
    """The step counts advanced, then each tensor's step size and bias correction's square root, as torch's
    foreach path computes them."""
    lr, (beta1, beta2) = group["lr"], group["betas"]
    torch._foreach_add_(steps, 1)
    counts = [s.item() for s in steps]
    return [(lr / (1 - beta1 ** n)) * -1 for n in counts], [(1 - beta2 ** n) ** 0.5 for n in counts]


def _adam_ops(group: dict, flags: tuple, params: list, grads: list, exp_avgs: list, exp_avg_sqs: list,
              max_sqs: list, step_size: list, bias_correction2_sqrt: list) -> None:
    """torch's foreach ops of an Adam update, in its order, over these tensors (the whole lists or a piece)."""
    _, _, amsgrad, maximize, _, _, decoupled, _ = flags
    lr, (beta1, beta2), wd, eps = group["lr"], group["betas"], group["weight_decay"], group["eps"]
    if maximize:
        grads = torch._foreach_neg(grads)
    if wd != 0:
        if decoupled:
            torch._foreach_mul_(params, 1 - lr * wd)
        else:
            grads = torch._foreach_add(grads, params, alpha=wd)  # a new list: the gradients stay as backward left them
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    if amsgrad:
        torch._foreach_maximum_(max_sqs, exp_avg_sqs)
    denom = torch._foreach_sqrt(max_sqs if amsgrad else exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)


def adam_foreach(lists: tuple, grads: list) -> None:
    """What `torch.optim.adam._multi_tensor_adam` runs for one device and dtype (not capturable, real tensors):
    on the CPU the for-loop's kernels in its order, so `_single_tensor_adam`'s numbers too."""
    group, flags, params, exp_avgs, exp_avg_sqs, max_sqs, steps = lists
    _adam_ops(group, flags, params, grads, exp_avgs, exp_avg_sqs, max_sqs, *_adam_scalars(group, steps))


def sgd_foreach(lists: tuple, grads: list) -> None:
    """What `torch.optim.sgd._multi_tensor_sgd` runs for one device and dtype once the momentum buffers are made
    (dense gradients); the gradients are left as backward wrote them, as the for-loop leaves them."""
    group, flags, params, bufs = lists
    lr, wd, momentum, dampening = group["lr"], group["weight_decay"], group["momentum"], group["dampening"]
    if flags[3]:  # maximize
        grads = torch._foreach_neg(grads)
    if wd != 0:
        grads = torch._foreach_add(grads, params, alpha=wd)
    if momentum != 0:
        torch._foreach_mul_(bufs, momentum)
        torch._foreach_add_(bufs, grads, alpha=1 - dampening)
        grads = torch._foreach_add(grads, bufs, alpha=momentum) if flags[7] else bufs
    torch._foreach_add_(params, grads, alpha=-lr)


def adam_chunked(lists: tuple, grads: list) -> bool:
    """`adam_foreach` a piece at a time (`lean_schedulefree.Chunks`): every op over one piece of the parameters and
    their moments, then the next, so that a piece stays in the cache across the ops (each op over the whole lists
    streams every parameter and moment through memory). The same ops on the same numbers in each piece: the same
    numbers (`flat_state.lean_chunks_agree`). False (the whole lists this step) where the gradients or the
    parameters' memory are not the pieces' (`Chunks.grads`)."""
    *kept, chunks = lists
    group, flags, params, _, _, _, steps = kept
    cut = chunks.grads(params, grads)
    if cut is None:
        adam_foreach(tuple(kept), grads)
        return False
    step_size, bias_correction2_sqrt = _adam_scalars(group, steps)
    for piece, (ps, ms, vs), gs in zip(chunks.pieces, chunks.views, cut):  # amsgrad takes no pieces (`chunks_for`)
        idx = [i for i, _, _ in piece]
        _adam_ops(group, flags, ps, gs, ms, vs, [], [step_size[i] for i in idx],
                  [bias_correction2_sqrt[i] for i in idx])
    return True


def chunks_for(group: dict, flags: tuple, params: list, lists: tuple) -> Chunks | None:
    """The pieces of a large float32 Adam group (without amsgrad) on torch's foreach ops (`adam_chunked`), or None.
    SGD's update is three ops, not eight: a piece at a time measured no faster (2-core Zen 4, 30 updates: 4.0 ->
    4.2 ms on a 6.3M-parameter GERNet, 6.8 -> 6.0 on ResNet-18), so it keeps the whole lists."""
    if flags[2] or params[0].dtype != torch.float32:
        return None
    return Chunks.of(params, *lists[:2], agree=lean_chunks_agree)
