#include "models/lora/nf4.h"

#include <torch/torch.h>

#include <cmath>
#include <stdexcept>

namespace nnstrain::models::lora {

const std::vector<float>& nf4_levels() {
  // The quantiles of N(0, 1) normalised to [-1, 1] (Dettmers et al., QLoRA, appendix E).
  static const std::vector<float> v = {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
                                       -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
                                       0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f,
                                       0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,
                                       0.7229568362236023f, 1.0f};
  return v;
}

const std::vector<float>& dynamic_map() {
  // Signed, 7 exponent bits of 8: for each exponent i, the means of a fp32
  // linspace(0.1, 1) of 2^i + 1 points, times 10^(i - 6), both signs; then
  // 0 and 1, sorted (Dettmers, 8-bit approximations for parallelism).
  static const std::vector<float> v = [] {
    std::vector<float> d;
    for (int i = 0; i < 7; ++i) {
      auto b = torch::linspace(0.1, 1.0, (1 << i) + 1, torch::kFloat32);
      auto means = (b.slice(0, 0, -1) + b.slice(0, 1)) / 2.0;
      auto scaled = means * std::pow(10.0, i - 6);
      auto acc = scaled.accessor<float, 1>();
      for (int64_t k = 0; k < scaled.numel(); ++k) d.push_back(acc[k]);
      auto neg = means * -std::pow(10.0, i - 6);
      auto nacc = neg.accessor<float, 1>();
      for (int64_t k = 0; k < neg.numel(); ++k) d.push_back(nacc[k]);
    }
    d.push_back(0.0f);
    d.push_back(1.0f);
    while (d.size() < 256) d.push_back(0.0f);
    std::sort(d.begin(), d.end());
    return d;
  }();
  return v;
}

namespace {

at::Tensor table(const std::vector<float>& v) { return torch::tensor(v, torch::kFloat32); }

// Per block of `blocksize` (the last one shorter): the absmax, and x scaled by its reciprocal into [-1, 1].
std::pair<at::Tensor, at::Tensor> block_scale(const at::Tensor& flat, int64_t blocksize) {
  const int64_t n = flat.numel(), rem = n % blocksize, full = n - rem;
  auto body = flat.narrow(0, 0, full).view({full / blocksize, blocksize});
  auto absmax = std::get<0>(body.abs().max(-1));
  auto scaled = torch::clamp(body * absmax.clamp_min(1e-38).reciprocal().view({-1, 1}), -1, 1).reshape(-1);
  if (rem) {
    auto tail = flat.narrow(0, full, rem);
    auto am = tail.abs().max().clamp_min(1e-38);
    absmax = torch::cat({absmax, am.unsqueeze(0)});
    scaled = torch::cat({scaled, torch::clamp(tail / am, -1, 1)});
  }
  return {absmax, scaled};
}

}  // namespace

int64_t Nf4Tensor::bytes() const {
  int64_t b = codes.numel();
  if (absmax.defined()) b += absmax.numel() * 4;
  if (absmax_codes.defined()) b += absmax_codes.numel() + absmax_scales.numel() * 4 + 4;
  return b;
}

Nf4Tensor quantize_nf4(const at::Tensor& w, int64_t blocksize, bool double_quant) {
  torch::NoGradGuard no_grad;
  Nf4Tensor q;
  q.shape = w.sizes().vec();
  q.blocksize = blocksize;
  auto flat = w.detach().reshape(-1).to(torch::kFloat32).contiguous();
  auto [absmax, scaled] = block_scale(flat, blocksize);
  if (scaled.numel() % 2) scaled = torch::constant_pad_nd(scaled, {0, 1});
  auto levels = table(nf4_levels()).to(flat.device());
  auto bounds = (levels.slice(0, 0, -1) + levels.slice(0, 1)) / 2;  // level i wins up to its upper midpoint
  auto idx = torch::bucketize(scaled, bounds, /*out_int32=*/true, /*right=*/false).to(torch::kUInt8);
  q.codes = torch::bitwise_or(torch::bitwise_left_shift(idx.slice(0, 0, c10::nullopt, 2), 4), idx.slice(0, 1, c10::nullopt, 2));
  if (!double_quant) {
    q.absmax = absmax;
    return q;
  }
  // The scales again: less their mean, absmax-scaled in blocks of 256, each the nearest dynamic-map level.
  const auto offset = absmax.mean();
  q.offset = offset.item<float>();
  auto [scales, s2] = block_scale(absmax - offset, 256);
  auto map = table(dynamic_map()).to(flat.device());
  q.absmax_codes = (s2.unsqueeze(-1) - map).abs().argmin(-1).to(torch::kUInt8);
  q.absmax_scales = scales;
  return q;
}

at::Tensor nf4_absmax(const Nf4Tensor& q) {
  if (!q.nested()) return q.absmax;
  auto map = table(dynamic_map()).to(q.absmax_codes.device());
  auto v = map.index({q.absmax_codes.to(torch::kLong)});
  const int64_t n = v.numel(), rem = n % 256, full = n - rem;
  auto body = (v.narrow(0, 0, full).view({-1, 256}) * q.absmax_scales.narrow(0, 0, full / 256).view({-1, 1})).reshape(-1);
  if (rem) body = torch::cat({body, v.narrow(0, full, rem) * q.absmax_scales[full / 256]});
  return body + q.offset;
}

at::Tensor dequantize_nf4(const Nf4Tensor& q, c10::ScalarType dtype) {
  int64_t n = 1;
  for (auto d : q.shape) n *= d;
  auto levels = table(nf4_levels()).to(q.codes.device());
  auto idx = torch::stack({torch::bitwise_right_shift(q.codes, 4), torch::bitwise_and(q.codes, 0xF)}, 1).reshape(-1);
  auto v = levels.index({idx.to(torch::kLong)}).narrow(0, 0, n);
  auto absmax = nf4_absmax(q);
  const int64_t rem = n % q.blocksize, full = n - rem;
  auto out = (v.narrow(0, 0, full).view({-1, q.blocksize}) * absmax.narrow(0, 0, full / q.blocksize).view({-1, 1})).reshape(-1);
  if (rem) out = torch::cat({out, v.narrow(0, full, rem) * absmax[full / q.blocksize]});
  return out.view(q.shape).to(dtype);
}

}  // namespace nnstrain::models::lora
