// optim::AdamW (every impl) against torch.optim.AdamW, and optim::learning_rate
// against nanoGPT's get_lr, written out here independently.
#include <catch2/catch.hpp>
#include <dirent.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <map>

#include "trainer/checkpoint/tensor_io.h"

#include "tests/unit/test_support.h"
#include "trainer/optim/adamw.h"
#include "trainer/optim/lr_schedule.h"

using namespace nnstrain;

namespace {

using nnstrain::testing::TempDir;
using nnstrain::testing::rel_err;




constexpr int kSteps = 5;
constexpr double kWeightDecay = 0.1, kBeta1 = 0.9, kBeta2 = 0.99, kEps = 1e-8;

// torch.optim.AdamW, its single-tensor reference algorithm (foreach=False, fused=False),
// on two parameter groups (weight decay on >= 2-D tensors, none on 1-D: nanoGPT's
// groups), the learning rate changing every step as a schedule would. Params and grads
// are random; the grads are large in some entries and tiny in others.
constexpr const char* kAdamwReference = R"PY(
import sys, torch
from safetensors.torch import save_file
out = sys.argv[1]
steps, wd, b1, b2, eps = 5, 0.1, 0.9, 0.99, 1e-8
torch.manual_seed(7)
shapes = [(8, 5), (5,), (3, 4, 2), (7,), (16, 16)]
params = [torch.randn(s, dtype=torch.float32) for s in shapes]
lrs = torch.tensor([1e-3, 8e-4, 6e-4, 3e-4, 1e-4], dtype=torch.float64)
grads = [[torch.randn(s) * (10.0 ** torch.randint(-3, 2, s).float()) for s in shapes] for _ in range(steps)]
inputs = {"lr": lrs}
for i, p in enumerate(params):
    inputs[f"param/{i}"] = p.clone()
    for k in range(steps):
        inputs[f"grad/{i}/{k}"] = grads[k][i]
ps = [torch.nn.Parameter(p.clone()) for p in params]
groups = [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": wd},
          {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]
opt = torch.optim.AdamW(groups, lr=1e-3, betas=(b1, b2), eps=eps, foreach=False, fused=False)
expected = {}
for k in range(steps):
    for i, p in enumerate(ps):
        p.grad = grads[k][i].clone()
    for g in opt.param_groups:
        g["lr"] = float(lrs[k])
    opt.step()
    for i, p in enumerate(ps):
        expected[f"param/{i}/{k}"] = p.detach().clone()
for i, p in enumerate(ps):
    expected[f"exp_avg/{i}"] = opt.state[p]["exp_avg"].clone()
    expected[f"exp_avg_sq/{i}"] = opt.state[p]["exp_avg_sq"].clone()
save_file(inputs, out + "/inputs.safetensors")
save_file(expected, out + "/expected.safetensors")
)PY";

struct AdamwReference {
  TempDir dir;
  std::map<std::string, torch::Tensor> in, want;
  size_t n = 0;
  AdamwReference() {
    REQUIRE(nnstrain::testing::python(kAdamwReference, {dir.path}) == 0);
    in = checkpoint::load_tensors(dir.file("inputs.safetensors"));
    want = checkpoint::load_tensors(dir.file("expected.safetensors"));
    while (in.count("param/" + std::to_string(n))) ++n;
    REQUIRE(n == 5);
  }
  double lr(int k) const { return in.at("lr")[k].item<double>(); }
};

config::OptimizerArgs adamw_args(const std::string& impl) {
  config::OptimizerArgs a;
  a.lr = 1e-3;  // unused by AdamW::step, which takes lr per call
  a.beta1 = kBeta1;
  a.beta2 = kBeta2;
  a.eps = kEps;
  a.weight_decay = kWeightDecay;
  a.impl = impl;
  return a;
}

// Our segments over fresh copies of the reference's initial params; grads are
// buffers the test refills before each step, as the trainer's flat gradient is.
std::vector<optim::Segment> segments_for(const AdamwReference& ref) {
  std::vector<optim::Segment> segs;
  for (size_t i = 0; i < ref.n; ++i) {
    auto p = ref.in.at("param/" + std::to_string(i)).clone();
    segs.push_back({"p" + std::to_string(i), p, torch::zeros_like(p), optim::weight_decay_for(p, kWeightDecay)});
  }
  return segs;
}

void set_grads(optim::AdamW& opt, const AdamwReference& ref, int k) {
  auto& segs = opt.segments();
  for (size_t i = 0; i < segs.size(); ++i)
    segs[i].grad.copy_(ref.in.at("grad/" + std::to_string(i) + "/" + std::to_string(k)));
}

}  // namespace

