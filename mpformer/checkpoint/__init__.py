"""Layout-free checkpoints: manifest.py (pure checks, run before torch.distributed is loaded, which
keeps bad-input exits fast), shards.py (the DCP planners) and io.py (save, load, read back).
Import what you need from those modules; this package imports nothing so that the manifest checks
stay light."""
