"""The switch trial and what it switches: settings measured on the run's own first steps (T18, T21, T23, T25).

- `autoswitch`: `SwitchStage`, the trainer's measured choice of precision, channels_last, fused kernels and
  threads;
- `trial_size`: how many rounds and steps a run affords the trial, and the decisions it writes;
- `switches`, `switch_choice`: `LiveTrial`, the trial's schedule, and the settings it chooses among
  (`Switches`, `candidate_grid`) with the choice (its rounds timed by `train.rounds`);
- `shadow`: candidates timed apart from the run's numerics, paced over the run;
- `trial_safety`, `user_state`: a candidate never ends a run, and the user's own state is put back;
- `half_fallback`: a half precision the run did not ask for gives way to fp32 when its gradients break;
- `pool`: a close cached choice measured again by the next runs, their timed steps pooled;
- what is switched: `precision` (T21), `memory_format` (channels_last, T23), `compile` (torch.compile, T25),
  `backends` (cudnn.benchmark T22, TF32, CPU threads), `dynamo_deferred` (torch's optimizers without
  importing torch._dynamo where nothing compiles, T42).

Nothing is gathered here: import each name from its module.
"""
