#include "data/indexed/indexed_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <stdexcept>

namespace nnstrain::indexed {

namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
constexpr size_t kHeader = 9 + 8 + 1 + 8 + 8;

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw std::runtime_error("cannot open '" + path + "' to sync it");
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw std::runtime_error("cannot sync '" + path + "'");
}

size_t dtype_size(DType d) { return d == DType::uint16 ? 2 : 4; }

}  // namespace

DType dtype_for_vocab(int64_t vocab_size) { return vocab_size < 65500 ? DType::uint16 : DType::int32; }
const char* dtype_name(DType d) { return d == DType::uint16 ? "uint16" : "int32"; }

// ---------------------------------------------------------------- Writer

Writer::Writer(std::string prefix, DType dtype) : prefix_(std::move(prefix)), dtype_(dtype) {
  bin_.open(prefix_ + ".bin.tmp", std::ios::binary | std::ios::trunc);
  if (!bin_) throw std::runtime_error("cannot write '" + prefix_ + ".bin.tmp'");
}

Writer::~Writer() {
  if (committed_) return;
  bin_.close();
  std::error_code ec;
  std::filesystem::remove(prefix_ + ".bin.tmp", ec);
  std::filesystem::remove(prefix_ + ".idx.tmp", ec);
}

void Writer::add_document(const std::vector<const std::vector<int32_t>*>& sequences) {
  const size_t sz = dtype_size(dtype_);
  for (const auto* seq : sequences)
    if (seq->size() > static_cast<size_t>(INT32_MAX))
      throw IndexLimitError("a sequence of " + std::to_string(seq->size()) + " tokens: the .idx format stores a "
                            "sequence's length as int32 (at most 2147483647 tokens); split the text into documents");
  constexpr size_t kChunk = 1 << 20;  // tokens converted per write: no second copy of a long document
  for (const auto* seq : sequences) {
    for (size_t from = 0; from < seq->size(); from += kChunk) {
      const size_t n = std::min(kChunk, seq->size() - from);
      buf_.resize(n * sz);
      for (size_t i = 0; i < n; ++i) {
        const int32_t id = (*seq)[from + i];
        if (id < 0 || (dtype_ == DType::uint16 && id > 0xFFFF))
          throw std::runtime_error("token id " + std::to_string(id) + " does not fit " + dtype_name(dtype_));
        if (dtype_ == DType::uint16) {
          const uint16_t v = static_cast<uint16_t>(id);
          std::memcpy(buf_.data() + 2 * i, &v, 2);  // little-endian hosts only (x86, ARM)
        } else {
          std::memcpy(buf_.data() + 4 * i, &id, 4);
        }
      }
      bin_.write(buf_.data(), static_cast<std::streamsize>(buf_.size()));
    }
    lengths_.push_back(static_cast<int32_t>(seq->size()));
    tokens_ += static_cast<int64_t>(seq->size());
  }
  doc_index_.push_back(static_cast<int64_t>(lengths_.size()));
  if (!bin_) throw std::runtime_error("cannot write '" + prefix_ + ".bin.tmp'");
}

void Writer::commit() {
  bin_.close();
  if (!bin_) throw std::runtime_error("cannot write '" + prefix_ + ".bin.tmp'");
  {
    std::ofstream idx(prefix_ + ".idx.tmp", std::ios::binary | std::ios::trunc);
    const uint64_t version = 1, seqs = lengths_.size(), docs = doc_index_.size();
    const uint8_t code = static_cast<uint8_t>(dtype_);
    idx.write(kMagic, 9);
    idx.write(reinterpret_cast<const char*>(&version), 8);
    idx.write(reinterpret_cast<const char*>(&code), 1);
    idx.write(reinterpret_cast<const char*>(&seqs), 8);
    idx.write(reinterpret_cast<const char*>(&docs), 8);
    idx.write(reinterpret_cast<const char*>(lengths_.data()), lengths_.size() * 4);
    int64_t ptr = 0;
    std::vector<int64_t> ptrs;
    ptrs.reserve(lengths_.size());
    for (int32_t len : lengths_) {
      ptrs.push_back(ptr);
      ptr += static_cast<int64_t>(len) * static_cast<int64_t>(dtype_size(dtype_));
    }
    idx.write(reinterpret_cast<const char*>(ptrs.data()), ptrs.size() * 8);
    idx.write(reinterpret_cast<const char*>(doc_index_.data()), doc_index_.size() * 8);
    if (!idx) throw std::runtime_error("cannot write '" + prefix_ + ".idx.tmp'");
  }
  fsync_path(prefix_ + ".bin.tmp");
  fsync_path(prefix_ + ".idx.tmp");
  std::filesystem::rename(prefix_ + ".bin.tmp", prefix_ + ".bin");
  std::filesystem::rename(prefix_ + ".idx.tmp", prefix_ + ".idx");
  committed_ = true;
}

