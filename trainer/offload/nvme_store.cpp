#include "trainer/offload/nvme_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#define XXH_INLINE_ALL
#include <xxhash.h>

#ifdef NNSTRAIN_LIBURING
#include <liburing.h>
#endif

#include "base/log.h"

namespace nnstrain::parallel {

namespace fs = std::filesystem;

std::shared_ptr<void> nvme_buffer(int64_t bytes) {
  const size_t n = static_cast<size_t>(nvme_round_up(std::max<int64_t>(1, bytes)));
  void* p = std::aligned_alloc(kNvmeAlign, n);
  if (!p) throw NvmeError("nvme offload: out of host memory allocating a " + std::to_string(n) + "-byte buffer");
  std::memset(p, 0, n);
  return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
}

namespace {

// Requests are cut into pieces of this size, so several are in flight per chunk.
constexpr int64_t kPiece = 2 << 20;
constexpr unsigned kQueueDepth = 64;
constexpr int kThreads = 4;

struct File {
  std::string name, path;
  int fd = -1;
  std::vector<int64_t> offset, bytes;  // per chunk; offsets aligned, each chunk padded to kNvmeAlign
  std::vector<uint64_t> sum;           // xxh3 of each chunk as last written
  std::vector<bool> written;
  int64_t size = 0;
  void* map = nullptr;
};

struct Op {
  int file = 0;
  size_t chunk = 0;
  bool write = false;
  void* buf = nullptr;
  uint64_t sum = 0;  // write: the checksum it stores
  int pending = 0;   // pieces not yet completed
  std::string error;
};

struct Piece {
  Op* op;
  int fd;
  char* buf;
  int64_t off, len;
};

}  // namespace

struct NvmeStore::Impl {
  int rank = 0;
  std::string base, folder, engine, why;
  bool direct = true;
  int note_fd = -1;
  std::vector<File> files;
  std::map<std::pair<int, size_t>, std::unique_ptr<Op>> ops;
  NvmeCounters counters;
  bool closed = false;

#ifdef NNSTRAIN_LIBURING
  bool ring_ok = false;
  io_uring ring{};
  unsigned in_ring = 0;
#endif
  // The thread pool (the fallback engine).
  std::vector<std::thread> threads;
  std::deque<Piece> queue;
  std::mutex mu;
  std::condition_variable work_cv, done_cv;
  bool stopping = false;

  std::string where() const { return "nvme offload (rank " + std::to_string(rank) + "): "; }
  [[noreturn]] void fail(const std::string& path, const std::string& what) const {
    throw NvmeError(where() + path + ": " + what);
  }
  std::string chunk_name(const Op& op) const {
    return files[op.file].path + " chunk " + std::to_string(op.chunk);
  }

  // A piece done with `res` bytes moved or -errno. Short transfers: a write
  // finishes synchronously; a read that meets the end of the file is a file
  // truncated behind the run's back.
  void complete(const Piece& p, int64_t res) {
    std::string err;
    if (res < 0) {
      err = std::string(p.op->write ? "write failed: " : "read failed: ") + std::strerror(static_cast<int>(-res));
    } else if (res < p.len) {
      int64_t done = res;
      while (done < p.len) {
        const ssize_t r = p.op->write ? ::pwrite(p.fd, p.buf + done, p.len - done, p.off + done)
                                      : ::pread(p.fd, p.buf + done, p.len - done, p.off + done);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
          err = std::string(p.op->write ? "write failed: " : "read failed: ") + std::strerror(errno);
          break;
        }
        if (r == 0) {
          err = p.op->write ? "write made no progress (disk full?)"
                            : "the file ends before this chunk does (truncated behind the run's back?)";
          break;
        }
        done += r;
      }
    }
    std::lock_guard<std::mutex> lk(mu);
    if (!err.empty() && p.op->error.empty()) p.op->error = err;
    --p.op->pending;
  }

