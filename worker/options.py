"""Dataclass fields as command-line options: one `--flag` per field, `PAGEDQ_<FIELD>` as its default.

`EngineConfig` and `ServiceConfig` both describe their options this way, so a flag, its env var and
the config field always share one name.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import field
from typing import Any

ENV_PREFIX = "PAGEDQ_"


def option(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field with its `--help` text (and optionally `type=` for argparse)."""
    return field(default=default, metadata={"help": help, **meta})


def add_cli_args(cls: type, parser: argparse.ArgumentParser, group: str, *, skip: tuple[str, ...] = ()) -> None:
    """One `--flag` per field of `cls` that carries help text (env `PAGEDQ_<FIELD>` as the default)."""
    g = parser.add_argument_group(group)
    for f in dataclasses.fields(cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        flag = "--" + f.name.replace("_", "-")
        env = os.environ.get(ENV_PREFIX + f.name.upper())
        default = f.default if env is None else env
        if f.type in ("bool", bool):
            if isinstance(default, str):
                default = default.lower() in ("1", "true", "yes", "on")
            g.add_argument(flag, default=default, action=argparse.BooleanOptionalAction, help=f.metadata["help"])
            continue
        conv = f.metadata.get("type") or _converter(f.type)
        g.add_argument(flag, default=default, type=conv, help=f.metadata["help"])


def from_cli_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)


def _converter(type_name: Any):
    text = str(type_name)
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str