// ---------------------------------------------------------------- Reader

// The index arrays start at byte 34 of the mapping (after the header), so they are
// not aligned for their types: each element is read with memcpy, never through an
// int32_t* or int64_t* (undefined behaviour, and a fault on some CPUs once vectorised).
namespace {
template <class T>
T load_unaligned(const unsigned char* array, int64_t i) {
  T v;
  std::memcpy(&v, array + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
  return v;
}
}  // namespace

struct Reader::Impl {
  std::string prefix;
  DType dtype = DType::uint16;
  int64_t seqs = 0, docs = 0, tokens = 0;
  const unsigned char* lengths = nullptr;    // int32[seqs]
  const unsigned char* pointers = nullptr;   // int64[seqs]
  const unsigned char* doc_index = nullptr;  // int64[docs + 1]
  int32_t length(int64_t s) const { return load_unaligned<int32_t>(lengths, s); }
  int64_t pointer(int64_t s) const { return load_unaligned<int64_t>(pointers, s); }
  int64_t doc(int64_t d) const { return load_unaligned<int64_t>(doc_index, d); }
  void* idx_map = nullptr;
  size_t idx_size = 0;
  void* bin_map = nullptr;
  size_t bin_size = 0;
  mutable std::once_flag max_once;
  mutable int64_t max_token = -1;
  ~Impl() {
    if (idx_map) ::munmap(idx_map, idx_size);
    if (bin_map && bin_size) ::munmap(bin_map, bin_size);
  }
};

namespace {

void* map_file(const std::string& path, size_t& size) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw std::runtime_error("indexed dataset: cannot open '" + path + "'");
  struct stat st{};
  ::fstat(fd, &st);
  size = static_cast<size_t>(st.st_size);
  void* p = nullptr;
  if (size) {
    p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      throw std::runtime_error("indexed dataset: cannot map '" + path + "'");
    }
  }
  ::close(fd);
  return p;
}

}  // namespace