  void start_threads() {
    for (int i = 0; i < kThreads; ++i)
      threads.emplace_back([this] {
        for (;;) {
          Piece p;
          {
            std::unique_lock<std::mutex> lk(mu);
            work_cv.wait(lk, [&] { return stopping || !queue.empty(); });
            if (queue.empty()) return;
            p = queue.front();
            queue.pop_front();
          }
          ssize_t r;
          do {
            r = p.op->write ? ::pwrite(p.fd, p.buf, p.len, p.off) : ::pread(p.fd, p.buf, p.len, p.off);
          } while (r < 0 && errno == EINTR);
          complete(p, r < 0 ? -int64_t(errno) : int64_t(r));
          done_cv.notify_all();
        }
      });
  }

#ifdef NNSTRAIN_LIBURING
  // Takes one completion off the ring (waiting for it).
  void reap_one() {
    io_uring_cqe* cqe = nullptr;
    int rc;
    do {
      rc = io_uring_wait_cqe(&ring, &cqe);
    } while (rc == -EINTR);
    if (rc < 0) throw NvmeError(where() + folder + ": io_uring wait failed: " + std::strerror(-rc));
    auto* p = static_cast<Piece*>(io_uring_cqe_get_data(cqe));
    const int64_t res = cqe->res;
    io_uring_cqe_seen(&ring, cqe);
    --in_ring;
    complete(*p, res);
    delete p;
  }
#endif

  void submit(Op& op) {
    const auto& f = files[op.file];
    const int64_t off = f.offset[op.chunk], len = nvme_round_up(f.bytes[op.chunk]);
    for (int64_t at = 0; at < len; at += kPiece) {
      Piece p{&op, f.fd, static_cast<char*>(op.buf) + at, off + at, std::min(kPiece, len - at)};
      {
        std::lock_guard<std::mutex> lk(mu);
        ++op.pending;
      }
#ifdef NNSTRAIN_LIBURING
      if (ring_ok) {
        io_uring_sqe* sqe = io_uring_get_sqe(&ring);
        while (!sqe) {  // the queue is full: hand it to the kernel and take a completion off
          io_uring_submit(&ring);
          reap_one();
          sqe = io_uring_get_sqe(&ring);
        }
        if (op.write) io_uring_prep_write(sqe, p.fd, p.buf, static_cast<unsigned>(p.len), p.off);
        else io_uring_prep_read(sqe, p.fd, p.buf, static_cast<unsigned>(p.len), p.off);
        io_uring_sqe_set_data(sqe, new Piece(p));
        ++in_ring;
        continue;
      }
#endif
      {
        std::lock_guard<std::mutex> lk(mu);
        queue.push_back(p);
      }
      work_cv.notify_one();
    }
#ifdef NNSTRAIN_LIBURING
    if (ring_ok) io_uring_submit(&ring);
#endif
  }

  void wait_op(Op& op) {
#ifdef NNSTRAIN_LIBURING
    if (ring_ok) {
      while (op.pending > 0) reap_one();
      return;
    }
#endif
    std::unique_lock<std::mutex> lk(mu);
    done_cv.wait(lk, [&] { return op.pending == 0; });
  }

  void remove_files() {
    for (auto& f : files) {
      if (f.map) ::munmap(f.map, static_cast<size_t>(f.size));
      f.map = nullptr;
      if (f.fd >= 0) ::close(f.fd);
      f.fd = -1;
      ::unlink(f.path.c_str());
    }
  }
};

NvmeStore::NvmeStore(const std::string& dir, int rank, const std::string& engine) : impl_(std::make_unique<Impl>()) {
  auto& m = *impl_;
  m.rank = rank;
  m.base = dir;
  m.folder = (fs::path(dir) / ("rank" + std::to_string(rank))).string();
  // A size limit (RLIMIT_FSIZE) then fails a write with EFBIG, reported as
  // such, rather than killing the process with no word.
  std::signal(SIGXFSZ, SIG_IGN);
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) m.fail(dir, std::string("the folder is not there: ") + std::strerror(errno));
  if (!S_ISDIR(st.st_mode)) m.fail(dir, "is not a folder");
  if (::mkdir(m.folder.c_str(), 0700) != 0 && errno != EEXIST)
    m.fail(m.folder, std::string("cannot create the rank's folder: ") + std::strerror(errno));
  // The note: why these files are here, and (locked while the run lives) a
  // guard against two runs sharing a folder.
  const std::string note = m.folder + "/NOTE.txt";
  const bool left_over = fs::exists(note);
  m.note_fd = ::open(note.c_str(), O_RDWR | O_CREAT, 0600);
  if (m.note_fd < 0) m.fail(note, std::string("cannot write: ") + std::strerror(errno));
  if (::flock(m.note_fd, LOCK_EX | LOCK_NB) != 0) {
    ::close(m.note_fd);
    m.note_fd = -1;
    m.fail(m.folder, "is in use by another running nnstrain (see its NOTE.txt); give each run its own offload.nvme_path");
  }
  if (left_over)
    log::warn(m.where() + m.folder + " holds files a run that did not exit cleanly left; they are rebuilt");
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  const std::string text =
      "Scratch files of nnstrain's NVMe offload (compute_config.offload: nvme), rank " + std::to_string(rank) +
      ", pid " + std::to_string(::getpid()) + " on " + host +
      ".\nA run that exits cleanly removes this folder. If it is still here after the run ended, the run died:\n"
      "the training state is in its last checkpoint, and resuming rebuilds these files. Safe to delete when no run uses it.\n";
  if (::ftruncate(m.note_fd, 0) != 0 || ::pwrite(m.note_fd, text.data(), text.size(), 0) != ssize_t(text.size()))
    m.fail(note, std::string("cannot write: ") + std::strerror(errno));

  if (engine != "auto" && engine != "io_uring" && engine != "threads")
    throw NvmeError(m.where() + "unknown I/O engine '" + engine + "'");
