"""Shared helpers for tests that run the trainer in-process."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ml_collections import ConfigDict

TINY = Path(__file__).resolve().parent / "tiny_config.py"


def load_tiny(**overrides: object) -> ConfigDict:
    """tests/tiny_config.py with overrides; `data_dir` sets config.data.dir."""
    spec = importlib.util.spec_from_file_location("tiny_config", TINY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    if "data_dir" in overrides:
        c.data.dir = overrides.pop("data_dir")
    for key, value in overrides.items():
        c[key] = value
    return c
