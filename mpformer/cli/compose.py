"""Hydra at the edge: compose configs/ + command-line overrides into a typed ``Config``.

We use Hydra's compose API rather than ``@hydra.main`` for two reasons: (1) every mistake becomes one
ConfigError line that names the key and the valid alternatives (Hydra's own messages span several
lines and point at internals), and (2) under torchrun every rank composes the same config without
each creating its own timestamped output directory; rank 0 decides the run directory and shares it.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from mpformer.core.composed import Composed, config_dir
from mpformer.core.config import Config
from mpformer.core.errors import ConfigError, format_choices

SCHEMA_NAME = "mpformer_schema"
# Groups picked in configs/config.yaml's defaults list; `cluster` belongs to the auto-configurator.
GROUPS = ("model", "parallel", "train", "optim", "data", "checkpoint", "logging", "eval", "experiment")


def _register_schema() -> None:
    ConfigStore.instance().store(name=SCHEMA_NAME, node=Config)


def _fields(cls: type) -> dict[str, typing.Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _check_key(path: list[str]) -> None:
    cls: typing.Any = Config
    for depth, part in enumerate(path):
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            return  # below a leaf (e.g. list index): leave it to OmegaConf
        fields = _fields(cls)
        if part not in fields:
            where = ".".join(path[:depth]) or "the top level"
            raise ConfigError(f"unknown config key '{'.'.join(path)}'; valid keys under {where}: "
                              f"{format_choices(sorted(fields))}")
        cls = fields[part]


def _group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


def _precheck(overrides: list[str]) -> None:
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise ConfigError(f"cannot parse overrides: {' '.join(str(e).split())}") from None
    for o in parsed:
        key = o.key_or_group
        if key == "hydra" or key.startswith("hydra."):
            continue  # e.g. hydra.run.dir; Hydra checks these itself
        if o.is_add() or o.is_force_add() or o.is_delete():
            raise ConfigError(f"override '{o.input_line}': adding or deleting keys is not allowed (configs are "
                              f"strict); set an existing key instead")
        if "." not in key and (config_dir() / key).is_dir():
            value = o.value()
            if key not in GROUPS:
                raise ConfigError(f"config group '{key}' is not used by this command; valid groups: "
                                  f"{format_choices(GROUPS)}")
            options = _group_options(key)
            if value not in options:
                raise ConfigError(f"{key}={value}: no such preset in configs/{key}; valid: {format_choices(options)}")
            continue
        _check_key(key.split("."))


def _cluster_alias(overrides: list[str]) -> list[str]:
    """``cluster=NAME`` (the documented spelling) is ``autoconfig.cluster=NAME``, checked against the presets;
    ``checkpoint.async=B`` is ``checkpoint.async_save=B``."""
    out = []
    for o in overrides:
        key, sep, value = o.partition("=")
        if key.lstrip("+") in ("checkpoint.async", "checkpoint.async_save"):  # `async` is a Python keyword
            if value.lower() not in ("true", "false"):
                raise ConfigError(f"{key}={value!r}; valid: true, false")
            o = f"checkpoint.async_save{sep}{value}"
        if sep and key in ("cluster", "autoconfig.cluster") and value not in ("null", ""):
            names = _group_options("cluster")
            if value not in names and not Path(value).is_file():
                raise ConfigError(f"unknown cluster {value!r}; valid: {format_choices(names)} (or a path to a cluster "
                                  "YAML)")
            o = f"autoconfig.cluster={value}"
        out.append(o)
    return out


def compose_config(overrides: list[str], config_name: str = "config") -> Composed:
    """Compose and type-check; raises ConfigError with one line on any mistake."""
    overrides = _cluster_alias(list(overrides))
    _precheck(overrides)
    _register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            raw = compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
        run_dir = str(OmegaConf.select(raw, "hydra.run.dir"))
        with open_dict(raw):
            del raw["hydra"]  # Hydra's own node has job/sweep values only @hydra.main fills in
        plain = OmegaConf.to_container(raw, resolve=True)
        resolved = OmegaConf.merge(OmegaConf.structured(Config), plain)
        cfg = OmegaConf.to_object(resolved)
    except MissingConfigException as e:
        raise ConfigError(" ".join(str(e).split())) from None
    except (HydraException, OmegaConfBaseException) as e:
        cause = e.__cause__ if e.__cause__ is not None else e
        key, msg = getattr(cause, "full_key", None), (getattr(cause, "msg", None) or str(cause)).split("\n")[0]
        text = f"{key}: {msg}" if key else msg
        if key and "ListConfig" in msg:  # e.g. data.paths=/x: say what a list looks like on the command line
            text = text.rstrip(".") + f"; a list is written in brackets, e.g. {key}=[a,b]"
        if key and "is not a valid bool" in msg:  # e.g. autoconfig.explain=maybe: OmegaConf does not say what is
            text = text.rstrip(".") + "; valid: true, false"
        raise ConfigError(" ".join(text.split())) from None
    finally:
        GlobalHydra.instance().clear()
    assert isinstance(cfg, Config)
    return Composed(cfg=cfg, raw=resolved, run_dir=run_dir, overrides=overrides)
