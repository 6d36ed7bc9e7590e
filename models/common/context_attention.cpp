#include "models/common/context_attention.h"

#include <torch/torch.h>

#include "models/common/cp_document_layout.h"
#include "models/common/kernels/kernels.h"
#include "models/common/segments_cache.h"
#include "models/common/varlen_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <deque>
#include <map>
#include <stdexcept>

namespace nnstrain::models::common {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

CpCommType parse_cp_comm_type(const std::string& s) {
  if (s == "p2p") return CpCommType::P2P;
  if (s == "all_gather") return CpCommType::AllGather;
  throw std::invalid_argument("cp_comm_type must be p2p or all_gather, got '" + s + "'");
}

CpLayout parse_cp_layout(const std::string& s) {
  if (s == "zigzag") return CpLayout::Zigzag;
  if (s == "none") return CpLayout::Contiguous;
  throw std::invalid_argument("cp_load_balance must be zigzag or none, got '" + s + "'");
}

const char* to_string(CpCommType t) { return t == CpCommType::P2P ? "p2p" : "all_gather"; }
const char* to_string(CpLayout l) { return l == CpLayout::Zigzag ? "zigzag" : "none"; }

namespace {

std::atomic<int64_t> doc_tiles{0};

int64_t chunks_per_rank(CpLayout layout) { return layout == CpLayout::Zigzag ? 2 : 1; }

// The global chunk indices rank r holds, in local (ascending) order.
std::vector<int64_t> rank_chunks(int cp, int r, CpLayout layout) {
  if (layout == CpLayout::Zigzag) return {r, 2 * cp - 1 - r};
  return {r};
}

}  // namespace

void check_cp_split(int64_t seq_len, int cp, CpLayout layout) {
  if (cp < 1) throw std::invalid_argument("context-parallel size must be at least 1, got " + std::to_string(cp));
  const int64_t parts = chunks_per_rank(layout) * cp;
  if (seq_len <= 0 || seq_len % parts != 0) {
    const std::string need = layout == CpLayout::Zigzag ? "2 x context_parallel_size" : "context_parallel_size";
    throw std::invalid_argument("sequence length " + std::to_string(seq_len) + " does not split over " +
                                std::to_string(cp) + " context-parallel ranks with load balance " +
                                to_string(layout) + ": it must be a multiple of " + need + " (" +
                                std::to_string(parts) + ")");
  }
}

std::vector<int64_t> cp_position_ids(int64_t seq_len, int cp, int rank, CpLayout layout) {
  check_cp_split(seq_len, cp, layout);
  TORCH_CHECK(rank >= 0 && rank < cp, "context-parallel rank ", rank, " out of range for size ", cp);
  const int64_t clen = seq_len / (chunks_per_rank(layout) * cp);
  std::vector<int64_t> pos;
  pos.reserve(seq_len / cp);
  for (int64_t c : rank_chunks(cp, rank, layout))
    for (int64_t t = 0; t < clen; ++t) pos.push_back(c * clen + t);
  return pos;
}

at::Tensor cp_shard(const at::Tensor& full, int64_t dim, int cp, int rank, CpLayout layout) {
  if (cp == 1) return full;
  const auto pos = cp_position_ids(full.size(dim), cp, rank, layout);
  auto idx = torch::tensor(pos, torch::dtype(torch::kLong)).to(full.device());
  return full.index_select(dim, idx);
}

at::Tensor cp_unshard(const at::Tensor& gathered, int64_t dim, CpLayout layout) {
  const int cp = static_cast<int>(gathered.size(0));
  // Rank-major concatenation along dim, then every global position picked from its place in it.
  auto cat = at::cat(gathered.unbind(0), dim);
  if (cp == 1) return cat;
  const int64_t seq = cat.size(dim);
  std::vector<int64_t> where(seq);
  int64_t at_local = 0;
  for (int r = 0; r < cp; ++r)
    for (int64_t p : cp_position_ids(seq, cp, r, layout)) where[p] = at_local++;
  return cat.index_select(dim, torch::tensor(where, torch::dtype(torch::kLong)).to(cat.device()));
}

namespace {

// A rectangle of one block that one kernel call computes: queries
// [q0, q0 + qn) against keys [k0, k0 + kn) (local indices), either every key
// visible or causal (square, on the diagonal).
struct Piece {
  int64_t q0, qn, k0, kn;
  bool causal;
};

// The pieces of block (q_rank's queries, k_rank's keys): nothing fully masked
// is ever handed to a kernel (the CPU flash kernel reports lse 0, not -inf,
// for a row without keys), and rows outside every piece keep lse -inf.
std::vector<Piece> block_pieces(int cp, int q_rank, int k_rank, int64_t tl, CpLayout layout, bool causal) {
  if (!causal) return {{0, tl, 0, tl, false}};
  if (q_rank == k_rank) return {{0, tl, 0, tl, true}};  // local order is ascending global order
  const auto qc = rank_chunks(cp, q_rank, layout), kc = rank_chunks(cp, k_rank, layout);
  const int64_t clen = tl / static_cast<int64_t>(qc.size());
  std::vector<Piece> out;
  for (size_t a = 0; a < qc.size(); ++a) {
    // Different ranks never share a chunk: a key chunk is wholly before or after
    // a query chunk, and those before are a prefix of the ascending key chunks.
    int64_t m = 0;
    while (m < static_cast<int64_t>(kc.size()) && kc[m] < qc[a]) ++m;
    if (m == 0) continue;
    const int64_t q0 = static_cast<int64_t>(a) * clen;
    if (!out.empty() && out.back().q0 + out.back().qn == q0 && out.back().kn == m * clen)
      out.back().qn += clen;  // same keys as the query chunk before: one call
    else
      out.push_back({q0, clen, 0, m * clen, false});
  }
  return out;
}

double scale_of(const CpAttentionOptions& o, const at::Tensor& q) {
  return o.scale ? *o.scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
}

// --- One kernel call: out (q's dtype) [B, Hq, L, D], lse fp32 [B, Hq, L] ----
// CPU: the flash kernel, which takes GQA as it is (a KV head serves its g query
// heads inside the kernel; dk, dv come back with Hkv heads). CUDA: the
// memory-efficient kernel (every dtype, returns the lse), which needs equal
// heads: the g query heads of a KV head are folded into its rows
// ([B, Hkv, g L, D], a view) when every key is visible, and called group by
// group on causal pieces. Compiled here but untested: no GPU in this session.

// [B, Hq, L, D] <-> [B, Hkv, g L, D].
at::Tensor fold_groups(const at::Tensor& q, int64_t hkv) {
  const auto s = q.sizes();
  return q.contiguous().view({s[0], hkv, (s[1] / hkv) * s[2], s[3]});
}
at::Tensor unfold_groups(const at::Tensor& x, int64_t hq) {
  const auto s = x.sizes();  // [B, Hkv, gL(, D)]
  std::vector<int64_t> shape{s[0], hq, s[2] / (hq / s[1])};
  if (x.dim() == 4) shape.push_back(s[3]);
  return x.contiguous().view(shape);
}

int64_t padded32(int64_t n) { return (n + 31) / 32 * 32; }

std::pair<at::Tensor, at::Tensor> cuda_forward_equal_heads(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v, bool causal, double scale) {
  auto r = at::_scaled_dot_product_efficient_attention(q, k, v, {}, /*compute_log_sumexp=*/true, 0.0, causal, scale);
  auto lse = std::get<1>(r).narrow(2, 0, q.size(2));  // the kernel pads rows to a multiple of 32
  return {std::get<0>(r), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cuda_backward_equal_heads(const at::Tensor& dout, const at::Tensor& q,
                                                                        const at::Tensor& k, const at::Tensor& v,
                                                                        const at::Tensor& out, const at::Tensor& lse,
                                                                        bool causal, double scale) {
  auto lse_p = at::constant_pad_nd(lse, {0, padded32(lse.size(2)) - lse.size(2)}, 0.0).contiguous();
  auto none = at::zeros({}, at::dtype(at::kLong));  // philox seed/offset: unused without dropout
  auto r = at::_scaled_dot_product_efficient_attention_backward(dout, q, k, v, at::Tensor(), out, lse_p, none, none,
                                                                0.0, {true, true, true, false}, causal, scale);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r)};
}

std::pair<at::Tensor, at::Tensor> kernel_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 bool causal, double scale) {
  if (!q.is_cuda()) {
    auto r = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, {}, scale);
    return {std::get<0>(r), std::get<1>(r)};
  }
  const int64_t hq = q.size(1), hkv = k.size(1), g = hq / hkv;
  if (g == 1) return cuda_forward_equal_heads(q, k, v, causal, scale);
  if (!causal) {
    auto r = cuda_forward_equal_heads(fold_groups(q, hkv), k, v, false, scale);
    return {unfold_groups(r.first, hq), unfold_groups(r.second, hq)};
  }
  auto qg = q.contiguous().view({q.size(0), hkv, g, q.size(2), q.size(3)});
  std::vector<at::Tensor> outs, lses;
  for (int64_t j = 0; j < g; ++j) {
    auto r = cuda_forward_equal_heads(qg.select(2, j).contiguous(), k, v, true, scale);
    outs.push_back(r.first);
    lses.push_back(r.second);
  }
  return {unfold_groups(at::stack(outs, 2).flatten(2, 3), hq), unfold_groups(at::stack(lses, 2).flatten(2, 3), hq)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> kernel_backward(const at::Tensor& dout, const at::Tensor& q,
                                                              const at::Tensor& k, const at::Tensor& v,
                                                              const at::Tensor& out, const at::Tensor& lse,
                                                              bool causal, double scale) {
  if (!q.is_cuda())
    return at::_scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal, {}, scale);
  const int64_t hq = q.size(1), hkv = k.size(1), g = hq / hkv;
  if (g == 1) return cuda_backward_equal_heads(dout, q, k, v, out, lse, causal, scale);
  if (!causal) {
    auto [dq, dk, dv] = cuda_backward_equal_heads(fold_groups(dout, hkv), fold_groups(q, hkv), k, v,
                                                  fold_groups(out, hkv), fold_groups(lse.unsqueeze(-1), hkv).squeeze(-1),
                                                  false, scale);
    return {unfold_groups(dq, hq), dk, dv};
  }
  auto five = [&](const at::Tensor& x) { return x.contiguous().view({x.size(0), hkv, g, x.size(2), x.size(3)}); };
  auto qg = five(q), dog = five(dout), og = five(out);
  auto lg = lse.contiguous().view({lse.size(0), hkv, g, lse.size(2)});
  std::vector<at::Tensor> dqs;
  at::Tensor dk, dv;
  for (int64_t j = 0; j < g; ++j) {
    auto [dqj, dkj, dvj] = cuda_backward_equal_heads(dog.select(2, j).contiguous(), qg.select(2, j).contiguous(), k, v,
                                                     og.select(2, j).contiguous(), lg.select(2, j).contiguous(), true,
                                                     scale);
    dqs.push_back(dqj);
    dk = j ? dk + dkj : dkj;
    dv = j ? dv + dvj : dvj;
  }
  return {unfold_groups(at::stack(dqs, 2).flatten(2, 3), hq), dk, dv};
}

// --- Document-masked tiles (fp32 composite, any device) --------------------

// Every rank's global token positions, ascending: under documents, zigzag is
// the per-micro-batch balanced layout (cp_document_layout.h).
std::vector<std::vector<int64_t>> rank_positions(const at::Tensor& segments, int cp, CpLayout layout) {
  if (layout == CpLayout::Zigzag && cp > 1) return cp_document_layout(segments, cp);
  std::vector<std::vector<int64_t>> pos;
  for (int r = 0; r < cp; ++r) pos.push_back(cp_position_ids(segments.size(1), cp, r, layout));
  return pos;
}

// The rows' document masks: the global positions of the two ranks' tokens and the segments on q's device.
struct DocMask {
  at::Tensor seg, qpos, kpos;  // [B, T] int64; [Tl] int64 each
  int64_t window = 0;          // > 0: a key at most window - 1 positions before its query
  at::Tensor operator()(const DocTile& t) const {
    auto qp = qpos.narrow(0, t.q0, t.qn), kp = kpos.narrow(0, t.k0, t.kn);
    auto qs = seg[t.b].index_select(0, qp), ks = seg[t.b].index_select(0, kp);
    auto m = qs.unsqueeze(1).eq(ks.unsqueeze(0)).logical_and(kp.unsqueeze(0).le(qp.unsqueeze(1)));
    if (window > 0) m = m.logical_and(kp.unsqueeze(0).gt(qp.unsqueeze(1) - window));
    return m;
  }
};

std::atomic<int64_t> doc_plans{0};

// The tiles of q positions against k positions (each rank's, ascending) for host int64 segments.
std::vector<DocTile> tiles_of(const at::Tensor& seg, const std::vector<int64_t>& qpos,
                              const std::vector<int64_t>& kpos, int64_t window, int64_t tile = 64) {
  const int64_t B = seg.size(0), T = seg.size(1), tl = static_cast<int64_t>(qpos.size());
  std::vector<DocTile> out;
  std::vector<int64_t> start(static_cast<size_t>(T));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* s = seg.data_ptr<int64_t>() + b * T;
    // Where each token's document starts (documents are contiguous, numbered in order).
    for (int64_t p = 0; p < T; ++p) {
      TORCH_CHECK(p == 0 || s[p] >= s[p - 1], "document-masked attention: segments decrease at token ", p,
                  " of batch row ", b);
      start[p] = p > 0 && s[p] == s[p - 1] ? start[p - 1] : p;
    }
    // A query tile (within one run of contiguous global positions) sees the
    // keys from its first query's document start to its last query: a
    // contiguous range of the ascending local keys.
    for (int64_t i = 0, run = 1; i < tl; i += run, run = 1) {
      while (i + run < tl && qpos[i + run] == qpos[i] + run) ++run;
      for (int64_t q0 = i; q0 < i + run; q0 += tile) {
        const int64_t qn = std::min(tile, i + run - q0);
        // (A window starts the range at the first query's window, if later.)
        const int64_t lo = window > 0 ? std::max(start[qpos[q0]], qpos[q0] - window + 1) : start[qpos[q0]];
        const int64_t hi = qpos[q0 + qn - 1];
        const int64_t k0 = std::lower_bound(kpos.begin(), kpos.end(), lo) - kpos.begin();
        const int64_t k1 = std::upper_bound(kpos.begin(), kpos.end(), hi) - kpos.begin();
        if (k1 > k0) out.push_back({b, q0, qn, k0, k1 - k0});
      }
    }
  }
  return out;
}

