#include "data/prepare.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "data/chat/render_command.h"
#include "data/sha256.h"

extern char** environ;

namespace nnstrain::data {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Exit status 2: the command line is wrong (unknown dataset, missing file, bad option).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Exit status 1: everything else (hash mismatch, I/O, download).
struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

constexpr const char* kUsage =
    "usage: nnstrain prepare shakespeare_char [--input PATH] [--out DIR]\n"
    "       nnstrain prepare text --input FILE --out DIR [--level char|byte] [--val-fraction 0.1]\n"
    "       nnstrain prepare corpus --tokenizer PATH --input PATH [--input PATH ...] --out PREFIX [...]\n"
    "                (nnstrain prepare corpus --help: Megatron .bin/.idx from JSONL, text or alpaca records)\n";
constexpr const char* kShakespeareShared = "shared/data/tinyshakespeare/input.txt";
constexpr int kFormatVersion = 1;

struct Options {
  std::string dataset;
  std::optional<std::string> input;
  std::optional<std::string> out;
  std::optional<std::string> level;
  std::optional<double> val_fraction;
  bool help = false;
};

double parse_fraction(const std::string& s) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != s.size() || !(v > 0.0 && v < 1.0))
    throw UsageError("--val-fraction: expected a number in (0, 1), got '" + s + "'");
  return v;
}

Options parse_args(std::vector<std::string> args) {
  if (!args.empty() && args[0] == "prepare") args.erase(args.begin());
  Options o;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string a = args[i];
    if (a == "-h" || a == "--help") {
      o.help = true;
      continue;
    }
    if (a.rfind("--", 0) != 0) {
      if (!o.dataset.empty()) throw UsageError("unexpected argument '" + a + "'");
      o.dataset = a;
      continue;
    }
    // --key value or --key=value
    std::string value;
    auto eq = a.find('=');
    if (eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
    } else {
      if (i + 1 >= args.size()) throw UsageError("option " + a + " needs a value");
      value = args[++i];
    }
    if (a == "--input") o.input = value;
    else if (a == "--out") o.out = value;
    else if (a == "--level") o.level = value;
    else if (a == "--val-fraction") o.val_fraction = parse_fraction(value);
    else throw UsageError("unknown option '" + a + "'");
  }
  return o;
}

std::string read_whole_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Failure("cannot open '" + path + "': " + std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw Failure("read error in '" + path + "'");
  return ss.str();
}

}  // namespace

// Temp file in the same folder, fsync, rename: readers see the old file or the whole new one.
void write_file_atomic(const std::string& path_s, const std::string& bytes) {
  const fs::path path(path_s);
  const std::string tmp = path.string() + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw Failure("cannot create '" + tmp + "': " + std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      throw Failure("cannot write '" + tmp + "': " + std::strerror(e));
    }
    done += size_t(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw Failure("cannot flush '" + tmp + "': " + std::strerror(errno));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    throw Failure("cannot rename '" + tmp + "' to '" + path.string() + "': " + std::strerror(e));
  }
}

namespace {

void write_atomic(const fs::path& path, const std::string& bytes) { write_file_atomic(path.string(), bytes); }

// Strict UTF-8 -> code points (what Python's str, and so nanoGPT, calls characters).
std::vector<uint32_t> decode_utf8(const std::string& s, const std::string& path) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    unsigned char c = p[i];
    uint32_t cp;
    int len;
    if (c < 0x80) { cp = c; len = 1; }
    else if ((c & 0xE0) == 0xC0) { cp = c & 0x1F; len = 2; }
    else if ((c & 0xF0) == 0xE0) { cp = c & 0x0F; len = 3; }
    else if ((c & 0xF8) == 0xF0) { cp = c & 0x07; len = 4; }
    else { len = 0; cp = 0; }
    bool ok = len > 0 && i + size_t(len) <= n;
    for (int k = 1; ok && k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) ok = false;
      else cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    static const uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (ok && (cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))) ok = false;
    if (!ok)
      throw Failure("'" + path + "' is not valid UTF-8 (byte offset " + std::to_string(i) +
                    "); use --level byte");
    out.push_back(cp);
    i += size_t(len);
  }
  return out;
}

