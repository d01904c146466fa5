from mpformer.checkpoint.io import load_checkpoint, read_all_tensors, save_checkpoint
from mpformer.checkpoint.manifest import read_manifest, resolve_checkpoint_dir

__all__ = ["load_checkpoint", "read_all_tensors", "read_manifest", "resolve_checkpoint_dir", "save_checkpoint"]
