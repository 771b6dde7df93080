"""State and checkpoints: what a run saves, how it resumes exactly, and the optimizer state kept flat.

- `checkpoint`: atomic writes, a checksum, safe loading (`save_checkpoint`, `load_checkpoint`,
  `CheckpointManager`);
- `store`: one folder of step checkpoints (names, listing, pruning, stale-file cleanup);
- `dcp`: sharded checkpoints with torch.distributed.checkpoint for FSDP2 runs (T31);
- `stateful`, `resume`: the trainer's stateful parts in one list, and which checkpoint a run continues (T14);
- `rng`: random-number state and deterministic mode (T22);
- `flat_state`: a group's optimizer moments in one flat buffer (T51).

Nothing is gathered here: import each name from its module.
"""
