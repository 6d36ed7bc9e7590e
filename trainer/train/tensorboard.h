// TensorBoard sink: scalar summaries in TensorBoard's event-file format, written
// by nnstrain itself (no TensorFlow, no protobuf library). An event file is a
// sequence of TFRecords (length, masked CRC32C of the length, payload, masked
// CRC32C of the payload) whose payloads are `tensorboard.Event` protobuf
// messages; the few fields used here are encoded by hand (tensorboard.cpp).
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

namespace nnstrain::train {

// CRC-32C (Castagnoli), and the masked form TFRecord framing stores.
uint32_t crc32c(const void* data, size_t size);
uint32_t masked_crc32c(const void* data, size_t size);

class TensorBoardSink {
 public:
  // Opens a new event file in `dir` (created if absent). A run resumed at
  // `start_step` > 0 writes a SessionLog START at start_step + 1: TensorBoard then
  // drops what the interrupted run had logged after its checkpoint, so every step
  // shows once.
  TensorBoardSink(const std::string& dir, int64_t start_step);

  // Every numeric field of `record` except "step" becomes a scalar at step
  // record["step"], tagged by tag_for(key). Flushed every write.
  void write(const nlohmann::json& record);

  // The TensorBoard tag of a metrics key, grouped the way TensorBoard shows
  // sections: "time_forward_ms" -> "time/forward_ms", "val_loss" -> "val/loss",
  // anything else -> "train/<key>" ("train/loss", "train/loss_scale", ...).
  static std::string tag_for(const std::string& key);

  const std::string& path() const { return path_; }

 private:
  void write_event(const std::string& event);

  std::string path_;
  std::ofstream out_;
};

}  // namespace nnstrain::train
