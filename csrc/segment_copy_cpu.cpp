// CPU implementation of segment_copy: full table validation, then a parallel memcpy per row.
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "segment_copy_common.h"

namespace hybridengine {

// Every row in bounds and no two destinations overlap; the message names the first bad row.
static void validate_table(const int64_t* t, int64_t rows, int64_t src_numel, int64_t dst_numel) {
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t s = t[3 * i], d = t[3 * i + 1], n = t[3 * i + 2];
    TORCH_CHECK_VALUE(s >= 0 && d >= 0 && n >= 0, "segment_copy: table row ", i, " = (", s, ", ", d, ", ", n,
                ") has a negative entry");
    TORCH_CHECK_VALUE(s <= src_numel - n, "segment_copy: table row ", i, " reads src[", s, ":", s + n,
                "] out of range (src has ", src_numel, " elements)");
    TORCH_CHECK_VALUE(d <= dst_numel - n, "segment_copy: table row ", i, " writes dst[", d, ":", d + n,
                "] out of range (dst has ", dst_numel, " elements)");
  }
  std::vector<int64_t> order(rows);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [t](int64_t a, int64_t b) { return t[3 * a + 1] < t[3 * b + 1]; });
  int64_t prev = -1;
  for (int64_t k = 0; k < rows; ++k) {
    const int64_t i = order[k];
    if (t[3 * i + 2] == 0) continue;
    if (prev >= 0) {
      TORCH_CHECK_VALUE(t[3 * prev + 1] + t[3 * prev + 2] <= t[3 * i + 1], "segment_copy: table rows ", prev, " and ", i,
                  " write overlapping destinations dst[", t[3 * prev + 1], ":", t[3 * prev + 1] + t[3 * prev + 2],
                  "] and dst[", t[3 * i + 1], ":", t[3 * i + 1] + t[3 * i + 2], "]");
    }
    prev = i;
  }
}

static void segment_copy_cpu(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& table,
                             int64_t max_blocks) {
  check_segment_copy_args(src, dst, table);
  TORCH_CHECK_VALUE(max_blocks >= 0, "segment_copy: max_blocks must be >= 0 (0: no bound), got ", max_blocks);
  const int64_t rows = table.size(0);
  const int64_t* t = table.data_ptr<int64_t>();
  validate_table(t, rows, src.numel(), dst.numel());
  const auto es = static_cast<int64_t>(src.element_size());
  const char* s = static_cast<const char*>(src.data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(d + t[3 * i + 1] * es, s + t[3 * i] * es, static_cast<size_t>(t[3 * i + 2] * es));
    }
  });
}

TORCH_LIBRARY_IMPL(hybridengine, CPU, m) { m.impl("segment_copy", &segment_copy_cpu); }

}  // namespace hybridengine
