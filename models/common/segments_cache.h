// What a batch's packed documents imply (cumulative lengths, a dense mask) is the
// same for every layer of a forward and for its recomputation: they all get the
// batch's one segments tensor. One value per thread, kept while that tensor comes
// back unchanged, so the derivation (and its host copy) runs once per batch, not
// once per layer. The tensor is held, so its storage cannot be reused by the next
// batch's and mistaken for it; the version counter catches writes in place.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>

namespace nnstrain::models::common {

template <class T>
class SegmentsCache {
 public:
  template <class Make>
  T& get(const at::Tensor& segments, Make make) {  // mutable: a value may fill itself in on use
    if (!key_.defined() || !key_.is_same(segments) || version_ != segments._version()) {
      value_ = make(segments);
      key_ = segments;
      version_ = segments._version();
    }
    return value_;
  }

 private:
  at::Tensor key_;
  int64_t version_ = 0;
  T value_{};
};

}  // namespace nnstrain::models::common
