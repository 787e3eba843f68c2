"""What Triton made of the paged decode kernel on this GPU: cp.async (software pipelining) and global-load
counts, registers, spills and shared memory per launch config, at the 1.5B decode shape (B = 128, 2 kv heads).
Run: python -m bench.probe_decode_kernel (CUDA only)."""
import torch, math
from hybridengine import attention as A
from hybridengine.kernels import paged_attention as K
dev = torch.device("cuda")
B, H, KV, D, ctx, bs = 128, 12, 2, 128, 256, 16
q = torch.randn(B, H, D, dtype=torch.bfloat16, device=dev)
nb = B * ctx // bs
kc = torch.randn(nb, bs, KV, D, dtype=torch.bfloat16, device=dev); vc = torch.randn_like(kc)
tables = torch.randperm(nb, device=dev).view(B, -1).int(); lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
for cfg in (None, dict(PREFETCH=True), dict(BLOCK_N=64, num_stages=1, PREFETCH=True), dict(BLOCK_N=128, num_warps=8, num_stages=1, PREFETCH=True)):
    A.paged_decode_attention_triton(q, kc, vc, tables, lens, scale=D**-0.5, num_splits=1, config=cfg)
for dev_cache in K.paged_decode_kernel.device_caches.values():
    for key, k in dev_cache[0].items():
        ptx = k.asm["ptx"]
        print("cp.async", ptx.count("cp.async"), "ld.global", ptx.count("ld.global"), "regs", k.n_regs, "spills", k.n_spills,
              "shared", k.metadata.shared, "warps", k.metadata.num_warps, "stages", k.metadata.num_stages)
