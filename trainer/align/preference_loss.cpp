#include "trainer/align/preference_loss.h"

#include <torch/torch.h>

namespace nnstrain::align {

namespace {
namespace F = torch::nn::functional;

// log(1 - exp(x)) for x < 0, stable on both sides of -ln 2 (ORPOTrainer's log1mexp).
torch::Tensor log1mexp(const torch::Tensor& x) {
  return torch::where(x < -0.6931471805599453, torch::log1p(-torch::exp(x)), torch::log(-torch::expm1(x)));
}

// -(1 - eps) log sigmoid(z) - eps log sigmoid(-z): the conservative form, eps the flipped share.
torch::Tensor smoothed_sigmoid_loss(const torch::Tensor& z, double eps) {
  auto l = -F::logsigmoid(z);
  return eps > 0 ? l * (1 - eps) - F::logsigmoid(-z) * eps : l;
}
}  // namespace

PairLoss preference_loss(const config::AlignmentArgs& a, const PairScores& s) {
  PairLoss out;
  const double beta = a.beta;
  torch::Tensor per_pair;
  if (!a.reference_free()) {
    const auto chosen_ratio = s.chosen - s.ref_chosen, rejected_ratio = s.rejected - s.ref_rejected;
    const auto delta = chosen_ratio - rejected_ratio;
    if (a.loss_type == "sigmoid") {
      per_pair = smoothed_sigmoid_loss(beta * delta, a.label_smoothing);
    } else if (a.loss_type == "hinge") {
      per_pair = torch::relu(1 - beta * delta);
    } else {  // ipo: the log-ratios averaged per completion token, as TRL (confirmed with IPO's authors)
      const auto d = chosen_ratio / s.chosen_len - rejected_ratio / s.rejected_len;
      per_pair = (d - 1 / (2 * beta)).pow(2);
    }
    out.chosen_rewards = (beta * chosen_ratio).detach();
    out.rejected_rewards = (beta * rejected_ratio).detach();
    out.logps_chosen = s.chosen.detach();
    out.logps_rejected = s.rejected.detach();
    out.loss = per_pair.mean();
    return out;
  }
  const auto chosen_avg = s.chosen / s.chosen_len, rejected_avg = s.rejected / s.rejected_len;
  if (a.loss_type == "simpo") {
    per_pair = smoothed_sigmoid_loss(beta * (chosen_avg - rejected_avg - a.simpo_gamma / beta), a.label_smoothing);
    out.loss = per_pair.mean();
  } else {  // orpo: the chosen completions' NLL minus beta x the log-sigmoid of the log odds ratio
    const auto log_odds = (chosen_avg - rejected_avg) - (log1mexp(chosen_avg) - log1mexp(rejected_avg));
    const auto ratio = F::logsigmoid(log_odds);
    const auto nll = s.chosen_nll_sum / s.chosen_len.sum();
    out.loss = nll - (beta * ratio).mean();
    out.log_odds_ratio = ratio.mean().detach();
    out.log_odds_chosen = log_odds.mean().detach();
  }
  out.chosen_rewards = (beta * chosen_avg).detach();
  out.rejected_rewards = (beta * rejected_avg).detach();
  out.logps_chosen = chosen_avg.detach();
  out.logps_rejected = rejected_avg.detach();
  return out;
}

}  // namespace nnstrain::align
