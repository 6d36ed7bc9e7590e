// NF4 (QLoRA's 4-bit NormalFloat): a tensor in blocks of `blocksize`
// elements, each scaled by its absmax and rounded to the nearest of 16 levels,
// two codes a byte (the first in the high nibble); with double quantization the
// fp32 absmax values, less their mean, are quantized again to 8 bits in blocks
// of 256 with the signed dynamic map. As bitsandbytes' quantize_4bit(quant_type
// "nf4") lays them out, so its codes and scales compare bit for bit
// (tests/integration/test_lora.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace nnstrain::models::lora {

struct Nf4Tensor {
  at::Tensor codes;                // uint8 [ceil(n / 2)]
  at::Tensor absmax;               // fp32 [blocks]; undefined when nested
  std::vector<int64_t> shape;
  int64_t blocksize = 64;
  // Double quantization: absmax = dequant8(absmax_codes, absmax_scales) + offset.
  at::Tensor absmax_codes;         // uint8 [blocks]
  at::Tensor absmax_scales;        // fp32 [ceil(blocks / 256)]
  float offset = 0;
  bool nested() const { return absmax_codes.defined(); }
  int64_t bytes() const;
};

// The 16 NF4 levels (fp32), ascending.
const std::vector<float>& nf4_levels();
// The signed 8-bit dynamic map bitsandbytes' blockwise quantization uses (256 levels, ascending).
const std::vector<float>& dynamic_map();

Nf4Tensor quantize_nf4(const at::Tensor& w, int64_t blocksize = 64, bool double_quant = false);
// The block scales as fp32 (through the nested 8-bit codes when double-quantized).
at::Tensor nf4_absmax(const Nf4Tensor& q);
// Back to `shape` in `dtype`: level x absmax in fp32, then cast.
at::Tensor dequantize_nf4(const Nf4Tensor& q, c10::ScalarType dtype);

}  // namespace nnstrain::models::lora
