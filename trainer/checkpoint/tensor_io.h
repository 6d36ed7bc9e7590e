// LibTorch adapter over the torch-free safetensors reader and writer.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "trainer/checkpoint/safetensors.h"

namespace nnstrain::checkpoint {

// Throws std::invalid_argument for a scalar type safetensors cannot hold (complex, quantized, ...).
DType to_dtype(c10::ScalarType type);
c10::ScalarType to_scalar_type(DType dtype);

// An owned CPU copy of one tensor; throws SafetensorsError naming file and tensor.
at::Tensor read_tensor(const SafetensorsReader& reader, const std::string& name);
// An owned CPU copy of the block [offsets[d], offsets[d] + sizes[d]) of every dim.
at::Tensor read_tensor_slice(const SafetensorsReader& reader, const std::string& name,
                             const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes);

// Writes the tensors in the given order (any device, any layout; copied to CPU
// one at a time). Writes `path` directly; see SafetensorsWriter for atomicity.
void save_tensors(const std::string& path,
                  const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                  const std::map<std::string, std::string>& metadata = {});
// Every tensor of the file, as owned CPU tensors.
std::map<std::string, at::Tensor> load_tensors(const std::string& path);

}  // namespace nnstrain::checkpoint
