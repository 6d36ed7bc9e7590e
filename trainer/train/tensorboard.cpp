#include "trainer/train/tensorboard.h"

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>

namespace nnstrain::train {

namespace {

// Reflected CRC-32C polynomial (iSCSI, RFC 3720), as TFRecord uses.
constexpr uint32_t kCastagnoli = 0x82F63B78u;

std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kCastagnoli : c >> 1;
    t[i] = c;
  }
  return t;
}

// --- protobuf wire format: just what Event, Summary and SessionLog need ------
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void put_key(std::string& out, int field, int wire_type) { put_varint(out, (uint64_t(field) << 3) | wire_type); }
template <class T>
void put_fixed(std::string& out, T v) {  // little-endian, as x86 and ARM store it
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}
void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_key(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

// tensorboard.Event: wall_time = 1 (double), step = 2 (int64), then one of
// file_version = 3 (string), summary = 5 (Summary), session_log = 7 (SessionLog).
std::string event_header(int64_t step) {
  std::string e;
  put_key(e, 1, 1);
  put_fixed(e, std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  put_key(e, 2, 0);
  put_varint(e, static_cast<uint64_t>(step));
  return e;
}

}  // namespace

std::string TensorBoardSink::tag_for(const std::string& key) {
  for (const char* group : {"time", "val", "eval"}) {  // eval_<task>/<metric>: eval/<task>/<metric>
    const std::string prefix = std::string(group) + "_";
    if (key.rfind(prefix, 0) == 0 && key.size() > prefix.size())
      return std::string(group) + "/" + key.substr(prefix.size());
  }
  return "train/" + key;
}

uint32_t crc32c(const void* data, size_t size) {
  static const auto table = make_crc_table();
  uint32_t c = 0xFFFFFFFFu;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t c = crc32c(data, size);
  return ((c >> 15) | (c << 17)) + 0xA282EAD8u;
}

TensorBoardSink::TensorBoardSink(const std::string& dir, int64_t start_step) {
  std::filesystem::create_directories(dir);
  // TensorBoard reads a folder's event files in name order: seconds and
  // microseconds, fixed width, keep a resumed run's file after the one it resumes.
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(now).count();
  char host[256] = "localhost";
  gethostname(host, sizeof(host) - 1);
  char name[512];
  std::snprintf(name, sizeof(name), "events.out.tfevents.%010lld.%06lld.%s.%d", static_cast<long long>(us / 1000000),
                static_cast<long long>(us % 1000000), host, static_cast<int>(getpid()));
  path_ = (std::filesystem::path(dir) / name).string();
  out_.open(path_, std::ios::binary | std::ios::trunc);
  if (!out_) throw std::runtime_error("cannot open TensorBoard event file " + path_);

  std::string version = event_header(0);
  put_bytes(version, 3, "brain.Event:2");  // file_version 2: readers honour SessionLog restarts
  write_event(version);
  std::string start = event_header(start_step + 1);
  std::string session_log;
  put_key(session_log, 1, 0);  // SessionLog.status
  put_varint(session_log, 1);  // START
  put_bytes(start, 7, session_log);
  write_event(start);
}

void TensorBoardSink::write(const nlohmann::json& record) {
  std::string summary;
  for (const auto& [key, value] : record.items()) {
    if (key == "step" || !value.is_number()) continue;
    std::string v;  // Summary.Value: tag = 1 (string), simple_value = 2 (float)
    put_bytes(v, 1, tag_for(key));
    put_key(v, 2, 5);
    put_fixed(v, static_cast<float>(value.get<double>()));
    put_bytes(summary, 1, v);  // Summary.value = 1 (repeated)
  }
  if (summary.empty()) return;
  std::string e = event_header(record.at("step").get<int64_t>());
  put_bytes(e, 5, summary);
  write_event(e);
}

void TensorBoardSink::write_event(const std::string& event) {
  std::string rec;
  const uint64_t len = event.size();
  put_fixed(rec, len);
  put_fixed(rec, masked_crc32c(rec.data(), sizeof(len)));
  rec += event;
  put_fixed(rec, masked_crc32c(event.data(), event.size()));
  out_.write(rec.data(), static_cast<std::streamsize>(rec.size()));
  out_.flush();
  if (!out_) throw std::runtime_error("cannot write TensorBoard event file " + path_);
}

}  // namespace nnstrain::train
