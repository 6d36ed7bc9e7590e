#include "models/common/recompute.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>

#include <map>
#include <mutex>
#include <optional>

namespace nnstrain::models::common {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Fn = std::function<torch::Tensor(const torch::Tensor&)>;

thread_local int recomputing_depth = 0;

// Marks the recomputation for recomputing(), also when fn throws.
struct RecomputingScope {
  RecomputingScope() { ++recomputing_depth; }
  ~RecomputingScope() { --recomputing_depth; }
};

// Lets the autograd context hold the block (saved_data takes IValues only).
struct FnHolder : torch::CustomClassHolder {
  FnHolder(Fn f, ParallelRng* r) : fn(std::move(f)), rng(r) {}
  Fn fn;
  ParallelRng* rng;                                   // sharded-region generator, if any
  std::map<std::string, torch::Tensor> rng_states;    // its states at forward
};

// The generators whose draws fn may make: the CPU one, and x's CUDA one.
std::vector<at::Generator> generators_for(const torch::Tensor& x) {
  std::vector<at::Generator> gens{at::detail::getDefaultCPUGenerator()};
  if (x.is_cuda()) gens.push_back(at::globalContext().defaultGenerator(x.device()));
  return gens;
}

std::vector<torch::Tensor> get_states(std::vector<at::Generator>& gens) {
  std::vector<torch::Tensor> states;
  for (auto& g : gens) {
    std::lock_guard<std::mutex> lock(g.mutex());
    states.push_back(g.get_state());
  }
  return states;
}

void set_states(std::vector<at::Generator>& gens, const std::vector<torch::Tensor>& states) {
  for (size_t i = 0; i < gens.size(); ++i) {
    std::lock_guard<std::mutex> lock(gens[i].mutex());
    gens[i].set_state(states[i]);
  }
}

// Replays the forward's RNG and autocast state for the recomputation, and puts
// the caller's back afterwards (also when fn throws), so the rest of the run's
// random stream is unchanged by the replay.
class ReplayGuard {
 public:
  ReplayGuard(const torch::Tensor& x, const std::vector<torch::Tensor>& forward_states,
              bool autocast_on, at::ScalarType autocast_dtype)
      : gens_(generators_for(x)), device_(x.device().type()) {
    saved_ = get_states(gens_);
    set_states(gens_, forward_states);
    autocast_was_ = at::autocast::is_autocast_enabled(device_);
    autocast_dtype_was_ = at::autocast::get_autocast_dtype(device_);
    at::autocast::set_autocast_enabled(device_, autocast_on);
    at::autocast::set_autocast_dtype(device_, autocast_dtype);
  }
  ~ReplayGuard() {
    set_states(gens_, saved_);
    at::autocast::set_autocast_enabled(device_, autocast_was_);
    at::autocast::set_autocast_dtype(device_, autocast_dtype_was_);
  }

 private:
  std::vector<at::Generator> gens_;
  std::vector<torch::Tensor> saved_;
  c10::DeviceType device_;
  bool autocast_was_ = false;
  at::ScalarType autocast_dtype_was_;
};

class Recompute : public torch::autograd::Function<Recompute> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, c10::intrusive_ptr<FnHolder> holder) {
    auto gens = generators_for(x);
    const auto states = get_states(gens);
    const auto dev = x.device().type();
    if (holder->rng) holder->rng_states = holder->rng->states();
    torch::Tensor y;
    {
      torch::NoGradGuard no_grad;
      y = holder->fn(x);
    }
    ctx->save_for_backward({x});
    ctx->saved_data["fn"] = c10::IValue::make_capsule(std::move(holder));
    ctx->saved_data["rng"] = c10::List<torch::Tensor>(states);
    ctx->saved_data["autocast"] = at::autocast::is_autocast_enabled(dev);
    ctx->saved_data["autocast_dtype"] = static_cast<int64_t>(at::autocast::get_autocast_dtype(dev));
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto x = ctx->get_saved_variables()[0];
    auto holder = c10::static_intrusive_pointer_cast<FnHolder>(ctx->saved_data["fn"].toCapsule());
    const auto rng = ctx->saved_data["rng"].toTensorVector();
    const bool autocast_on = ctx->saved_data["autocast"].toBool();
    const auto autocast_dtype = static_cast<at::ScalarType>(ctx->saved_data["autocast_dtype"].toInt());

    auto xd = x.detach().requires_grad_(true);
    torch::Tensor y;
    {
      ReplayGuard replay(x, rng, autocast_on, autocast_dtype);
      std::map<std::string, torch::Tensor> rng_after;
      if (holder->rng) {
        rng_after = holder->rng->states();
        holder->rng->set_states(holder->rng_states);
      }
      torch::AutoGradMode grad_on(true);
      RecomputingScope scope;
      y = holder->fn(xd);
      if (holder->rng) holder->rng->set_states(rng_after);
    }
    // Re-entrant backward: accumulates fn's parameter grads and xd's.
    if (y.requires_grad() && grad_out[0].defined()) torch::autograd::backward({y}, {grad_out[0]});
    return {ctx->needs_input_grad(0) ? xd.grad() : torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

bool recomputing() { return recomputing_depth > 0; }

torch::Tensor recompute(Fn fn, const torch::Tensor& x, ParallelRng* rng) {
  if (!torch::GradMode::is_enabled()) return fn(x);
  // The autograd function's output needs grad only if an input does; a block
  // fed a grad-free input still has parameters that want theirs.
  const auto in = x.requires_grad() ? x : x.detach().requires_grad_(true);
  return Recompute::apply(in, c10::make_intrusive<FnHolder>(std::move(fn), rng));
}

}  // namespace nnstrain::models::common
