#include "models/common/cp_document_layout.h"

#include <torch/torch.h>

#include <algorithm>
#include <numeric>
#include <stdexcept>

namespace nnstrain::models::common {

std::vector<std::vector<int64_t>> cp_document_layout(const at::Tensor& segments, int cp) {
  const auto seg = segments.to(at::kCPU, at::kLong).contiguous();
  const int64_t B = seg.size(0), T = seg.size(1);
  if (cp < 1 || T % cp != 0)
    throw std::invalid_argument("sequence length " + std::to_string(T) + " does not split over " +
                                std::to_string(cp) + " context-parallel ranks");
  int64_t m = 1;
  for (int64_t c : {16, 8, 4, 2})
    if (T % (cp * c) == 0 && T / (cp * c) >= 8) {
      m = c;
      break;
    }
  const int64_t n = cp * m, clen = T / n;
  std::vector<int64_t> work(static_cast<size_t>(n), 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* s = seg.data_ptr<int64_t>() + b * T;
    int64_t start = 0;
    for (int64_t p = 0; p < T; ++p) {
      if (p > 0 && s[p] != s[p - 1]) start = p;
      work[size_t(p / clen)] += p - start + 1;
    }
  }
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return work[a] > work[b]; });
  std::vector<int64_t> load(static_cast<size_t>(cp), 0);
  std::vector<std::vector<int64_t>> chunks(static_cast<size_t>(cp));
  for (int64_t c : order) {
    int best = -1;
    for (int r = 0; r < cp; ++r)
      if (int64_t(chunks[r].size()) < m && (best < 0 || load[r] < load[best])) best = r;
    chunks[best].push_back(c);
    load[best] += work[c];
  }
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(cp));
  for (int r = 0; r < cp; ++r) {
    std::sort(chunks[r].begin(), chunks[r].end());
    for (int64_t c : chunks[r])
      for (int64_t t = 0; t < clen; ++t) out[r].push_back(c * clen + t);
  }
  return out;
}

}  // namespace nnstrain::models::common
