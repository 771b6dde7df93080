"""The language-model workload: a small GPT on bytes of real text every machine has.

- `stdlib_text`: the Python standard library's own source files (the top-level `.py`
  files of `sysconfig`'s stdlib folder, in sorted order, capped at `max_bytes`): real text
  with no download, the same wherever the same Python version runs. Where no stdlib source
  is found (an embedded or zipped Python), it falls back to torch's own Python source and
  says so in `source`.
- `ByteWindows`: fixed-length windows of those bytes, x = bytes[i:i+T], y = bytes[i+1:i+T+1]
  (int64, vocabulary 256), at offsets drawn from a seed; `byte_text_datasets` splits the
  stream into a train part (the first 90%) and a val part (the rest), so no window is in both.
- `GPT`: nanoGPT-style: token + position embeddings, pre-LayerNorm blocks of causal
  self-attention through `F.scaled_dot_product_attention` (fused kernels) and a GELU MLP, a
  final LayerNorm and an LM head tied to the token embedding. `forward(idx)` returns logits
  (B, T, V). The vocabulary is padded to a multiple of 64 (T24: sizes that are multiples of
  8, 64 on A100+, keep the Tensor Cores busy; bytes need none, 256 already is one).

Example:
    >>> train, val = byte_text_datasets(train_size=2048, val_size=256, block_size=128)
    >>> logits = GPT()(train[0][0][None])        # (1, 128, 256)
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

__all__ = ["stdlib_text", "ByteWindows", "byte_text_datasets", "GPT", "GPTConfig", "TEXT_BYTES"]

TEXT_BYTES = 4_000_000  # the cap on bytes read: enough text, a fraction of a second to read


@dataclass(frozen=True)
class TextSource:
    data: torch.Tensor  # uint8, one byte per element
    source: str         # what was read, in words


def _py_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.py") if p.is_file()) if folder.is_dir() else []


def stdlib_text(max_bytes: int = TEXT_BYTES) -> TextSource:
    """The bytes of the stdlib's top-level `.py` files in sorted order, at most `max_bytes`."""
    import os

    files = _py_files(Path(sysconfig.get_paths()["stdlib"])) or _py_files(Path(os.__file__).parent)
    source = "the Python standard library's source"
    if not files:
        import warnings

        files = sorted(Path(torch.__file__).parent.rglob("*.py"))
        source = "torch's Python source (no standard-library source files were found)"
        warnings.warn(f"text workload: no .py files in the standard library; using {source}", stacklevel=2)
    chunks, total = [], 0
    for f in files:
        b = f.read_bytes()
        chunks.append(b[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    data = torch.frombuffer(bytearray(b"\n".join(chunks)[:max_bytes]), dtype=torch.uint8)
    if data.numel() < 10_000:
        raise RuntimeError(f"text workload: only {data.numel()} bytes of text found in {source}")
    return TextSource(data, f"{source}, {len(chunks)} files, {data.numel():,} bytes")


class ByteWindows(Dataset):
    """`n` windows of `block_size` bytes of `data` at offsets drawn from `seed`; (x, y) int64, y = x shifted by one."""

    def __init__(self, data: torch.Tensor, n: int, *, block_size: int = 128, seed: int = 0):
        if data.numel() < block_size + 2:
            raise ValueError(f"{data.numel()} bytes cannot hold a window of {block_size + 1}")
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, data.numel() - block_size - 1, (n,), generator=g)
        idx = starts[:, None] + torch.arange(block_size + 1)
        windows = data[idx].long()  # (n, T + 1), held in memory (T10)
        self.x, self.y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        self.starts, self.block_size, self.vocab_size = starts, block_size, 256

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def byte_text_datasets(*, train_size: int = 4096, val_size: int = 512, block_size: int = 128, seed: int = 0,
                       max_bytes: int = TEXT_BYTES, val_fraction: float = 0.1) -> tuple[ByteWindows, ByteWindows]:
    """(train, val) windows: train from the first 90% of the text, val from the last 10%."""
    text = stdlib_text(max_bytes)
    cut = int(text.data.numel() * (1 - val_fraction))
    train = ByteWindows(text.data[:cut], train_size, block_size=block_size, seed=seed)
    val = ByteWindows(text.data[cut:], val_size, block_size=block_size, seed=seed + 10_000)
    train.source = val.source = text.source
    return train, val


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    pad_vocab_to: int = 64  # T24; 1 leaves the vocabulary as it is


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # flash / memory-efficient kernels
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small GPT language model; `forward(idx)` with idx (B, T) int64 returns logits (B, T, padded vocab)."""

    def __init__(self, cfg: GPTConfig | None = None, **overrides):
        super().__init__()
        cfg = GPTConfig(**overrides) if cfg is None else cfg
        self.cfg = cfg
        m = max(cfg.pad_vocab_to, 1)
        self.vocab_size = (cfg.vocab_size + m - 1) // m * m  # padded rows are never targets: they stay unlikely
        self.tok = nn.Embedding(self.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.Sequential(*(Block(cfg) for _ in range(cfg.n_layer)))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, self.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied: one matrix for input and output tokens
        for name, p in self.named_parameters():
            if p.dim() > 1:  # GPT-2's init; residual projections scaled by depth
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.blocks(self.tok(idx) + self.pos(pos))
        return self.head(self.ln_f(x))
