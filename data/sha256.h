// SHA-256 (FIPS 180-4), self-contained so prepare needs no OpenSSL.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace nnstrain::data {

// Incremental hasher: update() any number of times, then hex_digest() once.
class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  std::string hex_digest();  // finalises; the object is spent afterwards

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_bytes_ = 0;
};

std::string sha256_hex(const void* data, size_t n);
inline std::string sha256_hex(const std::string& s) { return sha256_hex(s.data(), s.size()); }
// Streams the file; throws std::runtime_error naming the file if it cannot be read.
std::string sha256_file_hex(const std::string& path);

}  // namespace nnstrain::data
