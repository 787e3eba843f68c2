// Schema of hybridengine's torch ops and the Python module stub for hybridengine._C.
// Implementations register per device: *_cpu.cpp (always), *_cuda.cpp (only in CUDA builds).
#include <Python.h>
#include <torch/library.h>

extern "C" {
// Importing hybridengine._C loads this library, which runs the TORCH_LIBRARY registrations.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(hybridengine, m) {
  // dst[d:d+n] = src[s:s+n] for each row (s, d, n) of table (int64 [S, 3], in elements).
  m.def("segment_copy(Tensor src, Tensor(a!) dst, Tensor table, int max_blocks=0) -> ()");
}
