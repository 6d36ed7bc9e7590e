// ArgMap internals, shared by arg_map.cpp and load.cpp only: the one place (with
// those two files) where yaml-cpp types appear. Nothing outside config/ includes it.
#pragma once

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "base/config/arg_map.h"

namespace nnstrain::config {

// State shared by every ArgMap of one configuration file.
struct ConfigContext {
  std::string file;                     // the config file, as given (prefixes every message)
  std::set<std::string> cmdline_paths;  // key paths set or created by command-line overrides
  YAML::Node vars;                      // `vars:` with references already substituted (a map)
};

struct ArgMap::Impl {
  struct Entry {
    std::string key;
    YAML::Node key_node;  // for the line of the key
    YAML::Node value;
  };

  std::shared_ptr<ConfigContext> ctx;
  std::string path;                 // "model.args"; "" at the top level
  std::string loc;                  // where this mapping is: "line 4", "command line", or "" (not set)
  std::vector<Entry> entries;       // in file order
  std::vector<std::string> known;   // keys asked for, in order (did-you-mean candidates)
  std::set<std::string> consumed;   // keys read
  YAML::Node out;                   // the resolved mapping, in read order
  std::vector<std::shared_ptr<Impl>> children;

  // `node` must be a map, null or undefined (not set).
  static std::shared_ptr<Impl> make(std::shared_ptr<ConfigContext> ctx, std::string path,
                                    std::string loc, const YAML::Node& node);

  std::string key_path(const std::string& key) const;
  const Entry* find(const std::string& key) const;
  bool from_cmdline(const std::string& full_path) const;
  // "line 12" / "command line" / "" for the entry `key`.
  std::string loc_of(const std::string& key) const;
  std::string where(const std::string& key) const;
  [[noreturn]] void fail(const std::string& key, const std::string& message) const;

  // The value of `key` with $(vars.x) substituted; a null YAML::Node if not set (or null).
  // Marks the key known, and read when `consume`.
  YAML::Node value(const std::string& key, bool consume = true);
  void record(const std::string& key, const YAML::Node& resolved);

  // A nested mapping; not set and optional -> an empty one.
  std::shared_ptr<Impl> child(const std::string& key, bool required);
  // A list of mappings ("log: [{type: console}, ...]"); empty if not set.
  std::vector<std::shared_ptr<Impl>> child_list(const std::string& key);
  // Take `key` as is (no validation), echoing it into the resolved tree.
  void take_raw(const std::string& key);

  void collect_unknown(std::vector<std::string>& errors) const;
};

// Substitute $(vars.x) in a scalar (whole-scalar references keep the variable's
// node, e.g. a list); `fail` reports a bad reference against the key using it.
YAML::Node substitute_vars(const YAML::Node& node, const YAML::Node& vars,
                           const std::function<void(const std::string&)>& fail);

// Shortest text that reads back as the same double ("0.1", "3e-04" -> "0.0003").
std::string format_double(double v);
// " (did you mean 'x'?)" for the nearest candidate by edit distance, or "".
std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates);
// "a, b, c"
std::string join(const std::vector<std::string>& items, const std::string& sep = ", ");

}  // namespace nnstrain::config
