// Virtual-memory parameter buffer: a reserved device address range whose pages are backed by
// physical allocations mapped and unmapped on demand (CUDA driver VMM API). Plain C++ interface,
// no torch types, so vmm.cu needs only CUDA headers.
#pragma once
#include <cstddef>
#include <cstdint>

namespace hybridengine {

// Every call returns a CUresult as int (0 = success); vmm_error_string names it.
int vmm_granularity(int device, size_t* bytes);                       // minimum mapping granularity
int vmm_reserve(size_t bytes, uint64_t* address);                      // cuMemAddressReserve
int vmm_free_range(uint64_t address, size_t bytes);                    // cuMemAddressFree
// cuMemCreate + cuMemMap + cuMemSetAccess(read/write for `device`); on failure nothing stays mapped.
int vmm_map(uint64_t address, size_t bytes, int device, uint64_t* handle);
int vmm_unmap(uint64_t address, size_t bytes, uint64_t handle);        // cuMemUnmap + cuMemRelease
const char* vmm_error_string(int code);
// Host seconds and call counts, process-wide, of cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap,
// cuMemRelease (in that order) since the last reset.
void vmm_timings(double seconds[5], int64_t calls[5], bool reset);

}  // namespace hybridengine
