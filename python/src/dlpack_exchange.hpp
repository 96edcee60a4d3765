// The DLPack C structures this module reads, and the C exchange table (`__dlpack_c_exchange_api__`,
// DLPack 1.3) through which a framework hands a tensor and its current stream to C code without a
// Python call. Layouts are DLPack's ABI (stable within major version 1); declared here so that the
// module needs no framework header.
//
// Why: torch's Tensor.__dlpack__ is Python code (~6 us per tensor on a 2 GHz core), so importing four
// tensors through it would cost more than the whole C++ forward() call. The exchange table's
// dltensor_from_py_object_no_sync fills a DLTensor on our stack in ~0.1 us, and current_work_stream
// is torch.cuda.current_stream() for C.
#pragma once
#include <cstdint>

namespace fp4moe::py {

struct DLPackVersion {
  uint32_t major;
  uint32_t minor;
};

enum DLDeviceType : int32_t { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13 };

struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};

enum DLDataTypeCode : uint8_t {
  kDLInt = 0,
  kDLUInt = 1,
  kDLFloat = 2,
  kDLBfloat = 4,
  kDLBool = 6,
  kDLFloat8_e4m3fn = 10,
};

struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null means row-major contiguous
  uint64_t byte_offset;
};

struct DLPackExchangeAPIHeader {
  DLPackVersion version;
  DLPackExchangeAPIHeader* prev_api;
};

// Only the members this module calls are typed; the others keep their slots.
struct DLPackExchangeAPI {
  DLPackExchangeAPIHeader header;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  int (*dltensor_from_py_object_no_sync)(void* py_object, DLTensor* out);  // may be null
  int (*current_work_stream)(int32_t device_type, int32_t device_id, void** out_stream);
};

inline constexpr const char* kExchangeCapsuleName = "dlpack_exchange_api";
inline constexpr const char* kExchangeAttr = "__dlpack_c_exchange_api__";

}  // namespace fp4moe::py
