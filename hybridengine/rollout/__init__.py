"""Rollout: sequences, the paged-KV block manager, the continuous-batching scheduler, the model
runner (KV cache, batch preparation, CUDA graphs) and the sampler. Block bookkeeping is plain
Python; tensors appear only where the runner prepares a batch."""
