"""Unicron's training runtime. The in-place API is importable from here::

    from unicron.runtime import ConfigError, DataContext, ModelContext, ModelType, pretrain

The names are loaded on first use: ``unicron --help`` and the agent import submodules of this package
(flags, store) that must not pull in torch and Megatron-core.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from unicron.kernel.errors import ConfigError
    from unicron.runtime.api import pretrain
    from unicron.runtime.job import DataContext, MicroBatches, ModelContext
    from unicron.runtime.model import ModelType

__all__ = ["ConfigError", "DataContext", "MicroBatches", "ModelContext", "ModelType", "pretrain"]

_WHERE = {"ConfigError": "unicron.kernel.errors", "pretrain": "unicron.runtime.api", "DataContext": "unicron.runtime.job",
          "MicroBatches": "unicron.runtime.job", "ModelContext": "unicron.runtime.job", "ModelType": "unicron.runtime.model"}


def __getattr__(name: str) -> object:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'unicron.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(where), name)
