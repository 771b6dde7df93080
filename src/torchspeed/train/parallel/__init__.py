"""Training on several processes: DDP and FSDP2 on PyTorch's own engine (T31).

- `distributed`: the process group, DistributedDataParallel, reduced metrics, the LR scaled with the world
  size (T31, T17);
- `rank_exit`: a rank ended without the interpreter teardown that can abort it (`exit_process`, T31);
- `fsdp`: sharded data parallelism on FSDP2 (`fully_shard`);
- `shard`: each rank's share of the data (DistributedSampler loaders, evaluation shards).

(Named `parallel`, not `distributed`: the module `distributed` lives inside it.) Nothing is gathered here:
import each name from its module.
"""