// What one batch's documents imply for its blocks at (cp, layout, device): every
// rank's positions, on the host and the device, the segments on the device, and
// each (q rank, k rank) pair's tiles on first use. Derived once per batch
// (SegmentsCache: every layer, ring step and recomputation gets the batch's one
// segments tensor), not once per block: each derivation read the segments back
// to the host (a stream sync on CUDA) and balanced the layout again.
struct DocPlan {
  int cp = 0;
  int64_t window = 0;
  CpLayout layout = CpLayout::Zigzag;
  at::Device device = at::kCPU;
  at::Tensor seg_host, seg_device;
  std::vector<std::vector<int64_t>> pos;  // per rank
  std::vector<at::Tensor> pos_device;     // per rank
  std::map<std::pair<int, int>, std::vector<DocTile>> tiles;
};
struct DocPlans {
  std::deque<DocPlan> plans;  // one per (cp, layout, device) seen with this batch (references stay valid)
};

DocPlan& doc_plan(const at::Tensor& segments, int cp, CpLayout layout, const at::Device& device, int64_t window) {
  static thread_local SegmentsCache<DocPlans> cache;
  auto& plans = cache.get(segments, [](const at::Tensor&) { return DocPlans{}; }).plans;
  for (auto& p : plans)
    if (p.cp == cp && p.layout == layout && p.device == device && p.window == window) return p;
  auto& p = plans.emplace_back();
  p.cp = cp, p.layout = layout, p.device = device, p.window = window;
  p.seg_host = segments.to(at::kCPU, at::kLong).contiguous();
  p.seg_device = p.seg_host.to(device);
  p.pos = rank_positions(p.seg_host, cp, layout);
  for (const auto& pos : p.pos) p.pos_device.push_back(at::tensor(pos, at::TensorOptions().dtype(at::kLong)).to(device));
  doc_plans.fetch_add(1, std::memory_order_relaxed);
  return p;
}

