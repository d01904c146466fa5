"""Reading and writing Hugging Face model folders (config.json + safetensors, one file or sharded).

Only safetensors is read: pickled ``pytorch_model.bin`` files can run code on load, and every HF
checkpoint we target is published as safetensors. Writing follows ``save_pretrained``: one
``model.safetensors``, or numbered shards plus ``model.safetensors.index.json`` above a size limit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mpformer.core.errors import ConfigError

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# The files that make up a tokenizer across fast/slow tokenizers and transformers 4/5.
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what} {path} is not valid JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must hold a JSON object")
    return data


def check_hf_dir(path: str | os.PathLike) -> Path:
    """An existing folder with config.json; pytorch_model.bin-only folders are refused."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"HF model folder {p} does not exist or is not a directory")
    if not (p / CONFIG).is_file():
        raise ConfigError(f"HF model folder {p} has no {CONFIG}")
    if not (p / SINGLE).is_file() and not (p / INDEX).is_file():
        found = [f for f in PICKLE_FILES if (p / f).is_file()]
        if found:
            raise ConfigError(f"HF model folder {p} has only {found[0]}; safetensors is required (load it in "
                              "transformers and save_pretrained(..., safe_serialization=True) first)")
        raise ConfigError(f"HF model folder {p} has neither {SINGLE} nor {INDEX}")
    return p


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    return _read_json(check_hf_dir(path) / CONFIG, "HF config")


def read_generation_config(path: str | os.PathLike) -> dict[str, Any] | None:
    p = Path(path) / GENERATION_CONFIG
    return _read_json(p, "HF generation config") if p.is_file() else None


def _shard_files(p: Path) -> list[Path]:
    if not (p / INDEX).is_file():
        return [p / SINGLE]
    index = _read_json(p / INDEX, "safetensors index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"safetensors index {p / INDEX} has no weight_map")
    files = sorted(set(weight_map.values()))
    for f in files:
        if not (p / f).is_file():
            raise ConfigError(f"safetensors index {p / INDEX} names shard {f}, which is missing")
    return [p / f for f in files]


def read_hf_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder in its stored dtype; the index (if any) must match the shards."""
    p = check_hf_dir(path)
    out: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for shard in _shard_files(p):
        try:
            with safe_open(str(shard), framework="pt") as f:
                for key in f.keys():
                    if key in out:
                        raise ConfigError(f"HF tensor {key} is stored twice ({where[key]} and {shard.name})")
                    out[key], where[key] = f.get_tensor(key), shard.name
        except SafetensorError as e:
            raise ConfigError(f"{shard} is not a readable safetensors file ({' '.join(str(e).split())}); it is "
                              "truncated or damaged") from None
    if (p / INDEX).is_file():
        weight_map = _read_json(p / INDEX, "safetensors index")["weight_map"]
        for key, shard_name in weight_map.items():
            if where.get(key) != shard_name:
                raise ConfigError(f"safetensors index lists {key} in {shard_name}, but it is "
                                  f"{'in ' + where[key] if key in where else 'in no shard'}")
        extra = sorted(set(out) - set(weight_map))
        if extra:
            raise ConfigError(f"HF tensor {extra[0]} is in {where[extra[0]]} but not in {INDEX}")
    return out


def write_hf_dir(path: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                 generation_config: dict[str, Any] | None, *,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write config.json, generation_config.json (if given) and safetensors into ``path`` (must exist)."""
    names = sorted(tensors)
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        nbytes = tensors[n].numel() * tensors[n].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes
    if len(shards) == 1:
        save_file({n: tensors[n] for n in names}, str(path / SINGLE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for k, shard in enumerate(shards, 1):
            fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: tensors[n] for n in shard}, str(path / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        _write_json(path / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(path / CONFIG, config)
    if generation_config is not None:
        _write_json(path / GENERATION_CONFIG, generation_config)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


