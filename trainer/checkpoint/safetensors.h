// safetensors reading and writing without LibTorch. The reader validates a whole
// file (header size, JSON, dtypes, shapes, offsets contiguous and in bounds, no
// duplicate names, exact file length) before handing out a single byte; the
// writer streams tensors of any size with a bounded buffer. Format:
// https://github.com/huggingface/safetensors (8-byte little-endian header length,
// JSON header, raw little-endian tensor bytes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace nnstrain::checkpoint {

// Any malformed file or failed I/O; the message names the file and the fault.
struct SafetensorsError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class DType { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, U16, U32, U64 };

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);  // "F32", "BF16", ... as in the header
std::optional<DType> parse_dtype(const std::string& name);

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets within the data section
  int64_t numel() const;        // 1 for a 0-d tensor
  uint64_t nbytes() const;
};

class SafetensorsReader {
 public:
  // Opens, memory-maps and validates the whole file; throws SafetensorsError.
  explicit SafetensorsReader(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(SafetensorsReader&& other) noexcept;
  SafetensorsReader& operator=(SafetensorsReader&& other) noexcept;
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // in data order
  const TensorInfo* find(const std::string& name) const;               // nullptr if absent
  const TensorInfo& at(const std::string& name) const;  // throws naming file and tensor
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Pointer into the read-only mapping; valid while the reader lives.
  const uint8_t* data(const TensorInfo& info) const;
  // Copies the block [offsets[d], offsets[d] + sizes[d]) of every dim d into dst,
  // contiguous row-major; touches only the bytes of that block.
  void read_slice(const TensorInfo& info, const std::vector<int64_t>& offsets,
                  const std::vector<int64_t>& sizes, void* dst) const;
  // Throws (naming file and tensor) unless the block lies within the tensor.
  void check_slice(const TensorInfo& info, const std::vector<int64_t>& offsets,
                   const std::vector<int64_t>& sizes) const;

 private:
  [[noreturn]] void fail(const std::string& fault) const;
  void validate();

  std::string path_;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
  uint8_t* map_ = nullptr;
  size_t map_size_ = 0;
  uint64_t data_start_ = 0;  // 8 + header length
};

// Two-phase writer: declare every tensor (the header is then fixed), then append
// their bytes in declaration order, in chunks of any size. Writes straight to
// `path`; callers that need atomicity write into a temporary folder, finish(),
// and publish by rename + fsync_dir.
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string path, std::map<std::string, std::string> metadata = {});
  ~SafetensorsWriter();  // if not finished: closes and removes the partial file
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  void declare(const std::string& name, DType dtype, const std::vector<int64_t>& shape);
  void append(const void* bytes, size_t n);  // bytes of the declared tensors, in order
  // Checks every declared byte was written, flushes, fsyncs and closes.
  void finish();

  const std::string& path() const { return path_; }

 private:
  [[noreturn]] void fail(const std::string& fault);
  void write_header();
  void flush_buffer();
  void write_all(const uint8_t* bytes, size_t n);
  void start_writeback();  // after each write: see kWritebackChunk
  std::string current_tensor() const;

  std::string path_;
  std::map<std::string, std::string> metadata_;
  std::vector<TensorInfo> declared_;
  std::unordered_map<std::string, size_t> index_;
  uint64_t total_ = 0;    // bytes declared
  uint64_t written_ = 0;  // data bytes appended so far
  std::unique_ptr<uint8_t[]> buffer_;  // uninitialised: no 8 MiB memset per file
  size_t capacity_ = 0, buffered_ = 0;
  uint64_t offset_ = 0;   // bytes handed to write(2)
  uint64_t started_ = 0;  // writeback started for [0, started_)
  uint64_t dropped_ = 0;  // written back and dropped from the page cache: [0, dropped_)
  bool writeback_ = true;  // false where sync_file_range is not supported
  int fd_ = -1;
  bool header_written_ = false;
  bool finished_ = false;
  bool failed_ = false;  // an I/O error left the file in an unknown state
};

// fsync a directory so a rename inside it survives a crash.
void fsync_dir(const std::string& dir);

}  // namespace nnstrain::checkpoint
