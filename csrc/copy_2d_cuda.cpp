// CUDA implementation of copy_2d: one cudaMemcpy2DAsync per run on the current stream. The driver
// runs device-to-device copies on the GPU's copy engines (DMA), not on the SMs, so an unpack issued
// this way beside an NCCL all-gather leaves every SM to the collective. Host-compiled; only c10's
// device-generic guard and stream API (no c10/cuda headers), like segment_copy_cuda.cpp.
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <cuda_runtime.h>

#include "copy_2d_common.h"

namespace hybridengine {

static void copy_2d_cuda(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& runs) {
  check_copy_2d_args(src, dst, runs);
  const c10::DeviceGuard guard(src.device());
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(src.device());
  const auto cuda_stream = static_cast<cudaStream_t>(stream.native_handle());
  const auto es = static_cast<size_t>(src.element_size());
  const char* s = static_cast<const char*>(src.data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  const int64_t* r = runs.data_ptr<int64_t>();
  for (int64_t i = 0; i < runs.size(0); ++i, r += kRunFields) {
    if (r[2] == 0 || r[3] == 0) continue;
    const cudaError_t err =
        r[3] == 1 ? cudaMemcpyAsync(d + r[1] * es, s + r[0] * es, r[2] * es, cudaMemcpyDeviceToDevice, cuda_stream)
                  : cudaMemcpy2DAsync(d + r[1] * es, r[5] * es, s + r[0] * es, r[4] * es, r[2] * es, r[3],
                                      cudaMemcpyDeviceToDevice, cuda_stream);
    TORCH_CHECK(err == cudaSuccess, "copy_2d: cudaMemcpy2DAsync of run ", i, " failed: ", cudaGetErrorString(err));
  }
}

TORCH_LIBRARY_IMPL(hybridengine, CUDA, m) { m.impl("copy_2d", &copy_2d_cuda); }

}  // namespace hybridengine
