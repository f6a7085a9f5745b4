"""Weight sync: push sharded parameters from trainer ranks into serving engines over gRPC.

Public API (imported lazily so `weight_sync.config` and `python -m weight_sync --help` stay free of torch):
`WeightSyncConfig`, `TensorSpec`, `WeightSink`, `StateDictSink`, `SafetensorsDirSink`, `WeightReceiver`,
`WeightSender`, `Shard`, `PushReport`, `checkpoint_shards`. Protocol: `protos/weight_sync.proto`.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "WeightSyncConfig": "weight_sync.config",
    "TensorSpec": "weight_sync.spec",
    "WeightSink": "weight_sync.sink",
    "StateDictSink": "weight_sync.sink",
    "SafetensorsDirSink": "weight_sync.sink",
    "WeightReceiver": "weight_sync.receiver",
    "WeightSender": "weight_sync.sender",
    "Shard": "weight_sync.sender",
    "PushReport": "weight_sync.report",
    "checkpoint_shards": "weight_sync.checkpoint",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'weight_sync' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
