// ArgMap: a typed, validating view of one mapping of the configuration, handed to
// the code that owns a sub-schema (a model's `args`, say). Every read records the
// resolved value (defaults included) for --print-config, and every error names the
// full key path and the YAML line. No YAML type leaks out of this header.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace nnstrain::config {

// Any invalid configuration: the CLI prints what() and exits with status 2.
struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class ArgMap {
 public:
  struct Impl;
  explicit ArgMap(std::shared_ptr<Impl> impl);
  ~ArgMap();

  bool has(const std::string& key) const;

  // Typed reads. Without a default the key is required. Ranges are inclusive.
  int64_t get_int(const std::string& key, std::optional<int64_t> def = std::nullopt,
                  std::optional<int64_t> min = std::nullopt,
                  std::optional<int64_t> max = std::nullopt);
  double get_float(const std::string& key, std::optional<double> def = std::nullopt,
                   std::optional<double> min = std::nullopt,
                   std::optional<double> max = std::nullopt);
  bool get_bool(const std::string& key, std::optional<bool> def = std::nullopt);
  std::string get_string(const std::string& key, std::optional<std::string> def = std::nullopt,
                         const std::vector<std::string>& choices = {});
  std::vector<double> get_float_list(const std::string& key,
                                     std::optional<std::vector<double>> def = std::nullopt);
  std::vector<std::string> get_string_list(const std::string& key,
                                           std::optional<std::vector<std::string>> def = std::nullopt);
  // A nested mapping (empty if absent and optional).
  ArgMap child(const std::string& key, bool required = false);

  // "model.args.n_head (line 12)": for messages about a key's value.
  std::string where(const std::string& key) const;
  [[noreturn]] void fail(const std::string& key, const std::string& message) const;

  // Errors on every key that was never read, with a did-you-mean.
  void finish();

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace nnstrain::config
