// Owning device allocation (RAII, move-only). Host-side helper for tests, benchmarks and layers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "fp4moe/cuda_check.hpp"

namespace fp4moe {

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // `what` names the buffer in the out-of-memory message ("the layer workspace").
  explicit DeviceBuffer(size_t count, const char* what = "a device buffer") : count_(count) {
    FP4MOE_REQUIRE(count_ <= SIZE_MAX / sizeof(T), "{}: {} elements of {} bytes overflow size_t", what, count_,
                   sizeof(T));
    ptr_ = static_cast<T*>(device_malloc(count_ * sizeof(T), what));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);  // no throw from a destructor; a failure here leaves nothing to do
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), count_(std::exchange(o.count_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      if (ptr_) cudaFree(ptr_);
      ptr_ = std::exchange(o.ptr_, nullptr);
      count_ = std::exchange(o.count_, 0);
    }
    return *this;
  }

  T* get() const { return ptr_; }
  template <class U>
  U* as() const {
    return reinterpret_cast<U*>(ptr_);
  }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

  void upload(const std::vector<T>& host) {
    FP4MOE_REQUIRE(host.size() == count_, "upload: host size {} != device size {}", host.size(), count_);
    copy_to_device(ptr_, host.data(), bytes());
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    if (count_) FP4MOE_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, bytes(), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

}  // namespace fp4moe
