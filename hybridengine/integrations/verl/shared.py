"""The process-local HybridEngine that verl's training engine and rollout share (verl's HYBRID mode).

In an `ActorRolloutRefWorker` verl builds the actor's training engine first (`BaseEngine.initialize`) and
the rollout after it, and neither holds a reference to the other. The training engine (engine.py) offers
a factory here at `initialize`; the rollout (rollout.py) sets the engine options that are the rollout's
to decide (`configure`: tp_generation, gpu_memory_utilization, max_model_len, exact_logprobs, ...) and
takes the engine with `get`. The engine is built at the first `get`, so that options set by the rollout
after the training engine's `initialize` still reach its construction (the TP degree of generation fixes
the buffer's layout, exact mode the kernels). One engine per process: a second offer raises.

Nothing here imports verl.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable

from hybridengine.config import EngineConfig
from hybridengine.engine import HybridEngine

__all__ = ["configure", "get", "is_built", "offer", "options", "reset"]

_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(EngineConfig))

_lock = threading.Lock()
_factory: Callable[[dict], HybridEngine] | None = None
_owner: str | None = None
_options: dict = {}
_engine: HybridEngine | None = None


def offer(factory: Callable[[dict], HybridEngine], *, owner: str) -> None:
    """Register how this process's engine is built: `factory(options)` -> HybridEngine, where options are
    the EngineConfig fields set by `configure`. owner: who offers (named in errors). A second offer raises
    (one engine per process) unless `reset` ran in between."""
    global _factory, _owner
    if not callable(factory):
        raise ValueError(f"offer: factory must be a callable options -> HybridEngine, got {type(factory).__name__}")
    with _lock:
        if _factory is not None:
            raise RuntimeError(f"offer: this process already has a hybridengine engine (offered by {_owner}); "
                               f"verl's HYBRID mode holds one actor engine per worker process")
        _factory, _owner = factory, owner


def configure(**fields) -> None:
    """Set EngineConfig fields for the engine's construction (the rollout's: tp_generation,
    gpu_memory_utilization, max_model_len, exact_logprobs, ...). Before the engine is built they are merged
    into the options (a field set twice to different values raises); after, a value that differs from the
    built engine's config raises, since the engine cannot change it any more."""
    unknown = sorted(set(fields) - _OPTION_NAMES)
    if unknown:
        raise ValueError(f"configure: {', '.join(unknown)} not EngineConfig field(s); the fields are "
                         f"{', '.join(sorted(_OPTION_NAMES))}")
    with _lock:
        if _engine is not None:
            built = {name: getattr(_engine.config, name) for name in fields}
            differ = {k: (v, built[k]) for k, v in fields.items() if v != built[k]}
            if differ:
                detail = ", ".join(f"{k}={new!r} (built with {old!r})" for k, (new, old) in differ.items())
                raise RuntimeError(f"configure: the engine is already built; it cannot take {detail}")
            return
        clash = {k: (_options[k], v) for k, v in fields.items() if k in _options and _options[k] != v}
        if clash:
            detail = ", ".join(f"{k}: {old!r} vs {new!r}" for k, (old, new) in clash.items())
            raise ValueError(f"configure: set twice to different values: {detail}")
        _options.update(fields)


def options() -> dict:
    """A copy of the EngineConfig fields set so far by `configure`."""
    with _lock:
        return dict(_options)


def get() -> HybridEngine:
    """This process's engine, built at the first call from the offered factory and the configured options.
    Raises RuntimeError when no training engine offered one (the actor's strategy is not hybridengine, or
    its `initialize` has not run)."""
    global _engine
    with _lock:
        if _engine is None:
            if _factory is None:
                raise RuntimeError("no hybridengine engine in this process: the rollout 'hybridengine' needs the "
                                   "actor's training engine 'hybridengine' in the same worker "
                                   "(actor_rollout_ref.actor.strategy=hybridengine, rollout mode 'hybrid'), "
                                   "initialized before the engine is used")
            engine = _factory(dict(_options))
            if not isinstance(engine, HybridEngine):
                raise RuntimeError(f"the factory offered by {_owner} returned {type(engine).__name__}, "
                                   f"not a HybridEngine")
            _engine = engine
        return _engine


def is_built() -> bool:
    """Whether `get` has built the engine."""
    return _engine is not None


def reset() -> None:
    """Forget the factory, the options and the engine (tests; a worker that re-initializes)."""
    global _factory, _owner, _engine
    with _lock:
        _factory, _owner, _engine = None, None, None
        _options.clear()
