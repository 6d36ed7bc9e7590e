// Context parallelism: one sequence split over the cp ranks of a CpComm, each
// holding T / cp of its tokens (queries, keys and values), and attention
// computed exactly as on the whole sequence (issue 22).
//
// - p2p: the K/V blocks travel round the ring (rank r sends to r + 1) while the
//   current block computes; all_gather: K/V gathered once.
// - Partial results are merged by their log-sum-exp in fp32. A row that sees no
//   key of a block gets lse -inf from it and contributes nothing.
// - Layouts: contiguous (rank r holds the r-th T / cp tokens) or zigzag (the
//   sequence cut into 2 cp chunks, rank r holding chunks r and 2 cp - 1 - r, so
//   every rank has the same causal work). Local tokens are in ascending global
//   order in both, so a block is masked by the global chunks it holds: below
//   the diagonal fully visible, above it invisible, on it causal.
// - GQA: q [B, Hq, T, D] against k, v [B, Hkv, T, D], Hq a multiple of Hkv;
//   K/V never expanded (context_attention.cpp says how, per device).
// - Backward recomputes each block with the saved lse (flash-style); p2p sends
//   the K/V gradients round the ring with the blocks until they reach home,
//   all_gather reduce-scatters them.
// - Packed documents (CpAttentionOptions::segments): a query sees the keys of
//   its own document at or before it. Every cp rank reads the whole batch, so
//   each knows where every document starts and masks any block without
//   communicating. Each query tile of a block computes only the key range its
//   documents reach (document_tiles): masked tiles are never computed, on any
//   device, and at cp 1 the same op is the CPU path of document masking.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "models/common/sharding.h"

namespace nnstrain::models::common {

CpCommType parse_cp_comm_type(const std::string& s);  // "p2p" | "all_gather"
CpLayout parse_cp_layout(const std::string& s);       // "zigzag" | "none" (contiguous)
const char* to_string(CpCommType t);
const char* to_string(CpLayout l);

struct CpAttentionOptions {
  CpCommType comm_type = CpCommType::P2P;
  CpLayout layout = CpLayout::Zigzag;
  std::optional<double> scale;  // default 1 / sqrt(D)
  // Document masking: [B, T] int64, the whole sequence's document number per
  // token in global order (non-decreasing along it), the same on every rank.
  at::Tensor segments;
  // Sliding window (Mistral, Gemma's local layers): > 0, a query sees keys at
  // most window - 1 positions before it; runs the masked-tile path (with
  // segments, or one document a row), fp32 composite on every device.
  int64_t window = 0;
};

// The rectangles a document-masked block computes: for batch row b, this
// rank's query rows [q0, q0 + qn) against k_rank's key rows [k0, k0 + kn)
// (local indices); everything else of the block is masked.
struct DocTile {
  int64_t b, q0, qn, k0, kn;
};
// segments: host int64 [B, T]. Query tiles of at most `tile` rows.
std::vector<DocTile> document_tiles(const at::Tensor& segments, int cp, int q_rank, int k_rank, CpLayout layout,
                                    int64_t tile = 64);
// Document-masked tiles this process has computed (forward), for the run's record.
int64_t document_tiles_computed();
// How often this process derived a batch's document plan (positions, tiles): once per batch
// and (cp, layout, device), however many layers, ring steps and recomputations use it.
int64_t document_plans_derived();
// The (query, key) pairs each rank computes for one batch: [cp], for balance checks.
std::vector<int64_t> document_work(const at::Tensor& segments, int cp, CpLayout layout);

// The dense form of document masking: [B, 1, T, T] bool, true where query i may
// attend key j (j <= i, same document) for segments [B, T].
at::Tensor document_causal_mask(const at::Tensor& segments);

// Document-masked attention on one process (cp 1): q [B, Hq, T, D], k, v
// [B, Hkv, T, D], segments [B, T]. By the same tiles on the CPU (and under
// NNSTRAIN_KERNELS=composite); on CUDA flash's varlen kernel where it runs
// (varlen_attention.h), else SDPA with the dense mask. Differentiable in q, k, v.
at::Tensor document_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& segments, std::optional<double> scale = std::nullopt);

// Throws, naming the numbers, unless a sequence of seq_len tokens splits over
// cp ranks in `layout` (2 cp equal chunks for zigzag, cp for contiguous).
void check_cp_split(int64_t seq_len, int cp, CpLayout layout);

// The global positions of rank `rank`'s tokens, in local order: int64 [seq_len / cp].
// Rotary embeddings take these (the tokens' global positions).
std::vector<int64_t> cp_position_ids(int64_t seq_len, int cp, int rank, CpLayout layout);
// A full sequence (along `dim`) -> this rank's tokens.
at::Tensor cp_shard(const at::Tensor& full, int64_t dim, int cp, int rank, CpLayout layout);
// Every rank's tokens, [cp, ...] stacked in rank order as all_gather returns
// them (rank r's tokens at [r], the sequence along `dim` of each) -> the full
// sequence along `dim`: cp_shard's inverse.
at::Tensor cp_unshard(const at::Tensor& gathered, int64_t dim, CpLayout layout);

// The attention op: q [B, Hq, Tl, D], k, v [B, Hkv, Tl, D], this rank's tokens
// in `options.layout`; returns this rank's output [B, Hq, Tl, D], exact as if
// the whole sequence had been attended on one rank. Differentiable in q, k, v.
at::Tensor context_parallel_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                                      const c10::intrusive_ptr<CpComm>& comm, const CpAttentionOptions& options);

// The same forward without autograd, also returning the rows' log-sum-exp
// (fp32 [B, Hq, Tl]) over every key they see.
std::pair<at::Tensor, at::Tensor> context_parallel_attention_lse(const at::Tensor& q, const at::Tensor& k,
                                                                 const at::Tensor& v, bool causal,
                                                                 const c10::intrusive_ptr<CpComm>& comm,
                                                                 const CpAttentionOptions& options);

// One block: rank q_rank's queries against rank k_rank's keys and values, the
// mask following their global positions. fp32 out [B, Hq, Tl, D] and lse
// [B, Hq, Tl]; rows that see none of these keys: out 0, lse -inf.
std::pair<at::Tensor, at::Tensor> cp_attention_block(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     bool causal, int cp, int q_rank, int k_rank,
                                                     const CpAttentionOptions& options);

// Merges a partial result into the running one (fp32, in place): the softmax
// over the union of both key sets. Rows -inf on both sides stay out 0, lse -inf.
void merge_attention(at::Tensor& out, at::Tensor& lse, const at::Tensor& block_out, const at::Tensor& block_lse);

}  // namespace nnstrain::models::common
