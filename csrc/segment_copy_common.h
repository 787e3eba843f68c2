// Argument checks shared by the CPU and CUDA implementations of segment_copy.
#pragma once
#include <torch/library.h>

namespace hybridengine {

inline void check_segment_copy_args(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& table) {
  TORCH_CHECK_VALUE(src.dim() == 1 && src.is_contiguous(), "segment_copy: src must be a contiguous 1-D tensor, got shape ",
              src.sizes(), src.is_contiguous() ? "" : " (non-contiguous)");
  TORCH_CHECK_VALUE(dst.dim() == 1 && dst.is_contiguous(), "segment_copy: dst must be a contiguous 1-D tensor, got shape ",
              dst.sizes(), dst.is_contiguous() ? "" : " (non-contiguous)");
  TORCH_CHECK_VALUE(src.scalar_type() == dst.scalar_type(), "segment_copy: dtype mismatch, src is ", src.scalar_type(),
              " and dst is ", dst.scalar_type());
  TORCH_CHECK_VALUE(src.device() == dst.device(), "segment_copy: device mismatch, src is on ", src.device(),
              " and dst on ", dst.device());
  TORCH_CHECK_VALUE(table.scalar_type() == at::kLong, "segment_copy: table must be int64, got ", table.scalar_type());
  TORCH_CHECK_VALUE(table.dim() == 2 && table.size(1) == 3 && table.is_contiguous(),
              "segment_copy: table must be a contiguous [S, 3] tensor of (src, dst, numel) rows, got shape ",
              table.sizes());
  TORCH_CHECK_VALUE(table.device() == src.device(), "segment_copy: table must be on the device of src (", src.device(),
              "), got ", table.device());
  const auto es = static_cast<int64_t>(src.element_size());
  const auto s0 = reinterpret_cast<uintptr_t>(src.data_ptr()), d0 = reinterpret_cast<uintptr_t>(dst.data_ptr());
  const bool disjoint = s0 + src.numel() * es <= d0 || d0 + dst.numel() * es <= s0;
  TORCH_CHECK_VALUE(src.numel() == 0 || dst.numel() == 0 || disjoint,
              "segment_copy: src and dst overlap in memory; copy through a separate buffer");
}

}  // namespace hybridengine
