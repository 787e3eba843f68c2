"""Higher-level trainers driving a `HybridEngine`.

`hybridengine.integrations.trl`: TRL's `GRPOTrainer` with rollout and the optimizer step on the
engine (`HybridGRPOTrainer`; needs the `trl` extra: `pip install hybridengine[trl]`). Each module
imports its framework on import, so this package itself imports nothing beyond hybridengine.
"""
