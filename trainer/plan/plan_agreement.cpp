#include "trainer/plan/plan_agreement.h"

#include "base/hash.h"

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

namespace nnstrain::parallel {

namespace {

using Clock = std::chrono::steady_clock;

using base::fnv1a_hex;

std::string hostname() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "?";
  return buf;
}

nlohmann::json to_json(const RankFacts& f) {
  return {{"rank", f.rank}, {"host", f.host}, {"device", f.device}, {"device_memory_bytes", f.device_memory_bytes},
          {"memory_budget_bytes", f.memory_budget_bytes}, {"world_size", f.world_size},
          {"config_hash", f.config_hash}};
}

RankFacts facts_from_json(const nlohmann::json& j) {
  RankFacts f;
  f.rank = j.at("rank");
  f.host = j.at("host");
  f.device = j.at("device");
  f.device_memory_bytes = j.at("device_memory_bytes");
  f.memory_budget_bytes = j.at("memory_budget_bytes");
  f.world_size = j.at("world_size");
  f.config_hash = j.at("config_hash");
  return f;
}

std::string gib(double bytes) {
  std::ostringstream o;
  o.precision(1);
  o << std::fixed << bytes / 1073741824.0 << " GiB";
  return o.str();
}

// How `f` differs from rank 0's `ref`, or "" when it agrees.
std::string differences(const RankFacts& f, const RankFacts& ref) {
  std::vector<std::string> d;
  if (f.device != ref.device) d.push_back("device '" + f.device + "' (rank 0: '" + ref.device + "')");
  if (f.device_memory_bytes != ref.device_memory_bytes)
    d.push_back("device memory " + gib(f.device_memory_bytes) + " (rank 0: " + gib(ref.device_memory_bytes) + ")");
  if (f.memory_budget_bytes != ref.memory_budget_bytes)
    d.push_back("memory budget " + gib(f.memory_budget_bytes) + " (rank 0: " + gib(ref.memory_budget_bytes) + ")");
  if (f.world_size != ref.world_size)
    d.push_back("world size " + std::to_string(f.world_size) + " (rank 0: " + std::to_string(ref.world_size) + ")");
  if (f.config_hash != ref.config_hash) d.push_back("a different resolved config (hash " + f.config_hash + ")");
  std::string out;
  for (size_t i = 0; i < d.size(); ++i) out += (i ? ", " : "") + d[i];
  return out;
}

// "600 s", "0.8 s": the timeout in messages.
std::string seconds(std::chrono::milliseconds t) {
  std::ostringstream o;
  o << t.count() / 1000.0 << " s";
  return o.str();
}

class Exchange {
 public:
  Exchange(c10d::Store& store, int world, std::chrono::milliseconds timeout)
      : store_(store), world_(world), timeout_(timeout) {}

