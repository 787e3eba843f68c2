// CUDA driver VMM calls behind vmm.h. The driver entry points are looked up through the runtime
// (cudaGetDriverEntryPointByVersion), so the extension does not link libcuda and loads on machines without
// a driver (it then reports the error on first use instead of failing to import).
#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>

#include "vmm.h"

namespace hybridengine {
namespace {

struct DriverApi {
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuMemAddressReserve) reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuGetErrorName) error_name = nullptr;
  int status = CUDA_ERROR_NOT_INITIALIZED;
};

template <typename Fn>
bool load(const char* name, Fn* fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found;
  // The VMM entry points have kept their CUDA 12.0 ABI; ask for that version explicitly.
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess || p == nullptr) {
    return false;
  }
  *fn = reinterpret_cast<Fn>(p);
  return true;
}

const DriverApi& api() {
  static const DriverApi table = [] {
    DriverApi a;
    const bool ok = load("cuMemGetAllocationGranularity", &a.granularity) &&
                    load("cuMemAddressReserve", &a.reserve) && load("cuMemAddressFree", &a.address_free) &&
                    load("cuMemCreate", &a.create) && load("cuMemMap", &a.map) &&
                    load("cuMemSetAccess", &a.set_access) && load("cuMemUnmap", &a.unmap) &&
                    load("cuMemRelease", &a.release) && load("cuGetErrorName", &a.error_name);
    a.status = ok ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
    return a;
  }();
  return table;
}

// Host seconds spent in each driver call (nanoseconds, summed over threads): what a switch's mapping
// costs, call by call (hybridengine_bench.probes.profile_switch reads them through VmmRange.timings()).
enum Step { kCreate, kMap, kAccess, kUnmap, kRelease, kSteps };
std::atomic<int64_t> g_ns[kSteps];
std::atomic<int64_t> g_calls[kSteps];

template <typename Fn>
CUresult timed(Step step, Fn&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  const CUresult r = fn();
  g_ns[step] += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  g_calls[step] += 1;
  return r;
}

CUmemAllocationProp device_prop(int device) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

}  // namespace

int vmm_granularity(int device, size_t* bytes) {
  const DriverApi& a = api();
  if (a.status != CUDA_SUCCESS) return a.status;
  CUmemAllocationProp prop = device_prop(device);
  return a.granularity(bytes, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
}

int vmm_reserve(size_t bytes, uint64_t* address) {
  const DriverApi& a = api();
  if (a.status != CUDA_SUCCESS) return a.status;
  CUdeviceptr ptr = 0;
  const CUresult r = a.reserve(&ptr, bytes, 0, 0, 0);
  *address = static_cast<uint64_t>(ptr);
  return r;
}

int vmm_free_range(uint64_t address, size_t bytes) {
  const DriverApi& a = api();
  if (a.status != CUDA_SUCCESS) return a.status;
  return a.address_free(static_cast<CUdeviceptr>(address), bytes);
}

int vmm_map(uint64_t address, size_t bytes, int device, uint64_t* handle) {
  const DriverApi& a = api();
  if (a.status != CUDA_SUCCESS) return a.status;
  CUmemAllocationProp prop = device_prop(device);
  CUmemGenericAllocationHandle h = 0;
  CUresult r = timed(kCreate, [&] { return a.create(&h, bytes, &prop, 0); });
  if (r != CUDA_SUCCESS) return r;
  const CUdeviceptr ptr = static_cast<CUdeviceptr>(address);
  r = timed(kMap, [&] { return a.map(ptr, bytes, 0, h, 0); });
  if (r != CUDA_SUCCESS) {
    a.release(h);
    return r;
  }
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = timed(kAccess, [&] { return a.set_access(ptr, bytes, &access, 1); });
  if (r != CUDA_SUCCESS) {
    a.unmap(ptr, bytes);
    a.release(h);
    return r;
  }
  *handle = static_cast<uint64_t>(h);
  return CUDA_SUCCESS;
}

int vmm_unmap(uint64_t address, size_t bytes, uint64_t handle) {
  const DriverApi& a = api();
  if (a.status != CUDA_SUCCESS) return a.status;
  const CUresult r = timed(kUnmap, [&] { return a.unmap(static_cast<CUdeviceptr>(address), bytes); });
  if (r != CUDA_SUCCESS || handle == 0) return r;
  return timed(kRelease, [&] { return a.release(static_cast<CUmemGenericAllocationHandle>(handle)); });
}

void vmm_timings(double seconds[5], int64_t calls[5], bool reset) {
  for (int i = 0; i < kSteps; ++i) {
    seconds[i] = static_cast<double>(reset ? g_ns[i].exchange(0) : g_ns[i].load()) * 1e-9;
    calls[i] = reset ? g_calls[i].exchange(0) : g_calls[i].load();
  }
}

const char* vmm_error_string(int code) {
  if (code == CUDA_ERROR_NOT_FOUND && api().status != CUDA_SUCCESS) {
    return "CUDA_ERROR_NOT_FOUND (the driver's VMM entry points could not be loaded)";
  }
  const char* name = nullptr;
  if (api().error_name == nullptr || api().error_name(static_cast<CUresult>(code), &name) != CUDA_SUCCESS ||
      name == nullptr) {
    return "unknown CUresult";
  }
  return name;
}

}  // namespace hybridengine