DocMask doc_mask(const DocPlan& plan, int q_rank, int k_rank) {
  return {plan.seg_device, plan.pos_device[size_t(q_rank)], plan.pos_device[size_t(k_rank)], plan.window};
}

const std::vector<DocTile>& plan_tiles(DocPlan& plan, int q_rank, int k_rank) {
  auto it = plan.tiles.find({q_rank, k_rank});
  if (it == plan.tiles.end())
    it = plan.tiles.emplace(std::make_pair(q_rank, k_rank),
                            tiles_of(plan.seg_host, plan.pos[size_t(q_rank)], plan.pos[size_t(k_rank)], plan.window))
             .first;
  return it->second;
}

// Scores of one tile, [Hkv, g Lq, Lk] fp32, masked entries -inf; q [Hq, Lq, D]
// and k [Hkv, Lk, D] fp32 (a KV head serves its g query heads as they are).
at::Tensor tile_scores(const at::Tensor& q, const at::Tensor& k, const at::Tensor& mask, double scale) {
  const int64_t hkv = k.size(0), g = q.size(0) / hkv, lq = q.size(1);
  auto s = at::matmul(q.reshape({hkv, g * lq, q.size(2)}), k.transpose(1, 2)).mul_(scale);
  return s.view({hkv, g, lq, k.size(1)})
      .masked_fill_(mask.logical_not(), -std::numeric_limits<float>::infinity())
      .view({hkv, g * lq, k.size(1)});
}

