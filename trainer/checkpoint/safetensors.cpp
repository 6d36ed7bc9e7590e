#include "trainer/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_set>
#include <utility>

#include "base/text.h"

// Tensor bytes are copied as they lie in the file, which is little-endian.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors I/O assumes a little-endian host");

namespace nnstrain::checkpoint {
namespace {

using ojson = nlohmann::ordered_json;  // keeps header order, so ties sort stably

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the reference implementation's limit
constexpr size_t kWriteBuffer = size_t{8} << 20;
// Writeback in the background while writing: every kWritebackChunk bytes the kernel
// is told to start writing them to disk, so finish()'s fsync finds little left
// (dirty pages otherwise sit in the page cache until the fsync, below the kernel's
// background threshold, and the disk idles while we copy). Ranges kWritebackLag
// chunks back are waited for and dropped from the page cache, so a checkpoint
// neither piles up dirty memory nor evicts the training's pages.
constexpr uint64_t kWritebackChunk = uint64_t{32} << 20;
constexpr uint64_t kWritebackLag = 4;
const char* const kMetadataKey = "__metadata__";

struct DTypeRow {
  DType dtype;
  const char* name;
  size_t size;
};
constexpr DTypeRow kDTypes[] = {
    {DType::F64, "F64", 8}, {DType::F32, "F32", 4}, {DType::F16, "F16", 2},
    {DType::BF16, "BF16", 2}, {DType::I64, "I64", 8}, {DType::I32, "I32", 4},
    {DType::I16, "I16", 2}, {DType::I8, "I8", 1}, {DType::U8, "U8", 1},
    {DType::BOOL, "BOOL", 1}, {DType::U16, "U16", 2}, {DType::U32, "U32", 4},
    {DType::U64, "U64", 8},
};

const DTypeRow& row(DType dtype) {
  for (const auto& r : kDTypes)
    if (r.dtype == dtype) return r;
  throw std::invalid_argument("invalid nnstrain::checkpoint::DType value " +
                              std::to_string(static_cast<int>(dtype)));
}

std::string errno_text() { return std::strerror(errno); }

std::string shape_text(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

// Bytes of a tensor, or nullopt if the product does not fit in 64 bits.
std::optional<uint64_t> checked_nbytes(const std::vector<int64_t>& shape, DType dtype) {
  uint64_t n = dtype_size(dtype);
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return std::nullopt;
  }
  return n;
}

// Returns the offset of the first byte that breaks UTF-8, or npos.
size_t invalid_utf8_at(const uint8_t* s, size_t n) {
  size_t i = 0;
  while (i < n) {
    uint8_t c = s[i];
    size_t len;
    uint32_t cp;
    if (c < 0x80) { ++i; continue; }
    if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; }
    else return i;
    if (i + len > n) return i;
    for (size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    // Overlong forms, surrogates and code points past U+10FFFF are not UTF-8.
    static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::string::npos;
}

std::string json_kind(const ojson& j) {
  if (j.is_number_float()) return "a float";
  if (j.is_number_integer()) return "an integer";
  return std::string("a ") + j.type_name();
}

}  // namespace

size_t dtype_size(DType dtype) { return row(dtype).size; }
const char* dtype_name(DType dtype) { return row(dtype).name; }

std::optional<DType> parse_dtype(const std::string& name) {
  for (const auto& r : kDTypes)
    if (name == r.name) return r.dtype;
  return std::nullopt;
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

uint64_t TensorInfo::nbytes() const { return static_cast<uint64_t>(numel()) * dtype_size(dtype); }

// ------------------------------------------------------------------ reader ----

SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open: " + errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    std::string err = errno_text();
    ::close(fd);
    fail("cannot stat: " + err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("not a regular file");
  }
  map_size_ = static_cast<size_t>(st.st_size);
  if (map_size_ < 8) {
    ::close(fd);
    fail("file is " + std::to_string(map_size_) +
         " bytes, shorter than 8 bytes: too short for the header length");
  }
  // The mapping stays valid after close. A file truncated by someone else while
  // mapped would raise SIGBUS on access; checkpoints are immutable once published.
  void* p = ::mmap(nullptr, map_size_, PROT_READ, MAP_PRIVATE, fd, 0);
  std::string err = errno_text();
  ::close(fd);
  if (p == MAP_FAILED) {
    map_size_ = 0;
    fail("cannot mmap: " + err);
  }
  map_ = static_cast<uint8_t*>(p);
  try {
    validate();
  } catch (...) {
    ::munmap(map_, map_size_);
    map_ = nullptr;
    throw;
  }
}

SafetensorsReader::~SafetensorsReader() {
  if (map_) ::munmap(map_, map_size_);
}

SafetensorsReader::SafetensorsReader(SafetensorsReader&& other) noexcept
    : path_(std::move(other.path_)),
      tensors_(std::move(other.tensors_)),
      index_(std::move(other.index_)),
      metadata_(std::move(other.metadata_)),
      map_(std::exchange(other.map_, nullptr)),
      map_size_(std::exchange(other.map_size_, 0)),
      data_start_(other.data_start_) {}

SafetensorsReader& SafetensorsReader::operator=(SafetensorsReader&& other) noexcept {
  if (this != &other) {
    if (map_) ::munmap(map_, map_size_);
    path_ = std::move(other.path_);
    tensors_ = std::move(other.tensors_);
    index_ = std::move(other.index_);
    metadata_ = std::move(other.metadata_);
    map_ = std::exchange(other.map_, nullptr);
    map_size_ = std::exchange(other.map_size_, 0);
    data_start_ = other.data_start_;
  }
  return *this;
}

void SafetensorsReader::fail(const std::string& fault) const {
  throw SafetensorsError("safetensors file '" + path_ + "': " + fault);
}

void SafetensorsReader::validate() {
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | map_[i];
  const uint64_t room = map_size_ - 8;
  if (header_len > room)
    fail("header length " + std::to_string(header_len) + " exceeds the file (" +
         std::to_string(room) + " bytes follow the length field)");
  if (header_len > kMaxHeaderBytes)
    fail("header length " + std::to_string(header_len) + " is over the " +
         std::to_string(kMaxHeaderBytes) + "-byte limit");
  data_start_ = 8 + header_len;
  const uint64_t data_size = map_size_ - data_start_;
  const uint8_t* hbegin = map_ + 8;
  const uint8_t* hend = hbegin + header_len;

  size_t bad = invalid_utf8_at(hbegin, header_len);
  if (bad != std::string::npos)
    fail("header is not valid UTF-8 (byte " + std::to_string(bad) + " of the header)");

  // nlohmann keeps one of two equal keys silently, so duplicates are caught while
  // parsing. Each level remembers its keys and the key that led into it.
  struct Level {
    bool object;
    std::unordered_set<std::string> keys;
    std::string last_key;
  };
  std::vector<Level> stack;
  auto on_event = [&](int, ojson::parse_event_t event, ojson& parsed) -> bool {
    using E = ojson::parse_event_t;
    if (event == E::object_start || event == E::array_start) {
      // The deepest valid header is root -> tensor entry -> shape array.
      if (stack.size() >= 3) fail("header nests deeper than a safetensors header can");
      stack.push_back({event == E::object_start, {}, {}});
    } else if (event == E::object_end || event == E::array_end) {
      if (!stack.empty()) stack.pop_back();
    } else if (event == E::key && !stack.empty()) {
      Level& level = stack.back();
      std::string key = parsed.get<std::string>();
      if (!level.keys.insert(key).second) {
        if (stack.size() == 1) fail("duplicate tensor name " + util::quote_prefix(key) + " in the header");
        const std::string& owner = stack[stack.size() - 2].last_key;
        if (owner == kMetadataKey) fail("duplicate key " + util::quote_prefix(key) + " in __metadata__");
        fail("duplicate key " + util::quote_prefix(key) + " in the entry of tensor " + util::quote_prefix(owner));
      }
      level.last_key = std::move(key);
    }
    return true;
  };
  ojson header;
  try {
    header = ojson::parse(hbegin, hend, on_event);
  } catch (const ojson::exception& e) {
    fail(std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) fail("header is not a JSON object but " + json_kind(header));

  auto read_uint = [&](const ojson& j, uint64_t max, const std::string& what) -> uint64_t {
    if (!j.is_number_integer())
      fail(what + " must be a non-negative integer, not " + json_kind(j));
    if (j.is_number_unsigned()) {
      uint64_t v = j.get<uint64_t>();
      if (v > max) fail(what + " " + std::to_string(v) + " is too large");
      return v;
    }
    int64_t v = j.get<int64_t>();
    if (v < 0) fail(what + " must be non-negative, not " + std::to_string(v));
    return static_cast<uint64_t>(v);
  };

  for (const auto& [name, entry] : header.items()) {
    if (name == kMetadataKey) {
      if (!entry.is_object())
        fail("__metadata__ must be an object of strings, not " + json_kind(entry));
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string())
          fail("__metadata__ value of " + util::quote_prefix(key) + " must be a string, not " + json_kind(value));
        metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor " + util::quote_prefix(name);
    if (!entry.is_object()) fail(where + " must be an object, not " + json_kind(entry));
    for (const auto& [key, value] : entry.items()) {
      (void)value;
      if (key != "dtype" && key != "shape" && key != "data_offsets")
        fail(where + " has unexpected key " + util::quote_prefix(key));
    }
    for (const char* key : {"dtype", "shape", "data_offsets"})
      if (!entry.contains(key)) fail(where + " lacks " + util::quote_prefix(key));

    TensorInfo info;
    info.name = name;
    const ojson& dtype = entry["dtype"];
    if (!dtype.is_string()) fail(where + " dtype must be a string, not " + json_kind(dtype));
    auto parsed = parse_dtype(dtype.get<std::string>());
    if (!parsed) fail(where + " has unknown dtype " + util::quote_prefix(dtype.get<std::string>()));
    info.dtype = *parsed;

    const ojson& shape = entry["shape"];
    if (!shape.is_array()) fail(where + " shape must be an array, not " + json_kind(shape));
    for (const auto& d : shape)
      info.shape.push_back(static_cast<int64_t>(read_uint(
          d, static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), where + " shape entry")));

    const ojson& offsets = entry["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2)
      fail(where + " data_offsets must be an array [begin, end]");
    info.begin = read_uint(offsets[0], std::numeric_limits<uint64_t>::max(), where + " data_offsets begin");
    info.end = read_uint(offsets[1], std::numeric_limits<uint64_t>::max(), where + " data_offsets end");
    const std::string span = "data_offsets [" + std::to_string(info.begin) + ", " +
                             std::to_string(info.end) + "]";
    if (info.end < info.begin) fail(where + " " + span + " end before they begin");
    auto need = checked_nbytes(info.shape, info.dtype);
    if (!need || *need != info.end - info.begin)
      fail(where + " size mismatch: " + span + " span " + std::to_string(info.end - info.begin) +
           " bytes but shape " + shape_text(info.shape) + " of " + dtype_name(info.dtype) +
           " needs " + (need ? std::to_string(*need) : std::string("more than 2^64")));
    if (info.begin > data_size)
      fail(where + " " + span + " are out of bounds: the data section holds " +
           std::to_string(data_size) + " bytes");
    tensors_.push_back(std::move(info));
  }

  // Sorted by position, the tensors must tile the data section exactly.
  std::stable_sort(tensors_.begin(), tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expected = 0;
  const TensorInfo* prev = nullptr;
  for (const TensorInfo& t : tensors_) {
    if (t.begin < expected)
      fail("tensors " + util::quote_prefix(prev->name) + " and " + util::quote_prefix(t.name) + " overlap: " + util::quote_prefix(t.name) +
           " begins at " + std::to_string(t.begin) + " but " + util::quote_prefix(prev->name) + " ends at " +
           std::to_string(expected));
    if (t.begin > expected)
      fail("hole in the data section: bytes [" + std::to_string(expected) + ", " +
           std::to_string(t.begin) + ") before tensor " + util::quote_prefix(t.name) + " belong to no tensor");
    expected = t.end;
    prev = &t;
  }
  if (expected < data_size)
    fail(std::to_string(data_size - expected) + " trailing bytes after the last tensor (data "
         "section holds " + std::to_string(data_size) + " bytes, tensors cover " +
         std::to_string(expected) + ")");
  if (expected > data_size)
    fail("file is truncated: the header describes " + std::to_string(expected) +
         " data bytes but only " + std::to_string(data_size) + " follow the header");

  for (size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
}

const TensorInfo* SafetensorsReader::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& SafetensorsReader::at(const std::string& name) const {
  const TensorInfo* info = find(name);
  if (!info) fail("has no tensor " + util::quote_prefix(name));
  return *info;
}

const uint8_t* SafetensorsReader::data(const TensorInfo& info) const {
  return map_ + data_start_ + info.begin;
}

void SafetensorsReader::check_slice(const TensorInfo& info, const std::vector<int64_t>& offsets,
                                    const std::vector<int64_t>& sizes) const {
  const size_t rank = info.shape.size();
  const std::string where = "slice of tensor '" + info.name + "' " + shape_text(info.shape);
  if (offsets.size() != rank || sizes.size() != rank)
    fail(where + ": offsets " + shape_text(offsets) + " and sizes " + shape_text(sizes) +
         " must have one entry per dim");
  for (size_t d = 0; d < rank; ++d)
    if (offsets[d] < 0 || sizes[d] < 0 || sizes[d] > info.shape[d] - offsets[d])
      fail(where + ": block at offsets " + shape_text(offsets) + " of sizes " +
           shape_text(sizes) + " is out of range in dim " + std::to_string(d));
}

void SafetensorsReader::read_slice(const TensorInfo& info, const std::vector<int64_t>& offsets,
                                   const std::vector<int64_t>& sizes, void* dst) const {
  check_slice(info, offsets, sizes);
  const size_t rank = info.shape.size();
  const size_t es = dtype_size(info.dtype);
  const uint8_t* src = data(info);
  auto* out = static_cast<uint8_t*>(dst);
  for (int64_t s : sizes)
    if (s == 0) return;
  if (rank == 0) {
    std::memcpy(out, src, es);
    return;
  }
  // Row-major element strides of the stored tensor.
  std::vector<uint64_t> stride(rank, 1);
  for (size_t d = rank - 1; d > 0; --d) stride[d - 1] = stride[d] * info.shape[d];
  // Trailing dims taken whole merge into one contiguous run starting at dim k.
  size_t k = rank - 1;
  while (k > 0 && offsets[k] == 0 && sizes[k] == info.shape[k]) --k;
  const size_t run = static_cast<size_t>(sizes[k]) * stride[k] * es;
  std::vector<int64_t> idx(k, 0);  // odometer over dims before k
  while (true) {
    uint64_t elem = static_cast<uint64_t>(offsets[k]) * stride[k];
    for (size_t d = 0; d < k; ++d) elem += static_cast<uint64_t>(offsets[d] + idx[d]) * stride[d];
    std::memcpy(out, src + elem * es, run);
    out += run;
    size_t d = k;
    while (d > 0) {
      --d;
      if (++idx[d] < sizes[d]) break;
      idx[d] = 0;
      if (d == 0) return;
    }
    if (k == 0) return;
  }
}

// ------------------------------------------------------------------ writer ----

SafetensorsWriter::SafetensorsWriter(std::string path, std::map<std::string, std::string> metadata)
    : path_(std::move(path)), metadata_(std::move(metadata)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("cannot create: " + errno_text());
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!finished_) ::unlink(path_.c_str());
}

void SafetensorsWriter::fail(const std::string& fault) {
  throw SafetensorsError("safetensors file '" + path_ + "': " + fault);
}

std::string SafetensorsWriter::current_tensor() const {
  for (const TensorInfo& t : declared_)
    if (written_ < t.end) return "'" + t.name + "'";
  return "(none)";
}

void SafetensorsWriter::declare(const std::string& name, DType dtype,
                                const std::vector<int64_t>& shape) {
  if (failed_ || finished_ || header_written_)
    fail("declare('" + name + "') after the header was fixed: declare every tensor first");
  if (name == kMetadataKey) fail("'__metadata__' cannot name a tensor");
  if (index_.count(name)) fail("tensor '" + name + "' declared twice");
  auto nbytes = checked_nbytes(shape, dtype);
  if (!nbytes)
    fail("tensor '" + name + "' has an invalid shape " + shape_text(shape) + " for " +
         dtype_name(dtype));
  if (*nbytes > std::numeric_limits<uint64_t>::max() - total_)
    fail("tensor '" + name + "' pushes the file past 2^64 bytes");
  TensorInfo info{name, dtype, shape, total_, total_ + *nbytes};
  total_ = info.end;
  index_.emplace(name, declared_.size());
  declared_.push_back(std::move(info));
}

void SafetensorsWriter::write_header() {
  ojson header = ojson::object();
  if (!metadata_.empty()) {
    ojson meta = ojson::object();
    for (const auto& [k, v] : metadata_) meta[k] = v;
    header[kMetadataKey] = std::move(meta);
  }
  for (const TensorInfo& t : declared_)
    header[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape},
                      {"data_offsets", {t.begin, t.end}}};
  std::string text;
  try {
    text = header.dump();  // strict: names and metadata must be valid UTF-8
  } catch (const ojson::exception& e) {
    failed_ = true;
    fail(std::string("cannot encode the header: ") + e.what());
  }
  // Pad with spaces so the data section starts 8-byte aligned, as the reference does.
  text.append((8 - text.size() % 8) % 8, ' ');
  header_written_ = true;

  capacity_ = static_cast<size_t>(std::min<uint64_t>(kWriteBuffer, 8 + text.size() + total_));
  buffer_.reset(new uint8_t[capacity_]);
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(uint64_t(text.size()) >> (8 * i));
  write_all(len, 8);
  write_all(reinterpret_cast<const uint8_t*>(text.data()), text.size());
}

// Writes through the buffer when it has room, else flushes and writes directly.
void SafetensorsWriter::write_all(const uint8_t* bytes, size_t n) {
  if (n <= capacity_ - buffered_) {
    std::memcpy(buffer_.get() + buffered_, bytes, n);
    buffered_ += n;
    return;
  }
  flush_buffer();
  if (n < capacity_) {
    std::memcpy(buffer_.get(), bytes, n);
    buffered_ = n;
    return;
  }
  while (n > 0) {
    // In chunks, so that writeback starts during a large tensor too.
    ssize_t w = ::write(fd_, bytes, std::min<size_t>(n, kWritebackChunk));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      failed_ = true;
      fail("write failed: " + (w < 0 ? errno_text() : std::string("no progress")));
    }
    bytes += w;
    n -= static_cast<size_t>(w);
    offset_ += static_cast<uint64_t>(w);
    start_writeback();
  }
}

void SafetensorsWriter::start_writeback() {
#ifdef SYNC_FILE_RANGE_WRITE
  if (!writeback_ || offset_ - started_ < kWritebackChunk) return;
  const uint64_t end = offset_ - offset_ % kWritebackChunk;
  // Errors are real I/O errors (or "not supported": then fsync alone, as before). They
  // must not be ignored: a waiting sync_file_range consumes the error fsync would report.
  auto range = [&](uint64_t from, uint64_t to, unsigned flags) {
    while (::sync_file_range(fd_, static_cast<off64_t>(from), static_cast<off64_t>(to - from), flags) != 0) {
      if (errno == EINTR) continue;
      if (errno == EINVAL || errno == ENOSYS || errno == ESPIPE) {
        writeback_ = false;
        return false;
      }
      failed_ = true;
      fail("writeback failed: " + errno_text());
    }
    return true;
  };
  if (!range(started_, end, SYNC_FILE_RANGE_WRITE)) return;
  started_ = end;
  if (end >= kWritebackLag * kWritebackChunk) {
    const uint64_t done = end - kWritebackLag * kWritebackChunk;
    if (done > dropped_) {
      if (!range(dropped_, done, SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER))
        return;
      // Written back (not yet durable: finish() fsyncs the file, which flushes the disk's cache).
      (void)::posix_fadvise(fd_, static_cast<off_t>(dropped_), static_cast<off_t>(done - dropped_),
                            POSIX_FADV_DONTNEED);
      dropped_ = done;
    }
  }
#endif
}

void SafetensorsWriter::flush_buffer() {
  const uint8_t* p = buffer_.get();
  size_t n = buffered_;
  while (n > 0) {
    ssize_t w = ::write(fd_, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      failed_ = true;
      fail("write failed: " + (w < 0 ? errno_text() : std::string("no progress")));
    }
    p += w;
    n -= static_cast<size_t>(w);
    offset_ += static_cast<uint64_t>(w);
  }
  buffered_ = 0;
  start_writeback();
}

void SafetensorsWriter::append(const void* bytes, size_t n) {
  if (failed_) fail("append after an earlier write error");
  if (finished_) fail("append after finish()");
  if (!header_written_) write_header();
  if (n > total_ - written_)
    fail("append of " + std::to_string(n) + " bytes exceeds the declared data: " +
         std::to_string(total_ - written_) + " bytes remain (at tensor " + current_tensor() + ")");
  if (n == 0) return;
  write_all(static_cast<const uint8_t*>(bytes), n);
  written_ += n;
}

void SafetensorsWriter::finish() {
  if (failed_) fail("finish after an earlier write error");
  if (finished_) fail("finish() called twice");
  if (!header_written_) write_header();
  if (written_ != total_)
    fail("finish() after " + std::to_string(written_) + " of " + std::to_string(total_) +
         " declared data bytes; tensor " + current_tensor() + " is incomplete");
  flush_buffer();
  buffer_.reset();
  if (::fsync(fd_) != 0) {
    failed_ = true;
    fail("fsync failed: " + errno_text());
  }
  // Durable now: keep the page cache for the training, not for a file nobody reads soon.
  (void)::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED);
  int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) {
    failed_ = true;
    fail("close failed: " + errno_text());
  }
  finished_ = true;
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw SafetensorsError("cannot open directory '" + dir + "' to fsync: " + errno_text());
  if (::fsync(fd) != 0) {
    std::string err = errno_text();
    ::close(fd);
    throw SafetensorsError("fsync of directory '" + dir + "' failed: " + err);
  }
  ::close(fd);
}

}  // namespace nnstrain::checkpoint