std::string encode_utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += char(0xE0 | (cp >> 12));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xF0 | (cp >> 18));
    s += char(0x80 | ((cp >> 12) & 0x3F));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  }
  return s;
}

std::string to_uint16_le(const std::vector<uint32_t>& ids, size_t begin, size_t end) {
  std::string bytes((end - begin) * 2, '\0');
  for (size_t i = begin; i < end; ++i) {
    bytes[2 * (i - begin)] = char(ids[i] & 0xFF);
    bytes[2 * (i - begin) + 1] = char((ids[i] >> 8) & 0xFF);
  }
  return bytes;
}

std::string pretty_size(uintmax_t bytes) {
  std::ostringstream s;
  s.precision(3);
  if (bytes >= (1u << 20)) s << double(bytes) / double(1u << 20) << " MiB";
  else if (bytes >= (1u << 10)) s << double(bytes) / double(1u << 10) << " KiB";
  else s << bytes << " B";
  return s.str();
}

void verify_hash(const std::string& path, const std::string& expected, const std::string& actual) {
  if (actual != expected)
    throw Failure("sha256 mismatch for '" + path + "': expected " + expected + ", got " + actual +
                  " (a corrupted or different file; delete it or pass the right --input)");
}

// What prepare would write, described so a rerun can tell whether it is already done.
struct Spec {
  std::string dataset;
  std::string level;  // char | byte
  double val_fraction;
  std::string source_sha256;
};

// True if out_dir holds complete outputs of `spec` (meta.json is written last, so it marks completion).
bool up_to_date(const fs::path& out_dir, const Spec& spec) {
  std::error_code ec;
  const fs::path meta_path = out_dir / "meta.json";
  if (!fs::exists(meta_path, ec)) return false;
  try {
    json meta = json::parse(read_whole_file(meta_path.string()));
    if (meta.value("format_version", 0) != kFormatVersion) return false;
    if (meta.value("source_sha256", "") != spec.source_sha256) return false;
    if (meta.value("level", "") != spec.level) return false;
    if (meta.value("dataset", "") != spec.dataset) return false;
    if (meta.value("val_fraction", -1.0) != spec.val_fraction) return false;
    const uintmax_t elem = meta.value("dtype", "") == "uint32" ? 4 : 2;
    for (const char* split : {"train", "val"}) {
      const uintmax_t tokens = meta.at(std::string(split) + "_tokens").get<uintmax_t>();
      const fs::path bin = out_dir / (std::string(split) + ".bin");
      if (!fs::exists(bin, ec) || fs::file_size(bin, ec) != tokens * elem) return false;
    }
    return true;
  } catch (const std::exception&) {
    return false;  // unreadable or foreign meta.json: just rebuild
  }
}

