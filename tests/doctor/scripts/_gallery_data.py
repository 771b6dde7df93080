"""A sibling module the clean scripts import (the doctor must put the script's folder on sys.path)."""
import numpy as np
import torch
from sklearn.datasets import load_digits


def digits_tensors():
    d = load_digits()
    x = d.data.astype(np.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)   # normalized inputs
    return torch.from_numpy(x), torch.from_numpy(d.target).long()


def fast_bf16() -> bool:
    """bf16 autocast only where the hardware runs it natively."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
