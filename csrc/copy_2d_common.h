// Argument checks shared by the CPU and CUDA implementations of copy_2d.
#pragma once
#include <torch/library.h>

namespace hybridengine {

// A run (s, d, w, h, sp, dp) copies h rows of w elements: dst[d + i*dp : +w] = src[s + i*sp : +w].
constexpr int64_t kRunFields = 6;

inline void check_copy_2d_args(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& runs) {
  TORCH_CHECK_VALUE(src.dim() == 1 && src.is_contiguous(), "copy_2d: src must be a contiguous 1-D tensor, got shape ",
                    src.sizes());
  TORCH_CHECK_VALUE(dst.dim() == 1 && dst.is_contiguous(), "copy_2d: dst must be a contiguous 1-D tensor, got shape ",
                    dst.sizes());
  TORCH_CHECK_VALUE(src.scalar_type() == dst.scalar_type(), "copy_2d: dtype mismatch, src is ", src.scalar_type(),
                    " and dst is ", dst.scalar_type());
  TORCH_CHECK_VALUE(src.device() == dst.device(), "copy_2d: device mismatch, src is on ", src.device(), " and dst on ",
                    dst.device());
  TORCH_CHECK_VALUE(runs.device().is_cpu() && runs.scalar_type() == at::kLong && runs.dim() == 2 &&
                        runs.size(1) == kRunFields && runs.is_contiguous(),
                    "copy_2d: runs must be a contiguous int64 CPU tensor [R, 6] of (src, dst, width, height, "
                    "src_pitch, dst_pitch) rows, got ", runs.scalar_type(), " ", runs.sizes(), " on ", runs.device());
  const auto es = static_cast<int64_t>(src.element_size());
  const auto s0 = reinterpret_cast<uintptr_t>(src.data_ptr()), d0 = reinterpret_cast<uintptr_t>(dst.data_ptr());
  const bool disjoint = s0 + src.numel() * es <= d0 || d0 + dst.numel() * es <= s0;
  TORCH_CHECK_VALUE(src.numel() == 0 || dst.numel() == 0 || disjoint,
                    "copy_2d: src and dst overlap in memory; copy through a separate buffer");
  // Bounds of every run (a bad run fails the call before anything is copied). Overlaps between runs'
  // destinations are the caller's contract (hybridengine.ops.runs_from_table builds disjoint runs).
  const int64_t* r = runs.data_ptr<int64_t>();
  for (int64_t i = 0; i < runs.size(0); ++i, r += kRunFields) {
    const int64_t s = r[0], d = r[1], w = r[2], h = r[3], sp = r[4], dp = r[5];
    TORCH_CHECK_VALUE(s >= 0 && d >= 0 && w >= 0 && h >= 0, "copy_2d: run ", i, " has a negative offset or size");
    if (w == 0 || h == 0) continue;
    TORCH_CHECK_VALUE(h == 1 || (sp >= w && dp >= w), "copy_2d: run ", i, " has pitches (", sp, ", ", dp,
                      ") smaller than its width ", w);
    TORCH_CHECK_VALUE(s + (h - 1) * sp + w <= src.numel(), "copy_2d: run ", i, " reads past src (", src.numel(),
                      " elements)");
    TORCH_CHECK_VALUE(d + (h - 1) * dp + w <= dst.numel(), "copy_2d: run ", i, " writes past dst (", dst.numel(),
                      " elements)");
  }
}

}  // namespace hybridengine