#ifdef NNSTRAIN_LIBURING
  if (engine != "threads") {
    const int rc = io_uring_queue_init(kQueueDepth, &m.ring, 0);
    if (rc == 0) {
      m.ring_ok = true;
      m.engine = "io_uring";
      m.why = "liburing, queue depth " + std::to_string(kQueueDepth);
    } else {
      m.why = std::string("io_uring is unavailable here (io_uring_queue_init: ") + std::strerror(-rc) + ")";
    }
  } else {
    m.why = "threads asked for (NNSTRAIN_NVME_ENGINE)";
  }
#else
  m.why = engine == "threads" ? "threads asked for (NNSTRAIN_NVME_ENGINE)" : "this build has no liburing";
#endif
  if (m.engine.empty()) {
    if (engine == "io_uring") throw NvmeError(m.where() + "io_uring asked for, but " + m.why);
    m.engine = "threads";
    m.why = "pread/pwrite on " + std::to_string(kThreads) + " threads: " + m.why;
    m.start_threads();
  }
}

NvmeStore::~NvmeStore() {
  auto& m = *impl_;
  try {
    drain();
  } catch (const std::exception&) {
  }
  {
    std::lock_guard<std::mutex> lk(m.mu);
    m.stopping = true;
  }
  m.work_cv.notify_all();
  for (auto& t : m.threads) t.join();
#ifdef NNSTRAIN_LIBURING
  if (m.ring_ok) io_uring_queue_exit(&m.ring);
#endif
  for (auto& f : m.files) {
    if (f.map) ::munmap(f.map, static_cast<size_t>(f.size));
    if (f.fd >= 0) ::close(f.fd);
  }
  if (m.note_fd >= 0) ::close(m.note_fd);  // the lock goes with it; the note stays unless close() ran
}

int NvmeStore::add_file(const std::string& name, const std::vector<int64_t>& chunk_bytes) {
  auto& m = *impl_;
  File f;
  f.name = name;
  f.path = m.folder + "/" + name;
  for (auto b : chunk_bytes) {
    f.offset.push_back(f.size);
    f.bytes.push_back(b);
    f.size += nvme_round_up(b);
  }
  f.sum.assign(chunk_bytes.size(), 0);
  f.written.assign(chunk_bytes.size(), false);
  const int flags = O_RDWR | O_CREAT | O_TRUNC;
  f.fd = m.direct ? ::open(f.path.c_str(), flags | O_DIRECT, 0600) : -1;
  if (f.fd < 0 && m.direct && errno == EINVAL) {  // tmpfs and a few others: no direct I/O
    m.direct = false;
    f.fd = ::open(f.path.c_str(), flags, 0600);
  }
  if (f.fd < 0) m.fail(f.path, std::string("cannot create: ") + std::strerror(errno));
  m.files.push_back(std::move(f));
  return static_cast<int>(m.files.size()) - 1;
}

int64_t NvmeStore::file_bytes() const {
  int64_t n = 0;
  for (const auto& f : impl_->files) n += f.size;
  return n;
}