TEST_CASE("AdamW matches torch.optim.AdamW for 5 steps, two weight-decay groups", "[optim]") {
  AdamwReference ref;
  // The groups are nanoGPT's: decay on matrices only.
  CHECK(optim::weight_decay_for(ref.in.at("param/0"), kWeightDecay) == kWeightDecay);
  CHECK(optim::weight_decay_for(ref.in.at("param/1"), kWeightDecay) == 0.0);

  for (const std::string impl : {"fused", "foreach", "loop"}) {
    {  // one reference run (python) for all impls
      optim::AdamW opt(segments_for(ref), adamw_args(impl));
      CHECK(opt.impl() == impl);
      double worst = 0;
      for (int k = 0; k < kSteps; ++k) {
        set_grads(opt, ref, k);
        opt.step(ref.lr(k));
        CHECK(opt.step_count() == k + 1);
        for (size_t i = 0; i < ref.n; ++i) {
          const double e = rel_err(opt.segments()[i].param, ref.want.at("param/" + std::to_string(i) + "/" + std::to_string(k)));
          INFO(impl << ": param " << i << " after step " << k + 1 << ": relative error " << e);
          CHECK(e < 1e-6);
          worst = std::max(worst, e);
        }
      }
      for (size_t i = 0; i < ref.n; ++i) {
        const double em = rel_err(opt.exp_avg(i), ref.want.at("exp_avg/" + std::to_string(i)));
        const double ev = rel_err(opt.exp_avg_sq(i), ref.want.at("exp_avg_sq/" + std::to_string(i)));
        INFO(impl << ": state of param " << i << ": exp_avg " << em << ", exp_avg_sq " << ev);
        CHECK(em < 1e-6);
        CHECK(ev < 1e-6);
      }
      WARN("AdamW " << impl << " vs torch.optim.AdamW: worst relative error over " << kSteps << " steps " << worst);
    }
  }
}

TEST_CASE("AdamW resumed from its state continues as if never stopped", "[optim]") {
  AdamwReference ref;
  for (const std::string impl : {"fused", "foreach", "loop"}) {
    {  // one reference run (python) for all impls
      optim::AdamW first(segments_for(ref), adamw_args(impl));
      for (int k = 0; k < 3; ++k) {
        set_grads(first, ref, k);
        first.step(ref.lr(k));
      }
      // What a checkpoint holds: params, both moments, the step count.
      auto segs = segments_for(ref);
      for (size_t i = 0; i < segs.size(); ++i) segs[i].param.copy_(first.segments()[i].param);
      optim::AdamW resumed(std::move(segs), adamw_args(impl));
      for (size_t i = 0; i < ref.n; ++i) {
        resumed.exp_avg(i).copy_(first.exp_avg(i));
        resumed.exp_avg_sq(i).copy_(first.exp_avg_sq(i));
      }
      resumed.set_step_count(3);
      for (int k = 3; k < kSteps; ++k) {
        set_grads(resumed, ref, k);
        resumed.step(ref.lr(k));
      }
      CHECK(resumed.step_count() == kSteps);
      for (size_t i = 0; i < ref.n; ++i) {
        const double e = rel_err(resumed.segments()[i].param,
                                 ref.want.at("param/" + std::to_string(i) + "/" + std::to_string(kSteps - 1)));
        INFO(impl << ": param " << i << " after resume: relative error " << e);
        CHECK(e < 1e-6);
      }
    }
  }
}

namespace {

// nanoGPT's train.py get_lr, transcribed (not calling our code).
double nanogpt_get_lr(int64_t it, double learning_rate, int64_t warmup_iters, int64_t lr_decay_iters, double min_lr) {
  if (it < warmup_iters) return learning_rate * (it + 1) / (warmup_iters + 1);
  if (it > lr_decay_iters) return min_lr;
  const double decay_ratio = double(it - warmup_iters) / double(lr_decay_iters - warmup_iters);
  const double coeff = 0.5 * (1.0 + std::cos(3.14159265358979323846 * decay_ratio));
  return min_lr + coeff * (learning_rate - min_lr);
}

config::LrSchedulerArgs schedule(const std::string& type, int64_t warmup, int64_t decay, double min_lr) {
  config::LrSchedulerArgs s;
  s.type = type;
  s.warmup_steps = warmup;
  s.decay_steps = decay;
  s.min_lr = min_lr;
  return s;
}

}  // namespace

