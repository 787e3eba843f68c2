// CUDA kernel of the fused resharding copy. Includes only CUDA headers (CI compiles it with nvcc -c).
//
// One warp per table row, kWarps rows per block. Rows are pre-split to at most 32 KiB
// (prepare_table), so a long parameter still spreads over many warps, and short rows (a
// row-parallel weight's TP slice is a few KiB) do not leave most of a block idle, as a block per
// row would. When source and destination share their address modulo 16, the body moves in 16-byte
// vectors, kUnroll loads in flight per lane before the stores; otherwise the widest word both
// addresses and the length allow.
#include "segment_copy.h"

namespace hybridengine {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kUnroll = 4;

template <typename Word>
__device__ __forceinline__ void copy_words(const char* src, char* dst, int64_t nbytes, int lane) {
  const Word* s = reinterpret_cast<const Word*>(src);
  Word* d = reinterpret_cast<Word*>(dst);
  const int64_t n = nbytes / static_cast<int64_t>(sizeof(Word));
  for (int64_t base = lane; base < n; base += 32 * kUnroll) {
    Word r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + 32 * u;
      if (i < n) r[u] = s[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + 32 * u;
      if (i < n) d[i] = r[u];
    }
  }
}

__device__ __forceinline__ void copy_row(const char* __restrict__ src, char* __restrict__ dst, const int64_t* row,
                                         int64_t element_size, int64_t src_numel, int64_t dst_numel, int lane) {
  const int64_t s = row[0], d = row[1], n = row[2];
  if (s < 0 || d < 0 || n <= 0 || s + n > src_numel || d + n > dst_numel) return;
  const char* sp = src + s * element_size;
  char* dp = dst + d * element_size;
  int64_t nbytes = n * element_size;
  const uintptr_t sa = reinterpret_cast<uintptr_t>(sp), da = reinterpret_cast<uintptr_t>(dp);
  if (((sa ^ da) & 15) == 0) {
    // Bytes up to the first 16-byte boundary, then vectors, then the tail.
    int64_t head = static_cast<int64_t>((16 - (sa & 15)) & 15);
    if (head > nbytes) head = nbytes;
    for (int64_t i = lane; i < head; i += 32) dp[i] = sp[i];
    sp += head; dp += head; nbytes -= head;
    const int64_t body = nbytes & ~static_cast<int64_t>(15);
    copy_words<uint4>(sp, dp, body, lane);
    for (int64_t i = body + lane; i < nbytes; i += 32) dp[i] = sp[i];
  } else if (((sa | da | static_cast<uintptr_t>(nbytes)) & 3) == 0) {
    copy_words<uint32_t>(sp, dp, nbytes, lane);
  } else if (((sa | da | static_cast<uintptr_t>(nbytes)) & 1) == 0) {
    copy_words<uint16_t>(sp, dp, nbytes, lane);
  } else {
    copy_words<uint8_t>(sp, dp, nbytes, lane);
  }
}

__global__ void __launch_bounds__(kThreads)
segment_copy_kernel(const char* __restrict__ src, char* __restrict__ dst,
                    const int64_t* __restrict__ table, int64_t num_segments, int64_t element_size,
                    int64_t src_numel, int64_t dst_numel) {
  const int lane = threadIdx.x % 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;  // one pass unless the grid was bounded
  for (int64_t seg = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; seg < num_segments;
       seg += stride) {
    copy_row(src, dst, table + 3 * seg, element_size, src_numel, dst_numel, lane);
  }
}

}  // namespace

cudaError_t segment_copy_cuda(const void* src, void* dst, const int64_t* table, int64_t num_segments,
                              int64_t element_size, int64_t src_numel, int64_t dst_numel, int64_t max_blocks,
                              cudaStream_t stream) {
  if (num_segments == 0) return cudaSuccess;
  int64_t blocks = (num_segments + kWarps - 1) / kWarps;
  if (max_blocks > 0 && blocks > max_blocks) blocks = max_blocks;
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidValue;
  segment_copy_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const char*>(src), static_cast<char*>(dst), table, num_segments, element_size, src_numel,
      dst_numel);
  return cudaGetLastError();
}

}  // namespace hybridengine
