#include "trainer/checkpoint/manifest.h"

#include <sys/stat.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "base/text.h"

namespace nnstrain::checkpoint {

using util::quote_prefix;

namespace {

std::string real_path(const std::string& p) {
  char buf[PATH_MAX];
  return ::realpath(p.c_str(), buf) ? std::string(buf) : std::string();
}

}  // namespace

nlohmann::json parse_json_bounded(const std::string& text, const std::string& where) {
  if (text.size() > kMaxJsonBytes)
    throw CheckpointError(where + ": " + std::to_string(text.size()) + " bytes, over the limit of " +
                          std::to_string(kMaxJsonBytes) + " bytes for a JSON file");
  auto depth_guard = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json&) {
    using E = nlohmann::json::parse_event_t;
    if ((event == E::object_start || event == E::array_start) && depth >= kMaxJsonDepth)
      throw CheckpointError(where + ": JSON nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
    return true;
  };
  try {
    return nlohmann::json::parse(text, depth_guard);
  } catch (const nlohmann::json::exception& e) {
    // nlohmann's messages quote the last token read; keep them short.
    std::string msg = e.what();
    if (msg.size() > 200) msg = msg.substr(0, 200) + "...";
    throw CheckpointError(where + ": not valid JSON: " + msg);
  }
}

std::string read_file_bounded(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw CheckpointError(path + ": cannot open: " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) throw CheckpointError(path + ": not a regular file");
  if (static_cast<uint64_t>(st.st_size) > kMaxJsonBytes)
    throw CheckpointError(path + ": " + std::to_string(st.st_size) + " bytes, over the limit of " +
                          std::to_string(kMaxJsonBytes) + " bytes for a JSON file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CheckpointError(path + ": cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

nlohmann::json read_json_bounded(const std::string& path) { return parse_json_bounded(read_file_bounded(path), path); }

void check_plain_name(const std::string& name, const std::string& what) {
  std::string fault;
  if (name.empty()) fault = "is empty";
  else if (name == "." || name == "..") fault = "is '" + name + "'";
  else if (name.find('/') != std::string::npos) fault = "contains '/'";
  else if (name.find('\0') != std::string::npos) fault = "contains a NUL byte";
  if (!fault.empty())
    throw CheckpointError(what + " " + quote_prefix(name) + " " + fault +
                          ": only plain file names inside the folder are allowed");
}

std::string confined_path(const std::string& dir, const std::string& name, const std::string& what) {
  check_plain_name(name, what);
  const std::string path = dir + "/" + name;
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return path;
  const std::string target = real_path(path), root = real_path(dir);
  if (target.empty())
    throw CheckpointError(what + " " + quote_prefix(name) + " is a symbolic link that does not resolve");
  if (root.empty() || target.compare(0, root.size() + 1, root + "/") != 0)
    throw CheckpointError(what + " " + quote_prefix(name) + " is a symbolic link to " + quote_prefix(target, 200) +
                          ", outside " + dir);
  return path;
}

Manifest parse_manifest(const std::string& text, const std::string& where) {
  Manifest m;
  m.json = parse_json_bounded(text, where);
  const auto& j = m.json;
  if (!j.is_object()) throw CheckpointError(where + ": not a JSON object");
  const auto format = j.value("format", nlohmann::json()).is_string() ? j.at("format").get<std::string>() : "";
  if (format != kCheckpointFormat)
    throw CheckpointError(where + ": not an nnstrain checkpoint manifest (format " + quote_prefix(format) + ")");
  if (!j.contains("version") || j.at("version") != kCheckpointVersion)
    throw CheckpointError(where + ": unsupported version " +
                          quote_prefix(j.value("version", nlohmann::json(0)).dump()));
  try {
    const auto& files = j.at("files");
    if (!files.is_object()) throw CheckpointError(where + ": \"files\" is not an object");
    for (const auto& [file, specs] : files.items()) {
      check_plain_name(file, where + ": shard file");
      if (!specs.is_array())
        throw CheckpointError(where + ": the entry of shard file " + quote_prefix(file) + " is not a list");
      m.files.push_back(file);
      for (const auto& s : specs) {
        ManifestEntry e{s.get<ShardSpec>(), file, s.value("key", std::string()), s.value("transposed", false)};
        if (e.key.empty()) e.key = e.spec.name;
        if (s.contains("key_offset")) {
          if (!s.at("key_offset").is_number_integer() || s.at("key_offset").get<int64_t>() < 0 || e.transposed)
            throw CheckpointError(where + ": " + quote_prefix(e.spec.name) + " in " + quote_prefix(file) +
                                  " has a key_offset that is not a non-negative integer (or is transposed)");
          e.key_offset = s.at("key_offset").get<int64_t>();
        }
        if (e.transposed && (e.spec.global_shape.size() != 2 || !e.spec.is_full()))
          throw CheckpointError(where + ": " + quote_prefix(e.spec.name) + " in " + quote_prefix(file) +
                                " is marked transposed but is not a whole 2-d tensor");
        auto& list = m.index[e.spec.name];
        if (!list.empty() && (list.front().spec.global_shape != e.spec.global_shape ||
                              list.front().spec.dtype != e.spec.dtype))
          throw CheckpointError(where + ": the pieces of " + quote_prefix(e.spec.name) + " in " +
                                quote_prefix(list.front().file) + " and " + quote_prefix(file) + " disagree on the global shape or dtype");
        list.push_back(std::move(e));
      }
    }
    if (!j.at("state").is_object()) throw CheckpointError(where + ": \"state\" is not an object");
    // The counters a resume reads as integers (a float there would be cast without a check).
    const auto& st = j.at("state");
    const bool bad_step = st.contains("step") && !st.at("step").is_number_integer();
    const bool bad_count = st.contains("optimizer") && st.at("optimizer").is_object() &&
                           st.at("optimizer").contains("step_count") &&
                           !st.at("optimizer").at("step_count").is_number_integer();
    if (bad_step || bad_count)
      throw CheckpointError(where + ": state." + (bad_step ? "step" : "optimizer.step_count") + " is not an integer");
    if (!j.at("rank_states").is_object()) throw CheckpointError(where + ": \"rank_states\" is not an object");
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(where + ": malformed manifest: " + e.what());
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::runtime_error& e) {  // ShardSpec validation
    throw CheckpointError(where + ": " + e.what());
  }
  return m;
}

}  // namespace nnstrain::checkpoint
