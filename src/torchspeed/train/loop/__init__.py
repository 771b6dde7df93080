"""The loop and its step: what `Trainer` runs every batch, and what it reads and reports on the way.

- `trainer`: `Trainer`, which composes the techniques and holds none of them;
- `setup`: `TrainerSetup`, the steps of the trainer's construction that stand apart (its loss, optimizer,
  checkpoints and the parts that run the steps);
- `step`: the optimizer step with accumulation, clipping and loss scaling (T19, T20, T21);
- `lean_step`: torch's Adam/AdamW/SGD step without its per-step Python, and Schedule-Free AdamW's through
  `train/lean_schedulefree.py` (T51, T42), its foreach ops through `train/lean_kernels.py` (a large Adam group's a
  piece at a time);
- `batch`, `model_call`, `model_output`, `batch_notes`: the batch contract (what a batch may be, how a loss comes
  out of it), how a model is called with a batch's inputs, how its output is read (T13), and what a first step's
  error is told besides torch's words;
- `guard`: a non-finite loss skipped (T21's skip, for bf16 and fp32 too), running out of memory explained;
- `callbacks`: the events, `EarlyStopping` and `EMA` (T40);
- `progress`, `metrics`: progress bars and metrics kept on the device (T13);
- `segment`, `run_length`: how long a run is, and a finished run extended by a new segment (T14, T16, T17).

Nothing is gathered here: import each name from its module.
"""