TEST_CASE("cosine learning rate equals nanoGPT's get_lr at every step", "[optim]") {
  const double lr = 1e-3, min_lr = 1e-4;
  // shakespeare_char's numbers, and a decay that ends before the run does.
  for (auto [warmup, decay, total] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {100, 2000, 2000}, {100, 5000, 5000}, {10, 300, 500}, {0, 50, 60}}) {
    for (int64_t it = 0; it < total; ++it) {
      INFO("warmup " << warmup << ", decay " << decay << ", it " << it);
      CHECK(optim::learning_rate(schedule("cosine", warmup, decay, min_lr), lr, it, total) ==
            Approx(nanogpt_get_lr(it, lr, warmup, decay, min_lr)).epsilon(1e-12).margin(0));
    }
  }
  // decay_steps 0 decays over the whole run (max_train_steps).
  for (int64_t it : {0, 9, 10, 150, 299, 300}) {
    INFO("decay_steps 0, it " << it);
    CHECK(optim::learning_rate(schedule("cosine", 10, 0, min_lr), lr, it, 300) ==
          Approx(nanogpt_get_lr(it, lr, 10, 300, min_lr)).epsilon(1e-12));
  }
}

TEST_CASE("linear and constant learning-rate shapes", "[optim]") {
  const double lr = 1e-3, min_lr = 1e-4;
  const auto lin = schedule("linear", 10, 110, min_lr);
  // Warmup as nanoGPT's: lr * (it + 1) / (warmup + 1).
  CHECK(optim::learning_rate(lin, lr, 0, 200) == Approx(lr / 11));
  CHECK(optim::learning_rate(lin, lr, 9, 200) == Approx(lr * 10 / 11));
  CHECK(optim::learning_rate(lin, lr, 10, 200) == Approx(lr));                 // peak right after warmup
  CHECK(optim::learning_rate(lin, lr, 60, 200) == Approx((lr + min_lr) / 2));  // halfway down
  CHECK(optim::learning_rate(lin, lr, 35, 200) == Approx(lr - 0.25 * (lr - min_lr)));
  CHECK(optim::learning_rate(lin, lr, 110, 200) == Approx(min_lr));            // reaches min_lr at decay_steps
  CHECK(optim::learning_rate(lin, lr, 150, 200) == Approx(min_lr));            // and stays there
  // Monotone non-increasing after warmup.
  for (int64_t it = 11; it < 200; ++it)
    CHECK(optim::learning_rate(lin, lr, it, 200) <= optim::learning_rate(lin, lr, it - 1, 200));

  const auto cst = schedule("constant", 4, 0, min_lr);
  CHECK(optim::learning_rate(cst, lr, 0, 100) == Approx(lr / 5));
  CHECK(optim::learning_rate(cst, lr, 3, 100) == Approx(lr * 4 / 5));
  for (int64_t it : {4, 50, 99, 150}) CHECK(optim::learning_rate(cst, lr, it, 100) == lr);
  // No warmup: the base rate from the first step.
  CHECK(optim::learning_rate(schedule("constant", 0, 0, 0.0), lr, 0, 100) == lr);
  CHECK(optim::learning_rate(schedule("linear", 0, 100, 0.0), lr, 0, 100) == lr);
}

namespace {

config::LrSchedulerArgs wsd(int64_t warmup, int64_t decay_steps, double decay_ratio, const std::string& shape,
                            double min_lr) {
  config::LrSchedulerArgs s;
  s.type = "wsd";
  s.warmup_steps = warmup;
  s.decay_steps = decay_steps;
  s.decay_ratio = decay_ratio;
  s.decay_type = shape;
  s.min_lr = min_lr;
  return s;
}

// WSD as docs/config.md states it, written out here (not calling our code):
// warmup lr (it + 1) / (W + 1); lr until the last D iterations of the run;
// there the i-th decay iteration (1-based) is at progress p = i / (D + 1), lr
// min_lr + (lr - min_lr) f(p) with f = 1 - p, (1 + cos(pi p)) / 2 or 1 - sqrt(p).
double wsd_reference(int64_t it, double lr, int64_t warmup, int64_t decay, int64_t total, const std::string& shape,
                     double min_lr) {
  if (it < warmup) return lr * double(it + 1) / double(warmup + 1);
  const int64_t i = it - (total - decay) + 1;  // 1-based index in the decay phase
  if (i < 1) return lr;
  const double p = double(i) / double(decay + 1);
  const double f = shape == "linear" ? 1 - p : shape == "cosine" ? (1 + std::cos(3.14159265358979323846 * p)) / 2
                                                                  : 1 - std::sqrt(p);
  return min_lr + (lr - min_lr) * f;
}

}  // namespace

