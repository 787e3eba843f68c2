// torch binding of the VMM range (CUDA builds only): torch.classes.hybridengine.VmmRange.
// One reserved virtual range per buffer; each map() backs [offset, offset + bytes) with its own
// physical allocation, so the caller chooses the allocation size: one per (unit, shard), because the
// driver's page calls cost far more per byte in small allocations than in large ones.
#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <cuda_runtime.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "vmm.h"

namespace hybridengine {

// Methods never throw: an exception thrown out of a custom-class method can crash the process
// (a segfault with torch 2.11), so each returns an error message ("" on success) that
// hybridengine/sharding/vmm.py turns into ValueError ("invalid: ...") or RuntimeError.
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
    join_mapper();
    wait_released();
    for (const auto& [offset, m] : mappings_) vmm_unmap(address_ + offset, m.bytes, m.handle);
    for (const auto& [offset, m] : releasing_) vmm_unmap(address_ + offset, m.bytes, m.handle);
    if (address_ != 0) vmm_free_range(address_, static_cast<size_t>(size_));
  }

  std::string error() const { return error_; }
  int64_t granularity() const { return granularity_; }
  int64_t size() const { return size_; }
  int64_t address() const { return static_cast<int64_t>(address_); }
  int64_t device() const { return device_; }

  // Bytes backed by physical memory now: mapped ranges plus any whose deferred release is still pending.
  int64_t mapped_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t total = 0;
    for (const auto& [offset, m] : mappings_) total += static_cast<int64_t>(m.bytes);
    for (const auto& [offset, m] : releasing_) total += static_cast<int64_t>(m.bytes);
    return total;
  }

  // Back [offset, offset + bytes) with one new physical allocation; on failure nothing changes.
  std::string map(int64_t offset, int64_t bytes) {
    join_mapper();
    std::string pending = wait_released();  // a deferred release may still hold this offset
    if (!pending.empty()) return pending;
    if (address_ == 0) return "invalid: the range was never reserved (" + error_ + ")";
    std::string bad = check_free(offset, bytes);
    if (!bad.empty()) return bad;
    uint64_t handle = 0;
    std::string err = describe(vmm_map(address_ + offset, static_cast<size_t>(bytes), static_cast<int>(device_), &handle),
                               "cuMemCreate/cuMemMap/cuMemSetAccess of " + std::to_string(bytes) + " bytes at offset " +
                                   std::to_string(offset));
    if (err.empty()) mappings_[offset] = Mapping{static_cast<size_t>(bytes), handle};
    return err;
  }

  // Release the allocation mapped at exactly `offset` (by map(offset, ...)).
  std::string unmap(int64_t offset) {
    join_mapper();
    std::string pending = wait_released();
    if (!pending.empty()) return pending;
    auto it = mappings_.find(offset);
    if (it == mappings_.end()) return "invalid: nothing was mapped at offset " + std::to_string(offset);
    std::string err = describe(vmm_unmap(address_ + offset, it->second.bytes, it->second.handle),
                               "cuMemUnmap/cuMemRelease at offset " + std::to_string(offset));
    if (err.empty()) mappings_.erase(it);
    return err;
  }

  bool is_mapped(int64_t offset) {
    std::lock_guard<std::mutex> lock(mutex_);
    return mappings_.count(offset) != 0;
  }

  // Release the allocations mapped at `offsets` once the work queued so far on the current CUDA stream
  // is done, on a host thread: the call returns after recording one event while cuMemUnmap +
  // cuMemRelease run beside whatever the caller does next. The offsets
  // leave the mapped set at once; mapped_bytes() counts them until released. map(), unmap() and
  // wait_released() join the thread first. Checks every offset before changing anything.
  std::string unmap_after_current_stream(std::vector<int64_t> offsets) {
    join_mapper();
    std::string pending = wait_released();
    if (!pending.empty()) return pending;
    std::sort(offsets.begin(), offsets.end());
    offsets.erase(std::unique(offsets.begin(), offsets.end()), offsets.end());
    for (int64_t offset : offsets) {
      if (mappings_.count(offset) == 0) return "invalid: nothing was mapped at offset " + std::to_string(offset);
    }
    if (offsets.empty()) return "";
    cudaEvent_t done = nullptr;
    // The event belongs to this range's device, whatever device the caller has current.
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(static_cast<int>(device_));
    // c10's device-generic stream API (no c10/cuda headers: CI syntax-checks this file against CPU torch).
    const c10::Device dev(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_));
    const auto stream = static_cast<cudaStream_t>(
        c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(dev).native_handle());
    cudaError_t e = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(done, stream);
    cudaSetDevice(previous);
    if (e != cudaSuccess) {
      if (done != nullptr) cudaEventDestroy(done);
      return "VmmRange on cuda:" + std::to_string(device_) + ": recording the release event failed with " +
             cudaGetErrorName(e);
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (int64_t offset : offsets) {
        auto it = mappings_.find(offset);
        releasing_.emplace(offset, it->second);
        mappings_.erase(it);
      }
    }
    try {
      releaser_ = std::thread([this, done] { release_after(done); });
    } catch (const std::exception&) {  // no thread to be had: release here, synchronously
      release_after(done);
    }
    return "";
  }

  // Map the pieces [offsets[i], offsets[i] + sizes[i]) on a host thread, each with its own allocation as
  // map() does, and return at once: the driver's page calls run beside whatever the caller does
  // next (an optimizer step), so a later switch finds its pages mapped. The pieces join
  // the mapped set when all are mapped; on a failure the thread unmaps what it mapped (all or nothing)
  // and wait_mapped() returns the error. Every other call that changes mappings joins the thread
  // first. Checks every piece before starting.
  std::string map_in_background(std::vector<int64_t> offsets, std::vector<int64_t> sizes) {
    std::string pending = wait_mapped();
    if (pending.empty()) pending = wait_released();
    if (!pending.empty()) return pending;
    if (address_ == 0) return "invalid: the range was never reserved (" + error_ + ")";
    if (offsets.size() != sizes.size()) {
      return "invalid: offsets and sizes must have the same length, got " + std::to_string(offsets.size()) +
             " and " + std::to_string(sizes.size());
    }
    std::vector<std::pair<int64_t, int64_t>> pieces;
    std::string bad = sorted_free_pieces(offsets, sizes, &pieces);
    if (!bad.empty()) return bad;
    if (pieces.empty()) return "";
    try {
      mapper_ = std::thread([this, pieces] { map_all(pieces); });
    } catch (const std::exception&) {  // no thread to be had: map here, synchronously
      map_all(pieces);
    }
    return "";
  }

  // Join a background mapping; its error ("" if none, or if none was started).
  std::string wait_mapped() {
    join_mapper();
    std::lock_guard<std::mutex> lock(mutex_);
    std::string err = std::move(map_error_);
    map_error_.clear();
    return err;
  }

  // [seconds x 5, calls x 5] of cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease,
  // process-wide since the last reset (host time; the release thread's calls included).
  std::vector<double> timings(bool reset) {
    double seconds[5];
    int64_t calls[5];
    vmm_timings(seconds, calls, reset);
    std::vector<double> out(seconds, seconds + 5);
    for (int64_t c : calls) out.push_back(static_cast<double>(c));
    return out;
  }

  // Join a deferred release; its error ("" if none). Ranges it failed to release count as mapped.
  std::string wait_released() {
    if (releaser_.joinable()) releaser_.join();
    std::lock_guard<std::mutex> lock(mutex_);
    std::string err = std::move(release_error_);
    release_error_.clear();
    return err;
  }

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

  void join_mapper() {
    if (mapper_.joinable()) mapper_.join();
  }

  // map_in_background's thread: map every piece, or none.
  void map_all(const std::vector<std::pair<int64_t, int64_t>>& pieces) {
    cudaSetDevice(static_cast<int>(device_));  // a new thread: the range's device (its primary context) current
    std::vector<std::pair<int64_t, Mapping>> done;
    std::string err;
    for (const auto& [offset, n] : pieces) {
      uint64_t handle = 0;
      err = describe(vmm_map(address_ + offset, static_cast<size_t>(n), static_cast<int>(device_), &handle),
                     "background cuMemCreate/cuMemMap/cuMemSetAccess of " + std::to_string(n) + " bytes at offset " +
                         std::to_string(offset));
      if (!err.empty()) break;
      done.emplace_back(offset, Mapping{static_cast<size_t>(n), handle});
    }
    if (!err.empty()) {
      for (const auto& [offset, m] : done) vmm_unmap(address_ + offset, m.bytes, m.handle);
      done.clear();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [offset, m] : done) mappings_[offset] = m;
    map_error_ = err;
  }

  // Wait for `done`, then unmap and release everything in releasing_ (on the releaser thread, or
  // inline when no thread could be started).
  void release_after(cudaEvent_t done) {
    cudaSetDevice(static_cast<int>(device_));
    const cudaError_t waited = cudaEventSynchronize(done);
    cudaEventDestroy(done);
    std::lock_guard<std::mutex> lock(mutex_);
    if (waited != cudaSuccess) {
      release_error_ = std::string("waiting for the release event failed with ") + cudaGetErrorName(waited);
      return;  // nothing is unmapped while the GPU may still read it; the mappings stay pending
    }
    for (auto it = releasing_.begin(); it != releasing_.end();) {
      const int code = vmm_unmap(address_ + it->first, it->second.bytes, it->second.handle);
      if (code != 0 && release_error_.empty()) {
        release_error_ = describe(code, "deferred cuMemUnmap/cuMemRelease at offset " + std::to_string(it->first));
      }
      it = code == 0 ? releasing_.erase(it) : std::next(it);
    }
  }

  // The (offset, bytes) pieces sorted by offset into *pieces, or the "invalid: ..." message when one
  // is not free (check_free) or two overlap.
  std::string sorted_free_pieces(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes,
                                 std::vector<std::pair<int64_t, int64_t>>* pieces) {
    for (size_t i = 0; i < offsets.size(); ++i) pieces->emplace_back(offsets[i], sizes[i]);
    std::sort(pieces->begin(), pieces->end());
    for (size_t i = 0; i < pieces->size(); ++i) {
      const auto& [offset, bytes] = (*pieces)[i];
      std::string bad = check_free(offset, bytes);
      if (bad.empty() && i > 0 && (*pieces)[i - 1].first + (*pieces)[i - 1].second > offset) {
        bad = "invalid: pieces at offsets " + std::to_string((*pieces)[i - 1].first) + " and " +
              std::to_string(offset) + " overlap";
      }
      if (!bad.empty()) return bad;
    }
    return "";
  }

  // "" if [offset, offset + bytes) is inside the range, granularity-aligned and overlaps nothing
  // mapped or pending release; else the "invalid: ..." message.
  std::string check_free(int64_t offset, int64_t bytes) {
    if (bytes <= 0 || offset < 0 || offset + bytes > size_) {
      return "invalid: [" + std::to_string(offset) + ", " + std::to_string(offset + bytes) +
             ") is empty or outside the reserved " + std::to_string(size_) + " bytes";
    }
    if (offset % granularity_ != 0 || bytes % granularity_ != 0) {
      return "invalid: offset " + std::to_string(offset) + " and bytes " + std::to_string(bytes) +
             " must be multiples of the granularity " + std::to_string(granularity_);
    }
    for (const auto& [held, m] : releasing_) {  // after the join: only ranges whose release failed
      if (held < offset + bytes && held + static_cast<int64_t>(m.bytes) > offset) {
        return "invalid: [" + std::to_string(offset) + ", " + std::to_string(offset + bytes) +
               ") overlaps a range whose release failed (offset " + std::to_string(held) + ")";
      }
    }
    auto next = mappings_.lower_bound(offset);
    const bool clash_next = next != mappings_.end() && next->first < offset + bytes;
    const bool clash_prev = next != mappings_.begin() &&
                            std::prev(next)->first + static_cast<int64_t>(std::prev(next)->second.bytes) > offset;
    if (clash_next || clash_prev) {
      return "invalid: [" + std::to_string(offset) + ", " + std::to_string(offset + bytes) +
             ") overlaps a range that is already mapped";
    }
    return "";
  }

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
  std::map<int64_t, Mapping> releasing_;  // handed to releaser_, not yet unmapped
  std::thread releaser_;
  std::thread mapper_;  // map_in_background's
  std::mutex mutex_;  // guards mappings_, releasing_, release_error_ and map_error_ against the threads
  std::string release_error_;
  std::string map_error_;
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
      .def("unmap_after_current_stream", &VmmRange::unmap_after_current_stream)
      .def("wait_released", &VmmRange::wait_released)
      .def("map_in_background", &VmmRange::map_in_background)
      .def("wait_mapped", &VmmRange::wait_mapped)
      .def("timings", &VmmRange::timings)
      .def("bytes_tensor", &VmmRange::bytes_tensor);
}

}  // namespace hybridengine