Reader::Reader(const std::string& prefix) : impl_(std::make_shared<Impl>()) {
  Impl& r = *impl_;
  r.prefix = prefix;
  const std::string idx = prefix + ".idx", bin = prefix + ".bin";
  auto bad = [&](const std::string& what) { throw std::runtime_error("indexed dataset '" + idx + "': " + what); };
  r.idx_map = map_file(idx, r.idx_size);
  const auto* p = static_cast<const unsigned char*>(r.idx_map);
  if (r.idx_size < kHeader || std::memcmp(p, kMagic, 9) != 0) bad("not a Megatron index (no MMIDIDX header)");
  uint64_t version, seqs, docs;
  std::memcpy(&version, p + 9, 8);
  const uint8_t code = p[17];
  std::memcpy(&seqs, p + 18, 8);
  std::memcpy(&docs, p + 26, 8);
  if (version != 1) bad("version " + std::to_string(version) + " (only 1 is known)");
  if (code != 4 && code != 8) bad("dtype code " + std::to_string(code) + " (token files are uint16 (8) or int32 (4))");
  r.dtype = static_cast<DType>(code);
  if (seqs > (r.idx_size / 12) || docs == 0 || docs > r.idx_size / 8 ||
      kHeader + seqs * 12 + docs * 8 > r.idx_size)
    bad("counts do not fit the file (" + std::to_string(seqs) + " sequences, " + std::to_string(docs) + " indices)");
  // Megatron writes sequence modes after the document indices only for multimodal data.
  if (kHeader + seqs * 12 + docs * 8 != r.idx_size) bad("file size does not match its counts (multimodal indices are not supported)");
  r.seqs = static_cast<int64_t>(seqs);
  r.docs = static_cast<int64_t>(docs) - 1;
  r.lengths = p + kHeader;
  r.pointers = p + kHeader + seqs * 4;
  r.doc_index = p + kHeader + seqs * 12;
  r.bin_map = map_file(bin, r.bin_size);
  const int64_t item = static_cast<int64_t>(dtype_size(r.dtype));
  int64_t expect = 0;
  for (int64_t s = 0; s < r.seqs; ++s) {
    const int32_t len = r.length(s);
    if (len < 0) bad("sequence " + std::to_string(s) + " has a negative length");
    if (r.pointer(s) != expect) bad("sequence " + std::to_string(s) + " does not start where the previous ends");
    expect += len * item;
  }
  if (expect != static_cast<int64_t>(r.bin_size))
    throw std::runtime_error("indexed dataset '" + bin + "': " + std::to_string(r.bin_size) + " bytes, its index says " +
                             std::to_string(expect));
  r.tokens = expect / item;
  if (r.doc(0) != 0 || r.doc(r.docs) != r.seqs) bad("document indices do not span the sequences");
  for (int64_t d = 0; d < r.docs; ++d)
    if (r.doc(d + 1) < r.doc(d)) bad("document indices are not increasing");
}

const std::string& Reader::prefix() const { return impl_->prefix; }
DType Reader::dtype() const { return impl_->dtype; }
int64_t Reader::sequences() const { return impl_->seqs; }
int64_t Reader::documents() const { return impl_->docs; }
int64_t Reader::tokens() const { return impl_->tokens; }
int64_t Reader::doc_begin(int64_t d) const { return impl_->doc(d); }
int32_t Reader::seq_length(int64_t s) const { return impl_->length(s); }
int64_t Reader::seq_offset(int64_t s) const {
  return impl_->pointer(s) / static_cast<int64_t>(dtype_size(impl_->dtype));
}

void Reader::read(int64_t start, int64_t n, int64_t* out) const {
  const Impl& r = *impl_;
  if (start < 0 || n < 0 || start + n > r.tokens)
    throw std::runtime_error("indexed dataset '" + r.prefix + ".bin': read of tokens [" + std::to_string(start) + ", " +
                             std::to_string(start + n) + ") past its " + std::to_string(r.tokens));
  if (r.dtype == DType::uint16) {
    const auto* p = static_cast<const uint16_t*>(r.bin_map) + start;
    for (int64_t i = 0; i < n; ++i) out[i] = p[i];
  } else {
    const auto* p = static_cast<const int32_t*>(r.bin_map) + start;
    for (int64_t i = 0; i < n; ++i) out[i] = p[i];
  }
}

int64_t Reader::max_token() const {
  const Impl& r = *impl_;
  std::call_once(r.max_once, [&] {
    int64_t m = -1;
    if (r.dtype == DType::uint16) {
      const auto* p = static_cast<const uint16_t*>(r.bin_map);
      for (int64_t i = 0; i < r.tokens; ++i) m = std::max<int64_t>(m, p[i]);
    } else {
      const auto* p = static_cast<const int32_t*>(r.bin_map);
      for (int64_t i = 0; i < r.tokens; ++i) {
        if (p[i] < 0) throw std::runtime_error("indexed dataset '" + r.prefix + ".bin' holds a negative token id");
        m = std::max<int64_t>(m, p[i]);
      }
    }
    r.max_token = m;
  });
  return r.max_token;
}

}  // namespace nnstrain::indexed
