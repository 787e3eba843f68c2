"""Rollout: what `HybridEngine.generate` and the request API run between `rollout()`'s switch and its exit.

`sampling_params` (per-request settings), `sequence` (a prompt or sample and its block table),
`block_manager` (paged-KV blocks, reference counts, copy-on-write, the prefix cache), `scheduler`
(continuous batching, preemption), `kv_cache` (the cache and its size), `runner` (batch preparation,
one model step, CUDA graphs), `sampler` (the torch and fused samplers and the choice between them),
`requests` (one rollout's requests: add, step, abort, async waiters, partial rollouts), `generator`
(the batch call over it, async decode) and `outputs`. Block bookkeeping is plain Python; tensors appear only where
the runner prepares a batch.
"""
