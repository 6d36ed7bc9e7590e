#include "base/config/load.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>

#include "base/config/arg_map_impl.h"
#include "base/text.h"

namespace nnstrain::config {

namespace fs = std::filesystem;
using Impl = ArgMap::Impl;

namespace {

using util::quote_prefix;

// Bounds on a configuration. Real configs are a few KB with a few hundred nodes;
// these stop a crafted file (an alias bomb, a megabyte-long key) in milliseconds,
// before anything walks or copies the tree.
constexpr uintmax_t kMaxConfigBytes = uintmax_t{1} << 20;
constexpr size_t kMaxNodes = 100'000;  // counted with every alias expanded
constexpr size_t kMaxDepth = 64;
constexpr size_t kMaxKeyBytes = 256;
constexpr size_t kMaxScalarBytes = 16384;
// Nodes that substituting `vars:` into each other may build, all rounds together: real
// configs build a few hundred; a bomb is refused after building at most this many
// (yaml-cpp nodes are costly to build and free: ~0.15 s for 10^4 under ASan, 10x that for 10^5).
constexpr size_t kMaxSubstitutedNodes = 10'000;

void check_bounds(const YAML::Node& root, const std::string& file) {
  size_t nodes = 0;
  std::function<void(const YAML::Node&, const std::string&, size_t)> walk = [&](const YAML::Node& n,
                                                                                 const std::string& path,
                                                                                 size_t depth) {
    auto fail = [&](const std::string& what) {
      const int line = n.Mark().line;
      throw ConfigError(file + (line >= 0 ? " (line " + std::to_string(line + 1) + ")" : "") + ": " +
                        (path.empty() ? std::string("top level") : path) + ": " + what);
    };
    if (++nodes > kMaxNodes)
      fail("more than " + std::to_string(kMaxNodes) +
           " YAML nodes with aliases expanded (the limit; is an alias repeated into a bomb?)");
    if (depth > kMaxDepth) fail("nested deeper than the limit of " + std::to_string(kMaxDepth) + " levels");
    if (n.IsScalar() && n.Scalar().size() > kMaxScalarBytes)
      fail("value " + quote_prefix(n.Scalar()) + " is longer than the limit of " +
           std::to_string(kMaxScalarBytes) + " bytes");
    if (n.IsSequence()) {
      size_t i = 0;
      for (const auto& item : n) walk(item, path + "[" + std::to_string(i++) + "]", depth + 1);
    } else if (n.IsMap()) {
      for (const auto& kv : n) {
        const std::string key = kv.first.IsScalar() ? kv.first.Scalar() : "?";
        const bool plain = key.size() <= 32 && std::all_of(key.begin(), key.end(), [](unsigned char c) {
          return c > 0x20 && c < 0x7f && c != '.';
        });
        const std::string shown = plain ? key : quote_prefix(key, 32);
        const std::string child = path.empty() ? shown : path + "." + shown;
        if (key.size() > kMaxKeyBytes) {
          const int line = kv.first.Mark().line;
          throw ConfigError(file + (line >= 0 ? " (line " + std::to_string(line + 1) + ")" : "") + ": key " +
                            quote_prefix(key) + " is longer than the limit of " + std::to_string(kMaxKeyBytes) +
                            " bytes");
        }
        walk(kv.first, child, depth + 1);
        walk(kv.second, child, depth + 1);
      }
    }
  };
  walk(root, "", 0);
}

void check_config_size(uintmax_t bytes, const std::string& file) {
  if (bytes > kMaxConfigBytes)
    throw ConfigError(file + ": " + std::to_string(bytes) + " bytes, over the limit of " +
                      std::to_string(kMaxConfigBytes) + " bytes for a configuration file");
}

std::string read_config_text(const std::string& file) {
  std::error_code ec;
  if (!fs::is_regular_file(file, ec))
    throw ConfigError(file + ": configuration file not found" +
                      (fs::exists(file, ec) ? " (it is not a regular file)" : ""));
  const uintmax_t bytes = fs::file_size(file, ec);
  if (!ec) check_config_size(bytes, file);  // before reading a huge file into memory
  std::ifstream in(file, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

YAML::Node parse_config_text(const std::string& text, const std::string& file) {
  check_config_size(text.size(), file);  // the file may have grown since its size was read
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::ParserException& e) {
    // yaml-cpp says "illegal map value" for a plain key over YAML's 1024 characters: name that.
    std::string hint;
    size_t start = 0;
    for (int l = 0; l < e.mark.line && start != std::string::npos; ++l) {
      start = text.find('\n', start);
      if (start != std::string::npos) ++start;
    }
    if (start != std::string::npos && e.mark.line >= 0) {
      const std::string line = text.substr(start, text.find('\n', start) - start);
      const auto opened = std::count(line.begin(), line.end(), '[') + std::count(line.begin(), line.end(), '{');
      if (opened > static_cast<long>(kMaxDepth))
        hint = "; the line opens " + std::to_string(opened) + " brackets: values nested deeper than " +
               std::to_string(kMaxDepth) + " levels are refused";
      else if (line.size() > 1024 && e.msg.find("map value") != std::string::npos)
        hint = "; the line is " + std::to_string(line.size()) + " bytes long (" + quote_prefix(line) +
               "): a plain key may have at most 1024 characters in YAML, and nnstrain's at most " +
               std::to_string(kMaxKeyBytes) + " bytes";
    }
    throw ConfigError(file + " (line " + std::to_string(e.mark.line + 1) + "): YAML syntax error: " + e.msg + hint);
  } catch (const YAML::Exception& e) {
    throw ConfigError(file + ": cannot read: " + e.what());
  }
  if (root.IsNull()) return YAML::Node(YAML::NodeType::Map);  // an empty file: "model is missing" follows
  if (!root.IsMap())
    throw ConfigError(file + ": the top level must be a mapping (model: ..., optimizer: ...), got a " +
                      (root.IsSequence() ? "list" : "single value"));
  return root;
}

bool parse_index(const std::string& s, size_t& idx) {
  if (s.empty() || s.size() > 9 ||
      !std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c); }))
    return false;
  idx = std::stoul(s);
  return true;
}

// Set `key` (dotted; a number indexes a list) to `value` read as YAML, creating
// missing mappings on the way. Records what it sets or creates as command-line.
void apply_override(YAML::Node& root, ConfigContext& ctx, const std::string& key, const std::string& value) {
  auto bad = [&](const std::string& message) {
    throw ConfigError(ctx.file + ": " + key + " (command line): " + message);
  };
  std::vector<std::string> parts;
  std::stringstream ss(key);
  for (std::string part; std::getline(ss, part, '.');) parts.push_back(part);
  if (key.empty() || key.back() == '.' ||
      std::any_of(parts.begin(), parts.end(), [](const std::string& p) { return p.empty(); }))
    bad("malformed key (expected names separated by dots, like optimizer.args.lr)");

  YAML::Node parsed;
  if (value.empty()) {
    parsed = YAML::Node(std::string());  // --key= sets an empty string
  } else {
    try {
      parsed = YAML::Load(value);
    } catch (const YAML::Exception& e) {
      bad("cannot read the value " + quote_prefix(value) + " as YAML: " + e.msg);
    }
  }

  YAML::Node cur;
  cur.reset(root);
  std::string path;
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string& part = parts[i];
    const bool last = i + 1 == parts.size();
    YAML::Node next;
    if (cur.IsSequence()) {
      size_t idx = 0;
      if (!parse_index(part, idx) || idx >= cur.size())
        bad(path + " is a list of " + std::to_string(cur.size()) + " items; '" + part +
            "' is not an index into it");
      path += "[" + part + "]";
      if (last) cur[idx] = parsed;
      else next.reset(cur[idx]);
    } else if (!cur.IsDefined() || cur.IsMap() || cur.IsNull()) {  // undefined: created just now
      bool existed = false;
      if (cur.IsMap())
        for (const auto& kv : cur) existed = existed || kv.first.Scalar() == part;
      path += (path.empty() ? "" : ".") + part;
      if (last) cur[part] = parsed;
      else next.reset(cur[part]);
      if (!existed) ctx.cmdline_paths.insert(path);
    } else {
      bad(path + " is a single value (" + quote_prefix(cur.Scalar()) + "), so it has no key " + quote_prefix(part));
    }
    if (!last) cur.reset(next);
  }
  ctx.cmdline_paths.insert(path);
}

