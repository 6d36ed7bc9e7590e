#include "trainer/dist/progress_board.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace nnstrain::dist {

namespace {

constexpr const char* kBoardName = "nnstrain-progress";
constexpr int kBoardSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

// The worker's slot in the launcher's board, mapped on first use (null: none).
// The variable may have been inherited by a process the launcher did not start
// (a worker's own child, a shell), whose descriptor 4 is then anything: mapped
// only when it is the launcher's sealed board.
std::atomic<int64_t>* worker_slot() {
  static std::atomic<int64_t>* slot = []() -> std::atomic<int64_t>* {
    const char* fd_text = std::getenv(kProgressFdVar);
    const char* local = std::getenv("LOCAL_RANK");
    if (!fd_text || !local) return nullptr;
    char* end = nullptr;
    const long fd = std::strtol(fd_text, &end, 10), index = std::strtol(local, nullptr, 10);
    if (end == fd_text || *end || fd < 0 || fd > 1 << 20 || index < 0) return nullptr;
    if (!is_progress_board(static_cast<int>(fd))) return nullptr;
    struct stat st {};
    if (fstat(static_cast<int>(fd), &st) != 0 ||
        st.st_size < static_cast<off_t>((index + 1) * static_cast<long>(sizeof(int64_t))))
      return nullptr;
    void* p = mmap(nullptr, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, static_cast<int>(fd), 0);
    close(static_cast<int>(fd));  // ours: the mapping stays
    if (p == MAP_FAILED) return nullptr;
    return reinterpret_cast<std::atomic<int64_t>*>(p) + index;
  }();
  return slot;
}

}  // namespace

bool is_progress_board(int fd) {
  // Only a memfd takes seals, and only the launcher seals its board so.
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & kBoardSeals) != kBoardSeals) return false;
  char link[128] = {};
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = readlink(path.c_str(), link, sizeof link - 1);
  return n > 0 && std::string(link, static_cast<size_t>(n)).rfind(std::string("/memfd:") + kBoardName, 0) == 0;
}

void publish_step(int64_t step) {
  if (auto* s = worker_slot()) s->store(step, std::memory_order_relaxed);
}

ProgressBoard::ProgressBoard(int slots) : slots_(slots) {
  fd_ = memfd_create(kBoardName, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  const size_t bytes = sizeof(int64_t) * static_cast<size_t>(slots);
  if (fd_ < 0 || ftruncate(fd_, static_cast<off_t>(bytes)) != 0 || fcntl(fd_, F_ADD_SEALS, kBoardSeals) != 0)
    throw std::runtime_error(std::string("progress board: ") + std::strerror(errno));
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) throw std::runtime_error(std::string("progress board: mmap: ") + std::strerror(errno));
  map_ = static_cast<volatile int64_t*>(p);
  clear();
}

ProgressBoard::~ProgressBoard() {
  if (map_) munmap(const_cast<int64_t*>(map_), sizeof(int64_t) * static_cast<size_t>(slots_));
  if (fd_ >= 0) close(fd_);
}

void ProgressBoard::clear() {
  for (int i = 0; i < slots_; ++i) map_[i] = 0;
}

int64_t ProgressBoard::step(int slot) const { return slot >= 0 && slot < slots_ ? map_[slot] : 0; }

}  // namespace nnstrain::dist