TEST_CASE("wsd learning rate: warmup, stable, linear / cosine / 1-sqrt decay at named steps", "[optim][wsd]") {
  const double lr = 1e-3, min_lr = 1e-4;
  // 20 steps: warmup 4 (steps 0-3), stable 4-14, decay over the last 5 (15-19).
  const int64_t total = 20;
  for (const std::string shape : {"linear", "cosine", "1-sqrt"}) {
    INFO(shape);
    const auto s = wsd(4, 5, 0.0, shape, min_lr);
    CHECK(optim::learning_rate(s, lr, 0, total) == Approx(lr / 5).epsilon(1e-12));
    CHECK(optim::learning_rate(s, lr, 3, total) == Approx(lr * 4 / 5).epsilon(1e-12));
    for (int64_t it : {4, 9, 14}) CHECK(optim::learning_rate(s, lr, it, total) == lr);  // stable: exactly the base lr
    // The decay's first and last steps, at progress 1/6 and 5/6; its middle (step 17) at 1/2.
    const double first = shape == "linear" ? 5.0 / 6 : shape == "cosine" ? (1 + std::cos(M_PI / 6)) / 2 : 1 - std::sqrt(1.0 / 6);
    const double mid = shape == "1-sqrt" ? 1 - std::sqrt(0.5) : 0.5;
    const double last = shape == "linear" ? 1.0 / 6 : shape == "cosine" ? (1 + std::cos(5 * M_PI / 6)) / 2 : 1 - std::sqrt(5.0 / 6);
    CHECK(optim::learning_rate(s, lr, 15, total) == Approx(min_lr + (lr - min_lr) * first).epsilon(1e-12));
    CHECK(optim::learning_rate(s, lr, 17, total) == Approx(min_lr + (lr - min_lr) * mid).epsilon(1e-12));
    CHECK(optim::learning_rate(s, lr, 19, total) == Approx(min_lr + (lr - min_lr) * last).epsilon(1e-12));
    // Every step against the reference, for decay_steps and the same decay as decay_ratio 0.25 of 20.
    for (int64_t it = 0; it < total; ++it) {
      INFO("it " << it);
      const double want = wsd_reference(it, lr, 4, 5, total, shape, min_lr);
      CHECK(optim::learning_rate(s, lr, it, total) == Approx(want).epsilon(1e-12).margin(0));
      CHECK(optim::learning_rate(wsd(4, 0, 0.25, shape, min_lr), lr, it, total) == Approx(want).epsilon(1e-12).margin(0));
    }
  }
  // decay_ratio rounds to the nearest step, halves up: 0.1 of 25 = 2.5 -> 3; 0.1 of 24 = 2.4 -> 2.
  for (auto [total, decay] : std::vector<std::pair<int64_t, int64_t>>{{25, 3}, {24, 2}})
    for (int64_t it = 0; it < total; ++it) {
      INFO("total " << total << ", it " << it);
      CHECK(optim::learning_rate(wsd(2, 0, 0.1, "cosine", 0.0), lr, it, total) ==
            Approx(wsd_reference(it, lr, 2, decay, total, "cosine", 0.0)).epsilon(1e-12).margin(0));
    }
  // No warmup, decay over the whole run (ratio 1): the first step already decays.
  CHECK(optim::learning_rate(wsd(0, 0, 1.0, "linear", 0.0), lr, 0, 9) == Approx(lr * 0.9).epsilon(1e-12));
  // The annealing branch: a 12-step stable run resumed to 16 steps with decay_steps 4
  // keeps the stable lr through step 11 and decays from step 12, the first resumed one.
  for (int64_t it = 4; it < 12; ++it) CHECK(optim::learning_rate(wsd(4, 4, 0, "1-sqrt", 0.0), lr, it, 16) == lr);
  CHECK(optim::learning_rate(wsd(4, 4, 0, "1-sqrt", 0.0), lr, 12, 16) == Approx(lr * (1 - std::sqrt(0.2))).epsilon(1e-12));
}

TEST_CASE("wsd under interval epoch counts epochs", "[optim][wsd]") {
  // 30 steps of 3 per epoch = 10 epochs: warmup 1 epoch, decay over the last 4.
  auto s = wsd(1, 4, 0.0, "linear", 0.0);
  s.interval = "epoch";
  const double lr = 2e-3;
  for (int64_t step = 0; step < 30; ++step) {
    INFO("step " << step);
    CHECK(optim::learning_rate_at_step(s, lr, step, 30, 3) ==
          Approx(wsd_reference(step / 3, lr, 1, 4, 10, "linear", 0.0)).epsilon(1e-12).margin(0));
  }
  CHECK(optim::learning_rate_at_step(s, lr, 17, 30, 3) == lr);                // epoch 5: stable
  CHECK(optim::learning_rate_at_step(s, lr, 18, 30, 3) == Approx(lr * 0.8));  // epoch 6: first decay epoch, 1/5
}