void NvmeStore::allocate() {
  auto& m = *impl_;
  struct statvfs vfs {};
  if (::statvfs(m.folder.c_str(), &vfs) != 0) m.fail(m.folder, std::string("statvfs: ") + std::strerror(errno));
  const int64_t avail = int64_t(vfs.f_bavail) * int64_t(vfs.f_frsize), need = file_bytes();
  if (avail < need)
    m.fail(m.folder, "has " + std::to_string(avail >> 20) + " MiB free, but this rank's offloaded state needs " +
                         std::to_string((need + (1 << 20) - 1) >> 20) + " MiB (disk full?)");
  for (auto& f : m.files) {
    if (f.size == 0) continue;
    const int rc = ::posix_fallocate(f.fd, 0, f.size);
    if (rc != 0)
      m.fail(f.path, "cannot reserve " + std::to_string(f.size) + " bytes: " + std::strerror(rc) +
                         (rc == ENOSPC || rc == EFBIG ? " (disk full or a file size limit)" : ""));
  }
}

void NvmeStore::submit_read(int file, size_t chunk, void* buf) {
  auto& m = *impl_;
  auto& op = m.ops[{file, chunk}];
  if (op) throw NvmeError(m.where() + m.files[file].path + ": chunk " + std::to_string(chunk) + " already in flight");
  op = std::make_unique<Op>();
  op->file = file;
  op->chunk = chunk;
  op->buf = buf;
  m.submit(*op);
}

void NvmeStore::submit_write(int file, size_t chunk, const void* buf) {
  auto& m = *impl_;
  auto& op = m.ops[{file, chunk}];
  if (op) throw NvmeError(m.where() + m.files[file].path + ": chunk " + std::to_string(chunk) + " already in flight");
  op = std::make_unique<Op>();
  op->file = file;
  op->chunk = chunk;
  op->write = true;
  op->buf = const_cast<void*>(buf);
  op->sum = XXH3_64bits(buf, static_cast<size_t>(m.files[file].bytes[chunk]));
  m.submit(*op);
}

bool NvmeStore::in_flight(int file, size_t chunk) const { return impl_->ops.count({file, chunk}) > 0; }

void NvmeStore::wait(int file, size_t chunk) {
  auto& m = *impl_;
  auto it = m.ops.find({file, chunk});
  if (it == m.ops.end()) return;
  auto op = std::move(it->second);
  m.wait_op(*op);
  m.ops.erase(it);
  auto& f = m.files[file];
  if (!op->error.empty()) throw NvmeError(m.where() + m.chunk_name(*op) + ": " + op->error);
  const int64_t n = f.bytes[chunk];
  if (op->write) {
    f.sum[chunk] = op->sum;
    f.written[chunk] = true;
    m.counters.bytes_written += n;
    ++m.counters.writes;
    return;
  }
  m.counters.bytes_read += n;
  ++m.counters.reads;
  if (f.written[chunk] && XXH3_64bits(op->buf, static_cast<size_t>(n)) != f.sum[chunk])
    throw NvmeError(m.where() + m.chunk_name(*op) + " (bytes " + std::to_string(f.offset[chunk]) + ".." +
                    std::to_string(f.offset[chunk] + n) +
                    "): checksum mismatch, the file changed behind the run's back (corrupt disk or another writer)");
}

void NvmeStore::drain() {
  std::vector<std::pair<int, size_t>> keys;
  for (const auto& [k, op] : impl_->ops) keys.push_back(k);
  std::string first;
  for (const auto& k : keys) {
    try {
      wait(k.first, k.second);
    } catch (const NvmeError& e) {
      if (first.empty()) first = e.what();
    }
  }
  if (!first.empty()) throw NvmeError(first);
}

void NvmeStore::verify_all(void* buf) {
  drain();
  for (size_t fi = 0; fi < impl_->files.size(); ++fi)
    for (size_t c = 0; c < impl_->files[fi].bytes.size(); ++c) {
      submit_read(static_cast<int>(fi), c, buf);
      wait(static_cast<int>(fi), c);
    }
}

void* NvmeStore::map(int file) {
  auto& m = *impl_;
  auto& f = m.files[file];
  if (!f.map && f.size > 0) {
    void* p = ::mmap(nullptr, static_cast<size_t>(f.size), PROT_READ | PROT_WRITE, MAP_SHARED, f.fd, 0);
    if (p == MAP_FAILED) m.fail(f.path, std::string("mmap: ") + std::strerror(errno));
    ::madvise(p, static_cast<size_t>(f.size), MADV_SEQUENTIAL);
    f.map = p;
  }
  return f.map;
}

