// The pipeline's transfers under NCCL's point-to-point rules (docs/parallelism.md,
// "Point to point under NCCL's rules"): tags ignored, one FIFO per rank pair, a
// send blocked until its receive is posted unless both are in groups in flight,
// a communicator's groups one after another. check_backend_rules runs the
// lowered lists that way; every schedule the planner can choose passes it, and
// the lowering this replaced (each transfer alone, beside its compute, told
// apart by tag) is refused for the reasons it would fail on a GPU cluster.
#include <catch2/catch.hpp>

#include <map>
#include <string>
#include <vector>

#include "trainer/pipeline/schedule.h"

using namespace nnstrain::parallel::pipeline;

namespace {

// The old lowering, kept as a fixture: a receive right before its consumer, a
// send right after its producer, each transfer a group of its own.
Schedule old_lower(const Schedule& s) {
  Schedule out = s;
  for (int r = 0; r < s.ranks; ++r) {
    auto& row = out.actions[r];
    row.clear();
    int group = 0;
    auto xfer = [&](Op op, int stage, int micro, int peer, bool grad) {
      row.push_back({op, stage, micro, peer, grad, group++});
    };
    for (const auto& a : s.actions[r]) {
      const bool fwd = a.op == Op::F, bwd = a.op == Op::B || a.op == Op::I;
      if (fwd && a.stage > 0 && s.stage_rank[a.stage - 1] != r) xfer(Op::Recv, a.stage, a.micro, s.stage_rank[a.stage - 1], false);
      if (bwd && a.stage + 1 < s.stages && s.stage_rank[a.stage + 1] != r)
        xfer(Op::Recv, a.stage, a.micro, s.stage_rank[a.stage + 1], true);
      row.push_back(a);
      if (fwd && a.stage + 1 < s.stages && s.stage_rank[a.stage + 1] != r)
        xfer(Op::Send, a.stage + 1, a.micro, s.stage_rank[a.stage + 1], false);
      if (bwd && a.stage > 0 && s.stage_rank[a.stage - 1] != r) xfer(Op::Send, a.stage - 1, a.micro, s.stage_rank[a.stage - 1], true);
    }
  }
  return out;
}

struct Case {
  std::string name;
  int p, stages, m;
};

// Every combination the planner may choose in the ranges the issue names:
// pp 2..8, m 1..16, interleaving with 2..4 stages per rank.
std::vector<Case> planner_cases(int max_p, int max_m) {
  std::vector<Case> out;
  for (const auto& name : scheduler_names())
    for (int p = 2; p <= max_p; ++p)
      for (int v : name == "1f1b_interleaved" ? std::vector<int>{2, 3, 4} : std::vector<int>{default_stages(name, p) / p})
        for (int m = 1; m <= max_m; ++m) {
          try {
            make_schedule(name, p, v * p, m);
          } catch (const ScheduleError&) {
            continue;  // a combination the scheduler refuses at load
          }
          out.push_back({name, p, v * p, m});
        }
  return out;
}

std::string refusal(const Schedule& lowered, const BackendCheck& check = {}) {
  try {
    check_backend_rules(lowered, check);
  } catch (const BackendRuleError& e) {
    return e.line;
  }
  return "";
}

}  // namespace

TEST_CASE("every schedule the planner can choose holds under NCCL's rules, tied exchange and post-validation included",
          "[pipeline][nccl]") {
  int checked = 0;
  for (const auto& c : planner_cases(8, 16)) {
    INFO(c.name << " pp " << c.p << " stages " << c.stages << " m " << c.m);
    const auto lowered = lower(make_schedule(c.name, c.p, c.stages, c.m));
    BackendCheck check;
    check.tied = true;
    check.prefix = post_validation_prefix(lowered);
    CHECK(refusal(lowered, check) == "");
    CHECK(refusal(lower_forward(make_schedule(c.name, c.p, c.stages, c.m))) == "");
    ++checked;
  }
  // The walk covered the space: 7 pp x 16 m for each scheduler with fixed
  // stages, and for interleaving the m that are multiples of pp (26) x 3.
  CHECK(checked == 4 * 7 * 16 + 26 * 3);
}

