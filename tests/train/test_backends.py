"""TF32 through one API: the legacy flags, which torch.get_float32_matmul_precision() can read (Lightning
reads it), and the per-backend fp32_precision settings only where the process already uses them."""

from types import SimpleNamespace as NS

import pytest
import torch

from torchspeed.train.backends import enable_tf32


class _Mixed:
    """A backend whose legacy flag no longer reads: the per-backend API was written in this process."""

    fp32_precision = "ieee"

    @property
    def allow_tf32(self):
        raise RuntimeError("mix of the legacy and new APIs")


def test_tf32_sets_the_legacy_flags_that_every_reader_can_read():
    b = NS(cuda=NS(matmul=NS(allow_tf32=False, fp32_precision="none")),
           cudnn=NS(allow_tf32=False, conv=NS(fp32_precision="none"), rnn=NS(fp32_precision="none")))
    how = enable_tf32(b)
    assert b.cuda.matmul.allow_tf32 and b.cudnn.allow_tf32 and "allow_tf32" in how
    assert b.cuda.matmul.fp32_precision == "none"  # the per-backend API left alone: no mixed state


def test_tf32_uses_the_per_backend_settings_where_the_process_already_uses_them():
    b = NS(cuda=NS(matmul=_Mixed()), cudnn=NS(conv=NS(fp32_precision="none"), rnn=NS(fp32_precision="none")))
    how = enable_tf32(b)
    assert (b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision, b.cudnn.rnn.fp32_precision) == ("tf32",) * 3
    assert "fp32_precision" in how


def test_tf32_on_this_torch_leaves_the_matmul_precision_readable():
    """The GPU check's Lightning row failed with "mix of the legacy and new APIs" after fit set TF32 per backend."""
    m, c = torch.backends.cuda.matmul, torch.backends.cudnn
    try:
        saved = (m.allow_tf32, c.allow_tf32)
    except RuntimeError:
        pytest.skip("an earlier test left this process on the per-backend API")
    try:
        enable_tf32()
        assert torch.get_float32_matmul_precision() == "high" and m.allow_tf32
        if hasattr(m, "fp32_precision"):
            assert m.fp32_precision == "tf32"  # torch maps the legacy flag onto the per-backend setting
    finally:
        m.allow_tf32, c.allow_tf32 = saved
