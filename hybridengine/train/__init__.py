"""Training: batches and micro-batch planning, the trainer (per-unit gather, prefetch, activation
checkpointing, reduce-scatter), the flat-shard AdamW and the advantage estimators."""