TEST_CASE("the checker refuses the old lowering: deadlocks and mis-pairs, as on a GPU cluster", "[pipeline][nccl]") {
  std::map<std::string, int> deadlocks, mispairs, clean;
  for (const auto& c : planner_cases(4, 8)) {
    const auto why = refusal(old_lower(make_schedule(c.name, c.p, c.stages, c.m)));
    if (why.find("deadlock") != std::string::npos) ++deadlocks[c.name];
    else if (why.find("mis-paired") != std::string::npos) ++mispairs[c.name];
    else if (why.empty()) ++clean[c.name];
    else FAIL("unexpected refusal: " << why);
  }
  // GPipe alone (every forward, then every backward) survives without the tied exchange.
  CHECK(deadlocks["gpipe"] + mispairs["gpipe"] == 0);
  for (const auto& name : {"1f1b", "zb1p", "1f1b_interleaved", "zbv"}) {
    INFO(name);
    CHECK(deadlocks[name] + mispairs[name] > 0);
  }
  CHECK(mispairs["zbv"] > 0);

  // 1F1B's steady state: rank 0 sends activation 1, then waits for gradient 0;
  // rank 1 sends gradient 0, then receives activation 1.
  const auto why = refusal(old_lower(make_schedule("1f1b", 2, 2, 2)));
  CHECK(why.rfind("pipeline schedule 1f1b (pp 2, 2 micro-batches) breaks NCCL's point-to-point rules: deadlock: ", 0) == 0);
  CHECK(why.find("rank 0's sa1.1>1 waits for rank 1's ra1.1<0, queued behind rank 1's sg0.0>0") != std::string::npos);
  CHECK(why.find('\n') == std::string::npos);  // one line

  // zbv at pp 2, m 3: rank 1's gradient of stage 2, micro-batch 0 would be
  // filled with stage 1's activation of micro-batch 2 (same shape, no error).
  const auto zbv = refusal(old_lower(make_schedule("zbv", 2, 4, 3)));
  CHECK(zbv.find("mis-paired") != std::string::npos);
}

TEST_CASE("a tied-gradient exchange of two lone sends deadlocks, as one group it holds", "[pipeline][nccl]") {
  // The old sum_tied: both ranks send the whole gradient, then receive.
  const auto old_text = "schedule gpipe ranks 2 stages 2 micros 1\n"
                        "placement 0 1\n"
                        "rank 0: F0.0 sa1.0>1 rg0.0<1 B0.0 st>1 rt<1\n"
                        "rank 1: ra1.0<0 F1.0 B1.0 sg0.0>0 st>0 rt<0\n";
  const auto old = from_text(old_text, "old tied exchange");
  CHECK(to_text(old) == old_text);  // the text form round-trips lowered rows
  const auto why = refusal(old);
  CHECK(why.find("deadlock: rank 0's st>1 waits for rank 1's rt<0, queued behind rank 1's st>0") != std::string::npos);
  const auto grouped = from_text("schedule gpipe ranks 2 stages 2 micros 1\nplacement 0 1\n"
                                 "rank 0: F0.0 sa1.0>1 rg0.0<1 B0.0 st>1+rt<1\n"
                                 "rank 1: ra1.0<0 F1.0 B1.0 sg0.0>0 st>0+rt<0\n",
                                 "grouped tied exchange");
  CHECK(refusal(grouped) == "");
}

TEST_CASE("the checker sees post-validation's prefixes: a message crossing a prefix's edge hangs the sync",
          "[pipeline][nccl]") {
  const auto lowered = lower(make_schedule("1f1b", 4, 4, 8));
  BackendCheck check;
  check.prefix = post_validation_prefix(lowered);
  CHECK(refusal(lowered, check) == "");
  // Rank 0 running one more group before the validation than its receiver
  // takes into its own prefix: that send waits for a receive posted only after
  // the host sync, which rank 0 cannot reach.
  auto wider = check;
  const auto& row = lowered.actions[0];
  int k = wider.prefix[0];
  while (k < static_cast<int>(row.size()) && row[k].op != Op::Send) ++k;
  REQUIRE(k < static_cast<int>(row.size()));
  wider.prefix[0] = k + 1;
  const auto why = refusal(lowered, wider);
  CHECK(why.find("post-validation") != std::string::npos);
  CHECK(why.find("deadlock") != std::string::npos);
}

TEST_CASE("lowered groups: sends before receives, both ends in one order, receives before their consumer",
          "[pipeline][nccl]") {
  for (const auto& c : planner_cases(4, 8)) {
    INFO(c.name << " pp " << c.p << " m " << c.m);
    const auto s = lower(make_schedule(c.name, c.p, c.stages, c.m));
    // Per ordered pair: the messages in the sender's order and in the receiver's.
    std::map<std::pair<int, int>, std::vector<std::tuple<bool, int, int>>> sent, received;
    for (int r = 0; r < c.p; ++r) {
      const auto& row = s.actions[r];
      const auto waits = group_waits(s, r);
      for (size_t k = 0; k < row.size(); ++k) {
        const auto& a = row[k];
        if (a.op == Op::Send) sent[{r, a.peer}].push_back({a.grad, a.stage, a.micro});
        if (a.op == Op::Recv) received[{a.peer, r}].push_back({a.grad, a.stage, a.micro});
        if (k > 0 && a.op == Op::Send && row[k - 1].op == Op::Recv) CHECK(row[k - 1].group != a.group);
        if (waits[k] >= 0) {  // the group it waits on sits before it
          bool before = false;
          for (size_t i = 0; i < k; ++i) before = before || (row[i].op == Op::Recv && row[i].group == waits[k]);
          CHECK(before);
        }
      }
    }
    CHECK(sent == received);
  }
}