// exp(s - lse) with rows of lse -inf (no key) all 0.
at::Tensor tile_probs(const at::Tensor& s, const at::Tensor& lse) {
  auto safe = at::where(lse.isneginf(), at::zeros_like(lse), lse);
  return (s - safe.unsqueeze(-1)).exp_();
}

void doc_forward_block(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& segments,
                       int cp, int q_rank, int k_rank, CpLayout layout, double scale, at::Tensor& out,
                       at::Tensor& lse, int64_t window) {
  auto& plan = doc_plan(segments, cp, layout, q.device(), window);
  const auto mask_of = doc_mask(plan, q_rank, k_rank);
  const int64_t hq = q.size(1);
  for (const auto& t : plan_tiles(plan, q_rank, k_rank)) {
    auto qt = q[t.b].narrow(1, t.q0, t.qn).to(at::kFloat), kt = k[t.b].narrow(1, t.k0, t.kn).to(at::kFloat),
         vt = v[t.b].narrow(1, t.k0, t.kn).to(at::kFloat);
    auto s = tile_scores(qt, kt, mask_of(t), scale);
    auto l = s.logsumexp(-1);  // [Hkv, g Lq]
    doc_tiles.fetch_add(1, std::memory_order_relaxed);
    auto o = at::matmul(tile_probs(s, l), vt).view({hq, t.qn, q.size(3)});
    auto out_rows = out[t.b].narrow(1, t.q0, t.qn), lse_rows = lse[t.b].narrow(1, t.q0, t.qn);
    merge_attention(out_rows, lse_rows, o, l.view({hq, t.qn}));
  }
}

