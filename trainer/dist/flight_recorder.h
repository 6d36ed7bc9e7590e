// The flight recorder: each rank's last N collectives and point-to-point groups
// (group, op, sequence numbers, bytes, state) in a ring buffer, written to
// run_dir/flight/rank<R>.json when a collective fails or times out, on SIGUSR2
// (by the heartbeat thread, within about half a second), and when an error ends
// the run (the Runtime is destroyed without shutdown). `nnstrain report` lines
// the ranks' files up (align_flight_records) and names the first operation
// where they disagree. What TORCH_NCCL_TRACE_BUFFER_SIZE and
// torch.distributed.flight_recorder give PyTorch users. No LibTorch here.
//
// Sequence numbers: `seq` counts every operation this rank entered (the
// heartbeat's count); `group_seq` counts the collectives of one group, which
// every member issues in the same order (NCCL's rule), so it lines the members
// up. Point-to-point groups are numbered apart (p2p_seq): pairs of a group
// exchange different numbers of them, so they are listed, not lined up.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace nnstrain::dist {

class FlightRecorder {
 public:
  // path: the file to write; capacity: entries kept (> 0).
  FlightRecorder(std::string path, size_t capacity, int rank, int world);

  // Before the backend call: returns the entry's id. `op`: all_reduce,
  // all_gather, reduce_scatter, ring_shift or p2p.
  int64_t issued(const std::string& group, const std::vector<int>& ranks, const char* op, const char* what,
                 int64_t bytes, int64_t seq);
  void started(int64_t id, const void* work);  // the backend returned `work`
  void completed(const void* work);
  void completed_seq(int64_t seq);  // NCCL: the monitor saw operation `seq` finish
  void failed(const void* work, const std::string& cause);  // null work: the last entry still open
  // Writes the file (replacing an earlier dump); false when it cannot.
  bool dump(const std::string& reason);

  // SIGUSR2 asks for a dump; the heartbeat thread calls poll_dump_request().
  static void install_dump_signal();
  bool poll_dump_request();

 private:
  struct Entry {
    int64_t id = 0, seq = 0, group_seq = 0, bytes = 0;
    std::string group, op, what, state;
    int64_t t_ms = 0;
    const void* work = nullptr;
  };
  std::mutex mu_;
  std::string path_;
  size_t capacity_;
  int rank_, world_;
  int64_t next_id_ = 0;
  std::vector<Entry> ring_;  // entry id % capacity
  std::map<std::string, int64_t> group_seq_, p2p_seq_;
  std::map<std::string, std::vector<int>> groups_;
};

// The report: the ranks' files (parsed JSON, any order) of a job of `world`
// ranks lined up. Returns lines: which ranks wrote no record, and for each
// group the first collective where the members disagree (a rank missing, a
// different op, a different size), earliest first. Empty when all agree.
std::vector<std::string> align_flight_records(const std::vector<nlohmann::json>& records, int world);

}  // namespace nnstrain::dist