// Resolve references between variables (vars may use earlier or later vars); a
// chain longer than the number of variables is a cycle.
YAML::Node resolve_vars(Impl& vars_map) {
  YAML::Node resolved(YAML::NodeType::Map);
  for (const auto& e : vars_map.entries) resolved[e.key] = YAML::Clone(e.value);
  std::function<bool(const YAML::Node&)> has_ref = [&](const YAML::Node& n) {
    if (n.IsScalar()) return n.Scalar().find("$(") != std::string::npos;
    for (const auto& item : n)
      if (has_ref(n.IsMap() ? item.second : item)) return true;
    return false;
  };
  // One round substitutes every reference once. A substitution can multiply what it
  // copies (a variable holding two references to the one before, and so on: 2^n nodes,
  // or a string 2^n long, from n short lines), so the file's own limits bound what all
  // rounds together build, counted as it is built (a cycle of large variables cannot
  // rebuild them round after round). Every node is built afresh (substituted values
  // cloned): sharing nodes of the previous round would make yaml-cpp merge that round's
  // whole node set into each new container, quadratic time.
  size_t built = 0;
  auto spend = [&](size_t nodes, const std::string& key) {
    built += nodes;
    if (built > kMaxSubstitutedNodes)
      vars_map.fail(key, "more than " + std::to_string(kMaxSubstitutedNodes) +
                             " YAML nodes built substituting variables (the limit; does a variable repeat "
                             "another into a bomb?)");
  };
  // Nodes in n, counted as a tree, stopping once past `limit`.
  std::function<size_t(const YAML::Node&, size_t, size_t)> tree_size = [&](const YAML::Node& n, size_t depth,
                                                                             size_t limit) -> size_t {
    if (depth > kMaxDepth || !n.IsDefined()) return kMaxNodes + 1;
    size_t total = 1;
    for (const auto& item : n) {
      if (total > limit) break;
      if (n.IsMap()) total += 1 + tree_size(item.second, depth + 1, limit - total);
      else total += tree_size(item, depth + 1, limit - total);
    }
    return total;
  };
  std::function<YAML::Node(const YAML::Node&, const YAML::Node&, const std::string&, size_t)> pass =
      [&](const YAML::Node& n, const YAML::Node& lookup, const std::string& key, size_t depth) -> YAML::Node {
    if (depth > kMaxDepth)
      vars_map.fail(key, "nested deeper than the limit of " + std::to_string(kMaxDepth) +
                             " levels once variables are substituted");
    if (n.IsScalar()) {
      YAML::Node out = substitute_vars(n, lookup, [&](const std::string& m) { vars_map.fail(key, m); });
      if (out.IsScalar() && out.Scalar().size() > kMaxScalarBytes)
        vars_map.fail(key, "value " + quote_prefix(out.Scalar()) + " is longer than the limit of " +
                               std::to_string(kMaxScalarBytes) + " bytes once variables are substituted");
      const size_t size = tree_size(out, depth, kMaxSubstitutedNodes - std::min(built, kMaxSubstitutedNodes));
      spend(size, key);
      return YAML::Clone(out);
    }
    if (n.IsSequence()) {
      spend(1, key);
      YAML::Node seq(YAML::NodeType::Sequence);
      for (const auto& item : n) seq.push_back(pass(item, lookup, key, depth + 1));
      seq.SetStyle(n.Style());
      return seq;
    }
    if (n.IsMap()) {
      spend(1, key);
      YAML::Node map(YAML::NodeType::Map);
      for (const auto& kv : n) {
        spend(1, key);
        map[kv.first.Scalar()] = pass(kv.second, lookup, key, depth + 1);
      }
      return map;
    }
    spend(1, key);
    return YAML::Clone(n);
  };
  for (size_t round = 0; round <= vars_map.entries.size(); ++round) {
    std::string pending;
    for (const auto& e : vars_map.entries)
      if (has_ref(resolved[e.key])) pending = pending.empty() ? e.key : pending;
    if (pending.empty()) return resolved;
    YAML::Node next(YAML::NodeType::Map);
    for (const auto& e : vars_map.entries)  // only variables with references are rebuilt
      next[e.key] = has_ref(resolved[e.key]) ? pass(resolved[e.key], resolved, e.key, 1) : resolved[e.key];
    resolved.reset(next);
    if (round == vars_map.entries.size()) vars_map.fail(pending, "circular reference between variables");
  }
  return resolved;
}

TokenBinArgs read_token_bin(ArgMap& m, const TokenBinArgs* defaults) {
  TokenBinArgs t;
  t.path = m.get_string("path");
  if (t.path.empty()) m.fail("path", "must not be empty");
  t.dtype = m.get_string("dtype", defaults ? defaults->dtype : std::string("uint16"), {"uint16", "uint32"});
  t.seq_len = defaults ? m.get_int("seq_len", defaults->seq_len, 1) : m.get_int("seq_len", std::nullopt, 1);
  return t;
}

void check_token_file(const ArgMap& m, const TokenBinArgs& t) {
  std::error_code ec;
  if (!fs::exists(t.path, ec))
    m.fail("path", "data file not found: " + t.path +
                       (fs::path(t.path).is_relative() ? " (relative to the working directory " +
                                                             fs::current_path(ec).string() + ")"
                                                       : ""));
  if (!fs::is_regular_file(t.path, ec)) m.fail("path", t.path + " is not a regular file");
  const uintmax_t bytes = fs::file_size(t.path, ec);
  const uintmax_t item = t.dtype == "uint32" ? 4 : 2;
  if (bytes % item != 0)
    m.fail("path", t.path + " has " + std::to_string(bytes) + " bytes, not a whole number of " + t.dtype +
                       " tokens (is dtype right?)");
  if (bytes / item < static_cast<uintmax_t>(t.seq_len) + 1)
    m.fail("path", t.path + " holds " + std::to_string(bytes / item) + " tokens; seq_len " +
                       std::to_string(t.seq_len) + " needs at least " + std::to_string(t.seq_len + 1));
}

// dataset.type indexed: {datasets: [{path, weight}], seq_len, join, document_mask,
// mask_prompt}; val_args takes what it does not set from train_args.
IndexedArgs read_indexed(const std::shared_ptr<Impl>& impl, const IndexedArgs* defaults, std::vector<ArgMap>* sources) {
  ArgMap m(impl);
  IndexedArgs a;
  for (auto& item_impl : impl->child_list("datasets")) {
    ArgMap item(item_impl);
    IndexedSource src;
    src.path = item.get_string("path");
    if (src.path.empty()) item.fail("path", "must not be empty");
    src.weight = item.get_float("weight", 1.0);
    if (!(src.weight > 0) || !std::isfinite(src.weight))
      item.fail("weight", "must be a positive number, got " + format_double(src.weight));
    src.allow_other_chat_template = item.get_bool("allow_other_chat_template", false);
    item.finish();
    a.datasets.push_back(src);
    sources->push_back(item);
  }
  if (a.datasets.empty())
    m.fail("datasets", "required: a list of {path: PREFIX (or PREFIX.manifest.json), weight: W}");
  a.seq_len = defaults ? m.get_int("seq_len", defaults->seq_len, 1) : m.get_int("seq_len", std::nullopt, 1);
  a.join = m.get_string("join", defaults ? defaults->join : std::string("eos"), {"eos", "bos", "none"});
  a.document_mask = m.get_bool("document_mask", defaults ? defaults->document_mask : false);
  a.mask_prompt = m.get_bool("mask_prompt", defaults ? defaults->mask_prompt : false);
  return a;
}

// dataset.type preference: {path, seq_len, shuffle}; val_args takes what it does not set from train_args.
PreferenceArgs read_preference(ArgMap& m, const PreferenceArgs* defaults) {
  PreferenceArgs a;
  a.path = m.get_string("path");
  if (a.path.empty()) m.fail("path", "must not be empty");
  a.seq_len = defaults ? m.get_int("seq_len", defaults->seq_len, 2) : m.get_int("seq_len", std::nullopt, 2);
  a.shuffle = m.get_bool("shuffle", defaults ? defaults->shuffle : true);
  a.pack = m.get_bool("pack", defaults ? defaults->pack : false);
  if (a.pack && a.seq_len % 2 != 0) m.fail("seq_len", std::to_string(a.seq_len) + " does not halve: pack puts chosen and rejected in halves of a row");
  return a;
}

// Canonical precision names, then the nnScaler spellings they also accept.
const std::vector<std::pair<std::string, std::string>> kPrecisionAliases = {
    {"fp32", "32-true"}, {"fp16", "16-true"}, {"bf16", "bf16-true"}};
const std::vector<std::string> kPrecisions = {"32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed"};

// Empty mappings and lists print as {} and [] on the key's own line.
void compact_empty(const YAML::Node& n) {
  if (!n.IsMap() && !n.IsSequence()) return;
  if (n.size() == 0) {
    YAML::Node(n).SetStyle(YAML::EmitterStyle::Flow);
    return;
  }
  for (const auto& item : n) compact_empty(n.IsMap() ? item.second : item);
}