// Tokenise `text` and write train.bin, val.bin and meta.json (in that order) into out_dir.
void write_outputs(const std::string& text, const std::string& source_path, const Spec& spec,
                   const fs::path& out_dir, std::ostream& out) {
  std::vector<uint32_t> ids;
  json itos = json::array();
  int64_t vocab_size = 0;
  if (spec.level == "byte") {
    vocab_size = 256;
    ids.assign(reinterpret_cast<const unsigned char*>(text.data()),
               reinterpret_cast<const unsigned char*>(text.data()) + text.size());
  } else {
    ids = decode_utf8(text, source_path);
    // Vocabulary = sorted unique code points (nanoGPT: sorted(list(set(data)))).
    uint32_t max_cp = 0;
    for (uint32_t cp : ids) max_cp = std::max(max_cp, cp);
    std::vector<int32_t> stoi(size_t(max_cp) + 1, -1);
    for (uint32_t cp : ids) stoi[cp] = 0;
    for (uint32_t cp = 0; cp <= max_cp; ++cp) {
      if (stoi[cp] < 0) continue;
      stoi[cp] = int32_t(vocab_size++);
      itos.push_back(encode_utf8(cp));
    }
    if (vocab_size > 65536)
      throw Failure("'" + source_path + "' has " + std::to_string(vocab_size) +
                    " distinct characters, more than uint16 tokens can hold; use --level byte");
    for (uint32_t& id : ids) id = uint32_t(stoi[id]);
  }

  const size_t n = ids.size();
  // nanoGPT: train = data[:int(n*0.9)], val = the rest.
  const size_t n_train = size_t(std::floor(double(n) * (1.0 - spec.val_fraction)));
  if (n_train == 0 || n_train == n)
    throw Failure("'" + source_path + "' is too short to split (" + std::to_string(n) +
                  " tokens, val fraction " + std::to_string(spec.val_fraction) + ")");

  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) throw Failure("cannot create '" + out_dir.string() + "': " + ec.message());

  const fs::path train_path = out_dir / "train.bin", val_path = out_dir / "val.bin";
  write_atomic(train_path, to_uint16_le(ids, 0, n_train));
  out << "  wrote " << train_path.string() << ": " << n_train << " tokens (uint16, "
      << pretty_size(n_train * 2) << ")\n";
  write_atomic(val_path, to_uint16_le(ids, n_train, n));
  out << "  wrote " << val_path.string() << ": " << (n - n_train) << " tokens (uint16, "
      << pretty_size((n - n_train) * 2) << ")\n";

  json meta = {
      {"format_version", kFormatVersion},
      {"dataset", spec.dataset},
      {"level", spec.level},
      {"dtype", "uint16"},
      {"vocab_size", vocab_size},
      {"source", source_path},
      {"source_sha256", spec.source_sha256},
      {"source_bytes", text.size()},
      {"val_fraction", spec.val_fraction},
      {"train_file", "train.bin"},
      {"val_file", "val.bin"},
      {"train_tokens", n_train},
      {"val_tokens", n - n_train},
  };
  if (spec.level == "char") meta["itos"] = itos;  // byte level: token id = byte value
  write_atomic(out_dir / "meta.json", meta.dump(1) + "\n");
  out << "  wrote " << (out_dir / "meta.json").string() << ": vocab_size " << vocab_size << " ("
      << spec.level << " level)\n";
}

bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// curl -fsSL URL -o DIR/input.txt.part, then rename: a partial download never looks complete.
std::string download(const std::string& url, const fs::path& out_dir, std::ostream& out) {
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) throw Failure("cannot create '" + out_dir.string() + "': " + ec.message());
  const std::string part = (out_dir / "input.txt.part").string();
  const std::string dest = (out_dir / "input.txt").string();
  out << "downloading " << url << " -> " << dest << "\n";
  out.flush();
  std::vector<std::string> argv_s = {"curl", "-fsSL", url, "-o", part};
  std::vector<char*> argv;
  for (auto& s : argv_s) argv.push_back(s.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  int rc = ::posix_spawnp(&pid, "curl", nullptr, nullptr, argv.data(), environ);
  if (rc != 0)
    throw Failure(std::string("cannot run curl (") + std::strerror(rc) + "); download " + url +
                  " yourself and pass --input PATH");
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    ::unlink(part.c_str());
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    throw Failure("download of " + url + " failed (curl exit status " + std::to_string(code) +
                  (code == 127 ? ": curl not found" : "") + "); download it yourself and pass --input PATH");
  }
  if (::rename(part.c_str(), dest.c_str()) != 0)
    throw Failure("cannot rename '" + part + "' to '" + dest + "': " + std::strerror(errno));
  return dest;
}

// Where a local copy of tiny Shakespeare may be: ../shared relative to the working
// directory, then relative to the checkout the binary was built in, then a previous download.
std::optional<std::string> find_local_shakespeare(const fs::path& out_dir) {
  std::vector<fs::path> candidates = {fs::path("..") / kShakespeareShared};
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) candidates.push_back(exe.parent_path() / "../.." / kShakespeareShared);
  candidates.push_back(out_dir / "input.txt");
  for (const auto& c : candidates)
    if (is_file(c)) return c.lexically_normal().string();
  return std::nullopt;
}

