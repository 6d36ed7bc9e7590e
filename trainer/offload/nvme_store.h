// The NVMe tier's file I/O (compute_config.offload: nvme, docs/parallelism.md
// "Offload to NVMe"): files of fixed-size chunks in a private folder of this
// run, read and written asynchronously from buffers the caller owns (a bounded
// ring of host slots, training_state.cpp), each chunk carrying an xxh3
// checksum that is checked when it is read back.
//
// The folder: offload.nvme_path/rank<R>/run-XXXXXX. nvme_path may be a shared
// scratch folder, so nothing found there is trusted: rank<R> must be a real
// folder (not a symlink) owned by this user (else NvmeSetupError) and is set
// to mode 0700; run-XXXXXX is made fresh (a random name, mode 0700) and every
// file in it is created with O_EXCL | O_NOFOLLOW, relative to the folder's
// descriptor, so no planted name is ever followed or overwritten. Two runs
// may share nvme_path. A run-XXXXXX of this user whose NOTE.txt no live run
// holds locked is what a dead run left: it is removed (and logged).
//
// Engines: Linux io_uring (liburing) when the build has it, the kernel lets
// this process set up a ring (some containers forbid it) and its probe lists
// IORING_OP_READ and IORING_OP_WRITE (5.6+; a 5.1-5.5 kernel has a ring but
// not these), else a pool of threads calling pread/pwrite; chosen once at
// start and logged. At most the completion queue's size of pieces is in
// flight. Files use O_DIRECT where the filesystem allows it (not tmpfs), so
// chunks lie at 4 KiB-aligned offsets and buffers are 4 KiB-aligned and padded.
// Test hook (never set in a real run): NNSTRAIN_TEST_NVME_URING_PROBE=unsupported
// makes the probe report the opcodes missing.
//
// Failures are one line naming the path and the rank (NvmeError): a missing or
// read-only folder, too little space for the preallocated files (checked at
// start, so a full disk fails before the first step), a short read (a file
// truncated behind the run's back), a checksum mismatch (naming the chunk).
// The files are scratch: a checkpoint holds the state. close() removes them
// and the run's folder (and rank<R> when empty); a process that dies leaves
// them with NOTE.txt saying so.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace nnstrain::parallel {

struct NvmeError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// What the user sets up decides it (the folder, the engine asked for): `key`
// is the offload key to name ("nvme_path", "nvme_io"); the tier makes it a config error.
struct NvmeSetupError : NvmeError {
  NvmeSetupError(std::string k, const std::string& what) : NvmeError(what), key(std::move(k)) {}
  std::string key;
};

constexpr int64_t kNvmeAlign = 4096;
inline int64_t nvme_round_up(int64_t n) { return (n + kNvmeAlign - 1) / kNvmeAlign * kNvmeAlign; }

// kNvmeAlign-aligned host memory of nvme_round_up(bytes) bytes, zeroed; freed with the returned owner.
std::shared_ptr<void> nvme_buffer(int64_t bytes);

struct NvmeCounters {
  int64_t bytes_read = 0, bytes_written = 0, reads = 0, writes = 0;
  int64_t max_in_flight = 0;  // io_uring: the most pieces in the ring at once (never above queue_entries())
};

// How requests are cut and queued; the defaults are the tier's, tests use small ones.
struct NvmeQueueShape {
  unsigned queue_depth = 64;        // io_uring submission queue entries (the completion queue: twice that)
  int64_t piece_bytes = 2 << 20;    // requests are cut into pieces of this size (a multiple of kNvmeAlign)
};

class NvmeStore {
 public:
  // engine: "auto" (io_uring when available, else threads), "io_uring" (an
  // NvmeSetupError if unavailable) or "threads". dir: the configured folder;
  // the run's private folder is made in its "rank<R>" (see above).
  NvmeStore(const std::string& dir, int rank, const std::string& engine = "auto", const NvmeQueueShape& shape = {});
  ~NvmeStore();  // waits for what is in flight; leaves the files (close() removes them)
  NvmeStore(const NvmeStore&) = delete;
  NvmeStore& operator=(const NvmeStore&) = delete;

  // A file of chunks of these sizes (bytes), at aligned offsets. Returns its index.
  int add_file(const std::string& name, const std::vector<int64_t>& chunk_bytes);
  // After the last add_file: checks the free space and preallocates the files,
  // so that a disk too small fails here, naming the folder and what is needed.
  void allocate();
  int64_t file_bytes() const;  // what allocate() needs on disk

  // Asynchronous chunk I/O from/to `buf` (nvme_buffer memory, at least the
  // chunk's rounded size). submit_write checksums the chunk first; buf must
  // stay untouched until wait(). wait() returns once the chunk's I/O is done,
  // and for a read checks its checksum. One operation per chunk at a time.
  void submit_read(int file, size_t chunk, void* buf);
  void submit_write(int file, size_t chunk, const void* buf);
  void wait(int file, size_t chunk);
  bool in_flight(int file, size_t chunk) const;
  void drain();  // waits for everything in flight

  // Checksums every chunk as the files hold it now (reading through `buf`,
  // one chunk at a time): what a checkpoint save calls before it reads the
  // files through map(), so a corrupt file never reaches a checkpoint.
  void verify_all(void* buf);
  // The whole file mapped shared (read and write), for a checkpoint to read
  // from or load into; after writing through it, rehash() takes the new checksums.
  void* map(int file);
  void rehash(int file, size_t chunk);
  void unmap();  // every mapping gone (the views into them with it)
  int64_t chunk_offset(int file, size_t chunk) const;
  int64_t chunk_bytes(int file, size_t chunk) const;
  size_t chunks(int file) const;

  const std::string& engine() const;   // "io_uring" or "threads"
  const std::string& engine_why() const;  // why the engine is what it is (logged at start)
  bool direct_io() const;               // opened with O_DIRECT
  unsigned queue_entries() const;       // io_uring: the completion queue's entries, the in-flight cap (else 0)
  const std::string& folder() const;   // this run's private folder (rank<R>/run-XXXXXX)
  std::string path(int file) const;
  NvmeCounters counters() const;
  // Removes the files, the note, the run's folder and rank<R> if nothing else is in it (a clean exit).
  void close();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The disk's sequential rates as the NVMe tier sees them: `bytes` written and
// then read back in 8 MiB chunks, kept in flight as a step keeps them, through
// a store in a fresh subfolder of `dir` (a mkdtemp name, removed after).
// `nnstrain plan --probe-disk`.
struct DiskProbe {
  double write_bytes_per_s = 0, read_bytes_per_s = 0;
  int64_t bytes = 0;
  std::string engine;
  bool direct_io = false;
};
DiskProbe probe_disk(const std::string& dir, int64_t bytes, const std::string& engine = "auto");

}  // namespace nnstrain::parallel
