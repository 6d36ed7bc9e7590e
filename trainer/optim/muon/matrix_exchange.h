// Whole matrices from pieces: each matrix Muon takes is gathered to one owner
// rank, orthogonalised there, and its update scattered back to every rank that
// holds a piece of it. Works on ShardSpecs alone, so one code serves every plan
// (tensor-parallel slices, ZeRO's flat chunks, replicas over dp x cp, whole
// experts under ep, and any mix): a "matrix" is one [rows, cols] slice of a
// parameter (a parameter of global shape [..., rows, cols] holds
// prod(...) of them, e.g. one per expert).
//
// Owners: every member of the comm (this stage's ranks) knows every member's
// pieces (exchanged once, at construction), so all compute the same plan. The
// matrices are dealt out largest Newton-Schulz cost first, each to the member
// with the least cost so far (longest-processing-time first, as DistMuon and
// Dion balance their owners); ties go to the lowest member.
//
// Traffic per step: one all-to-all gathers each matrix's distinct pieces to its
// owner (a piece held by several replicas is sent by one of them, chosen by the
// owner's index so the senders rotate), one all-to-all returns each holder its
// piece of the update. Pieces are copied as strided row blocks, never element by element.
//
// Backend rules (NCCL's, checked on every backend): the two all-to-alls are
// collectives on the stage's own communicator, issued by every member in the
// same order (each update's begin_step, on every rank of the stage, skipped by
// all or none); each pair's sizes agree (checked once at construction).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "trainer/optim/comm.h"
#include "trainer/sharding/shard_spec.h"

namespace nnstrain::optim::muon {

struct Matrix {
  std::string name;       // the parameter
  int64_t index = 0;      // which [rows, cols] slice of it
  int64_t rows = 0, cols = 0;
  int owner = 0;          // member index
  double cost = 0;        // Newton-Schulz flops per iteration
};

class MatrixExchange {
 public:
  // mine: this rank's pieces (the optimizer's Muon segments' specs), in the
  // order their values are concatenated in the local buffer.
  MatrixExchange(const std::vector<sharding::ShardSpec>& mine, OptimizerComm& comm);

  // local: this rank's pieces' values, concatenated (local_size()). Returns the
  // matrices this rank owns, concatenated row-major in owned() order.
  at::Tensor gather(const at::Tensor& local);
  // The inverse: owned matrices' updates in, this rank's pieces of them out.
  at::Tensor scatter(const at::Tensor& owned);

  const std::vector<Matrix>& matrices() const { return matrices_; }  // all of this stage's
  const std::vector<size_t>& owned() const { return owned_; }         // indices into matrices()
  int64_t local_size() const { return local_size_; }
  int64_t owned_size() const { return owned_size_; }
  // This rank's matrix for each of its pieces: rows, cols (pieces of one parameter share them).
  const std::vector<std::pair<int64_t, int64_t>>& piece_shape() const { return piece_shape_; }
  // "12 matrices over 4 ranks, largest share 27% of the Newton-Schulz work"
  std::string describe() const;

 private:
  // rows x len elements: in the piece's storage contiguous from `local`, in the
  // matrix from `global` (offset within the matrix) with rows `stride` apart.
  struct Block {
    int64_t local = 0, global = 0, len = 0, rows = 1, stride = 0;
  };
  struct Transfer {  // to or from one member: blocks in wire order, with their matrix
    std::vector<std::pair<size_t, Block>> blocks;
    int64_t numel = 0;
  };
  void check_splits();
  at::Tensor piece_view(const at::Tensor& t, const Block& b) const;
  at::Tensor matrix_view(const at::Tensor& t, size_t m, const Block& b) const;
  // One all-to-all: `send`'s blocks packed from `from` (the owned matrices, or this
  // rank's pieces), `recv`'s unpacked into a new buffer of the other kind.
  at::Tensor move(const at::Tensor& from, bool from_matrices, const std::vector<Transfer>& send,
                  const std::vector<Transfer>& recv, int64_t out_size);

  std::vector<Transfer> gather_send_, gather_recv_, scatter_send_, scatter_recv_;
  std::vector<Matrix> matrices_;
  std::vector<size_t> owned_;
  std::vector<int64_t> owned_offset_;  // per matrix: its place in the owned buffer (-1: not mine)
  std::vector<std::pair<int64_t, int64_t>> piece_shape_;
  int64_t local_size_ = 0, owned_size_ = 0;
  OptimizerComm& comm_;
};

}  // namespace nnstrain::optim::muon
