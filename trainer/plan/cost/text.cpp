// How candidates and byte counts read in the planner's messages.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "trainer/plan/cost_model.h"

namespace nnstrain::parallel {

std::string offload_text(const Candidate& c) {
  if (c.offload_ratio <= 0 && !c.offload_params) return "";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", c.offload_ratio);
  return std::string(" offload=optimizer") + (c.offload_ratio < 1 ? ":" + std::string(buf) : "") +
         (c.offload_params ? "+params" : "") + (c.offload_nvme ? ":nvme" : "");
}

std::string split_text(const Candidate& c) {
  std::string out;
  if (c.cp > 1) out += " cp=" + std::to_string(c.cp) + ":" + c.cp_comm;
  if (c.pp > 1) out += " pp=" + std::to_string(c.pp) + ":" + c.scheduler + "/" + std::to_string(c.stages);
  if (c.ep > 1) out += " ep=" + std::to_string(c.ep);
  return out;
}

std::string candidate_text(const Candidate& c, int64_t layers) {
  // Under pp, recompute counts per stage: out of the largest stage's layers.
  int64_t of = layers;
  if (c.pp > 1 && !c.stage_layers.empty()) of = *std::max_element(c.stage_layers.begin(), c.stage_layers.end());
  return "tp=" + std::to_string(c.tp) + split_text(c) + " dp=" + std::to_string(c.dp) +
         " zero=" + std::to_string(c.zero_stage) + offload_text(c) + " recompute=" + std::to_string(c.recompute_layers) +
         "/" + std::to_string(of) + (c.pp > 1 ? " per stage" : "");
}

std::string format_fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string format_bytes(double bytes) {
  const double a = std::fabs(bytes);
  if (a >= kGiB) return format_fixed(bytes / kGiB, 2) + " GiB";
  if (a >= 1024.0 * 1024) return format_fixed(bytes / (1024.0 * 1024), 1) + " MiB";
  if (a >= 1024.0) return format_fixed(bytes / 1024.0, 1) + " KiB";
  return format_fixed(bytes, 0) + " B";
}

}  // namespace nnstrain::parallel