  void set(const std::string& key, const std::string& value) {
    store_.set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::string get(const std::string& key) {
    const auto v = store_.get(key);
    return std::string(v.begin(), v.end());
  }
  // Waits for `key` from rank 0, a little longer than rank 0 itself waits for
  // the others (so a missing third rank is reported by rank 0, not as silence).
  void wait_for(const std::string& key, int self, const std::string& what) {
    try {
      store_.wait({key}, timeout_ + std::max(std::chrono::milliseconds(5000), timeout_ / 10));
    } catch (const std::exception&) {
      throw PlanAgreementError("rank " + std::to_string(self) + ": no " + what + " from rank 0 within " +
                               seconds(timeout_) + " (compute_config.collective_timeout_s): rank 0 may have failed; see its log");
    }
  }
  // Waits for prefix + r of every rank r (or of `ranks`) up to `limit`; returns the ranks missing.
  std::vector<int> wait_all(const std::string& prefix, std::chrono::milliseconds limit,
                            std::vector<int> ranks = {}) {
    if (ranks.empty())
      for (int r = 0; r < world_; ++r) ranks.push_back(r);
    std::vector<std::string> keys;
    for (int r : ranks) keys.push_back(prefix + std::to_string(r));
    try {
      store_.wait(keys, limit);
      return {};
    } catch (const std::exception&) {
      std::vector<int> missing;
      for (size_t i = 0; i < ranks.size(); ++i)
        if (!store_.check({keys[i]})) missing.push_back(ranks[i]);
      return missing;
    }
  }
  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  c10d::Store& store_;
  int world_;
  std::chrono::milliseconds timeout_;
};

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

constexpr char kFacts[] = "nnstrain/plan/facts/", kVerdict[] = "nnstrain/plan/verdict",
               kRead[] = "nnstrain/plan/read/", kAck[] = "nnstrain/plan/ack/", kGo[] = "nnstrain/plan/go",
               kDone[] = "nnstrain/plan/done/";
// How long rank 0 (the store's server) stays up after a failed agreement so the
// others can read why before its exit takes the store down.
constexpr auto kLinger = std::chrono::milliseconds(30000);

}  // namespace

RankFacts local_facts(const PlanRequest& req, int rank) {
  RankFacts f;
  f.rank = rank;
  f.host = hostname();
  f.device = req.device.name;
  f.device_memory_bytes = req.device.memory_bytes;
  f.memory_budget_bytes = req.memory_budget_bytes;
  f.world_size = req.world_size;
  f.config_hash = req.args ? fnv1a_hex(req.args->resolved_yaml) : "";
  if (const char* e = std::getenv("NNSTRAIN_TEST_DEVICE_MEMORY_GB")) {
    const std::string s = e;
    const auto colon = s.find(':');
    if (colon != std::string::npos && std::stoi(s.substr(0, colon)) == rank)
      f.device_memory_bytes = std::stod(s.substr(colon + 1)) * 1073741824.0;
  }
  return f;
}

std::string plan_hash(const Plan& plan) {
  nlohmann::json j = plan;
  return fnv1a_hex(j.dump());
}

Plan agree_plan(const PlanRequest& req, c10d::Store& store, int rank, int world_size,
                std::chrono::milliseconds timeout) {
  Exchange ex(store, world_size, timeout);
  const RankFacts mine = local_facts(req, rank);
  ex.set(kFacts + std::to_string(rank), to_json(mine).dump());
  // The agreed facts are rank 0's: a rank that differs has been refused by now.
  PlanRequest agreed = req;
  agreed.device.memory_bytes = mine.device_memory_bytes;

  if (rank == 0) {
    // Step 2: check the facts, plan, publish the verdict.
    nlohmann::json verdict;
    const auto missing = ex.wait_all(kFacts, timeout);
    std::vector<int> present;  // the ranks that will read the verdict
    for (int r = 1; r < world_size; ++r)
      if (std::find(missing.begin(), missing.end(), r) == missing.end()) present.push_back(r);
    if (!missing.empty()) {
      verdict = {{"error", "rank(s) " + rank_list(missing) + " did not report their plan facts within " +
                               seconds(timeout) + " (compute_config.collective_timeout_s): they failed to start or are stuck; "
                               "see their logs"}};
    } else {
      std::vector<std::string> bad;
      for (int r = 1; r < world_size; ++r) {
        const auto f = facts_from_json(nlohmann::json::parse(ex.get(kFacts + std::to_string(r))));
        const auto d = differences(f, mine);
        if (!d.empty()) bad.push_back("rank " + std::to_string(r) + " (host " + f.host + ") reports " + d);
      }
      if (!bad.empty()) {
        std::string msg = "the ranks disagree on what the planner reads, so they cannot agree on one plan: ";
        for (size_t i = 0; i < bad.size(); ++i) msg += (i ? "; " : "") + bad[i];
        verdict = {{"error", msg + "; every rank must see the same device and config (memory_budget_gb "
                                   "fixes the budget, not the device facts)"}};
      } else {
        try {
          const Plan plan = make_plan(agreed);
          verdict = {{"plan", nlohmann::json(plan)}, {"hash", plan_hash(plan)}};
        } catch (const PlanError& e) {
          verdict = {{"plan_error", e.what()}, {"min_bytes", e.min_bytes}, {"config", e.config}};
        }
      }
    }
    ex.set(kVerdict, verdict.dump());
    if (!verdict.contains("plan")) {
      if (!present.empty()) ex.wait_all(kRead, kLinger, present);  // let them read why before the store goes
      if (verdict.contains("plan_error"))
        throw PlanError(verdict["plan_error"].get<std::string>(), verdict["min_bytes"].get<double>(),
                        verdict.value("config", false));
      throw PlanAgreementError(verdict["error"].get<std::string>());
    }
    // Step 3: every rank's own plan from the same facts must hash the same.
    const std::string hash = verdict["hash"];
    std::string go = "ok";
    const auto silent = world_size > 1 ? ex.wait_all(kAck, timeout, present) : std::vector<int>{};
    if (!silent.empty()) {
      go = "rank(s) " + rank_list(silent) + " did not confirm the plan within " +
           seconds(timeout) + " (compute_config.collective_timeout_s)";
    } else {
      std::vector<int> differ;
      for (int r = 1; r < world_size; ++r)
        if (ex.get(kAck + std::to_string(r)) != hash) differ.push_back(r);
      if (!differ.empty())
        go = "rank(s) " + rank_list(differ) + " computed a different plan than rank 0 from the same facts (hash " +
             hash + " on rank 0): are all ranks running the same nnstrain build?";
    }
    ex.set(kGo, go);
    // Rank 0 serves the store: it waits until every rank has read the outcome, so
    // that failing right after (a config error every rank finds) cannot take the
    // store from under a rank still reading it.
    if (!present.empty()) ex.wait_all(kDone, go == "ok" ? timeout : kLinger, present);
    if (go != "ok") throw PlanAgreementError(go);
    return verdict["plan"].get<Plan>();
  }

  ex.wait_for(kVerdict, rank, "plan verdict");
  const auto verdict = nlohmann::json::parse(ex.get(kVerdict));
  ex.set(kRead + std::to_string(rank), "1");
  if (verdict.contains("plan_error"))
    throw PlanError(verdict["plan_error"].get<std::string>(), verdict["min_bytes"].get<double>(),
                    verdict.value("config", false));
  if (verdict.contains("error")) throw PlanAgreementError(verdict["error"].get<std::string>());
  const Plan plan = verdict["plan"].get<Plan>();
  // Recompute from the agreed facts (equal to this rank's own, as checked).
  ex.set(kAck + std::to_string(rank), plan_hash(make_plan(agreed)));
  ex.wait_for(kGo, rank, "plan confirmation");
  const std::string go = ex.get(kGo);
  ex.set(kDone + std::to_string(rank), "1");
  if (go != "ok") throw PlanAgreementError(go);
  return plan;
}

}  // namespace nnstrain::parallel