void doc_backward_block(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& out, const at::Tensor& lse, const at::Tensor& segments, int cp, int q_rank,
                        int k_rank, CpLayout layout, double scale, at::Tensor& dq_acc, at::Tensor& dk_acc,
                        at::Tensor& dv_acc, int64_t window) {
  auto& plan = doc_plan(segments, cp, layout, q.device(), window);
  const auto mask_of = doc_mask(plan, q_rank, k_rank);
  const int64_t hq = q.size(1), hkv = k.size(1), d = q.size(3);
  for (const auto& t : plan_tiles(plan, q_rank, k_rank)) {
    const int64_t gl = (hq / hkv) * t.qn;
    auto qt = q[t.b].narrow(1, t.q0, t.qn).to(at::kFloat), kt = k[t.b].narrow(1, t.k0, t.kn).to(at::kFloat),
         vt = v[t.b].narrow(1, t.k0, t.kn).to(at::kFloat);
    auto dot = dout[t.b].narrow(1, t.q0, t.qn).to(at::kFloat), ot = out[t.b].narrow(1, t.q0, t.qn).to(at::kFloat);
    auto lt = lse[t.b].narrow(1, t.q0, t.qn).reshape({hkv, gl});
    auto p = tile_probs(tile_scores(qt, kt, mask_of(t), scale), lt);  // the rows' softmax over all their keys
    auto do3 = dot.reshape({hkv, gl, d});
    auto dv = at::matmul(p.transpose(1, 2), do3);
    auto dp = at::matmul(do3, vt.transpose(1, 2));
    auto rowdot = (dot * ot).sum(-1).reshape({hkv, gl, 1});
    auto ds = p.mul_(dp.sub_(rowdot));
    dq_acc[t.b].narrow(1, t.q0, t.qn).add_(at::matmul(ds, kt).mul_(scale).view({hq, t.qn, d}));
    dk_acc[t.b].narrow(1, t.k0, t.kn).add_(at::matmul(ds.transpose(1, 2), qt.reshape({hkv, gl, d})).mul_(scale));
    dv_acc[t.b].narrow(1, t.k0, t.kn).add_(dv);
  }
}

// --- Blocks ------------------------------------------------------------------

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int cp, CpLayout layout) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "context-parallel attention takes q, k, v as [B, H, T, D], got ", q.sizes(), ", ", k.sizes(), ", ",
              v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes(), "context-parallel attention: k ", k.sizes(), " and v ", v.sizes(), " differ");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3),
              "context-parallel attention: q ", q.sizes(), " and k ", k.sizes(), " disagree in B, T or D");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "context-parallel attention: ", q.size(1),
              " query heads are not a multiple of ", k.size(1), " KV heads");
  const int64_t tl = q.size(2);
  if (tl % chunks_per_rank(layout) != 0) check_cp_split(tl * cp, cp, layout);  // the message names the global length
}

// q's rows [q0, q0 + n) of every [B, H, T, ...] tensor.
at::Tensor rows(const at::Tensor& x, int64_t q0, int64_t n) { return x.narrow(2, q0, n); }

