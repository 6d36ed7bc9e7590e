// The optimizer as a plug-in (registry.h): what the trainer steps, checkpoints
// and backs up, whichever optimizer optimizer.type names. An optimizer works on
// "segments" (segment.h): parameter tensors, or under ZeRO flat slices of them,
// with their gradients; it declares its state per segment (checkpointed as
// optim/<state name>/<parameter>, resharded by ShardSpec like everything else).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "trainer/optim/segment.h"

namespace nnstrain::optim {

class Optimizer {
 public:
  virtual ~Optimizer() = default;

  // One update with learning rate lr (the schedule's value for the element-wise
  // optimizer's lr; an optimizer with its own lr scales it by the same factor).
  // Gradients are final (reduced, clipped, unscaled). found_inf (optional,
  // float [1]): where 1 the update is skipped whole. lr_device (optional): the
  // lr as a device scalar (CUDA graphs; only where capturable()). subset
  // (optional): only these segments, e.g. one offloaded bucket at a time; every
  // segment is stepped exactly once per update, whatever the subsets.
  // Called once per update, on every rank, before the update's step() calls
  // (whatever their subsets): the place for an optimizer's collectives.
  virtual void begin_step(const at::Tensor& found_inf) {}
  virtual void step(double lr, const at::Tensor& found_inf = {}, const at::Tensor& lr_device = {},
                    const std::vector<size_t>& subset = {}) = 0;

  virtual std::vector<Segment>& segments() = 0;
  // Segment i's state, by name, each tensor shaped as its param.
  virtual std::vector<std::pair<std::string, at::Tensor>> state(size_t i) = 0;
  // Updates applied (skipped ones not counted); may read the device.
  virtual int64_t step_count() const = 0;
  virtual void set_step_count(int64_t s) = 0;
  // How it runs, for the log ("fused", "muon (owners over 4 ranks) + fused adamw").
  virtual std::string impl() const = 0;
  // Learning rates this optimizer applies besides lr (the element-wise optimizer's, the
  // schedule's value), by metric name, at the schedule's lr: Muon's own ("lr_muon").
  virtual std::vector<std::pair<std::string, double>> other_learning_rates(double lr) const { return {}; }
  // Whether a step can be captured in a CUDA graph (no host decisions, no collectives).
  virtual bool capturable() const { return true; }

  // Optimizer post-validation (a step taken before it is known to stand):
  // everything step() changes, copied into `into` (buffers made on first use) and back.
  struct Backup {
    std::vector<at::Tensor> tensors;
    int64_t step = 0;
  };
  virtual void back_up(Backup& into) const = 0;
  virtual void restore(const Backup& from) = 0;

 protected:
  // Copies `live` into `saved` (allocating on first use), and back.
  static void save_tensors(const std::vector<at::Tensor>& live, std::vector<at::Tensor>& saved);
  static void load_tensors(const std::vector<at::Tensor>& saved, const std::vector<at::Tensor>& live);
};

}  // namespace nnstrain::optim
