// Muon (optimizer.type: muon) as torch.optim.Muon computes it, with AdamW for
// the parameters it does not take (embeddings, head, norms, biases: the rule of
// modded-nanogpt, torchtitan and Moonlight; optimizer.args.params overrides it).
//
// Per update, for each matrix: momentum B <- mu B + (1 - mu) g (PyTorch's
// lerp), the Nesterov mix g + mu (B - g) (or B), Newton-Schulz on the whole
// matrix, then W <- W (1 - lr wd) - lr adjust(A, B) O. Momentum and the update
// are element-wise, so each rank does them on its own pieces (ZeRO chunks,
// tensor-parallel slices, offloaded buckets on the host); only Newton-Schulz
// needs the matrix whole: matrix_exchange.h gathers each to one owner rank of
// this pipeline stage, balances the owners, and scatters the updates back.
//
// Precision: the momentum has the parameter's dtype (fp32 masters under
// *-mixed, as AdamW's moments); Newton-Schulz and the exchange run in
// optimizer.args.ns_dtype: auto is bf16 on CUDA (as PyTorch) and fp32 on the CPU.
#pragma once

#include <memory>
#include <vector>

#include "trainer/optim/adamw.h"
#include "trainer/optim/muon/matrix_exchange.h"
#include "trainer/optim/muon/muon_config.h"
#include "trainer/optim/muon/newton_schulz.h"
#include "trainer/optim/registry.h"

namespace nnstrain::optim::muon {

class Muon : public Optimizer {
 public:
  explicit Muon(OptimizerContext ctx);

  // The collective part of an update (momentum, gather, Newton-Schulz,
  // scatter) for all of this rank's matrices; every rank of the stage calls it
  // once per update, before its subsets' step() calls. step() without a subset does it itself.
  void begin_step(const at::Tensor& found_inf) override;
  void step(double lr, const at::Tensor& found_inf = {}, const at::Tensor& lr_device = {},
            const std::vector<size_t>& subset = {}) override;

  std::vector<Segment>& segments() override { return segments_; }
  std::vector<std::pair<std::string, at::Tensor>> state(size_t i) override;
  int64_t step_count() const override { return step_; }
  void set_step_count(int64_t s) override;
  std::string impl() const override;
  // Muon's lr at the schedule's lr (before adjust_lr_fn's per-matrix factor).
  std::vector<std::pair<std::string, double>> other_learning_rates(double lr) const override {
    return {{"lr_muon", lr * cfg_.lr / adamw_lr_}};
  }
  bool capturable() const override { return false; }
  void back_up(Backup& into) const override;
  void restore(const Backup& from) override;

  // Which segments Muon takes (the rest are AdamW's).
  bool takes(size_t i) const { return muon_of_[i] >= 0; }
  const MatrixExchange& exchange() const { return *exchange_; }

 private:
  std::vector<at::Tensor> live_tensors() const;  // what an update changes (AdamW's apart)

  MuonConfig cfg_;
  double adamw_lr_;                   // the schedule's base: Muon's lr follows it by ratio
  std::vector<Segment> segments_;
  std::vector<int> muon_of_, adamw_of_;  // per segment: its index among Muon's (or AdamW's), else -1
  std::vector<size_t> muon_;          // Muon's segments
  std::vector<at::Tensor> momentum_;  // per Muon segment
  std::vector<std::pair<int64_t, int64_t>> shape_;  // per Muon segment: its matrix [rows, cols]
  std::unique_ptr<AdamW> adamw_;
  std::unique_ptr<MatrixExchange> exchange_;
  std::shared_ptr<OptimizerComm> comm_;
  c10::ScalarType ns_dtype_;
  at::Tensor updates_;   // this update's orthogonalised pieces, this rank's Muon segments concatenated
  bool prepared_ = false, skip_ = false;
  int64_t step_ = 0;
};

}  // namespace nnstrain::optim::muon
