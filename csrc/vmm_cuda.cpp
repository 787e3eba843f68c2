// torch binding of the VMM range (CUDA builds only): torch.classes.hybridengine.VmmRange.
// One reserved virtual range per buffer; each map() backs [offset, offset + bytes) with its own
// physical allocation, so the caller chooses the allocation size (one per (unit, shard): creating
// 64-512 MiB allocations costs 1.2-1.5 ms/GiB on an H200 against 37 ms/GiB in 2 MiB pages).
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <map>
#include <string>

#include "vmm.h"

namespace hybridengine {

// Methods never throw: an exception thrown out of a custom-class method crashed the process
// (segfault, torch 2.11, H200 machine, 2026-11-30), so each returns an error message ("" on
// success) that hybridengine/vmm.py turns into ValueError ("invalid: ...") or RuntimeError.
class VmmRange : public torch::CustomClassHolder {
 public:
  VmmRange(int64_t bytes, int64_t device) : device_(device) {
    if (bytes <= 0 || device < 0) {
      error_ = "invalid: bytes must be > 0 and device a CUDA device index, got bytes=" + std::to_string(bytes) +
               " device=" + std::to_string(device);
      return;
    }
    size_t gran = 0;
    if (!(error_ = describe(vmm_granularity(static_cast<int>(device), &gran), "cuMemGetAllocationGranularity"))
             .empty()) {
      return;
    }
    granularity_ = static_cast<int64_t>(gran);
    size_ = (bytes + granularity_ - 1) / granularity_ * granularity_;
    uint64_t address = 0;
    error_ = describe(vmm_reserve(static_cast<size_t>(size_), &address), "cuMemAddressReserve");
    if (error_.empty()) address_ = address;
  }

  ~VmmRange() override {
    for (const auto& [offset, m] : mappings_) vmm_unmap(address_ + offset, m.bytes, m.handle);
    if (address_ != 0) vmm_free_range(address_, static_cast<size_t>(size_));
  }

  std::string error() const { return error_; }
  int64_t granularity() const { return granularity_; }
  int64_t size() const { return size_; }
  int64_t address() const { return static_cast<int64_t>(address_); }
  int64_t device() const { return device_; }

  int64_t mapped_bytes() const {
    int64_t total = 0;
    for (const auto& [offset, m] : mappings_) total += static_cast<int64_t>(m.bytes);
    return total;
  }

  // Back [offset, offset + bytes) with one new physical allocation; on failure nothing changes.
  std::string map(int64_t offset, int64_t bytes) {
    if (address_ == 0) return "invalid: the range was never reserved (" + error_ + ")";
    if (bytes <= 0 || offset < 0 || offset + bytes > size_) {
      return "invalid: [" + std::to_string(offset) + ", " + std::to_string(offset + bytes) +
             ") is empty or outside the reserved " + std::to_string(size_) + " bytes";
    }
    if (offset % granularity_ != 0 || bytes % granularity_ != 0) {
      return "invalid: offset " + std::to_string(offset) + " and bytes " + std::to_string(bytes) +
             " must be multiples of the granularity " + std::to_string(granularity_);
    }
    auto next = mappings_.lower_bound(offset);
    const bool clash_next = next != mappings_.end() && next->first < offset + bytes;
    const bool clash_prev = next != mappings_.begin() &&
                            std::prev(next)->first + static_cast<int64_t>(std::prev(next)->second.bytes) > offset;
    if (clash_next || clash_prev) {
      return "invalid: [" + std::to_string(offset) + ", " + std::to_string(offset + bytes) +
             ") overlaps a range that is already mapped";
    }
    uint64_t handle = 0;
    std::string err = describe(vmm_map(address_ + offset, static_cast<size_t>(bytes), static_cast<int>(device_), &handle),
                               "cuMemCreate/cuMemMap/cuMemSetAccess of " + std::to_string(bytes) + " bytes at offset " +
                                   std::to_string(offset));
    if (err.empty()) mappings_[offset] = Mapping{static_cast<size_t>(bytes), handle};
    return err;
  }

  // Release the allocation mapped at exactly `offset` (by map(offset, ...)).
  std::string unmap(int64_t offset) {
    auto it = mappings_.find(offset);
    if (it == mappings_.end()) return "invalid: nothing was mapped at offset " + std::to_string(offset);
    std::string err = describe(vmm_unmap(address_ + offset, it->second.bytes, it->second.handle),
                               "cuMemUnmap/cuMemRelease at offset " + std::to_string(offset));
    if (err.empty()) mappings_.erase(it);
    return err;
  }

  bool is_mapped(int64_t offset) const { return mappings_.count(offset) != 0; }

  // A uint8 tensor over [offset, offset + bytes) of the range (the caller checked the span); it keeps
  // the range alive. The device is given, not looked up from the pointer: parts of the range may be
  // unmapped, and touching those faults, so callers only touch what they mapped.
  at::Tensor bytes_tensor(int64_t offset, int64_t bytes) {
    auto keep = c10::intrusive_ptr<VmmRange>::unsafe_reclaim_from_nonowning(this);
    const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(device_));
    return at::for_blob(reinterpret_cast<void*>(address_ + offset), {bytes})
        .deleter([keep](void*) {})
        .options(at::TensorOptions().dtype(at::kByte).device(device))
        .target_device(device)
        .make_tensor();
  }

 private:
  struct Mapping {
    size_t bytes;
    uint64_t handle;
  };

  std::string describe(int code, const std::string& what) const {
    if (code == 0) return "";
    return "VmmRange on cuda:" + std::to_string(device_) + ": " + what + " failed with " + vmm_error_string(code);
  }

  int64_t device_ = 0;
  int64_t granularity_ = 0;
  int64_t size_ = 0;
  uint64_t address_ = 0;
  std::string error_;
  std::map<int64_t, Mapping> mappings_;
};

TORCH_LIBRARY_FRAGMENT(hybridengine, m) {
  m.class_<VmmRange>("VmmRange")
      .def(torch::init<int64_t, int64_t>())
      .def("error", &VmmRange::error)
      .def("granularity", &VmmRange::granularity)
      .def("size", &VmmRange::size)
      .def("address", &VmmRange::address)
      .def("device", &VmmRange::device)
      .def("mapped_bytes", &VmmRange::mapped_bytes)
      .def("map", &VmmRange::map)
      .def("unmap", &VmmRange::unmap)
      .def("is_mapped", &VmmRange::is_mapped)
      .def("bytes_tensor", &VmmRange::bytes_tensor);
}

}  // namespace hybridengine