// Adds one block (keys of k_rank) into the running fp32 out / lse.
void forward_block(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, int cp, int q_rank,
                   int k_rank, CpLayout layout, double scale, at::Tensor& out, at::Tensor& lse,
                   const at::Tensor& segments, int64_t window) {
  if (segments.defined())
    return doc_forward_block(q, k, v, segments, cp, q_rank, k_rank, layout, scale, out, lse, window);
  for (const auto& p : block_pieces(cp, q_rank, k_rank, q.size(2), layout, causal)) {
    auto [o, l] = kernel_forward(rows(q, p.q0, p.qn).contiguous(), rows(k, p.k0, p.kn).contiguous(),
                                 rows(v, p.k0, p.kn).contiguous(), p.causal, scale);
    auto out_rows = rows(out, p.q0, p.qn), lse_rows = rows(lse, p.q0, p.qn);
    merge_attention(out_rows, lse_rows, o.to(at::kFloat), l.to(at::kFloat));
  }
}

// The gradients of one block, recomputed with the whole rows' out and lse;
// dq accumulated into dq_acc, dk / dv into dk_acc / dv_acc (fp32).
void backward_block(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& out, const at::Tensor& lse, bool causal, int cp, int q_rank, int k_rank,
                    CpLayout layout, double scale, at::Tensor& dq_acc, at::Tensor& dk_acc, at::Tensor& dv_acc,
                    const at::Tensor& segments, int64_t window) {
  if (segments.defined())
    return doc_backward_block(dout, q, k, v, out, lse, segments, cp, q_rank, k_rank, layout, scale, dq_acc, dk_acc,
                              dv_acc, window);
  for (const auto& p : block_pieces(cp, q_rank, k_rank, q.size(2), layout, causal)) {
    auto [dq, dk, dv] = kernel_backward(rows(dout, p.q0, p.qn).contiguous(), rows(q, p.q0, p.qn).contiguous(),
                                        rows(k, p.k0, p.kn).contiguous(), rows(v, p.k0, p.kn).contiguous(),
                                        rows(out, p.q0, p.qn).contiguous(), rows(lse, p.q0, p.qn).contiguous(),
                                        p.causal, scale);
    rows(dq_acc, p.q0, p.qn).add_(dq);
    rows(dk_acc, p.k0, p.kn).add_(dk);
    rows(dv_acc, p.k0, p.kn).add_(dv);
  }
}

// The forward of the op: fp32 out and lse of this rank's rows.
// comm null: one process (cp 1).
std::pair<at::Tensor, at::Tensor> cp_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             bool causal, CpComm* comm, const CpAttentionOptions& o) {
  const int cp = comm ? comm->size() : 1, me = comm ? comm->rank() : 0;
  const auto& seg = o.segments;
  TORCH_CHECK(o.window <= 0 || seg.defined(), "context-parallel attention: a window without segments");
  if (seg.defined())
    TORCH_CHECK(causal && seg.dim() == 2 && seg.size(0) == q.size(0) && seg.size(1) == q.size(2) * cp,
                "document-masked attention: segments ", seg.sizes(), " do not cover the batch's ", q.size(2) * cp,
                " tokens (causal only)");
  check_inputs(q, k, v, cp, o.layout);
  const double scale = scale_of(o, q);
  auto f32 = q.options().dtype(at::kFloat);
  auto out = at::zeros(q.sizes(), f32);
  auto lse = at::full({q.size(0), q.size(1), q.size(2)}, -std::numeric_limits<float>::infinity(), f32);
  auto kv = at::stack({k, v});  // one message per step
  if (comm && o.comm_type == CpCommType::AllGather) {
    auto all = comm->all_gather(kv);
    for (int src = 0; src < cp; ++src)
      forward_block(q, all[src][0], all[src][1], causal, cp, me, src, o.layout, scale, out, lse, seg, o.window);
    return {out, lse};
  }
  for (int step = 0; step < cp; ++step) {
    const int src = ((me - step) % cp + cp) % cp;
    CpComm::Pending next;
    if (step + 1 < cp) next = comm->ring_shift_start(kv, 0);  // the next block travels while this one computes
    forward_block(q, kv[0], kv[1], causal, cp, me, src, o.layout, scale, out, lse, seg, o.window);
    if (next) kv = next();
  }
  return {out, lse};
}

