"""A plain read of a buffer, the floor for kernels that read their bytes once (bench only)."""

import triton
import triton.language as tl


@triton.jit
def read_sum_kernel(X, Out, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Program p sums elements [p * ITERS * BLOCK, (p + 1) * ITERS * BLOCK) of X in fp32 into Out[p]."""
    pid = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):
        offs = (pid * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(Out + pid, tl.sum(acc, 0))
