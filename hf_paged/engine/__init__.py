"""Continuous batching on top of `KVPool`: `Engine` (see `engine.py`), its scheduler and the packed step."""

from .engine import Engine, EngineStats
from .outputs import TokenEvent, TokenLogprobs

__all__ = ["Engine", "EngineStats", "TokenEvent", "TokenLogprobs"]
