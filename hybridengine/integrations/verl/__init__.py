"""hybridengine as a verl backend: the actor's training engine (backend "hybridengine") and the rollout
(name "hybridengine", verl's HYBRID mode) on one HybridEngine per worker process, with no weight sync.

verl imports this package at its own import through the entry point group "verl.plugins" (pyproject.toml);
the import registers the training engine in verl's `EngineRegistry`, the rollout in verl's rollout registry
and replica registry, and a CPU platform ("cpu", chosen with VERL_PLATFORM=cpu). A verl run then selects
them with

    actor_rollout_ref.actor.strategy=hybridengine actor_rollout_ref.rollout.name=hybridengine

How to run it: docs/integrations/verl.md.
"""

try:
    import verl  # noqa: F401
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("hybridengine.integrations.verl needs verl: `make setup-verl` (a venv with the verl extra, "
                      "constraints-verl.txt) or `pip install --no-build-isolation -e '.[verl]'`") from e

# The platform first: verl's engine modules (imported by engine.py) read the platform at their import, and
# with VERL_PLATFORM=cpu it must be registered by then.
from hybridengine.integrations.verl.platform import CPUPlatform, register_platform

register_platform()

from verl.workers.rollout import base as _rollout_base  # noqa: E402
from verl.workers.rollout.replica import RolloutReplicaRegistry  # noqa: E402

from hybridengine.integrations.verl.engine import HybridVerlEngine, register_engine  # noqa: E402
from hybridengine.integrations.verl.rollout import HybridEngineReplica, HybridEngineRollout, HybridEngineServer  # noqa: E402,E501

__all__ = ["BACKEND", "CPUPlatform", "HybridEngineReplica", "HybridEngineRollout", "HybridEngineServer",
           "HybridVerlEngine", "register"]

BACKEND = "hybridengine"


def _replica_class() -> type[HybridEngineReplica]:
    return HybridEngineReplica


def register() -> None:
    """Register the engine, the rollout and the CPU platform with verl (idempotent; the import runs it)."""
    register_engine()
    # verl 0.9.1 has no public call to add a rollout class: get_rollout_class reads this table.
    _rollout_base._ROLLOUT_REGISTRY[(BACKEND, "async")] = f"{HybridEngineRollout.__module__}.HybridEngineRollout"
    RolloutReplicaRegistry.register(BACKEND, _replica_class)
    register_platform()


register()
