"""Layout-free checkpoints.

manifest.py      the manifest, ``latest`` and the atomic directory write (pure file operations, run
                 before torch.distributed is loaded, which keeps bad-input exits fast)
shards.py        DCP planners that save and load exactly a rank's shards
rows.py          per-parameter tensors (optimizer state, masters) as chunks by canonical name and slice
io.py            save, load and read back (DCP)
checkpointer.py  the run's stateful parts saved and restored in one resume order

Import what you need from those modules; this package imports nothing so that the manifest checks
stay light.
"""
