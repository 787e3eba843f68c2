// torch binding of the windowed copier (CUDA builds only): torch.classes.hybridengine.WindowedCopier.
//
// A large transfer queued at once on a side stream holds the rest of its direction's traffic until it
// ends: the compute stream's small copies, and kernel stores into mapped host memory too (a decode
// step's sampled tokens, hybridengine/rollout/runner.py `Readback`). This copier queues the chunks from
// a host thread instead, at most `window` chunks ahead of the copy engine: the transfer keeps the link
// busy and those kernel stores pass between its chunks (small copies by the copy engine still wait).
#include <cuda_runtime.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <thread>
#include <vector>

namespace hybridengine {

// Methods never throw (see VmmRange): each returns an error message ("" on success) that
// hybridengine/train/offload.py (`WindowedCopier`) turns into ValueError ("invalid: ...") or RuntimeError.
class WindowedCopier : public torch::CustomClassHolder {
 public:
  WindowedCopier(int64_t device, int64_t window, int64_t chunk_bytes)
      : device_(device), window_(window), chunk_bytes_(chunk_bytes) {}

  ~WindowedCopier() override { join(); }

  // Copy pieces src[i] -> dst[i] of bytes[i] (device or registered host addresses) on `stream` (a
  // cudaStream_t of device `device`, as an integer) in chunks of chunk_bytes, from a host thread, at
  // most `window` chunks in flight; returns at once. The stream's earlier work runs first; nothing
  // queued on it later waits for the copies (wait() does). One transfer at a time.
  std::string start(std::vector<int64_t> dst, std::vector<int64_t> src, std::vector<int64_t> bytes, int64_t stream) {
    if (window_ < 1 || chunk_bytes_ < 1 || device_ < 0) {
      return "invalid: window and chunk_bytes must be >= 1 and device a CUDA device index, got window=" +
             std::to_string(window_) + " chunk_bytes=" + std::to_string(chunk_bytes_) + " device=" +
             std::to_string(device_);
    }
    if (dst.size() != src.size() || dst.size() != bytes.size()) {
      return "invalid: dst, src and bytes must have the same length, got " + std::to_string(dst.size()) + ", " +
             std::to_string(src.size()) + " and " + std::to_string(bytes.size());
    }
    for (int64_t b : bytes) {
      if (b < 0) return "invalid: bytes must be >= 0, got " + std::to_string(b);
    }
    join();
    if (running_.load()) return "invalid: a transfer is still running";
    error_.clear();
    finished_.store(false);
    seconds_ = -1.0;
    running_.store(true);
    auto body = [this, dst, src, bytes, stream] { run(dst, src, bytes, reinterpret_cast<cudaStream_t>(stream)); };
    try {
      thread_ = std::thread(body);
    } catch (const std::exception&) {  // no thread to be had: copy here, synchronously
      body();
    }
    return "";
  }

  // Every chunk is queued and done (or the transfer stopped at an error): wait() returns at once.
  bool done() { return finished_.load(); }

  // Wait until every chunk is done; the transfer's error ("" if none).
  std::string wait() {
    join();
    return error_;
  }

  // Device seconds from the first chunk's start to the last one's end (-1 before a transfer is done).
  double seconds() {
    join();
    return seconds_;
  }

 private:
  void join() {
    if (thread_.joinable()) thread_.join();
  }

  void run(const std::vector<int64_t>& dst, const std::vector<int64_t>& src, const std::vector<int64_t>& bytes,
           cudaStream_t stream) {
    // Relaxed: this thread's event waits must not disturb a CUDA graph capture on another thread.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
    cudaSetDevice(static_cast<int>(device_));
    std::vector<cudaEvent_t> slots(static_cast<size_t>(window_), nullptr);
    cudaEvent_t begin = nullptr, end = nullptr;
    // Blocking-sync events: the thread sleeps while a chunk copies instead of spinning on a core beside
    // the caller's host-bound loop (a decode loop).
    cudaError_t e = cudaEventCreateWithFlags(&begin, cudaEventBlockingSync);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&end, cudaEventBlockingSync);
    for (auto& ev : slots) {
      if (e == cudaSuccess) e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventBlockingSync);
    }
    if (e == cudaSuccess) e = cudaEventRecord(begin, stream);
    int64_t issued = 0;
    for (size_t i = 0; i < dst.size() && e == cudaSuccess; ++i) {
      for (int64_t off = 0; off < bytes[i] && e == cudaSuccess; off += chunk_bytes_) {
        cudaEvent_t slot = slots[static_cast<size_t>(issued % window_)];
        if (issued >= window_) e = cudaEventSynchronize(slot);  // the chunk `window` back is done
        const size_t n = static_cast<size_t>(std::min(chunk_bytes_, bytes[i] - off));
        if (e == cudaSuccess) {
          e = cudaMemcpyAsync(reinterpret_cast<void*>(dst[i] + off), reinterpret_cast<const void*>(src[i] + off), n,
                              cudaMemcpyDefault, stream);
        }
        if (e == cudaSuccess) e = cudaEventRecord(slot, stream);
        ++issued;
      }
    }
    if (e == cudaSuccess) e = cudaEventRecord(end, stream);
    if (e == cudaSuccess) e = cudaEventSynchronize(end);
    float ms = 0.0f;
    if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, begin, end);
    if (e == cudaSuccess) {
      seconds_ = ms / 1e3;
    } else {
      cudaStreamSynchronize(stream);  // nothing of a failed transfer is left running
      error_ = std::string("WindowedCopier on cuda:") + std::to_string(device_) + ": a chunk copy failed with " +
               cudaGetErrorName(e);
    }
    for (auto ev : slots) {
      if (ev != nullptr) cudaEventDestroy(ev);
    }
    if (begin != nullptr) cudaEventDestroy(begin);
    if (end != nullptr) cudaEventDestroy(end);
    cudaThreadExchangeStreamCaptureMode(&mode);
    running_.store(false);
    finished_.store(true);
  }

  int64_t device_, window_, chunk_bytes_;
  std::thread thread_;
  std::atomic<bool> running_{false};
  std::atomic<bool> finished_{false};
  std::string error_;  // written by the thread, read after join()
  double seconds_ = -1.0;
};

TORCH_LIBRARY_FRAGMENT(hybridengine, m) {
  m.class_<WindowedCopier>("WindowedCopier")
      .def(torch::init<int64_t, int64_t, int64_t>())
      .def("start", &WindowedCopier::start)
      .def("done", &WindowedCopier::done)
      .def("wait", &WindowedCopier::wait)
      .def("seconds", &WindowedCopier::seconds);
}

}  // namespace hybridengine
