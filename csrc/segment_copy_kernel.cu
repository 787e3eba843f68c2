// CUDA kernel of the fused resharding copy. Includes only CUDA headers (CI compiles it with nvcc -c).
//
// One block per table row. Rows are pre-split to at most a few hundred KiB (prepare_table), so a
// long parameter still spreads over many blocks. When source and destination share their address
// modulo 16, the body moves in 16-byte vectors, UNROLL loads in flight per thread before the
// stores; otherwise it falls back to the widest word both addresses and the length allow.
#include "segment_copy.h"

namespace hybridengine {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <typename Word>
__device__ __forceinline__ void copy_words(const char* src, char* dst, int64_t nbytes) {
  const Word* s = reinterpret_cast<const Word*>(src);
  Word* d = reinterpret_cast<Word*>(dst);
  const int64_t n = nbytes / static_cast<int64_t>(sizeof(Word));
  const int64_t stride = static_cast<int64_t>(blockDim.x) * kUnroll;
  for (int64_t base = threadIdx.x; base < n; base += stride) {
    Word r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
      if (i < n) r[u] = s[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * blockDim.x;
      if (i < n) d[i] = r[u];
    }
  }
}

__global__ void __launch_bounds__(kThreads)
segment_copy_kernel(const char* __restrict__ src, char* __restrict__ dst,
                    const int64_t* __restrict__ table, int64_t element_size,
                    int64_t src_numel, int64_t dst_numel) {
  const int64_t* row = table + 3 * static_cast<int64_t>(blockIdx.x);
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
    for (int64_t i = threadIdx.x; i < head; i += blockDim.x) dp[i] = sp[i];
    sp += head; dp += head; nbytes -= head;
    const int64_t body = nbytes & ~static_cast<int64_t>(15);
    copy_words<uint4>(sp, dp, body);
    for (int64_t i = body + threadIdx.x; i < nbytes; i += blockDim.x) dp[i] = sp[i];
  } else if (((sa | da | static_cast<uintptr_t>(nbytes)) & 3) == 0) {
    copy_words<uint32_t>(sp, dp, nbytes);
  } else if (((sa | da | static_cast<uintptr_t>(nbytes)) & 1) == 0) {
    copy_words<uint16_t>(sp, dp, nbytes);
  } else {
    copy_words<uint8_t>(sp, dp, nbytes);
  }
}

}  // namespace

cudaError_t segment_copy_cuda(const void* src, void* dst, const int64_t* table, int64_t num_segments,
                              int64_t element_size, int64_t src_numel, int64_t dst_numel,
                              cudaStream_t stream) {
  if (num_segments == 0) return cudaSuccess;
  if (num_segments > 0x7fffffffLL) return cudaErrorInvalidValue;
  segment_copy_kernel<<<static_cast<unsigned>(num_segments), kThreads, 0, stream>>>(
      static_cast<const char*>(src), static_cast<char*>(dst), table, element_size, src_numel, dst_numel);
  return cudaGetLastError();
}

}  // namespace hybridengine