// A module's check the config needs (LoadOptions::checks). Unset is the caller's
// bug, not the user's: it is never skipped silently.
template <typename Check>
Check required(Check check, const char* name) {
  if (!check) throw std::logic_error(std::string("config::LoadOptions::checks.") + name + " is not set");
  return check;
}

// What the pipeline's keys must agree on: global_batch = micro x nmicros x dp,
// and a scheduler that can run pp ranks, the stages and the micro-batches
// (accumulation 0: dp is the plan's, so those two are the planner's to check).
void check_pipeline(const ArgMap& pas, const ComputeConfig& c, int64_t accumulation, const std::string& dp_text,
                    const ModuleChecks& checks) {
  const auto& q = c.pipeline;
  if (accumulation > 0 && q.nmicros > 0 && q.nmicros != accumulation)
    pas.fail("pipeline_nmicros", std::to_string(q.nmicros) + " micro-batches per pipeline flush, but the step has " +
                                     std::to_string(accumulation) + " (grad_accumulation_steps; global_batch_size = "
                                     "micro_batch_size x pipeline_nmicros x " + dp_text + ")");
  if (accumulation == 0) return;
  required(checks.pipeline_schedule, "pipeline_schedule")(pas, q, static_cast<int>(accumulation));
}

// lr_scheduler.type wsd in a run of `total` iterations: the key (under
// lr_scheduler.args) whose value does not fit and why, or nothing.
std::optional<std::pair<std::string, std::string>> wsd_misfit(const LrSchedulerArgs& s, int64_t total,
                                                              const std::string& total_from) {
  const int64_t decay = wsd_decay_length(s, total);
  const std::string unit = s.interval == "epoch" ? "epochs" : "steps";
  const std::string run = "the run's " + std::to_string(total) + " " + unit + " (" + total_from + ")";
  if (s.decay_steps == 0 && decay < 1)
    return std::make_pair(std::string("decay_ratio"), format_double(s.decay_ratio) + " of " + run +
                                                          " rounds to no decay at all; raise it or set decay_steps");
  if (s.warmup_steps + decay <= total) return std::nullopt;
  const std::string phases = "warmup_steps " + std::to_string(s.warmup_steps) + " + " + std::to_string(decay) +
                             " decay " + unit + " = " + std::to_string(s.warmup_steps + decay) + " do not fit in " + run;
  if (s.decay_steps > 0) return std::make_pair(std::string("decay_steps"), std::to_string(s.decay_steps) + ": " + phases);
  return std::make_pair(std::string("decay_ratio"), format_double(s.decay_ratio) + ": " + phases);
}

// Whether a value given in model.args says what the folder's does (numbers by
// value, so 1e-6 is 0.000001; mappings by the folder's keys).
bool same_value(const YAML::Node& given, const YAML::Node& folder) {
  if (folder.IsMap()) {
    if (!given.IsMap()) return false;
    for (const auto& kv : folder)
      if (given[kv.first.Scalar()].IsDefined() && !same_value(given[kv.first.Scalar()], kv.second)) return false;
    return true;
  }
  if (folder.IsSequence()) {
    if (!given.IsSequence() || given.size() != folder.size()) return false;
    for (size_t i = 0; i < folder.size(); ++i)
      if (!same_value(given[i], folder[i])) return false;
    return true;
  }
  if (!given.IsScalar() || !folder.IsScalar()) return given.IsNull() == folder.IsNull();
  auto number = [](const std::string& t, double& out) {
    char* end = nullptr;
    out = std::strtod(t.c_str(), &end);
    return !t.empty() && end == t.c_str() + t.size();
  };
  double a = 0, b = 0;
  if (number(given.Scalar(), a) && number(folder.Scalar(), b))
    return std::abs(a - b) <= 1e-12 * std::max(1.0, std::abs(b));
  auto lower = [](std::string x) {
    for (auto& ch : x) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    return x;
  };
  return lower(given.Scalar()) == lower(folder.Scalar());
}

// model.init_from's folder fills the model.args keys not given; one given must agree.
// Keys the model does not read are taken as read (config.json holds more than the model's args).
void fill_from_folder(ArgMap::Impl& args, const ModelCatalog::Folder& from, const std::string& source) {
  const YAML::Node folder = YAML::Load(from.args_json);
  if (!folder.IsMap()) return;
  for (const auto& kv : folder) {
    const std::string key = kv.first.Scalar();
    if (kv.second.IsNull()) continue;
    const YAML::Node given = args.value(key, /*consume=*/false);
    if (given.IsDefined() && !given.IsNull()) {
      const bool free = std::find(from.free.begin(), from.free.end(), key) != from.free.end();
      if (!free && !same_value(given, kv.second)) {
        YAML::Emitter a, b;
        a << YAML::Flow << given;
        b << YAML::Flow << kv.second;
        args.fail(key, std::string(a.c_str()) + ", but " + source + " has " + b.c_str() +
                           " (leave it out to take the folder's, or give a folder that has it)");
      }
      continue;
    }
    auto at = std::find_if(args.entries.begin(), args.entries.end(), [&](const auto& e) { return e.key == key; });
    if (at != args.entries.end()) args.entries.erase(at);  // set to null: the folder's
    args.entries.push_back({key, YAML::Node(), kv.second});
    args.consumed.insert(key);
  }
}

}  // namespace

std::vector<std::pair<std::string, std::string>> parse_overrides(const std::vector<std::string>& tokens) {
  std::vector<std::pair<std::string, std::string>> out;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const std::string& tok = tokens[i];
    if (tok.size() < 3 || tok.compare(0, 2, "--") != 0)
      throw ConfigError("unexpected argument '" + tok +
                        "': configuration overrides look like --key.path value or --key.path=value");
    const std::string body = tok.substr(2);
    const size_t eq = body.find('=');
    std::string key = body.substr(0, eq);
    if (key.empty()) throw ConfigError("'" + tok + "': missing the key before '='");
    if (eq != std::string::npos) {
      out.emplace_back(key, body.substr(eq + 1));
    } else {
      if (i + 1 == tokens.size() || tokens[i + 1].compare(0, 2, "--") == 0)
        throw ConfigError(key + " (command line): --" + key + " has no value (use --" + key +
                          " VALUE or --" + key + "=VALUE)");
      out.emplace_back(key, tokens[++i]);
    }
  }
  return out;
}

void read_adamw_args(ArgMap& oargs, OptimizerArgs& o) {
  o.lr = oargs.get_float("lr", 1e-3);
  if (o.lr <= 0) oargs.fail("lr", "must be > 0, got " + format_double(o.lr));
  const std::vector<double> betas = oargs.get_float_list("betas", std::vector<double>{0.9, 0.999});
  if (betas.size() != 2) oargs.fail("betas", "expected two numbers [beta1, beta2], got " + std::to_string(betas.size()));
  for (double b : betas)
    if (b < 0 || b >= 1) oargs.fail("betas", "each beta must be in [0, 1), got " + format_double(b));
  o.beta1 = betas[0];
  o.beta2 = betas[1];
  o.eps = oargs.get_float("eps", 1e-8);
  if (o.eps <= 0) oargs.fail("eps", "must be > 0, got " + format_double(o.eps));
  o.weight_decay = oargs.get_float("weight_decay", 0.01, 0.0);
  o.impl = oargs.get_string("impl", "auto", {"auto", "fused", "foreach", "loop"});
}

// lora: (docs/lora.md). Every key checked here; whether a target names a module
// of the model is checked once the model is built (trainer/lora/converter.cpp).
static void load_lora(ArgMap& top, TrainerArgs& t) {
  if (!top.has("lora")) return;
  ArgMap m = top.child("lora");
  auto& l = t.lora;
  l.enabled = true;
  if (m.has("target_parameters"))  // peft's name for LoRA on raw parameters (stacked MoE experts)
    m.fail("target_parameters", "LoRA on parameters (peft's target_parameters: stacked MoE experts) is not offered; "
                                "adapt linear layers with target_modules, the experts stay frozen");
  l.r = m.get_int("r", 8, 1, 1 << 16);
  l.alpha = m.get_float("alpha", 8.0);
  if (!(l.alpha > 0)) m.fail("alpha", "must be > 0");
  l.dropout = m.get_float("dropout", 0.0, 0.0);
  if (l.dropout >= 1) m.fail("dropout", "must be in [0, 1)");
  l.target_modules = m.get_string_list("target_modules");
  if (l.target_modules.empty()) m.fail("target_modules", "names no module (give names, globs or [all-linear])");
  for (const auto& name : l.target_modules)
    if (name == "all-linear" && l.target_modules.size() > 1)
      m.fail("target_modules", "all-linear stands alone (it already names every linear layer but the output layer)");
  l.use_rslora = m.get_bool("use_rslora", false);
  l.init = m.get_string("init", "default", {"default", "gaussian"});
  l.modules_to_save = m.get_string_list("modules_to_save", std::vector<std::string>{});
  l.bias = m.get_string("bias", "none", {"none"});
  l.base_quantization = m.get_string("base_quantization", "none", {"none", "nf4"});
  l.double_quant = m.get_bool("double_quant", false);
  if (l.double_quant && l.base_quantization != "nf4")
    m.fail("double_quant", "quantizes the scales of an nf4 base; set base_quantization: nf4");
  l.init_from = m.get_string("init_from", "");
  for (const char* f : {"adapter_model.safetensors", "adapter_config.json"})
    if (!l.init_from.empty() && !fs::is_regular_file(fs::path(l.init_from) / f))
      m.fail("init_from", l.init_from + " holds no " + f + " (expected a peft adapter folder)");
}