struct CpAttentionFn : torch::autograd::Function<CpAttentionFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            bool causal, const c10::intrusive_ptr<CpComm>& comm, int64_t comm_type, int64_t layout,
                            double scale, const at::Tensor& segments, int64_t window) {
    CpAttentionOptions o;
    o.window = window;
    o.comm_type = static_cast<CpCommType>(comm_type);
    o.layout = static_cast<CpLayout>(layout);
    o.scale = scale;
    if (segments.numel() > 0) o.segments = segments;  // empty: no documents (apply takes no undefined tensor)
    auto [out32, lse] = cp_forward(q, k, v, causal, comm.get(), o);
    auto out = out32.to(q.scalar_type());
    ctx->save_for_backward({q, k, v, out, lse});
    if (comm) ctx->saved_data["comm"] = c10::IValue::make_capsule(comm);
    if (o.segments.defined()) ctx->saved_data["segments"] = o.segments;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["comm_type"] = comm_type;
    ctx->saved_data["layout"] = layout;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["window"] = window;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    CpComm* comm = nullptr;  // none: one process
    if (ctx->saved_data.count("comm")) {
      comm = dynamic_cast<CpComm*>(ctx->saved_data["comm"].toCapsule().get());
      TORCH_CHECK(comm, "saved context-parallel communicator has the wrong type");
    }
    const auto segments = ctx->saved_data.count("segments") ? ctx->saved_data["segments"].toTensor() : at::Tensor();
    const bool causal = ctx->saved_data["causal"].toBool();
    const auto type = static_cast<CpCommType>(ctx->saved_data["comm_type"].toInt());
    const auto layout = static_cast<CpLayout>(ctx->saved_data["layout"].toInt());
    const double scale = ctx->saved_data["scale"].toDouble();
    const int64_t window = ctx->saved_data["window"].toInt();
    const int cp = comm ? comm->size() : 1, me = comm ? comm->rank() : 0;
    const auto dout = grads[0].contiguous();
    auto f32 = q.options().dtype(at::kFloat);
    auto dq = at::zeros(q.sizes(), f32);
    auto kv = at::stack({k, v});
    // K and V gradients in fp32, [2, B, Hkv, Tl, D] like kv.
    at::Tensor dkv_home;
    if (!comm) {
      auto dkv = at::zeros(kv.sizes(), f32);
      auto dk = dkv[0], dv = dkv[1];
      backward_block(dout, q, k, v, out, lse, causal, 1, 0, 0, layout, scale, dq, dk, dv, segments, window);
      dkv_home = dkv;
    } else if (type == CpCommType::AllGather) {
      auto all = comm->all_gather(kv);
      auto dkv_all = at::zeros(all.sizes(), f32);
      for (int src = 0; src < cp; ++src) {
        auto dk = dkv_all[src][0], dv = dkv_all[src][1];
        backward_block(dout, q, all[src][0], all[src][1], out, lse, causal, cp, me, src, layout, scale, dq, dk, dv,
                       segments, window);
      }
      dkv_home = comm->reduce_scatter(dkv_all);
    } else {
      // The gradient of a block travels with it: at step s this rank receives
      // the sum over the ranks before it of the gradients of block (me - s),
      // adds its own and passes it on; after cp steps it is back home.
      CpComm::Pending dkv_in;
      for (int step = 0; step < cp; ++step) {
        const int src = ((me - step) % cp + cp) % cp;
        CpComm::Pending kv_next;
        if (step + 1 < cp) kv_next = comm->ring_shift_start(kv, 0);
        auto dkv = step == 0 ? at::zeros(kv.sizes(), f32) : dkv_in();
        auto dk = dkv[0], dv = dkv[1];
        backward_block(dout, q, kv[0], kv[1], out, lse, causal, cp, me, src, layout, scale, dq, dk, dv, segments,
                       window);
        dkv_in = comm->ring_shift_start(dkv, 1);
        if (kv_next) kv = kv_next();
      }
      dkv_home = dkv_in();
    }
    return {dq.to(q.scalar_type()), dkv_home[0].to(k.scalar_type()), dkv_home[1].to(v.scalar_type()),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// A window over a sequence without documents: one document a row, the
// masked-tile path's segments. The same tensor for the same shape, so the
// batch's plan (SegmentsCache) is derived once, not per layer.
CpAttentionOptions with_window_segments(CpAttentionOptions o, int64_t batch, int64_t tokens) {
  if (o.window <= 0 || o.segments.defined()) return o;
  static thread_local at::Tensor one;
  if (!one.defined() || one.size(0) != batch || one.size(1) != tokens) one = at::zeros({batch, tokens}, at::kLong);
  o.segments = one;
  return o;
}

}  // namespace

void merge_attention(at::Tensor& out, at::Tensor& lse, const at::Tensor& block_out, const at::Tensor& block_lse) {
  const float inf = std::numeric_limits<float>::infinity();
  auto m = at::maximum(lse, block_lse);
  auto m_safe = at::where(m == -inf, at::zeros_like(m), m);  // -inf on both sides: no NaN from -inf - -inf
  auto a = at::exp(lse - m_safe), b = at::exp(block_lse - m_safe);
  auto s = a + b;
  auto s_safe = at::where(s == 0, at::ones_like(s), s);
  out.copy_((out * (a / s_safe).unsqueeze(-1)) + (block_out * (b / s_safe).unsqueeze(-1)));
  lse.copy_(m_safe + at::log(s));  // log 0 = -inf: a row no key reached stays -inf
}

std::pair<at::Tensor, at::Tensor> cp_attention_block(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     bool causal, int cp, int q_rank, int k_rank,
                                                     const CpAttentionOptions& options) {
  check_inputs(q, k, v, cp, options.layout);
  auto f32 = q.options().dtype(at::kFloat);
  auto out = at::zeros(q.sizes(), f32);
  auto lse = at::full({q.size(0), q.size(1), q.size(2)}, -std::numeric_limits<float>::infinity(), f32);
  const auto o = with_window_segments(options, q.size(0), q.size(2) * cp);
  forward_block(q, k, v, causal, cp, q_rank, k_rank, o.layout, scale_of(o, q), out, lse, o.segments, o.window);
  return {out, lse};
}

std::pair<at::Tensor, at::Tensor> context_parallel_attention_lse(const at::Tensor& q, const at::Tensor& k,
                                                                 const at::Tensor& v, bool causal,
                                                                 const c10::intrusive_ptr<CpComm>& comm,
                                                                 const CpAttentionOptions& options) {
  TORCH_CHECK(comm, "context-parallel attention without a communicator");
  at::NoGradGuard no_grad;
  auto [out, lse] = cp_forward(q, k, v, causal, comm.get(), with_window_segments(options, q.size(0), q.size(2) * comm->size()));
  return {out.to(q.scalar_type()), lse};
}

at::Tensor context_parallel_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                                      const c10::intrusive_ptr<CpComm>& comm, const CpAttentionOptions& options) {
  TORCH_CHECK(comm, "context-parallel attention without a communicator");
  const auto o = with_window_segments(options, q.size(0), q.size(2) * comm->size());
  return CpAttentionFn::apply(q, k, v, causal, comm, static_cast<int64_t>(o.comm_type),
                              static_cast<int64_t>(o.layout), scale_of(o, q),
                              o.segments.defined() ? o.segments : at::empty({0}, at::kLong), o.window);
}

