// The preference losses, as tensors: from each pair's summed completion
// log-probabilities (and the reference's) to the per-pair loss and the rewards
// TRL logs. The formulas are TRL's: DPOTrainer's sigmoid / hinge / ipo (ipo on
// per-token averages of the log-ratios), CPOTrainer's simpo (per-token average
// log-probabilities, cpo_alpha 0), ORPOTrainer's odds ratio (average
// log-probabilities, added to the chosen completions' mean NLL).
#pragma once

#include <ATen/core/Tensor.h>

#include "base/config/alignment_args.h"

namespace nnstrain::align {

// One micro-batch of P pairs, each tensor [P] fp32 (fp64 for fp64 models).
struct PairScores {
  at::Tensor chosen, rejected;          // summed log-probabilities of the completions' tokens (policy)
  at::Tensor chosen_len, rejected_len;  // their counted tokens (>= 1)
  at::Tensor ref_chosen, ref_rejected;  // the reference's sums; undefined for simpo and orpo
  at::Tensor chosen_nll_sum;            // orpo: scalar, the chosen tokens' NLL summed (with gradient)
};

struct PairLoss {
  at::Tensor loss;                      // scalar: the micro-batch's loss (its pairs' mean, orpo's NLL term added)
  at::Tensor chosen_rewards, rejected_rewards;  // [P], detached: TRL's rewards/chosen and rewards/rejected
  at::Tensor logps_chosen, logps_rejected;      // [P], detached: what TRL logs as logps/* (averages for simpo, orpo)
  at::Tensor log_odds_ratio, log_odds_chosen;   // orpo: scalars, detached (ORPOTrainer's metrics)
};

PairLoss preference_loss(const config::AlignmentArgs& a, const PairScores& s);

}  // namespace nnstrain::align
