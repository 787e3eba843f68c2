// Torch binding of the CUDA segment_copy kernel (compiled by the host compiler; the kernel itself
// lives in segment_copy_kernel.cu). Bounds are enforced per row inside the kernel (bad rows are
// skipped); full validation of device tables happens once, on the host, in prepare_table.
// Uses only c10's device-generic guard and stream API (no c10/cuda headers), so the file can be
// syntax-checked against a CPU build of torch in CI.
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "segment_copy.h"
#include "segment_copy_common.h"

namespace hybridengine {

static void segment_copy_cuda_op(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& table,
                                 int64_t max_blocks) {
  check_segment_copy_args(src, dst, table);
  TORCH_CHECK_VALUE(max_blocks >= 0, "segment_copy: max_blocks must be >= 0 (0: no bound), got ", max_blocks);
  const c10::DeviceGuard guard(src.device());
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(src.device());
  const cudaError_t err = segment_copy_cuda(src.data_ptr(), dst.data_ptr(), table.data_ptr<int64_t>(),
                                            table.size(0), static_cast<int64_t>(src.element_size()), src.numel(),
                                            dst.numel(), max_blocks, static_cast<cudaStream_t>(stream.native_handle()));
  TORCH_CHECK(err == cudaSuccess, "segment_copy: CUDA launch failed: ", cudaGetErrorString(err));
}

TORCH_LIBRARY_IMPL(hybridengine, CUDA, m) { m.impl("segment_copy", &segment_copy_cuda_op); }

}  // namespace hybridengine
