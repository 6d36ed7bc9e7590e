#include "trainer/checkpoint/tensor_io.h"

#include <torch/torch.h>

#include <cstring>
#include <stdexcept>

namespace nnstrain::checkpoint {

DType to_dtype(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Double: return DType::F64;
    case c10::ScalarType::Float: return DType::F32;
    case c10::ScalarType::Half: return DType::F16;
    case c10::ScalarType::BFloat16: return DType::BF16;
    case c10::ScalarType::Long: return DType::I64;
    case c10::ScalarType::Int: return DType::I32;
    case c10::ScalarType::Short: return DType::I16;
    case c10::ScalarType::Char: return DType::I8;
    case c10::ScalarType::Byte: return DType::U8;
    case c10::ScalarType::Bool: return DType::BOOL;
    case c10::ScalarType::UInt16: return DType::U16;
    case c10::ScalarType::UInt32: return DType::U32;
    case c10::ScalarType::UInt64: return DType::U64;
    default:
      throw std::invalid_argument(std::string("scalar type ") + c10::toString(type) +
                                  " has no safetensors dtype");
  }
}

c10::ScalarType to_scalar_type(DType dtype) {
  switch (dtype) {
    case DType::F64: return c10::ScalarType::Double;
    case DType::F32: return c10::ScalarType::Float;
    case DType::F16: return c10::ScalarType::Half;
    case DType::BF16: return c10::ScalarType::BFloat16;
    case DType::I64: return c10::ScalarType::Long;
    case DType::I32: return c10::ScalarType::Int;
    case DType::I16: return c10::ScalarType::Short;
    case DType::I8: return c10::ScalarType::Char;
    case DType::U8: return c10::ScalarType::Byte;
    case DType::BOOL: return c10::ScalarType::Bool;
    case DType::U16: return c10::ScalarType::UInt16;
    case DType::U32: return c10::ScalarType::UInt32;
    case DType::U64: return c10::ScalarType::UInt64;
  }
  throw std::invalid_argument("invalid DType value " + std::to_string(static_cast<int>(dtype)));
}

at::Tensor read_tensor(const SafetensorsReader& reader, const std::string& name) {
  const TensorInfo& info = reader.at(name);
  at::Tensor out = at::empty(info.shape, at::TensorOptions().dtype(to_scalar_type(info.dtype)));
  if (info.nbytes() > 0) std::memcpy(out.data_ptr(), reader.data(info), info.nbytes());
  return out;
}

at::Tensor read_tensor_slice(const SafetensorsReader& reader, const std::string& name,
                             const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes) {
  const TensorInfo& info = reader.at(name);
  reader.check_slice(info, offsets, sizes);  // before allocating from `sizes`
  at::Tensor out = at::empty(sizes, at::TensorOptions().dtype(to_scalar_type(info.dtype)));
  reader.read_slice(info, offsets, sizes, out.data_ptr());
  return out;
}

void save_tensors(const std::string& path,
                  const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                  const std::map<std::string, std::string>& metadata) {
  SafetensorsWriter writer(path, metadata);
  for (const auto& [name, t] : tensors) {
    if (!t.defined())
      throw SafetensorsError("safetensors file '" + path + "': tensor '" + name + "' is undefined");
    DType dtype;
    try {
      dtype = to_dtype(t.scalar_type());
    } catch (const std::invalid_argument& e) {
      throw SafetensorsError("safetensors file '" + path + "': tensor '" + name + "': " + e.what());
    }
    writer.declare(name, dtype, t.sizes().vec());
  }
  // One tensor at a time on the host, so a GPU model is not copied whole.
  for (const auto& [name, t] : tensors) {
    at::Tensor host = t.to(at::kCPU).contiguous();
    writer.append(host.data_ptr(), host.nbytes());
  }
  writer.finish();
}

std::map<std::string, at::Tensor> load_tensors(const std::string& path) {
  SafetensorsReader reader(path);
  std::map<std::string, at::Tensor> out;
  for (const TensorInfo& info : reader.tensors()) out.emplace(info.name, read_tensor(reader, info.name));
  return out;
}

}  // namespace nnstrain::checkpoint
