// The pipeline's parts of the cost model (internal; pipeline.cpp): a
// candidate's stages and micro-batches, each pipeline rank's part of the
// model, and the schedule's time. cost_model.cpp's pipeline estimate prices
// every rank with the table's terms and the step with these.
#pragma once

#include <array>
#include <vector>

#include "trainer/plan/cost/setting.h"

namespace nnstrain::parallel::cost {

// A candidate's pipeline: stage_layers[s] model layers in stage s (from
// first_layer[s]), stage_rank[s] the rank running it, `micros` micro-batches a
// step, `m_sim` of them simulated; moments[r]: rank r's candidate peak moments
// ((stage, micro-batch)s live, between I and W, boundary tensors held).
struct PipelineLayout {
  int stages = 1, ranks = 1, micros = 1, m_sim = 1;
  std::vector<int> stage_layers, first_layer;
  const std::vector<int>* stage_rank = nullptr;
  const std::vector<std::vector<std::array<int, 3>>>* moments = nullptr;
  ScheduleCache::Impl* cache = nullptr;
};

PipelineLayout pipeline_layout(const PlanRequest& req, const ModelFacts& f, const Candidate& c,
                               ScheduleCache::Impl& cache);

// Rank r's part: its stages' layers and parameters, and the micro-batches'
// activations, pending W's and boundary tensors at its peak moment.
RankPart pipeline_rank_part(const PlanRequest& req, const ModelFacts& f, const Candidate& c,
                            const PipelineLayout& pl, int r, const optim::StepCost& optimizer);

// The schedule on the worst rank's setting x: each stage's F, I, W times from
// the compute, tensor- and context-parallel terms (OverRanks::Schedule), the
// simulation with and without the transfers between ranks. Fills compute_s,
// tp_comm_s, cp_comm_s, contention_s, pp_bubble and pp_comm_s; returns the
// step's makespan through the schedule.
double schedule_time(const Setting& x, const PipelineLayout& pl, PlanEstimate& e);

}  // namespace nnstrain::parallel::cost
