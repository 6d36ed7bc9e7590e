// Materialising a model built on meta: every parameter allocated at its local
// shape on the target device, zero-filled (so padding rows are zero), then
// filled with this rank's piece by a Filler: the fresh initialisation below,
// or a reader of pretrained weights (trainer/checkpoint/hf.cpp).
//
// The fresh initialisation is slice-for-slice the same at any tp degree: a
// parameter's values are generated in blocks of whole rows along dim 0, block k
// from a CPU generator seeded from (seed, parameter name, k), the blocks fixed by
// the global shape alone. A rank generates only the blocks its piece overlaps
// and narrows them (a row-split piece narrows the columns of each block), so
// peak host memory is its piece plus one block.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace nnstrain::models {
class CausalLM;
namespace common {

struct ParamLayout;

// Writes this rank's piece of `layout` into `local` (its blocks' rows first).
using Filler = std::function<void(const ParamLayout& layout, at::Tensor& local)>;

// `after`, if given, sees each parameter once filled, before the next is
// allocated (ZeRO-3 takes its chunks out of it and frees it, so a rank never
// holds the whole model).
void materialise(CausalLM& model, const c10::Device& device, const Filler& fill, const Filler& after = {});
void materialise_fresh(CausalLM& model, const c10::Device& device, uint64_t seed, const Filler& after = {});

// The fresh initialisation of one parameter's piece (InitRule of its layout).
void fill_fresh(const ParamLayout& layout, at::Tensor& local, uint64_t seed);
// Rows per generated block: fixed by the global shape (about 1 Mi elements a block).
int64_t init_rows_per_block(const std::vector<int64_t>& global_shape);

}  // namespace common
}  // namespace nnstrain::models
