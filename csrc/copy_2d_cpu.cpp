// CPU implementation of copy_2d: a memcpy per row of every run.
#include <cstring>

#include "copy_2d_common.h"

namespace hybridengine {

static void copy_2d_cpu(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& runs) {
  check_copy_2d_args(src, dst, runs);
  const auto es = static_cast<int64_t>(src.element_size());
  const char* s = static_cast<const char*>(src.data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  const int64_t* r = runs.data_ptr<int64_t>();
  for (int64_t i = 0; i < runs.size(0); ++i, r += kRunFields) {
    for (int64_t row = 0; row < r[3]; ++row) {
      std::memcpy(d + (r[1] + row * r[5]) * es, s + (r[0] + row * r[4]) * es, static_cast<size_t>(r[2] * es));
    }
  }
}

TORCH_LIBRARY_IMPL(hybridengine, CPU, m) { m.impl("copy_2d", &copy_2d_cpu); }

}  // namespace hybridengine
