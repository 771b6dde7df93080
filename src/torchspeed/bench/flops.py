"""Model FLOPs utilisation (MFU) for the bench: model FLOPs per second over the device's peak.

The FLOPs of one training step are counted by PyTorch's own `FlopCounterMode` on the meta
device (no memory, no compute: shapes only), forward and backward, matrix multiplications
and convolutions (2 FLOPs per multiply-add, the usual MFU convention); for `gpt` a sample is
one window of tokens and attention counts in full (no causal halving). The peak is the
GPU's dense bf16 Tensor Core rate from its datasheet, so fp32 rows are measured against
the same ceiling as bf16 rows and the column says how much of the chip each loop uses.

Example:
    >>> per_sample = train_flops_per_sample("resnet50", image_size=224)   # about 24.3e9
    >>> mfu(samples_per_s=3000, flops_per_sample=per_sample, device_name="NVIDIA H100 80GB HBM3")
"""

from __future__ import annotations

import functools

import torch

from torchspeed.bench.workloads import create_model, example_input

__all__ = ["train_flops_per_sample", "peak_bf16_flops", "mfu", "PEAK_BF16_TFLOPS"]

# Dense (no sparsity) bf16 Tensor Core peaks in TFLOP/s, from NVIDIA's datasheets, matched on
# the name torch reports (longest key first).
PEAK_BF16_TFLOPS = {
    "H200": 989.4, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.4, "GH200": 989.4,
    "B200": 2250.0, "A100": 312.0, "A10G": 70.0, "A10": 125.0, "L40S": 362.1, "L4": 121.0,
    "RTX 4090": 165.2, "RTX 3090": 71.0, "A6000": 154.8,
}


@functools.lru_cache(maxsize=32)
def train_flops_per_sample(model: str, *, image_size: int = 32, num_classes: int = 10) -> float:
    """Forward + backward FLOPs of one sample of bench model `model` (counted on the meta device)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        m = create_model(model, num_classes=num_classes, image_size=image_size)
        x = example_input(model, 2, image_size=image_size)  # images, or token ids for `gpt` (a sample: one window)
    with FlopCounterMode(display=False) as counter:
        m(x).sum().backward()
    return counter.get_total_flops() / 2


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by name, in FLOP/s; None when unknown (and for CPUs)."""
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in device_name:
            return PEAK_BF16_TFLOPS[key] * 1e12
    return None


def mfu(*, samples_per_s: float, flops_per_sample: float, device_name: str) -> float | None:
    """Fraction of the device's dense bf16 peak that the model's FLOPs reach (None when the peak is unknown)."""
    peak = peak_bf16_flops(device_name)
    return samples_per_s * flops_per_sample / peak if peak else None
