#include "trainer/dist/flight_recorder.h"

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "base/text.h"

namespace fs = std::filesystem;

namespace nnstrain::dist {

namespace {

std::atomic<bool> g_dump_requested{false};
extern "C" void on_dump_signal(int) { g_dump_requested.store(true); }

int64_t wall_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

FlightRecorder::FlightRecorder(std::string path, size_t capacity, int rank, int world)
    : path_(std::move(path)), capacity_(std::max<size_t>(1, capacity)), rank_(rank), world_(world) {
  ring_.resize(capacity_);
  // A record left by an earlier attempt (a restart, a rerun in the same
  // run_dir) would be lined up with this one's by `nnstrain report`: moved to
  // flight/earlier/, which the report does not read. Each rank moves its own;
  // rank 0 also those of ranks this run does not have.
  std::error_code ec;
  const fs::path dir = fs::path(path_).parent_path();
  const fs::path earlier = dir / "earlier";
  auto move_aside = [&](const fs::path& f) {
    if (!fs::exists(f, ec)) return;
    fs::create_directories(earlier, ec);
    fs::rename(f, earlier / f.filename(), ec);
    if (ec) fs::remove(f, ec);
  };
  move_aside(path_);
  if (rank_ != 0) return;
  std::vector<fs::path> beyond;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const auto n = e.path().filename().string();
    if (n.size() > 9 && n.size() < 24 && n.rfind("rank", 0) == 0 && n.compare(n.size() - 5, 5, ".json") == 0 &&
        std::all_of(n.begin() + 4, n.end() - 5, ::isdigit) && std::stoll(n.substr(4, n.size() - 9)) >= world_)
      beyond.push_back(e.path());
  }
  for (const auto& f : beyond) move_aside(f);
}

int64_t FlightRecorder::issued(const std::string& group, const std::vector<int>& ranks, const char* op,
                               const char* what, int64_t bytes, int64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  groups_.emplace(group, ranks);
  const bool p2p = std::string(op) == "p2p" || std::string(op) == "ring_shift";
  Entry e;
  e.id = next_id_++;
  e.seq = seq;
  e.group_seq = ++(p2p ? p2p_seq_ : group_seq_)[group];
  e.bytes = bytes;
  e.group = group;
  e.op = op;
  e.what = what;
  e.state = "issued";
  e.t_ms = wall_ms();
  ring_[e.id % capacity_] = std::move(e);
  return next_id_ - 1;
}

void FlightRecorder::started(int64_t id, const void* work) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& e = ring_[id % capacity_];
  if (e.id == id) e.work = work;
}

void FlightRecorder::completed(const void* work) {
  std::lock_guard<std::mutex> lock(mu_);
  // Newest first: the work waited on is almost always among the last few.
  const int64_t first = std::max<int64_t>(0, next_id_ - static_cast<int64_t>(capacity_));
  for (int64_t id = next_id_ - 1; id >= first; --id) {
    auto& e = ring_[id % capacity_];
    if (e.work == work && e.state == "issued") {
      e.state = "completed";
      e.work = nullptr;  // the address may be reused by later work
      return;
    }
  }
}

void FlightRecorder::completed_seq(int64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t first = std::max<int64_t>(0, next_id_ - static_cast<int64_t>(capacity_));
  for (int64_t id = next_id_ - 1; id >= first; --id) {
    auto& e = ring_[id % capacity_];
    if (e.seq == seq && e.state == "issued") {
      e.state = "completed";
      e.work = nullptr;
      return;
    }
  }
}

void FlightRecorder::failed(const void* work, const std::string& cause) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry* last = nullptr;
  for (auto& e : ring_)
    if (e.state == "issued" && (work ? e.work == work : true) && (!last || e.id > last->id)) last = &e;
  if (last) last->state = "failed: " + cause.substr(0, cause.find('\n'));
}

bool FlightRecorder::dump(const std::string& reason) {
  nlohmann::json out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    nlohmann::json entries = nlohmann::json::array();
    const int64_t first = std::max<int64_t>(0, next_id_ - static_cast<int64_t>(capacity_));
    for (int64_t id = first; id < next_id_; ++id) {
      const auto& e = ring_[id % capacity_];
      entries.push_back({{"seq", e.seq}, {"group", e.group}, {"group_seq", e.group_seq}, {"op", e.op},
                         {"what", e.what}, {"bytes", e.bytes}, {"state", e.state}, {"t_ms", e.t_ms}});
    }
    nlohmann::json groups = nlohmann::json::object();
    for (const auto& [name, ranks] : groups_) groups[name] = ranks;
    out = {{"rank", rank_}, {"world_size", world_}, {"reason", reason}, {"written_ms", wall_ms()},
           {"groups", groups}, {"entries", entries}};
  }
  try {
    fs::create_directories(fs::path(path_).parent_path());
    const std::string tmp = path_ + ".tmp";
    {
      std::ofstream f(tmp);
      f << out.dump(1) << "\n";
      if (!f) return false;
    }
    fs::rename(tmp, path_);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

void FlightRecorder::install_dump_signal() {
  struct sigaction sa {};
  sa.sa_handler = on_dump_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGUSR2, &sa, nullptr);
}

