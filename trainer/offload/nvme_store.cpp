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
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include <dirent.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#ifdef NNSTRAIN_LIBURING
#include <liburing.h>
#endif

#include "base/log.h"

namespace nnstrain::parallel {

std::shared_ptr<void> nvme_buffer(int64_t bytes) {
  const size_t n = static_cast<size_t>(nvme_round_up(std::max<int64_t>(1, bytes)));
  void* p = std::aligned_alloc(kNvmeAlign, n);
  if (!p) throw NvmeError("nvme offload: out of host memory allocating a " + std::to_string(n) + "-byte buffer");
  std::memset(p, 0, n);
  return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
}

namespace {

constexpr int kThreads = 4;

std::string path_in(const std::string& dir, const std::string& name) {
  return !dir.empty() && dir.back() == '/' ? dir + name : dir + "/" + name;
}

// A name no one can plant ahead of the run (mkdtemp's idea, made relative to a folder's descriptor).
std::string random_name(const std::string& prefix) {
  static const char kChars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  std::random_device rd;
  std::string s = prefix;
  for (int i = 0; i < 6; ++i) s += kChars[rd() % 62];
  return s;
}

// The entries of the folder `dirfd` is open on (its own descriptor is left as it is).
std::vector<std::string> entries(int dirfd) {
  std::vector<std::string> names;
  const int fd = ::openat(dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return names;
  DIR* d = ::fdopendir(fd);
  if (!d) {
    ::close(fd);
    return names;
  }
  while (const dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  return names;
}

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
  NvmeQueueShape shape;
  std::string base, rank_name, rank_folder, run_name, folder, engine, why;
  bool direct = true;
  int note_fd = -1;
  int base_fd = -1, rank_fd = -1, run_fd = -1;  // every name below nvme_path is opened relative to these
  std::vector<File> files;
  std::map<std::pair<int, size_t>, std::unique_ptr<Op>> ops;
  NvmeCounters counters;
  bool closed = false;

#ifdef NNSTRAIN_LIBURING
  bool ring_ok = false;
  io_uring ring{};
  unsigned cq_entries = 0;  // pieces in the ring never exceed it: a full completion queue drops or stalls them
  unsigned in_ring = 0;     // pieces prepared and not yet reaped
  unsigned unsent = 0;      // of those, not yet taken by the kernel
  std::string broken;       // io_uring_submit failed: every later operation fails with this
#endif
  // The thread pool (the fallback engine).
  std::vector<std::thread> threads;
  std::deque<Piece> queue;
  std::mutex mu;
  std::condition_variable work_cv, done_cv;
  bool stopping = false;

  ~Impl() {
    {
      std::lock_guard<std::mutex> lk(mu);
      stopping = true;
    }
    work_cv.notify_all();
    for (auto& t : threads) t.join();
#ifdef NNSTRAIN_LIBURING
    if (ring_ok) io_uring_queue_exit(&ring);
#endif
    for (auto& f : files) {
      if (f.map) ::munmap(f.map, static_cast<size_t>(f.size));
      if (f.fd >= 0) ::close(f.fd);
    }
    for (int fd : {note_fd, run_fd, rank_fd, base_fd})  // the note's lock goes with it; the files stay unless close() ran
      if (fd >= 0) ::close(fd);
  }

  std::string where() const { return "nvme offload (rank " + std::to_string(rank) + "): "; }
  [[noreturn]] void fail(const std::string& path, const std::string& what) const {
    throw NvmeError(where() + path + ": " + what);
  }
  [[noreturn]] void refuse(const std::string& key, const std::string& path, const std::string& what) const {
    throw NvmeSetupError(key, where() + path + ": " + what);
  }

  // `name` in `dirfd` as a folder, never through a symlink.
  int open_folder(int dirfd, const std::string& name, const std::string& path) const {
    const int fd = ::openat(dirfd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd >= 0) return fd;
    const int err = errno;
    struct stat st {};
    if (::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode))
      refuse("nvme_path", path,
             "is a symbolic link; refusing to follow it (someone else may have planted it): remove it, or point "
             "offload.nvme_path at the real folder");
    if (err == ENOTDIR) refuse("nvme_path", path, "is not a folder");
    fail(path, std::string("cannot open: ") + std::strerror(err));
  }

  // What a run that died left in this rank's folder: run-* folders of this
  // user whose note no live run holds locked. A run writes its note only once
  // it holds the lock, so an empty note is a run starting up: left alone.
  void remove_stale() {
    for (const auto& name : entries(rank_fd)) {
      if (name.rfind("run-", 0) != 0) continue;
      struct stat st {};
      if (::fstatat(rank_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(st.st_mode) ||
          st.st_uid != ::geteuid())
        continue;
      const int dfd = ::openat(rank_fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (dfd < 0) continue;
      const int nfd = ::openat(dfd, "NOTE.txt", O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
      struct stat ns {};
      const bool dead = nfd >= 0 && ::flock(nfd, LOCK_EX | LOCK_NB) == 0 && ::fstat(nfd, &ns) == 0 && ns.st_size > 0;
      if (dead) {
        for (const auto& e : entries(dfd))  // unlinkat removes a symlink itself, never its target
          if (e != "NOTE.txt") ::unlinkat(dfd, e.c_str(), 0);
        ::unlinkat(dfd, "NOTE.txt", 0);
      }
      if (nfd >= 0) ::close(nfd);
      ::close(dfd);
      if (dead && ::unlinkat(rank_fd, name.c_str(), AT_REMOVEDIR) == 0)
        log::warn(where() + "removed " + path_in(rank_folder, name) +
                  ", the files a run that did not exit cleanly left (the training state is in its checkpoint)");
    }
  }

#ifdef NNSTRAIN_LIBURING
  // What this kernel's io_uring lacks of the opcodes the engine submits ("" if nothing).
  std::string missing_opcodes() {
    if (const char* t = std::getenv("NNSTRAIN_TEST_NVME_URING_PROBE")) {
      if (std::string(t) != "unsupported")
        throw NvmeError(std::string("NNSTRAIN_TEST_NVME_URING_PROBE='") + t + "': expected unsupported");
      return "IORING_OP_READ and IORING_OP_WRITE (NNSTRAIN_TEST_NVME_URING_PROBE=unsupported)";
    }
    io_uring_probe* probe = io_uring_get_probe_ring(&ring);
    if (!probe) return "IORING_OP_READ and IORING_OP_WRITE (it has no opcode probe: a kernel before 5.6)";
    std::string missing;
    if (!io_uring_opcode_supported(probe, IORING_OP_READ)) missing = "IORING_OP_READ";
    if (!io_uring_opcode_supported(probe, IORING_OP_WRITE)) missing += std::string(missing.empty() ? "" : " and ") + "IORING_OP_WRITE";
    io_uring_free_probe(probe);
    return missing;
  }
#endif
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

  // Hands every prepared piece to the kernel. A submit that takes fewer (the
  // kernel short of memory, or its completion queue full) is retried once a
  // completion is taken off; any other failure breaks the ring.
  void flush() {
    while (unsent > 0) {
      const int rc = io_uring_submit(&ring);
      if (rc > 0) {
        unsent -= std::min(unsent, static_cast<unsigned>(rc));
        continue;
      }
      if (rc == -EINTR) continue;
      if ((rc == 0 || rc == -EAGAIN || rc == -EBUSY) && in_ring > unsent) {
        reap_one();
        continue;
      }
      broken = std::string("io_uring_submit failed: ") + (rc < 0 ? std::strerror(-rc) : "the kernel took no request");
      throw NvmeError(where() + folder + ": " + broken);
    }
  }

  void ring_put(const Piece& p) {
    while (in_ring >= cq_entries) {  // the completion queue holds what is in flight, no more
      flush();
      reap_one();
    }
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    if (!sqe) {  // the submission queue is full: the kernel takes it
      flush();
      sqe = io_uring_get_sqe(&ring);
    }
    if (!sqe) throw NvmeError(where() + folder + ": io_uring: no submission queue entry free after a submit");
    if (p.op->write) io_uring_prep_write(sqe, p.fd, p.buf, static_cast<unsigned>(p.len), p.off);
    else io_uring_prep_read(sqe, p.fd, p.buf, static_cast<unsigned>(p.len), p.off);
    io_uring_sqe_set_data(sqe, new Piece(p));
    ++in_ring;
    ++unsent;
    counters.max_in_flight = std::max<int64_t>(counters.max_in_flight, in_ring);
  }
#endif

  void submit(Op& op) {
#ifdef NNSTRAIN_LIBURING
    if (ring_ok && !broken.empty()) throw NvmeError(where() + folder + ": " + broken);
#endif
    const auto& f = files[op.file];
    const int64_t off = f.offset[op.chunk], len = nvme_round_up(f.bytes[op.chunk]);
    for (int64_t at = 0; at < len; at += shape.piece_bytes) {
      Piece p{&op, f.fd, static_cast<char*>(op.buf) + at, off + at, std::min(shape.piece_bytes, len - at)};
      {
        std::lock_guard<std::mutex> lk(mu);
        ++op.pending;
      }
#ifdef NNSTRAIN_LIBURING
      if (ring_ok) {
        ring_put(p);
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
    if (ring_ok) flush();
#endif
  }

  void wait_op(Op& op) {
#ifdef NNSTRAIN_LIBURING
    if (ring_ok) {
      while (op.pending > 0 && broken.empty()) reap_one();
      if (op.pending > 0) {  // a broken ring: what the kernel took completes, the rest never will
        while (in_ring > unsent) reap_one();
        if (op.pending > 0) {
          op.pending = 0;
          if (op.error.empty()) op.error = broken;
        }
      }
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
      ::unlinkat(run_fd, f.name.c_str(), 0);
    }
  }
};

NvmeStore::NvmeStore(const std::string& dir, int rank, const std::string& engine, const NvmeQueueShape& shape)
    : impl_(std::make_unique<Impl>()) {
  auto& m = *impl_;
  m.rank = rank;
  m.shape = shape;
  m.base = dir;
  if (shape.queue_depth == 0 || shape.piece_bytes <= 0 || shape.piece_bytes % kNvmeAlign != 0)
    throw NvmeError(m.where() + "queue depth " + std::to_string(shape.queue_depth) + " or piece of " +
                    std::to_string(shape.piece_bytes) + " bytes: expected a depth > 0 and a multiple of 4096 bytes");
  if (engine != "auto" && engine != "io_uring" && engine != "threads")
    throw NvmeError(m.where() + "unknown I/O engine '" + engine + "'");
  // A size limit (RLIMIT_FSIZE) then fails a write with EFBIG, reported as
  // such, rather than killing the process with no word.
  std::signal(SIGXFSZ, SIG_IGN);

  // The engine first, so that one asked for and missing fails before anything is created.
#ifdef NNSTRAIN_LIBURING
  if (engine != "threads") {
    io_uring_params params{};
    const int rc = io_uring_queue_init_params(shape.queue_depth, &m.ring, &params);
    if (rc != 0) {
      m.why = std::string("io_uring is unavailable here (io_uring_queue_init: ") + std::strerror(-rc) + ")";
    } else if (const std::string missing = m.missing_opcodes(); !missing.empty()) {
      io_uring_queue_exit(&m.ring);  // a 5.1-5.5 kernel sets up a ring whose every read and write would fail
      m.why = "the kernel's io_uring lacks " + missing;
    } else {
      m.ring_ok = true;
      m.cq_entries = params.cq_entries;
      m.engine = "io_uring";
      m.why = "liburing, queue depth " + std::to_string(params.sq_entries) + ", at most " +
              std::to_string(params.cq_entries) + " pieces in flight";
    }
  } else {
    m.why = "threads asked for (offload.nvme_io)";
  }
#else
  m.why = engine == "threads" ? "threads asked for (offload.nvme_io)" : "this build has no liburing";
#endif
  if (m.engine.empty()) {
    if (engine == "io_uring")
      throw NvmeSetupError("nvme_io", m.where() + "io_uring asked for, but " + m.why + "; use nvme_io: auto or threads");
    m.engine = "threads";
    m.why = "pread/pwrite on " + std::to_string(kThreads) + " threads: " + m.why;
  }

  // The folders: nvme_path as configured (it may be a link to the disk), then
  // nothing below it trusted (nvme_store.h).
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) m.fail(dir, std::string("the folder is not there: ") + std::strerror(errno));
  if (!S_ISDIR(st.st_mode)) m.fail(dir, "is not a folder");
  m.base_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (m.base_fd < 0) m.fail(dir, std::string("cannot open: ") + std::strerror(errno));
  m.rank_name = "rank" + std::to_string(rank);
  m.rank_folder = path_in(dir, m.rank_name);
  if (::mkdirat(m.base_fd, m.rank_name.c_str(), 0700) != 0 && errno != EEXIST)
    m.fail(m.rank_folder, std::string("cannot create the rank's folder: ") + std::strerror(errno));
  m.rank_fd = m.open_folder(m.base_fd, m.rank_name, m.rank_folder);
  if (::fstat(m.rank_fd, &st) != 0) m.fail(m.rank_folder, std::string("fstat: ") + std::strerror(errno));
  if (st.st_uid != ::geteuid())
    m.refuse("nvme_path", m.rank_folder,
             "is owned by uid " + std::to_string(st.st_uid) + ", not by this user (uid " + std::to_string(::geteuid()) +
                 "): refusing a folder another user controls; remove it, or give offload.nvme_path a folder of your own");
  if ((st.st_mode & 07777) != 0700 && ::fchmod(m.rank_fd, 0700) != 0)
    m.fail(m.rank_folder, std::string("cannot make it private (chmod 0700): ") + std::strerror(errno));
  m.remove_stale();
  for (int tries = 0;; ++tries) {
    m.run_name = random_name("run-");
    if (::mkdirat(m.rank_fd, m.run_name.c_str(), 0700) == 0) break;
    if (errno != EEXIST || tries >= 100)
      m.fail(m.rank_folder, std::string("cannot create the run's folder: ") + std::strerror(errno));
  }
  m.folder = path_in(m.rank_folder, m.run_name);
  m.run_fd = m.open_folder(m.rank_fd, m.run_name, m.folder);
  if (::fchmod(m.run_fd, 0700) != 0)  // the umask may have taken more than group and other bits
    m.fail(m.folder, std::string("chmod 0700: ") + std::strerror(errno));

  // The note: why these files are here; locked while the run lives, so a
  // later run tells a dead run's folder from a live one's.
  const std::string note = path_in(m.folder, "NOTE.txt");
  m.note_fd = ::openat(m.run_fd, "NOTE.txt", O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (m.note_fd < 0) m.fail(note, std::string("cannot write: ") + std::strerror(errno));
  int lrc;
  do {
    lrc = ::flock(m.note_fd, LOCK_EX);  // waits only while another run's cleanup looks at it
  } while (lrc != 0 && errno == EINTR);
  if (lrc != 0) m.fail(note, std::string("cannot lock: ") + std::strerror(errno));
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  const std::string text =
      "Scratch files of nnstrain's NVMe offload (compute_config.offload: nvme), rank " + std::to_string(rank) +
      ", pid " + std::to_string(::getpid()) + " on " + host +
      ".\nA run that exits cleanly removes this folder. If it is still here after the run ended, the run died:\n"
      "the training state is in its last checkpoint, and the next run in this folder removes these files.\n"
      "Safe to delete when no run uses it.\n";
  if (::pwrite(m.note_fd, text.data(), text.size(), 0) != ssize_t(text.size()))
    m.fail(note, std::string("cannot write: ") + std::strerror(errno));

  if (m.engine == "threads") m.start_threads();
}

NvmeStore::~NvmeStore() {
  try {
    drain();
  } catch (const std::exception&) {
  }
}  // the Impl stops the threads and the ring, closes the files; the files stay (close() removes them)

int NvmeStore::add_file(const std::string& name, const std::vector<int64_t>& chunk_bytes) {
  auto& m = *impl_;
  File f;
  f.name = name;
  f.path = path_in(m.folder, name);
  for (auto b : chunk_bytes) {
    f.offset.push_back(f.size);
    f.bytes.push_back(b);
    f.size += nvme_round_up(b);
  }
  f.sum.assign(chunk_bytes.size(), 0);
  f.written.assign(chunk_bytes.size(), false);
  // A new file in the run's own folder: never an existing one, never through a link.
  f.fd = ::openat(m.run_fd, name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (f.fd < 0) m.fail(f.path, std::string("cannot create: ") + std::strerror(errno));
  if (m.direct && ::fcntl(f.fd, F_SETFL, ::fcntl(f.fd, F_GETFL) | O_DIRECT) != 0) {
    const int err = errno;
    ::close(f.fd);
    ::unlinkat(m.run_fd, name.c_str(), 0);
    if (err != EINVAL) m.fail(f.path, std::string("cannot set O_DIRECT: ") + std::strerror(err));
    m.direct = false;  // tmpfs and a few others: no direct I/O
    f.fd = ::openat(m.run_fd, name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (f.fd < 0) m.fail(f.path, std::string("cannot create: ") + std::strerror(errno));
  }
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
unsigned NvmeStore::queue_entries() const {
#ifdef NNSTRAIN_LIBURING
  return impl_->ring_ok ? impl_->cq_entries : 0;
#else
  return 0;
#endif
}
std::string NvmeStore::path(int file) const { return impl_->files[file].path; }
NvmeCounters NvmeStore::counters() const { return impl_->counters; }

void NvmeStore::close() {
  auto& m = *impl_;
  if (m.closed) return;
  drain();
  m.remove_files();
  ::unlinkat(m.run_fd, "NOTE.txt", 0);
  if (m.note_fd >= 0) ::close(m.note_fd);
  m.note_fd = -1;
  ::unlinkat(m.rank_fd, m.run_name.c_str(), AT_REMOVEDIR);  // only if nothing else was put there
  ::unlinkat(m.base_fd, m.rank_name.c_str(), AT_REMOVEDIR);  // only if no other run uses it
  m.closed = true;
}

DiskProbe probe_disk(const std::string& dir, int64_t bytes, const std::string& engine) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) throw NvmeError("--probe-disk: " + dir + " is not a folder");
  std::string sub = path_in(dir, "nnstrain-probe-XXXXXX");  // a fresh name: nothing planted at it is followed
  if (!::mkdtemp(sub.data())) throw NvmeError("--probe-disk: cannot create a folder in " + dir + ": " + std::strerror(errno));
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
        const int fd = ::open(store.path(f).c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
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
