"""Higher-level trainers driving a `HybridEngine`.

`hybridengine.integrations.trl`: TRL's `GRPOTrainer` with rollout and the optimizer step on the
engine (`HybridGRPOTrainer`; needs the `trl` extra: `make setup EXTRAS=dev,bench,trl`), and
`hybridengine.integrations.trl_loss`, its GRPO objective in plain torch (no TRL needed). Each module
imports its framework on import, so this package itself imports nothing beyond hybridengine.
"""