// alignment: (docs/alignment.md). Whether the run can serve the reference
// (a plan, LoRA) is checked once the plan is made (trainer/align/).
static void load_alignment(ArgMap& top, TrainerArgs& t) {
  const bool preference = t.dataset.type == "preference";
  if (!top.has("alignment")) {
    if (preference)
      top.fail("dataset", "type preference trains on preference pairs: add an alignment: section "
                          "(loss_type, beta, reference; docs/alignment.md)");
    return;
  }
  ArgMap m = top.child("alignment");
  auto& a = t.alignment;
  a.enabled = true;
  a.loss_type = m.get_string("loss_type", "sigmoid", {"sigmoid", "ipo", "hinge", "simpo", "orpo"});
  a.beta = m.get_float("beta", 0.1);
  if (!(a.beta > 0) || !std::isfinite(a.beta)) m.fail("beta", "must be > 0, got " + format_double(a.beta));
  a.label_smoothing = m.get_float("label_smoothing", 0.0);
  if (!(a.label_smoothing >= 0 && a.label_smoothing < 0.5))
    m.fail("label_smoothing", "must be in [0, 0.5), got " + format_double(a.label_smoothing));
  if (a.label_smoothing > 0 && a.loss_type != "sigmoid" && a.loss_type != "simpo")
    m.fail("label_smoothing", "smooths the sigmoid and simpo losses only, not " + a.loss_type);
  // Read (and so written to the resolved config) only where it acts: a saved config loads again.
  if (a.loss_type == "simpo") a.simpo_gamma = m.get_float("simpo_gamma", 0.5);
  else if (m.has("simpo_gamma")) m.fail("simpo_gamma", "is simpo's margin; loss_type is " + a.loss_type);
  a.reference = m.get_string("reference", a.reference_free() ? "none" : "auto",
                             {"auto", "frozen", "precomputed", "adapters_off", "none"});
  if (a.reference_free() && a.reference != "none")
    m.fail("reference", a.loss_type + " is reference-free: it reads no reference (leave reference out or set none)");
  if (!a.reference_free() && a.reference == "none")
    m.fail("reference", a.loss_type + " compares with a reference: frozen, precomputed, adapters_off or auto");
  if (a.reference == "auto") a.reference = t.lora.enabled ? "adapters_off" : "frozen";
  if (a.reference == "adapters_off" && !t.lora.enabled)
    m.fail("reference", "adapters_off is the LoRA base with its adapters switched off; this run has no lora: section "
                        "(use frozen or precomputed)");
  a.ref_log_probs = m.get_string("ref_log_probs", "");
  if (!a.ref_log_probs.empty() && a.reference != "precomputed")
    m.fail("ref_log_probs", "is where precomputed reference log-probabilities are stored; reference is " + a.reference);
  if (!preference)
    m.fail("loss_type", "trains on preference pairs: dataset.type must be preference (prepare corpus --format preference)");
}

// eval: (docs/eval.md). The task files exist here; they are parsed (and
// refused naming file and line) when the run starts, before its first step.
static void load_eval(ArgMap& top, TrainerArgs& t) {
  if (!top.has("eval")) return;
  ArgMap m = top.child("eval");
  auto& e = t.eval;
  e.enabled = true;
  e.tasks = m.get_string_list("tasks");
  if (e.tasks.empty()) m.fail("tasks", "names no task file");
  for (const auto& f : e.tasks)
    if (!fs::is_regular_file(f)) m.fail("tasks", f + ": no such task file");
  e.every_n_train_steps = m.get_int("every_n_train_steps", std::nullopt, 1);
  e.limit = m.get_int("limit", 0, 0);
  e.batch_size = m.get_int("batch_size", 8, 1, 1 << 20);
  e.tokenizer = m.get_string("tokenizer", "");
  if (!e.tokenizer.empty() && !fs::exists(e.tokenizer)) m.fail("tokenizer", e.tokenizer + ": no such file or folder");
  // The evaluator reaches whole sequences through the model's logits() (under
  // pp: the last stage's); no context-parallel shard holds them.
  const auto& c = t.compute_config;
  if (c.context_parallel_size > 1)
    m.fail("tasks", "in-training evaluation does not run under context parallelism (compute_config.context_parallel_size " +
                        std::to_string(c.context_parallel_size) + "); evaluate a checkpoint with nnstrain eval");
}

TrainerArgs load_trainer_args(const std::string& file, const LoadOptions& opts) {
  return load_trainer_args_from_text(read_config_text(file), file, opts);
}