bool FlightRecorder::poll_dump_request() { return g_dump_requested.exchange(false); }

std::vector<std::string> align_flight_records(const std::vector<nlohmann::json>& records, int world) {
  std::vector<std::string> lines;
  std::map<int, const nlohmann::json*> by_rank;
  std::map<std::string, std::vector<int>> groups;
  for (const auto& r : records) {
    by_rank[r.at("rank").get<int>()] = &r;
    for (const auto& [name, ranks] : r.at("groups").items()) groups[name] = ranks.get<std::vector<int>>();
  }
  std::vector<int> missing;
  for (int r = 0; r < world; ++r)
    if (!by_rank.count(r)) missing.push_back(r);
  if (!missing.empty())
    lines.push_back("ranks with no flight record (gone or frozen before they could write): " + util::join(missing, ","));

  struct Finding {
    int64_t t_ms;
    std::string line;
  };
  std::vector<Finding> found;
  for (const auto& [group, members] : groups) {
    // Each member's collectives on this group by group_seq.
    std::map<int, std::map<int64_t, const nlohmann::json*>> ops;
    int64_t lo = 0, hi = 0;
    for (int m : members) {
      if (!by_rank.count(m)) continue;
      auto& mine = ops[m];
      for (const auto& e : by_rank[m]->at("entries")) {
        const auto op = e.at("op").get<std::string>();
        if (e.at("group").get<std::string>() != group || op == "p2p" || op == "ring_shift") continue;
        mine[e.at("group_seq").get<int64_t>()] = &e;
      }
      // The ring buffer forgets: compare from the newest first entry any member kept.
      if (!mine.empty()) lo = std::max(lo, mine.begin()->first), hi = std::max(hi, mine.rbegin()->first);
    }
    if (ops.empty() || hi == 0) continue;
    for (int64_t g = lo; g <= hi; ++g) {
      const nlohmann::json* ref = nullptr;
      int ref_rank = -1;
      std::vector<int> absent, issued, unrecorded;
      std::string differ;
      for (int m : members) {
        if (!by_rank.count(m)) {
          unrecorded.push_back(m);
          continue;
        }
        const auto it = ops[m].find(g);
        if (it == ops[m].end()) {
          absent.push_back(m);
          continue;
        }
        issued.push_back(m);
        const auto& e = *it->second;
        if (!ref) {
          ref = &e, ref_rank = m;
        } else if (differ.empty() && (e.at("op") != ref->at("op") || e.at("bytes") != ref->at("bytes") ||
                                      e.at("what") != ref->at("what"))) {
          differ = "rank " + std::to_string(ref_rank) + " issued " + ref->at("op").get<std::string>() + " '" +
                   ref->at("what").get<std::string>() + "' of " + std::to_string(ref->at("bytes").get<int64_t>()) +
                   " bytes, rank " + std::to_string(m) + " " + e.at("op").get<std::string>() + " '" +
                   e.at("what").get<std::string>() + "' of " + std::to_string(e.at("bytes").get<int64_t>()) + " bytes";
        }
      }
      if (!ref) continue;
      // A member without a record is named at the first collective the others did not complete.
      const bool open = ref->at("state").get<std::string>() != "completed";
      if (absent.empty() && differ.empty() && !(open && !unrecorded.empty())) continue;
      if (absent.empty() && differ.empty()) absent = unrecorded;
      const auto op_text = ref->at("op").get<std::string>() + " '" + ref->at("what").get<std::string>() + "' (" +
                           std::to_string(ref->at("bytes").get<int64_t>()) + " bytes)";
      std::string line = "group " + group + " (ranks " + util::join(members, ",") + ") collective #" + std::to_string(g) + ": ";
      if (!differ.empty()) {
        line += "the ranks disagree: " + differ;
      } else {
        line += "rank" + std::string(absent.size() > 1 ? "s " : " ") + util::join(absent, ",") + " never joined " + op_text +
                ", which rank" + (issued.size() > 1 ? "s " : " ") + util::join(issued, ",") + " issued (state: " +
                ref->at("state").get<std::string>() + ")";
      }
      found.push_back({ref->at("t_ms").get<int64_t>(), line});
      break;  // the first disagreement of this group
    }
  }
  std::sort(found.begin(), found.end(), [](const Finding& a, const Finding& b) { return a.t_ms < b.t_ms; });
  for (const auto& f : found) lines.push_back(f.line);
  return lines;
}

}  // namespace nnstrain::dist
