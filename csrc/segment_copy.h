// Fused segment-table copy: dst[d:d+n] = src[s:s+n] for every row (s, d, n) of a table.
// Plain C/CUDA interface (raw pointers, sizes, a stream) so the .cu file needs only CUDA headers.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace hybridengine {

// table: device pointer to num_segments rows of (src, dst, numel) in elements (int64).
// Rows whose range falls outside [0, src_numel) / [0, dst_numel) are skipped, never written.
// max_blocks > 0 bounds the grid (its blocks stride over the rows): a copy that runs beside an
// NCCL collective then leaves SMs free for the collective's next kernel. 0: one block per kWarps rows.
// Returns the launch error (cudaSuccess on success).
cudaError_t segment_copy_cuda(const void* src, void* dst, const int64_t* table, int64_t num_segments,
                              int64_t element_size, int64_t src_numel, int64_t dst_numel, int64_t max_blocks,
                              cudaStream_t stream);

}  // namespace hybridengine