TrainerArgs load_trainer_args_from_text(const std::string& text, const std::string& file, const LoadOptions& opts) {
  auto ctx = std::make_shared<ConfigContext>();
  ctx->file = file;
  YAML::Node root = parse_config_text(text, file);
  for (const auto& [key, value] : opts.overrides) apply_override(root, *ctx, key, value);
  check_bounds(root, file);  // overrides included

  auto top_impl = Impl::make(ctx, "", "", root);
  ArgMap top(top_impl);
  TrainerArgs t;
  t.config_file = file;

  // vars: every entry is taken (unused variables are fine), resolved first.
  {
    auto vars_impl = top_impl->child("vars", false);
    ctx->vars = resolve_vars(*vars_impl);
    for (const auto& e : vars_impl->entries) vars_impl->consumed.insert(e.key);
    if (vars_impl->entries.empty()) top_impl->out.remove("vars");
    else top_impl->record("vars", ctx->vars);
  }

  t.run_dir = top.get_string("run_dir", "runs/" + fs::path(file).stem().string());
  if (t.run_dir.empty()) top.fail("run_dir", "must not be empty");

  ArgMap cc = top.child("compute_config");
  auto& c = t.compute_config;
  c.plan_ngpus = static_cast<int>(cc.get_int("plan_ngpus", 1, 1, 1 << 20));
  const bool runtime_given = cc.has("runtime_ngpus");
  c.runtime_ngpus = static_cast<int>(cc.get_int("runtime_ngpus", opts.world_size, 1, 1 << 20));
  {
    // nnScaler's boolean stays valid: true is stage 1, false stage 0.
    const auto z = cc.get_string("use_zero", "0", {"0", "1", "2", "3", "true", "false"});
    c.use_zero = z == "true" ? 1 : z == "false" ? 0 : std::stoi(z);
  }
  c.zero_ngroups = static_cast<int>(cc.get_int("zero_ngroups", 1, 1, 1 << 20));
  c.zero_prefetch = static_cast<int>(cc.get_int("zero_prefetch", 1, 0, 64));
  c.reducer_bucket_cap_mb = cc.get_float("reducer_bucket_cap_mb", 25.0);
  if (c.reducer_bucket_cap_mb <= 0) cc.fail("reducer_bucket_cap_mb", "must be > 0");
  c.collective_timeout_s = cc.get_float("collective_timeout_s", 600.0);
  c.sequence_parallel = cc.get_bool("sequence_parallel", true);
  if (c.collective_timeout_s <= 0) cc.fail("collective_timeout_s", "must be > 0");
  c.backend = cc.get_string("backend", "auto", {"auto", "nccl", "gloo"});
  c.device = cc.get_string("device", "auto", {"auto", "cpu", "cuda"});
  c.memory_budget_gb = cc.get_float("memory_budget_gb", 0.0, 0.0);
  c.allow_tf32 = cc.get_bool("allow_tf32", false);
  c.cuda_graphs = cc.get_string("cuda_graphs", "auto", {"auto", "true", "false"});
  c.reduce_dtype = cc.get_string("reduce_dtype", "auto", {"auto", "fp32", "bf16", "fp16"});
  c.context_parallel_given = cc.has("context_parallel_size");
  c.context_parallel_size = static_cast<int>(cc.get_int("context_parallel_size", 1, 1, 1 << 20));
  c.cp_comm_type = cc.get_string("cp_comm_type", "p2p", {"p2p", "all_gather"});
  c.cp_load_balance = cc.get_string("cp_load_balance", "zigzag", {"zigzag", "none"});
  c.expert_parallel_given = cc.has("expert_parallel_size");
  c.expert_parallel_size = static_cast<int>(cc.get_int("expert_parallel_size", 1, 1, 1 << 20));
  c.moe_imbalance = cc.get_float("moe_imbalance", 1.25, 1.0);
  std::optional<ArgMap> pas;
  if (cc.has("pas_config")) {
    pas.emplace(cc.child("pas_config"));
    auto& q = c.pipeline;
    q.pp_size_given = pas->has("pp_size");
    q.scheduler_given = pas->has("pipeline_scheduler");
    q.pp_size = static_cast<int>(pas->get_int("pp_size", 1, 1, 1 << 20));
    const auto nstages = pas->get_string("pipeline_nstages", "auto");
    if (nstages != "auto") {
      try {
        size_t used = 0;
        q.nstages = std::stoi(nstages, &used);
        if (used != nstages.size() || q.nstages < 1) throw std::invalid_argument(nstages);
      } catch (const std::logic_error&) {
        pas->fail("pipeline_nstages", "'" + nstages + "' is neither auto nor an integer >= 1");
      }
    }
    q.nmicros = static_cast<int>(pas->get_int("pipeline_nmicros", 0, 0, 1 << 20));
    q.scheduler = pas->get_string("pipeline_scheduler", "1f1b", {"gpipe", "1f1b", "1f1b_interleaved", "zb1p", "zbv"});
    q.post_validation = pas->get_bool("pipeline_post_validation", false);
    if (pas->has("pipeline_layers")) {
      for (double v : pas->get_float_list("pipeline_layers")) {
        if (v < 1 || v != static_cast<double>(static_cast<int>(v)))
          pas->fail("pipeline_layers", "each stage's layer count must be an integer >= 1 (got " + format_double(v) + ")");
        q.layers.push_back(static_cast<int>(v));
      }
      if (q.nstages > 0 && static_cast<int>(q.layers.size()) != q.nstages)
        pas->fail("pipeline_layers", "lists " + std::to_string(q.layers.size()) + " stages but pipeline_nstages is " +
                                         std::to_string(q.nstages));
    }
  }
  std::optional<ArgMap> offload;
  if (cc.has("offload")) {
    offload.emplace(cc.child("offload"));
    // A tier: host (or true) or nvme; false: not offloaded.
    const std::vector<std::string> tiers{"false", "true", "host", "nvme"};
    const auto opt_tier = offload->get_string("optimizer", "false", tiers);
    const auto param_tier = offload->get_string("params", "false", tiers);
    c.offload.optimizer = opt_tier != "false";
    c.offload.params = param_tier != "false";
    c.offload.optimizer_nvme = opt_tier == "nvme";
    c.offload.params_nvme = param_tier == "nvme";
    const bool nvme = c.offload.optimizer_nvme || c.offload.params_nvme;
    c.offload.nvme_path = offload->get_string("nvme_path", "");
    c.offload.nvme_buffer_mb = offload->get_float("nvme_buffer_mb", 256.0, 0.0);
    c.offload.nvme_io = offload->get_string("nvme_io", "auto", {"auto", "io_uring", "threads"});
    if (nvme && c.offload.nvme_path.empty())
      offload->fail("nvme_path", "is required with the nvme tier: a folder on a local disk (each rank uses a subfolder)");
    // Set to anything but its default without the tier (a resolved config, defaults written out, still loads).
    if (!nvme && !c.offload.nvme_path.empty())
      offload->fail("nvme_path", "is for the nvme tier, but neither offload.optimizer nor offload.params is nvme");
    if (nvme && c.offload.nvme_buffer_mb <= 0) offload->fail("nvme_buffer_mb", "must be > 0");
    if (nvme && opts.check_files) {
      std::error_code ec;
      if (!std::filesystem::exists(c.offload.nvme_path, ec))
        offload->fail("nvme_path", "'" + c.offload.nvme_path + "' does not exist (create the folder first)");
      if (!std::filesystem::is_directory(c.offload.nvme_path, ec))
        offload->fail("nvme_path", "'" + c.offload.nvme_path + "' is not a folder");
    }
    if (c.offload.params_nvme && !c.offload.optimizer_nvme)
      offload->fail("params", "nvme needs the optimizer on NVMe too: compute_config.offload.optimizer: nvme");
    const bool ratio_given = offload->has("ratio");
    c.offload.ratio = offload->get_float("ratio", 1.0, 0.0, 1.0);
    if (c.offload.ratio <= 0) offload->fail("ratio", "must be > 0 (leave offload.optimizer false to offload nothing)");
    if (ratio_given && !c.offload.optimizer)
      offload->fail("ratio", "is the share of the optimizer state offloaded; it needs compute_config.offload.optimizer: true");
    c.offload.delayed_update = offload->get_bool("delayed_update", false);
    if (c.offload.delayed_update && c.offload.optimizer_nvme)
      offload->fail("delayed_update", "is for the host tier: the nvme tier streams the state through its buffer in the step");
    if (c.offload.delayed_update && (!c.offload.optimizer || c.offload.ratio < 1.0))
      offload->fail("delayed_update", "delays the host step, so it needs the whole optimizer on the host: "
                                      "compute_config.offload.optimizer: true and offload.ratio 1");
  }

  t.pas_policy = top.get_string("pas_policy", "autodist", {"dp", "tp", "hybrid", "autodist"});

  // model: the registry parses `args`; the loader never names a model.
  auto model_impl = top_impl->child("model", true);
  ArgMap model(model_impl);
  // A Hugging Face folder is enough: its config.json names the type and fills model.args.
  t.model.init_from = model.get_string("init_from", "");
  std::optional<ModelCatalog::Folder> folder;
  if (!t.model.init_from.empty() && opts.models.folder_args) {
    std::error_code ec;
    if (std::filesystem::exists(std::filesystem::path(t.model.init_from) / "config.json", ec)) {
      try {
        folder = opts.models.folder_args(t.model.init_from);
      } catch (const std::exception& e) {
        model.fail("init_from", e.what());
      }
    } else if (opts.check_files) {
      model.fail("init_from", "'" + t.model.init_from + "' has no config.json (a folder transformers' save_pretrained wrote)");
    }
  }
  t.model.type = folder ? model.get_string("type", folder->type) : model.get_string("type");
  if (folder && t.model.type != folder->type)
    model.fail("type", t.model.type + ", but " + t.model.init_from + "/config.json has model_type " + folder->type);
  const auto& names = opts.models.names;
  const bool check_type = opts.models.parse || !names.empty();
  if (check_type && std::find(names.begin(), names.end(), t.model.type) == names.end())
    model.fail("type", "unknown model type '" + t.model.type + "'" + did_you_mean(t.model.type, names) +
                           (names.empty() ? "; no models are registered" : "; registered: " + join(names)));
  if (opts.models.parse) {
    auto args_impl = model_impl->child("args", false);
    if (folder) fill_from_folder(*args_impl, *folder, t.model.init_from + "/config.json");
    ArgMap args(args_impl);
    t.model.args = opts.models.parse(t.model.type, args);
    if (const auto [key, p] = t.model.args->attention_dropout(); p > 0 && t.compute_config.context_parallel_size > 1)
      args.fail(key, format_double(p) + ": context-parallel attention (compute_config.context_parallel_size " +
                         std::to_string(t.compute_config.context_parallel_size) +
                         ") has no attention dropout; set it to 0 or context_parallel_size to 1");
    if (const auto [key, why] = t.model.args->context_parallel_refusal();
        !key.empty() && t.compute_config.context_parallel_size > 1)
      args.fail(key, why + ": context-parallel attention (compute_config.context_parallel_size " +
                         std::to_string(t.compute_config.context_parallel_size) + ") cannot run it");
    args.finish();
  } else {
    model_impl->take_raw("args");
  }
  t.model.activation_checkpointing = model.get_bool("activation_checkpointing", false);
  t.model.loss = model.get_string("loss", "auto", {"auto", "plain", "chunked", "fused"});
  t.model.loss_chunk_size = static_cast<int>(model.get_int("loss_chunk_size", 4096, 1, 1 << 30));
  t.model.make_vocab_size_divisible_by =
      static_cast<int>(model.get_int("make_vocab_size_divisible_by", 1, 1, 1 << 20));

  ArgMap optim = top.child("optimizer");
  auto& o = t.optimizer;
  {
    std::vector<std::string> types = opts.optimizers.names;
    if (std::find(types.begin(), types.end(), "adamw") == types.end()) types.insert(types.begin(), "adamw");
    o.type = optim.get_string("type", "adamw", types);
  }
  if (o.type == "adamw") {
    ArgMap oargs = optim.child("args");
    read_adamw_args(oargs, o);
  } else {
    o.args = opts.optimizers.parse(o.type, optim, o);
  }
  o.clip_gnorm = optim.get_float("clip_gnorm", 0.0, 0.0);

  ArgMap sched = top.child("lr_scheduler");
  auto& s = t.lr_scheduler;
  s.type = sched.get_string("type", "constant", {"constant", "linear", "cosine", "wsd"});
  ArgMap sargs = sched.child("args");
  s.warmup_steps = sargs.get_int("warmup_steps", 0, 0);
  const bool wsd = s.type == "wsd";
  if (wsd) {
    // The decay phase is decay_steps long or decay_ratio of the run: exactly one of them.
    const bool by_steps = sargs.has("decay_steps"), by_ratio = sargs.has("decay_ratio");
    if (by_steps && by_ratio)
      sargs.fail("decay_ratio", "is set as well as decay_steps; type wsd takes one of them (the decay phase's "
                                "length in steps, or its share of the run)");
    if (!by_steps && !by_ratio)
      sargs.fail("decay_steps", "type wsd needs decay_steps (the decay phase's length) or decay_ratio (its share "
                                "of the run)");
    s.decay_steps = sargs.get_int("decay_steps", 0, 1);
    s.decay_ratio = sargs.get_float("decay_ratio", 0.0);
    if (by_ratio && !(s.decay_ratio > 0 && s.decay_ratio <= 1))
      sargs.fail("decay_ratio", "must be in (0, 1], got " + format_double(s.decay_ratio));
    s.decay_type = sargs.get_string("decay_type", "linear", {"linear", "cosine", "1-sqrt"});
  } else {
    for (const char* key : {"decay_ratio", "decay_type"})
      if (sargs.has(key)) sargs.fail(key, "applies to lr_scheduler.type wsd only (type is " + s.type + ")");
    s.decay_steps = sargs.get_int("decay_steps", 0, 0);
  }
  s.min_lr = sargs.get_float("min_lr", 0.0, 0.0);
  // A constant rate (after warm-up) never decays: a decay length or floor would do
  // nothing (their defaults, 0, as a resolved config writes them, are fine).
  if (s.type == "constant") {
    if (s.decay_steps > 0)
      sargs.fail("decay_steps", std::to_string(s.decay_steps) + " does nothing under lr_scheduler.type constant (the rate never decays)");
    if (s.min_lr > 0)
      sargs.fail("min_lr", format_double(s.min_lr) + " does nothing under lr_scheduler.type constant (the rate never decays)");
  }
  s.interval = sched.get_string("interval", "step", {"step", "epoch"});

  auto ds_impl = top_impl->child("dataset", true);
  ArgMap ds(ds_impl);
  t.dataset.type = ds.get_string("type", "token_bin", {"token_bin", "indexed", "preference"});
  const bool indexed = t.dataset.type == "indexed";
  const bool preference = t.dataset.type == "preference";
  auto train_impl = ds_impl->child("train_args", true);
  ArgMap train_args(train_impl);
  std::vector<ArgMap> train_sources, val_sources;
  if (indexed) {
    t.dataset.indexed_train = read_indexed(train_impl, nullptr, &train_sources);
    t.dataset.train_args.seq_len = t.dataset.indexed_train.seq_len;  // the planner reads it for either type
  } else if (preference) {
    t.dataset.preference_train = read_preference(train_args, nullptr);
    t.dataset.train_args.seq_len = t.dataset.preference_train.seq_len;
  } else {
    t.dataset.train_args = read_token_bin(train_args, nullptr);
  }
  std::optional<ArgMap> val_args;
  if (ds.has("val_args")) {
    auto val_impl = ds_impl->child("val_args", false);
    val_args.emplace(val_impl);
    if (indexed) t.dataset.indexed_val = read_indexed(val_impl, &t.dataset.indexed_train, &val_sources);
    else if (preference) t.dataset.preference_val = read_preference(*val_args, &t.dataset.preference_train);
    else t.dataset.val_args = read_token_bin(*val_args, &t.dataset.train_args);
  }

  ArgMap dl = top.child("dataloader");
  t.dataloader.prefetch = static_cast<int>(dl.get_int("prefetch", 2, 0, 1024));
  t.dataloader.pin_memory = dl.get_bool("pin_memory", true);

  ArgMap ck = top.child("checkpoint");
  auto& k = t.checkpoint;
  k.save_dir = ck.get_string("save_dir", "");
  k.save_type = ck.get_string("save_type", "sharded", {"sharded", "deduped"});
  k.every_n_train_steps = ck.get_int("every_n_train_steps", 0, 0);
  k.keep_last_n_checkpoints = static_cast<int>(ck.get_int("keep_last_n_checkpoints", 0, 0, 1 << 20));
  k.resume_from = ck.get_string("resume_from", "");
  k.save_on_end = ck.get_bool("save_on_end", true);
  k.async_save = ck.get_bool("async_save", true);

  std::vector<std::string> precision_choices = kPrecisions;
  for (const auto& [alias, canonical] : kPrecisionAliases) precision_choices.push_back(alias);
  t.precision = top.get_string("precision", "32-true", precision_choices);
  for (const auto& [alias, canonical] : kPrecisionAliases)
    if (t.precision == alias) t.precision = canonical;
  top_impl->record("precision", YAML::Node(t.precision));
  {
    // Gradients are reduced in fp32 or in the compute dtype; nothing else makes sense.
    const std::string low = t.precision.rfind("bf16", 0) == 0 ? "bf16" : t.precision.rfind("16", 0) == 0 ? "fp16" : "fp32";
    if (c.reduce_dtype != "auto" && c.reduce_dtype != "fp32" && c.reduce_dtype != low)
      cc.fail("reduce_dtype", "reduce_dtype " + c.reduce_dtype + " does not fit precision " + t.precision +
                                  " (use auto, fp32" + (low == "fp32" ? "" : " or " + low) + ")");
  }
  const bool fp16 = t.precision == "16-mixed" || t.precision == "16-true";
  if (top.has("loss_scaler")) {
    ArgMap ls = top.child("loss_scaler");
    if (!fp16)
      top.fail("loss_scaler", "a loss scaler is used by the fp16 precisions (16-mixed, 16-true) only, not by " +
                                  t.precision);
    auto& l = t.loss_scaler;
    l.init_scale = ls.get_float("init_scale", l.init_scale);
    if (l.init_scale <= 0) ls.fail("init_scale", "must be > 0");
    l.growth_factor = ls.get_float("growth_factor", l.growth_factor);
    if (l.growth_factor <= 1) ls.fail("growth_factor", "must be > 1");
    l.backoff_factor = ls.get_float("backoff_factor", l.backoff_factor);
    if (l.backoff_factor <= 0 || l.backoff_factor >= 1) ls.fail("backoff_factor", "must be in (0, 1)");
    l.growth_interval = ls.get_int("growth_interval", l.growth_interval, 1);
  }

  t.micro_batch_size = top.get_int("micro_batch_size", 1, 1);
  const bool accumulation_given = top.has("grad_accumulation_steps");
  t.grad_accumulation_steps = top.get_int("grad_accumulation_steps", 1, 1);
  t.global_batch_size = top.get_int("global_batch_size", 0, 0);
  t.max_train_steps = top.get_int("max_train_steps", 0, 0);
  t.max_epochs = top.get_int("max_epochs", 0, 0);
  t.val_every_n_train_steps = top.get_int("val_every_n_train_steps", 0, 0);
  t.max_val_steps = top.get_int("max_val_steps", 0, 0);
  t.log_progress_every_n_train_steps = top.get_int("log_progress_every_n_train_steps", 10, 1);
  t.seed = static_cast<uint64_t>(top.get_int("seed", 0, 0));

  // log: a list of sinks; absent = console, <run_dir>/metrics.jsonl, <run_dir>/tensorboard.
  const std::string default_metrics = (fs::path(t.run_dir) / "metrics.jsonl").string();
  const std::string default_events = (fs::path(t.run_dir) / "tensorboard").string();
  if (top.has("log")) {
    for (auto& sink_impl : top_impl->child_list("log")) {
      ArgMap sink(sink_impl);
      LogSink ls;
      ls.type = sink.get_string("type", std::nullopt, {"console", "jsonl", "tensorboard"});
      ArgMap sargs_ = sink.child("args");
      if (ls.type == "jsonl") {
        ls.path = sargs_.get_string("path", default_metrics);
        if (ls.path.empty()) sargs_.fail("path", "must not be empty");
      } else if (ls.type == "tensorboard") {
        ls.path = sargs_.get_string("dir", default_events);
        if (ls.path.empty()) sargs_.fail("dir", "must not be empty");
      }
      t.log.push_back(ls);
    }
  } else {
    t.log = {{"console", ""}, {"jsonl", default_metrics}, {"tensorboard", default_events}};
    YAML::Node seq(YAML::NodeType::Sequence);
    for (const auto& ls : t.log) {
      YAML::Node sink(YAML::NodeType::Map);
      sink["type"] = ls.type;
      YAML::Node args(YAML::NodeType::Map);
      if (!ls.path.empty()) args[ls.type == "tensorboard" ? "dir" : "path"] = ls.path;
      sink["args"] = args;
      seq.push_back(sink);
    }
    top_impl->record("log", seq);
  }

  // profile: {steps: [from, to], dir, record_shapes, with_stack}
  if (top.has("profile")) {
    ArgMap prof = top.child("profile");
    const auto steps = prof.get_float_list("steps");
    if (steps.size() != 2 || steps[0] != std::floor(steps[0]) || steps[1] != std::floor(steps[1]) || steps[0] < 1 ||
        steps[1] < steps[0])
      prof.fail("steps", "expected two whole step numbers [from, to] with 1 <= from <= to");
    t.profile.from = static_cast<int64_t>(steps[0]);
    t.profile.to = static_cast<int64_t>(steps[1]);
    t.profile.dir = prof.get_string("dir", (fs::path(t.run_dir) / "profile").string());
    if (t.profile.dir.empty()) prof.fail("dir", "must not be empty");
    t.profile.record_shapes = prof.get_bool("record_shapes", false);
    t.profile.with_stack = prof.get_bool("with_stack", false);
  }
  t.memory_snapshot = top.get_bool("memory_snapshot", false);
  t.memory_snapshot_step = top.get_int("memory_snapshot_step", 0, 0);
  if (t.memory_snapshot_step > 0 && !t.memory_snapshot)
    top.fail("memory_snapshot_step", "is set but memory_snapshot is false");

  load_fault_tolerance(top, t);  // after checkpoint and compute_config (its checks combine them)
  load_lora(top, t);
  load_alignment(top, t);  // after lora (reference: auto) and dataset
  load_eval(top, t);  // after compute_config (it refuses pipeline and context parallelism)

  // Unknown keys before the checks that combine keys: a misspelt key would
  // otherwise surface as a confusing consequence of its default.
  top.finish();

  if (runtime_given && opts.world_size > 1 && c.runtime_ngpus != opts.world_size)
    cc.fail("runtime_ngpus", "is " + std::to_string(c.runtime_ngpus) + " but the job was launched with " +
                                 std::to_string(opts.world_size) +
                                 " processes (world size); leave it out to use the launch size");
  // Under autodist plan_ngpus only bounds tp (the planner takes a tp dividing
  // it and the world), so dp, and with it the accumulation, is the plan's:
  // derived after planning (planner.cpp), not here.
  const bool autodist = t.pas_policy == "autodist";
  const int tp_fixed = autodist ? 1 : c.plan_ngpus;
  const std::string tp_text = autodist ? "" : " x plan_ngpus " + std::to_string(c.plan_ngpus);
  if (!autodist && c.runtime_ngpus % c.plan_ngpus != 0)
    cc.fail("runtime_ngpus", std::to_string(c.runtime_ngpus) + " is not a multiple of plan_ngpus " +
                                 std::to_string(c.plan_ngpus));
  if (t.pas_policy == "dp" && c.plan_ngpus > 1)
    top.fail("pas_policy", "dp keeps a whole model on every rank, but compute_config.plan_ngpus " +
                               std::to_string(c.plan_ngpus) + " asks to split one over " + std::to_string(c.plan_ngpus) +
                               " ranks; use pas_policy hybrid (tp = plan_ngpus), tp or autodist");
  const int cp = c.context_parallel_size;
  if (cp > 1 && c.runtime_ngpus % (tp_fixed * cp) != 0)
    cc.fail("context_parallel_size", std::to_string(cp) + tp_text + " does not divide runtime_ngpus " +
                                         std::to_string(c.runtime_ngpus));
  if (cp > 1) {
    // Every sequence splits into cp equal parts, 2 cp under zigzag (rank r holds chunks r and 2 cp - 1 - r).
    const int64_t parts = c.cp_load_balance == "zigzag" ? 2 * cp : cp;
    const std::string need = c.cp_load_balance == "zigzag" ? "2 x context_parallel_size" : "context_parallel_size";
    auto check = [&](const ArgMap& m, int64_t seq) {
      if (seq % parts != 0)
        m.fail("seq_len", std::to_string(seq) + " does not split over compute_config.context_parallel_size " +
                              std::to_string(cp) + " with compute_config.cp_load_balance " + c.cp_load_balance +
                              ": it must be a multiple of " + need + " (" + std::to_string(parts) + ")");
    };
    check(train_args, t.dataset.train_args.seq_len);
    // Indexed datasets keep the validation set's length in indexed_val (val_args, token_bin's, is unset).
    if (val_args)
      check(*val_args, indexed ? t.dataset.indexed_val->seq_len
                       : preference ? t.dataset.preference_val->seq_len : t.dataset.val_args->seq_len);
  }
  const int pp = c.pipeline.pp_size;
  if (pp > 1 && c.runtime_ngpus % (tp_fixed * cp * pp) != 0)
    pas->fail("pp_size", std::to_string(pp) + tp_text +
                             (cp > 1 ? " x context_parallel_size " + std::to_string(cp) : std::string()) +
                             " does not divide runtime_ngpus " + std::to_string(c.runtime_ngpus));
  // nnScaler's reading (a replica spans plan_ngpus x cp x pp ranks): the dp of
  // every policy but autodist, whose planner checks zero_ngroups per candidate.
  const bool spans = c.runtime_ngpus % (c.plan_ngpus * cp * pp) == 0;
  const int64_t dp = spans ? c.runtime_ngpus / (c.plan_ngpus * cp * pp) : 0;
  // Under autodist the largest dp a plan can have (tp 1): every other divides it.
  const int64_t zero_dp = autodist ? c.runtime_ngpus / (cp * pp) : dp;
  if (zero_dp % c.zero_ngroups != 0)
    cc.fail("zero_ngroups", std::to_string(c.zero_ngroups) + " does not divide the data-parallel size " +
                                std::to_string(zero_dp) + " (runtime_ngpus " + std::to_string(c.runtime_ngpus) +
                                (autodist ? "" : " / plan_ngpus " + std::to_string(c.plan_ngpus)) +
                                (cp > 1 ? " / context_parallel_size " + std::to_string(cp) : std::string()) +
                                (pp > 1 ? " / pp_size " + std::to_string(pp) : std::string()) +
                                (autodist ? ", the most any autodist plan has)" : ")"));
  if (c.backend == "nccl" && c.device == "cpu")
    cc.fail("backend", "nccl needs CUDA devices, but compute_config.device is cpu (use gloo or auto)");
  if (c.offload.params && c.use_zero != 3)
    offload->fail("params", std::string(c.offload.params_nvme ? "nvme keeps ZeRO-3's parameter units in files" : "true keeps ZeRO-3's parameter units on the host") +
                                ", so it needs compute_config.use_zero: 3 (got " +
                                std::to_string(c.use_zero) + ")");
  // As FSDP's CPUOffload(offload_params=True): the parameters' chunks on the
  // host are what the optimizer updates there, so the whole step runs on the host.
  if (c.offload.params && (!c.offload.optimizer || c.offload.ratio < 1.0))
    offload->fail("params", std::string("true needs the whole optimizer on the host: compute_config.offload.optimizer: true") +
                                (c.offload.optimizer ? " and offload.ratio 1 (got " + format_double(c.offload.ratio) + ")"
                                                     : " (got false)"));
  if ((c.offload.optimizer || c.offload.params) && c.cuda_graphs == "true")
    offload->fail(c.offload.optimizer ? "optimizer" : "params",
                  "offload cannot be captured in a CUDA graph (the host step reads the gradient norm on the host); "
                  "set compute_config.cuda_graphs: false");

  // global = micro x dp x accumulation. Given a global batch and no accumulation,
  // derive the accumulation (as nnScaler does), so one file fits any dp.
  const std::string dp_text = "dp " + std::to_string(dp) + " (runtime_ngpus " +
                              std::to_string(c.runtime_ngpus) + " / plan_ngpus " +
                              std::to_string(c.plan_ngpus) +
                              (cp > 1 ? " / context_parallel_size " + std::to_string(cp) : std::string()) +
                              (pp > 1 ? " / pas_config.pp_size " + std::to_string(pp) : std::string()) + ")";
  const int64_t per_step = t.micro_batch_size * dp;
  // A pipeline's step is one flush of pipeline_nmicros micro-batches: the accumulation,
  // when neither it nor the global batch says otherwise.
  if (pp > 1 && c.pipeline.nmicros > 0 && !accumulation_given && t.global_batch_size == 0)
    t.grad_accumulation_steps = c.pipeline.nmicros;
  if (autodist && t.global_batch_size > 0) {
    // The global batch is fixed here; the accumulation is global / (micro x
    // the plan's dp), checked by the planner (and pinned when named too).
    const int64_t unit = t.micro_batch_size * (accumulation_given ? t.grad_accumulation_steps : 1);
    if (t.global_batch_size % unit != 0)
      top.fail("global_batch_size",
               std::to_string(t.global_batch_size) + " is not a multiple of micro_batch_size " +
                   std::to_string(t.micro_batch_size) +
                   (accumulation_given ? " x grad_accumulation_steps " + std::to_string(t.grad_accumulation_steps) +
                                             " = " + std::to_string(unit)
                                       : std::string()) +
                   " (global = micro x dp x accumulation, dp the plan's under pas_policy autodist)");
    t.accumulation_fixed = accumulation_given;
    // The accumulation at nnScaler's dp, for reading only: the trainer steps the plan's.
    if (!accumulation_given && dp > 0 && t.global_batch_size % per_step == 0)
      t.grad_accumulation_steps = t.global_batch_size / per_step;
  } else {
    if (dp == 0)  // autodist only: every other policy checked the spans above
      top.fail("global_batch_size", "is not given, and runtime_ngpus " + std::to_string(c.runtime_ngpus) +
                                        " is not a multiple of compute_config.plan_ngpus " +
                                        std::to_string(c.plan_ngpus) +
                                        (cp > 1 ? " x context_parallel_size " + std::to_string(cp) : std::string()) +
                                        (pp > 1 ? " x pas_config.pp_size " + std::to_string(pp) : std::string()) +
                                        " to derive it as micro_batch_size x grad_accumulation_steps x dp; name it");
    if (t.global_batch_size > 0 && !accumulation_given) {
      if (t.global_batch_size % per_step != 0)
        top.fail("global_batch_size",
                 std::to_string(t.global_batch_size) + " is not a multiple of micro_batch_size " +
                     std::to_string(t.micro_batch_size) + " x " + dp_text + " = " + std::to_string(per_step));
      t.grad_accumulation_steps = t.global_batch_size / per_step;
      top_impl->record("grad_accumulation_steps", YAML::Node(std::to_string(t.grad_accumulation_steps)));
    }
    const int64_t product = per_step * t.grad_accumulation_steps;
    if (t.global_batch_size > 0 && t.global_batch_size != product)
      top.fail("global_batch_size",
               std::to_string(t.global_batch_size) + " != micro_batch_size " + std::to_string(t.micro_batch_size) +
                   " x " + dp_text + " x grad_accumulation_steps " + std::to_string(t.grad_accumulation_steps) +
                   " = " + std::to_string(product));
    t.global_batch_size = product;
  }
  top_impl->record("global_batch_size", YAML::Node(std::to_string(t.global_batch_size)));
  // Under autodist the planner checks the micro-batches and the schedule per candidate.
  if (pp > 1) check_pipeline(*pas, c, autodist ? 0 : t.grad_accumulation_steps, dp_text, opts.checks);
  if (c.pipeline.post_validation) {
    // What the speculative step cannot follow: no pipeline to overlap, a host
    // step already delayed, a captured step, parameters gathered once per step.
    const auto refuse = [&](const std::string& why) {
      pas->fail("pipeline_post_validation", "true " + why + "; set pipeline_post_validation: false");
    };
    if (pp < 2) refuse("overlaps pipeline steps, so it needs pas_config.pp_size of 2 or more");
    if (c.offload.optimizer || c.offload.params) refuse("cannot back up an offloaded optimizer (compute_config.offload)");
    if (c.use_zero == 3) refuse("is not supported with compute_config.use_zero: 3 (its parameters are gathered once per step)");
    if (c.cuda_graphs == "true") refuse("cannot be captured in a CUDA graph (compute_config.cuda_graphs: true)");
  }

  // The asynchronous saver snapshots the state into host memory, which the nvme tier has no room for.
  if (c.offload.optimizer_nvme && t.checkpoint.async_save && ck.has("async_save"))
    ck.fail("async_save", "true would snapshot the NVMe-offloaded state into host memory; the nvme tier saves "
                          "synchronously, streaming from its files (leave async_save out or set it false)");
  if (c.offload.optimizer_nvme) t.checkpoint.async_save = false;

  if (t.max_train_steps == 0 && t.max_epochs == 0)
    top.fail("max_train_steps", "one of max_train_steps or max_epochs must be > 0");
  if (t.val_every_n_train_steps > 0 && !t.dataset.has_val())
    top.fail("val_every_n_train_steps", "validation needs dataset.val_args, which is not set");
  if (s.min_lr > o.lr)
    sargs.fail("min_lr", format_double(s.min_lr) + " is above optimizer.args.lr " + format_double(o.lr));
  if (!wsd && s.decay_steps > 0 && s.warmup_steps > s.decay_steps)
    sargs.fail("warmup_steps", std::to_string(s.warmup_steps) + " is longer than decay_steps " +
                                   std::to_string(s.decay_steps));
  // wsd's phases must fit in the run; where its length depends on the data
  // (max_epochs under interval step, max_train_steps under interval epoch),
  // start-up checks them once an epoch's steps are known (check_wsd_fits).
  if (wsd) {
    const bool by_epoch = s.interval == "epoch";
    std::optional<std::pair<int64_t, std::string>> total;
    if (!by_epoch && t.max_train_steps > 0) total.emplace(t.max_train_steps, "max_train_steps");
    if (by_epoch && t.max_train_steps == 0) total.emplace(t.max_epochs, "max_epochs");
    if (total)
      if (auto bad = wsd_misfit(s, total->first, total->second + " " + std::to_string(total->first)))
        sargs.fail(bad->first, bad->second);
  }
  if (k.every_n_train_steps > 0 && k.save_dir.empty())
    ck.fail("every_n_train_steps", "periodic checkpoints need checkpoint.save_dir");
  if (k.resume_from == "last" && k.save_dir.empty())
    ck.fail("resume_from", "'last' looks in checkpoint.save_dir, which is not set");

  if (cp > 1 && c.cuda_graphs == "true")
    cc.fail("cuda_graphs", "true is not supported with compute_config.context_parallel_size " + std::to_string(cp) +
                               " yet; set cuda_graphs: false or context_parallel_size: 1");
  if (t.dataset.document_mask() && c.cuda_graphs == "true")
    train_args.fail("document_mask", "a captured CUDA graph reads no per-token positions or masks; set "
                                     "compute_config.cuda_graphs: false or document_mask: false");
  if (opts.check_files) {
    if (indexed) {
      const IndexedKeys train{train_args, train_sources, t.dataset.indexed_train, t.model.init_from};
      std::optional<IndexedKeys> val;
      if (val_args) val.emplace(IndexedKeys{*val_args, val_sources, *t.dataset.indexed_val, t.model.init_from});
      required(opts.checks.indexed_datasets, "indexed_datasets")(train, val ? &*val : nullptr);
    } else if (!preference) {  // a preference dataset's manifest is read when the run opens it (data/preference_dataset)
      check_token_file(train_args, t.dataset.train_args);
      if (val_args) check_token_file(*val_args, *t.dataset.val_args);
    }
  }

  compact_empty(top_impl->out);
  YAML::Emitter emitter;
  emitter << top_impl->out;
  t.resolved_yaml = std::string(emitter.c_str()) + "\n";

  if (opts.reject_unimplemented) check_implemented(t);
  return t;
}

void check_implemented(const TrainerArgs&) {
  // Nothing is refused here at present (context with pipeline parallelism was,
  // until the stages carried cp slices). A setting the trainer cannot run yet
  // throws ConfigError(config_file + ": KEY: WHAT is not implemented yet").
}

int64_t wsd_decay_length(const LrSchedulerArgs& s, int64_t total) {
  return s.decay_steps > 0 ? s.decay_steps : std::llround(s.decay_ratio * static_cast<double>(total));
}

void check_wsd_fits(const LrSchedulerArgs& s, int64_t total, const std::string& total_from) {
  if (s.type != "wsd") return;
  if (auto bad = wsd_misfit(s, total, total_from))
    throw ConfigError("lr_scheduler.args." + bad->first + ": " + bad->second);
}

}  // namespace nnstrain::config