at::Tensor document_causal_mask(const at::Tensor& segments) {
  const auto T = segments.size(1);
  auto causal = torch::ones({T, T}, segments.options().dtype(torch::kBool)).tril();
  return (segments.unsqueeze(2) == segments.unsqueeze(1)).logical_and(causal).unsqueeze(1);
}

at::Tensor document_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& segments, std::optional<double> scale) {
  // CUDA: flash attention's varlen kernel where it runs, else SDPA with the dense
  // block-diagonal mask (what ran before the varlen kernel); NNSTRAIN_KERNELS=composite
  // keeps the tiles, the reference the GPU battery compares with.
  if (q.is_cuda() && kernels::impl() != kernels::Impl::Composite) {
    if (varlen_flash_fits(q, k)) return varlen_document_attention(q, k, v, segments, scale);
    static thread_local SegmentsCache<at::Tensor> masks;  // built once per batch, not per layer
    const auto& mask = masks.get(segments, [&](const at::Tensor& s) { return document_causal_mask(s.to(q.device())); });
    const int64_t rep = q.size(1) / k.size(1);
    return at::scaled_dot_product_attention(q, rep > 1 ? k.repeat_interleave(rep, 1) : k,
                                            rep > 1 ? v.repeat_interleave(rep, 1) : v, mask, 0.0, false, scale);
  }
  CpAttentionOptions o;
  o.scale = scale;
  return CpAttentionFn::apply(q, k, v, true, c10::intrusive_ptr<CpComm>(), static_cast<int64_t>(CpCommType::P2P),
                              static_cast<int64_t>(CpLayout::Contiguous), scale_of(o, q), segments, int64_t{0});
}

std::vector<DocTile> document_tiles(const at::Tensor& segments, int cp, int q_rank, int k_rank, CpLayout layout,
                                    int64_t tile) {
  const auto seg = segments.to(at::kCPU, at::kLong).contiguous();
  const auto pos = rank_positions(seg, cp, layout);
  return tiles_of(seg, pos[size_t(q_rank)], pos[size_t(k_rank)], /*window=*/0, tile);
}


int64_t document_tiles_computed() { return doc_tiles.load(); }
int64_t document_plans_derived() { return doc_plans.load(); }

std::vector<int64_t> document_work(const at::Tensor& segments, int cp, CpLayout layout) {
  std::vector<int64_t> work(static_cast<size_t>(cp), 0);
  for (int r = 0; r < cp; ++r)
    for (int src = 0; src < cp; ++src)
      for (const auto& t : document_tiles(segments, cp, r, src, layout)) work[r] += t.qn * t.kn;
  return work;
}

}  // namespace nnstrain::models::common
