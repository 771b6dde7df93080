"""Child process of the kill test: train a tiny MLP with an EMA and a checkpoint every step, resuming if asked.

usage: python _kill_child.py CHECKPOINT_DIR FINAL_PATH [--resume] [--fsdp2] [--steps N]

--fsdp2 trains the model sharded (FSDP2 in a 1-process group) with DCP checkpoint folders;
--steps N stops after N optimizer steps (default: all 240).

Prints "resumed <step>" when it continued from a checkpoint and writes the final weights and the
EMA's state (its averaged weights and update count) to FINAL_PATH when training ends. Deterministic: one thread, deterministic kernels, fixed seeds.
"""

import sys

import torch

torch.set_num_threads(1)

from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import torchspeed  # noqa: E402
from torchspeed.train.loop.callbacks import EMA  # noqa: E402
from torchspeed.train.state.checkpoint import save_checkpoint  # noqa: E402
from torchspeed.train.sampler import ResumableSampler  # noqa: E402

EPOCHS, N, BATCH = 3, 640, 8  # 80 batches per epoch, 240 optimizer steps


def main() -> None:
    ckpt_dir, final_path = sys.argv[1], sys.argv[2]
    resume = "auto" if "--resume" in sys.argv else None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 16, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    ds = TensorDataset(x, y)
    loader = DataLoader(ds, batch_size=BATCH, sampler=ResumableSampler(ds, seed=3), num_workers=0)
    torch.manual_seed(0)
    # Dropout draws from the global generator every step: a resume with the wrong RNG state would differ.
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 3))
    fsdp2 = "--fsdp2" in sys.argv
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else None
    # The EMA's state is in every checkpoint: a resume that lost or repeated one update would differ.
    ema = None if fsdp2 else EMA(0.9, apply_at_end=False)
    result = torchspeed.fit(model, loader, epochs=EPOCHS, device="cpu", optimizer="adamw", lr=3e-3,
                            precision="fp32", compile=False, progress=False, deterministic=True, seed=0,
                            checkpoint_dir=ckpt_dir, checkpoint_every=1, keep_last=3, resume=resume,
                            max_steps=steps, parallel="fsdp2" if fsdp2 else "auto", callbacks=[ema] if ema else None)
    if "resumed_from" in result.decisions:
        print("resumed", result.decisions["resumed_from"], flush=True)
    from torchspeed.train.parallel.fsdp import full_state_dict  # the whole model (from its shards under FSDP2)

    final = {"model": full_state_dict(model), "steps": result.steps}
    if ema is not None:
        final["ema"] = ema.averaged.state_dict()
    save_checkpoint(final_path, final)
    print("done", result.steps, flush=True)


if __name__ == "__main__":
    main()
