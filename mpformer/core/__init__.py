"""The pure core: what a run is, before any process or tensor exists.

errors.py         ConfigError, format_choices, user_errors_to_exit
model_config.py   ModelConfig (HF-compatible names)
layout.py         ParallelLayout and validate(): every layout rule, incl. the schedule arguments
topology.py       rank <-> coordinate arithmetic (tp fastest, then cp, dp, pp)
sequence.py       the zigzag split of a sequence over cp ranks (segments of global positions)
partition.py      transformer layers -> pipeline stages
pipeline_plan.py  StagePlan: the layers one pipeline rank holds
buffers.py        parameters packed into padded buckets, each rank's shard and its pieces (ZeRO's arithmetic)
shards.py         Shard: the block of a global tensor a rank holds
config.py         the typed config sections Hydra composes into
composed.py       Composed (a composed run config) and the config tree's location

Nothing here imports torch.distributed or any other mpformer package; import-linter checks it.
"""
