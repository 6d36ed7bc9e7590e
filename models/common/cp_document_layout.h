// Context parallelism over packed documents (dataset document_mask with
// compute_config.cp_load_balance: zigzag): which tokens each cp rank holds,
// chosen per micro-batch from its document numbers so that the ranks' masked
// attention work is about equal. A static layout cannot do that: a query's
// work is its position within its document, so a chunk's work depends on the
// documents that fall in it (docs/parallelism.md, "Packed documents").
//
// The sequence is cut into cp x m equal chunks (m: the most of 16, 8, 4, 2, 1
// that divides it into chunks of at least 8 tokens); each chunk's work is
// summed over the micro-batch's rows (the pairs a query sees: its position in
// its document + 1); chunks go, busiest first (ties: the earlier chunk), to
// the rank with the least work so far among those holding fewer than m (ties:
// the lower rank). Every rank computes the same layout from the same
// segments, so nothing is exchanged.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace nnstrain::models::common {

// segments: [B, T] int64 (any device). Rank r's tokens' global positions, ascending: [cp][T / cp].
std::vector<std::vector<int64_t>> cp_document_layout(const at::Tensor& segments, int cp);

}  // namespace nnstrain::models::common