int prepare_shakespeare(const Options& o, std::ostream& out) {
  if (o.level || o.val_fraction)
    throw UsageError("shakespeare_char takes only --input and --out (it is nanoGPT's fixed split)");
  const fs::path out_dir = o.out.value_or("data/shakespeare_char");
  const Spec spec{"shakespeare_char", "char", 0.1, kShakespeareSha256};

  std::optional<std::string> source;
  if (o.input) {
    if (!is_file(*o.input)) throw UsageError("input file '" + *o.input + "' not found");
    source = *o.input;
  } else {
    source = find_local_shakespeare(out_dir);
  }
  if (!source) {
    // Nothing local: outputs from an earlier run with the right hash need no download.
    if (up_to_date(out_dir, spec)) {
      out << "prepare shakespeare_char: " << out_dir.string() << " is already up to date (sha256 "
          << spec.source_sha256 << ")\n";
      return 0;
    }
    source = download(kShakespeareUrl, out_dir, out);
  }
  const std::string text = read_whole_file(*source);
  verify_hash(*source, kShakespeareSha256, sha256_hex(text));
  if (up_to_date(out_dir, spec)) {
    out << "prepare shakespeare_char: " << out_dir.string() << " is already up to date (source "
        << *source << ", sha256 " << spec.source_sha256 << ")\n";
    return 0;
  }
  out << "prepare shakespeare_char: source " << *source << " (" << text.size() << " bytes, sha256 "
      << spec.source_sha256 << ")\n";
  write_outputs(text, *source, spec, out_dir, out);
  return 0;
}

int prepare_text(const Options& o, std::ostream& out) {
  if (!o.input) throw UsageError("prepare text needs --input FILE");
  if (!o.out) throw UsageError("prepare text needs --out DIR");
  const std::string level = o.level.value_or("char");
  if (level != "char" && level != "byte")
    throw UsageError("--level: expected char or byte, got '" + level + "'");
  if (!is_file(*o.input)) throw UsageError("input file '" + *o.input + "' not found");
  const std::string text = read_whole_file(*o.input);
  const Spec spec{"text", level, o.val_fraction.value_or(0.1), sha256_hex(text)};
  const fs::path out_dir = *o.out;
  if (up_to_date(out_dir, spec)) {
    out << "prepare text: " << out_dir.string() << " is already up to date (source " << *o.input
        << ", sha256 " << spec.source_sha256 << ")\n";
    return 0;
  }
  out << "prepare text: source " << *o.input << " (" << text.size() << " bytes, sha256 "
      << spec.source_sha256 << ")\n";
  write_outputs(text, *o.input, spec, out_dir, out);
  return 0;
}

}  // namespace

int prepare_main(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  if (!args.empty() && args[0] == "corpus") return prepare_corpus_main({args.begin() + 1, args.end()}, out, err);
  if (!args.empty() && args[0] == "chat-render") return chat_render_main({args.begin() + 1, args.end()}, out, err);
  try {
    const Options o = parse_args(args);
    if (o.help) {
      out << kUsage;
      return 0;
    }
    if (o.dataset.empty()) throw UsageError("which dataset? (shakespeare_char or text)");
    if (o.dataset == "shakespeare_char") return prepare_shakespeare(o, out);
    if (o.dataset == "text") return prepare_text(o, out);
    throw UsageError("unknown dataset '" + o.dataset + "' (known: shakespeare_char, text, corpus)");
  } catch (const UsageError& e) {
    err << "nnstrain prepare: error: " << e.what() << "\n" << kUsage;
    return 2;
  } catch (const std::exception& e) {
    err << "nnstrain prepare: error: " << e.what() << "\n";
    return 1;
  }
}

int prepare_main(const std::vector<std::string>& args) {
  return prepare_main(args, std::cout, std::cerr);
}

}  // namespace nnstrain::data