void NvmeStore::rehash(int file, size_t chunk) {
  auto& f = impl_->files[file];
  const auto* p = static_cast<const char*>(map(file)) + f.offset[chunk];
  f.sum[chunk] = XXH3_64bits(p, static_cast<size_t>(f.bytes[chunk]));
  f.written[chunk] = true;
  // Direct reads go around the page cache: what the mapping changed goes to the file first.
  if (::msync(const_cast<char*>(p) - (f.offset[chunk] % ::getpagesize()), static_cast<size_t>(nvme_round_up(f.bytes[chunk])),
              MS_SYNC) != 0)
    impl_->fail(f.path, std::string("msync: ") + std::strerror(errno));
}

void NvmeStore::unmap() {
  for (auto& f : impl_->files) {
    if (f.map) ::munmap(f.map, static_cast<size_t>(f.size));
    f.map = nullptr;
  }
}

int64_t NvmeStore::chunk_offset(int file, size_t chunk) const { return impl_->files[file].offset[chunk]; }
int64_t NvmeStore::chunk_bytes(int file, size_t chunk) const { return impl_->files[file].bytes[chunk]; }
size_t NvmeStore::chunks(int file) const { return impl_->files[file].bytes.size(); }
const std::string& NvmeStore::engine() const { return impl_->engine; }
const std::string& NvmeStore::engine_why() const { return impl_->why; }
bool NvmeStore::direct_io() const { return impl_->direct; }
const std::string& NvmeStore::folder() const { return impl_->folder; }
std::string NvmeStore::path(int file) const { return impl_->files[file].path; }
NvmeCounters NvmeStore::counters() const { return impl_->counters; }

void NvmeStore::close() {
  auto& m = *impl_;
  if (m.closed) return;
  drain();
  m.remove_files();
  ::unlink((m.folder + "/NOTE.txt").c_str());
  if (m.note_fd >= 0) ::close(m.note_fd);
  m.note_fd = -1;
  ::rmdir(m.folder.c_str());  // only if nothing else was put there
  m.closed = true;
}

DiskProbe probe_disk(const std::string& dir, int64_t bytes, const std::string& engine) {
  const std::string sub = (fs::path(dir) / ("nnstrain-probe-" + std::to_string(::getpid()))).string();
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) throw NvmeError("--probe-disk: " + dir + " is not a folder");
  if (::mkdir(sub.c_str(), 0700) != 0 && errno != EEXIST)
    throw NvmeError("--probe-disk: cannot create " + sub + ": " + std::strerror(errno));
  DiskProbe r;
  {
    NvmeStore store(sub, 0, engine);
    constexpr int64_t kChunk = 8 << 20;
    constexpr size_t kInFlight = 8;  // chunks: what a step keeps in flight, a few slots' worth
    const size_t n = static_cast<size_t>(std::max<int64_t>(1, bytes / kChunk));
    const int f = store.add_file("probe.bin", std::vector<int64_t>(n, kChunk));
    store.allocate();
    std::vector<std::shared_ptr<void>> bufs;
    for (size_t i = 0; i < kInFlight; ++i) {
      bufs.push_back(nvme_buffer(kChunk));
      std::memset(bufs.back().get(), int(0x5a + i), kChunk);  // not zeros: no filesystem shortcut
    }
    auto run = [&](bool write) {
      const auto t0 = std::chrono::steady_clock::now();
      for (size_t c = 0; c < n; ++c) {
        if (c >= kInFlight) store.wait(f, c - kInFlight);
        if (write) store.submit_write(f, c, bufs[c % kInFlight].get());
        else store.submit_read(f, c, bufs[c % kInFlight].get());
      }
      store.drain();
      if (write) {  // buffered (no O_DIRECT): the write is done once it is on the disk
        const int fd = ::open(store.path(f).c_str(), O_RDONLY);
        if (fd >= 0) {
          ::fsync(fd);
          ::close(fd);
        }
      }
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    const double tw = run(true), tr = run(false);
    r.bytes = int64_t(n) * kChunk;
    r.write_bytes_per_s = double(r.bytes) / tw;
    r.read_bytes_per_s = double(r.bytes) / tr;
    r.engine = store.engine();
    r.direct_io = store.direct_io();
    store.close();
  }
  ::rmdir(sub.c_str());
  return r;
}

}  // namespace nnstrain::parallel
