"""Rollout: what `HybridEngine.generate` runs between `rollout()`'s switch and its exit.

`sampling_params` (per-request settings), `sequence` (a prompt or sample and its block table),
`block_manager` (paged-KV blocks, reference counts, copy-on-write), `scheduler` (continuous batching,
preemption), `kv_cache` (the cache and its size), `runner` (batch preparation, one model step, CUDA
graphs), `sampler` (the torch and fused samplers and the choice between them), `generator` (the
loop with async decode) and `outputs`. Block bookkeeping is plain Python; tensors appear only where
the runner prepares a batch.
"""
