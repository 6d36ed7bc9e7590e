// What a model is built from besides its config: the tensor-parallel degree and
// this rank's position in it, the options (device) to build on, and the
// collectives its parallel layers need. Models read local sizes from here and
// never see a rank or a process group: layers call the abstract TpComm, which
// trainer/state implements over its tensor-parallel group.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/TensorOptions.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace nnstrain::models {

// How a parameter may be split over tensor-parallel ranks (Megatron style).
enum class SplitStyle {
  Replicate,  // every rank holds all of it
  Column,     // output features split (dim 0 of a [out, in] weight, and its bias)
  Row,        // input features split (dim 1 of a [out, in] weight; bias replicated)
  Vocab,      // embedding / LM head rows split by vocabulary
  Expert,     // MoE expert weights [E, ...]: whole experts split over expert-parallel ranks (dim 0)
};

struct ParamSplit {
  std::string param;        // parameter name as in named_parameters()
  SplitStyle style = SplitStyle::Replicate;
  int64_t unit = 1;         // split only in multiples of this (e.g. head_dim for QKV)
  // Column splits of fused projections (QKV, gate/up): the sizes of the fused
  // parts along dim 0; each part is split separately so every rank gets its slice of each.
  std::vector<int64_t> fused_parts;
};

namespace common {

class ParallelRng;

// Collectives over the tensor-parallel group. Tensors in, results out; every
// rank of the group calls them in the same order. Held by autograd functions
// through an IValue capsule, hence the CustomClassHolder base.
class TpComm : public torch::CustomClassHolder {
 public:
  ~TpComm() override = default;
  virtual void all_reduce(at::Tensor& t) = 0;      // sum, in place (t contiguous)
  virtual void all_reduce_max(at::Tensor& t) = 0;  // elementwise max, in place
  // [tp, *t.shape]: every rank's t in rank order.
  virtual at::Tensor all_gather(const at::Tensor& t) = 0;
  // t [tp, *rest] -> [*rest]: the sum over ranks of their t[my rank].
  virtual at::Tensor reduce_scatter(const at::Tensor& t) = 0;
  // The same two started now and finished by calling the result (its tensor
  // is the collective's result), so a backward can compute while they run.
  // By default they run at once.
  using Pending = std::function<at::Tensor()>;
  virtual Pending all_gather_start(const at::Tensor& t) {
    auto r = all_gather(t);
    return [r] { return r; };
  }
  virtual Pending reduce_scatter_start(const at::Tensor& t) {
    auto r = reduce_scatter(t);
    return [r] { return r; };
  }
};

// Context parallelism's two choices (models/common/context_attention.h):
// K/V round a ring (p2p) or gathered once; tokens dealt in 2 cp chunks, rank r
// holding r and 2 cp - 1 - r (zigzag), or contiguously.
enum class CpCommType { P2P, AllGather };
enum class CpLayout { Contiguous, Zigzag };

// Collectives over the context-parallel group (ranks that split one sequence),
// as context-parallel attention calls them (models/common/context_attention.h).
// Every rank of the group calls them in the same order.
class CpComm : public torch::CustomClassHolder {
 public:
  ~CpComm() override = default;
  using Pending = std::function<at::Tensor()>;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // The ring step: sends t to the next rank (rank + 1 mod size) and receives
  // the previous rank's tensor of the same shape and dtype; started now,
  // finished by calling the result, so the current block computes meanwhile.
  // `channel` names which of two shifts in flight at once this is (K/V, their
  // gradients), for in-process implementations; between processes they are
  // told apart by the order every rank starts them in (NCCL ignores tags).
  virtual Pending ring_shift_start(const at::Tensor& t, int channel) = 0;
  // [size, *t.shape]: every rank's t in rank order.
  virtual at::Tensor all_gather(const at::Tensor& t) = 0;
  // t [size, *rest] -> [*rest]: the sum over ranks of their t[my rank].
  virtual at::Tensor reduce_scatter(const at::Tensor& t) = 0;
};

// Collectives over the expert-parallel group (the ranks one MoE layer's
// experts are split over, carved out of dp x cp), as the token dispatcher
// (models/common/moe_dispatch.h) calls them. Every rank of the group calls
// them in the same order, whatever tokens it routed (NCCL's rule).
class EpComm : public torch::CustomClassHolder {
 public:
  ~EpComm() override = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // counts: int64 [size, n] on the host, row d what this rank sends rank d.
  // Returns [size, n] on the host, row s what rank s sends here. The host sync
  // of expert parallelism: split sizes must be known on the host.
  virtual at::Tensor exchange_counts(const at::Tensor& counts) = 0;
  // Rows of t [sum(send), ...]: the first send[0] to rank 0, the next send[1]
  // to rank 1, ...; returns [sum(recv), ...], recv[s] rows from rank s in rank order.
  virtual at::Tensor all_to_all(const at::Tensor& t, const std::vector<int64_t>& send,
                                const std::vector<int64_t>& recv) = 0;
};

struct ShardingContext {
  int tp = 1;    // tensor-parallel degree
  int rank = 0;  // this rank's position in its tensor-parallel group
  // Where parameters are allocated at construction: meta (shapes only, filled
  // later by materialise) or a real device.
  c10::TensorOptions options = c10::TensorOptions().dtype(c10::kFloat);
  c10::intrusive_ptr<TpComm> comm;  // null when tp == 1
  // Megatron's sequence parallelism: norms, dropout and residuals hold T / tp
  // tokens each, all-gathered before column-parallel linears and the LM head,
  // reduce-scattered after row-parallel linears and the embedding.
  bool sequence_parallel = false;
  // Under tensor parallelism the vocabulary is padded to a multiple of
  // tp x vocab_multiple rows and each rank's share is padded / tp rows; the
  // padding rows (at the end) are never allocated (model.make_vocab_size_divisible_by).
  int64_t vocab_multiple = 1;
  // Dropout masks of sharded regions (this rank's heads) come from here; null:
  // the default generator (tp 1, or no dropout to draw). models/common/parallel_rng.h.
  std::shared_ptr<ParallelRng> rng;
  // Context parallelism: the ranks splitting each sequence (null at cp 1). Each
  // holds its tokens in cp_layout; attention calls context_parallel_attention
  // and rotary embeddings take the tokens' global positions.
  c10::intrusive_ptr<CpComm> cp_comm;
  CpCommType cp_comm_type = CpCommType::P2P;
  CpLayout cp_layout = CpLayout::Zigzag;
  // Expert parallelism: MoE layers hold experts [ep_rank x E / ep, + E / ep)
  // and route tokens to the others' through ep_comm (null at ep 1).
  int ep = 1, ep_rank = 0;
  c10::intrusive_ptr<EpComm> ep_comm;

  bool parallel() const { return tp > 1; }
  bool sp() const { return tp > 1 && sequence_parallel; }
  // This rank's part of n split over the group in whole `unit`s: n / unit units
  // dealt out as evenly as they go, the first ranks one more when tp does not
  // divide them (6 heads over 4 ranks: 2, 2, 1, 1). Every layer splits through
  // this, so parts of the same unit count (Q, K, V, the heads of the output
  // projection) land on the same rank. Throws naming `what` unless n is whole
  // units and every rank gets at least one.
  struct Span {
    int64_t offset = 0, size = 0;
  };
  Span span(int64_t n, const std::string& what, int64_t unit = 1) const;
  int64_t local(int64_t n, const std::string& what, int64_t unit = 1) const { return span(n, what, unit).size; }
  // The vocabulary as the split layers hold it: unpadded at tp == 1.
  int64_t padded_vocab(int64_t vocab) const;
};

}  // namespace common
}  // namespace nnstrain::models
