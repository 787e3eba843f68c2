"""Training: `batch` (PPOBatch, micro-batch planning), `config` (TrainConfig, PPOConfig, ValueConfig),
`losses` (token-level losses for `train_step`: PPO clip, GSPO, CISPO, SFT, DPO), `trainer`
(per-unit gather and prefetch, activation checkpointing, reduce-scatter, the step), `released_params`
(activations kept over released parameters), `packed_attention`, `optimizer` (the flat-shard AdamW)
and `advantages` (GAE, GRPO and friends)."""
