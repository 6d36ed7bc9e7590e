#include "data/token_bin.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <stdexcept>

#include <torch/torch.h>

#include "base/config/arg_map.h"
#include "data/splitmix.h"

namespace nnstrain::data {

struct TokenFile::Impl {
  std::string path, dtype;
  int elem = 2;  // bytes per token
  int64_t tokens = 0;
  const uint8_t* base = nullptr;
  size_t bytes = 0;
  mutable std::once_flag max_once;
  mutable int64_t max_token = -1;

  ~Impl() {
    if (base != nullptr) ::munmap(const_cast<uint8_t*>(base), bytes);
  }
};

TokenFile::TokenFile(const std::string& path, const std::string& dtype) : impl_(std::make_shared<Impl>()) {
  Impl& m = *impl_;
  m.path = path;
  m.dtype = dtype;
  if (dtype == "uint16") m.elem = 2;
  else if (dtype == "uint32") m.elem = 4;
  else throw std::runtime_error("token file '" + path + "': dtype must be uint16 or uint32, got '" + dtype + "'");

  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("token file '" + path + "': cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    throw std::runtime_error("token file '" + path + "': cannot stat: " + std::strerror(e));
  }
  m.bytes = size_t(st.st_size);
  if (m.bytes % size_t(m.elem) != 0) {
    ::close(fd);
    throw std::runtime_error("token file '" + path + "': size " + std::to_string(m.bytes) +
                             " bytes is not a multiple of " + std::to_string(m.elem) + " (dtype " + dtype +
                             "; is the dtype right?)");
  }
  m.tokens = int64_t(m.bytes / size_t(m.elem));
  if (m.bytes > 0) {
    void* p = ::mmap(nullptr, m.bytes, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      throw std::runtime_error("token file '" + path + "': mmap failed: " + std::strerror(e));
    }
    m.base = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // the mapping stays valid
}

const std::string& TokenFile::path() const { return impl_->path; }
const std::string& TokenFile::dtype() const { return impl_->dtype; }
int64_t TokenFile::size() const { return impl_->tokens; }

void TokenFile::read(int64_t start, int64_t n, int64_t* out) const {
  const Impl& m = *impl_;
  if (start < 0 || n < 0 || start > m.tokens - n)
    throw std::out_of_range("token file '" + m.path + "': tokens [" + std::to_string(start) + ", " +
                            std::to_string(start + n) + ") out of range (file has " + std::to_string(m.tokens) +
                            ")");
  // Assembled byte by byte: little endian whatever the host is (compiles to plain loads on x86/ARM).
  if (m.elem == 2) {
    const uint8_t* p = m.base + size_t(start) * 2;
    for (int64_t i = 0; i < n; ++i, p += 2) out[i] = int64_t(uint16_t(p[0] | (uint16_t(p[1]) << 8)));
  } else {
    const uint8_t* p = m.base + size_t(start) * 4;
    for (int64_t i = 0; i < n; ++i, p += 4)
      out[i] = int64_t(uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24));
  }
}

int64_t TokenFile::max_token() const {
  const Impl& m = *impl_;
  std::call_once(m.max_once, [&] {
    int64_t mx = -1;
    std::vector<int64_t> buf(1 << 16);
    for (int64_t s = 0; s < m.tokens; s += int64_t(buf.size())) {
      const int64_t n = std::min<int64_t>(int64_t(buf.size()), m.tokens - s);
      read(s, n, buf.data());
      for (int64_t i = 0; i < n; ++i) mx = std::max(mx, buf[size_t(i)]);
    }
    m.max_token = mx;
  });
  return m.max_token;
}

void check_token_ids(const TokenFile& file, int64_t vocab_size, const std::string& key) {
  const int64_t mx = file.max_token();
  if (mx >= vocab_size)
    throw config::ConfigError(key + ": token file '" + file.path() + "' holds token id " + std::to_string(mx) +
                              ", but the model's vocabulary has " + std::to_string(vocab_size) + " ids (0.." +
                              std::to_string(vocab_size - 1) + "); model.args' vocab_size or the data is wrong");
}

TokenBinDataset::TokenBinDataset(const config::TokenBinArgs& args, uint64_t seed)
    : file_(args.path, args.dtype), seq_len_(args.seq_len), seed_(seed) {
  if (seq_len_ <= 0)
    throw std::invalid_argument("token_bin '" + args.path + "': seq_len must be positive, got " +
                                std::to_string(seq_len_));
  if (file_.size() < seq_len_ + 1)
    throw std::runtime_error("token file '" + args.path + "' holds " + std::to_string(file_.size()) +
                             " tokens, too few for one sample of seq_len " + std::to_string(seq_len_) +
                             " (needs seq_len + 1 = " + std::to_string(seq_len_ + 1) + ")");
}

int64_t TokenBinDataset::samples_per_epoch() const { return (num_tokens() - 1) / seq_len_; }

int64_t TokenBinDataset::window_start(int64_t step, int64_t pos) const {
  if (step < 0 || pos < 0)
    throw std::out_of_range("token_bin '" + file_.path() + "': negative step " + std::to_string(step) +
                            " or position " + std::to_string(pos));
  const uint64_t h = splitmix64(splitmix64(splitmix64(seed_) ^ uint64_t(step)) ^ uint64_t(pos));
  return int64_t(h % uint64_t(num_tokens() - seq_len_));
}

int64_t TokenBinDataset::val_window(int64_t k, int64_t pos) const {
  if (k < 0 || pos < 0)
    throw std::out_of_range("token_bin '" + file_.path() + "': negative validation batch " + std::to_string(k) +
                            " or position " + std::to_string(pos));
  const uint64_t windows = uint64_t(samples_per_epoch());
  const uint64_t first = van_der_corput_index(uint64_t(k), windows);
  return int64_t((first + uint64_t(pos) % windows) % windows);
}

Batch TokenBinDataset::gather(const std::vector<int64_t>& starts) const {
  const int64_t B = int64_t(starts.size()), T = seq_len_;
  auto x = torch::empty({B, T}, torch::kInt64);
  auto y = torch::empty({B, T}, torch::kInt64);
  int64_t* px = x.data_ptr<int64_t>();
  int64_t* py = y.data_ptr<int64_t>();
  std::vector<int64_t> buf(size_t(T + 1));
  for (int64_t b = 0; b < B; ++b) {
    file_.read(starts[size_t(b)], T + 1, buf.data());
    std::memcpy(px + b * T, buf.data(), size_t(T) * sizeof(int64_t));
    std::memcpy(py + b * T, buf.data() + 1, size_t(T) * sizeof(int64_t));
  }
  return {x, y};
}

Batch TokenBinDataset::train_batch(int64_t step, int64_t first, int64_t count) const {
  if (first < 0 || count < 0)
    throw std::out_of_range("token_bin '" + file_.path() + "': bad batch slice first=" + std::to_string(first) +
                            " count=" + std::to_string(count));
  std::vector<int64_t> starts(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) starts[size_t(i)] = window_start(step, first + i);
  return gather(starts);
}

Batch TokenBinDataset::val_batch(int64_t k, int64_t first, int64_t count) const {
  if (first < 0 || count < 0)
    throw std::out_of_range("token_bin '" + file_.path() + "': bad batch slice first=" + std::to_string(first) +
                            " count=" + std::to_string(count));
  std::vector<int64_t> starts(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) starts[size_t(i)] = val_window(k, first + i) * seq_len_;
  return gather(starts);
}

}  // namespace nnstrain::data
