"""Continuous batching on top of `KVPool`: `Engine` (see `engine.py`), its scheduler and the packed step."""

from .engine import Engine, EngineStats

__all__ = ["Engine", "EngineStats"]
