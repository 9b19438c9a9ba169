"""Continuous batching on top of `KVPool`: `Engine` (see `engine.py`), its scheduler and the packed step."""

from .engine import Engine, EngineStats
from .outputs import Generated, TokenEvent, TokenLogprobs

__all__ = ["Engine", "EngineStats", "Generated", "TokenEvent", "TokenLogprobs"]
