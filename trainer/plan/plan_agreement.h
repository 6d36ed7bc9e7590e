// One plan for every rank. The planner is a pure function of its inputs, so
// ranks that plan alone agree only if their inputs agree; two nodes that see
// different memory would otherwise choose different plans and hang in
// mismatched collectives. So, through the rendezvous store and before any
// collective of training:
//   1. every rank publishes the facts the planner reads (device, memory, budget,
//      world size, the resolved config);
//   2. rank 0 checks that they agree, plans, and publishes its verdict: the plan,
//      or an error naming every rank whose facts differ from rank 0's;
//   3. every rank recomputes the plan from the agreed facts and reports its hash;
//      rank 0 publishes "go" only if every hash equals its own, and returns once
//      every rank has read it (it serves the store: a failure right after must
//      not take the store from a rank still reading).
// Every rank ends with the same message on a disagreement; a rank that never
// reports is named once the collective timeout has passed.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "trainer/plan/planner.h"

namespace c10d {
class Store;
}

namespace nnstrain::parallel {

struct PlanAgreementError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// What one rank knows that the planner reads.
struct RankFacts {
  int rank = 0;
  std::string host;
  std::string device;             // the device table entry, e.g. "H100" or "cpu"
  double device_memory_bytes = 0;
  double memory_budget_bytes = 0; // as configured (0: a fraction of the device's)
  int world_size = 1;
  std::string config_hash;        // of the resolved YAML
};

// This rank's facts for `req`. A test-only switch, NNSTRAIN_TEST_DEVICE_MEMORY_GB=
// RANK:GB, makes that rank report GB of device memory.
RankFacts local_facts(const PlanRequest& req, int rank);

// A stable 64-bit hash (FNV-1a) of a plan's JSON, as hex.
std::string plan_hash(const Plan& plan);

// The plan every rank of the job uses (see above). `timeout`: how long to wait
// for the other ranks. Throws PlanAgreementError (every rank the same message)
// or the planner's PlanError.
Plan agree_plan(const PlanRequest& req, c10d::Store& store, int rank, int world_size,
                std::chrono::milliseconds timeout);

}  // namespace nnstrain::parallel
