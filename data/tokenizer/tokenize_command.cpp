#include "data/tokenizer/tokenize_command.h"

#include <chrono>
#include <ctime>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "data/tokenizer/progress.h"
#include "data/tokenizer/tokenizer.h"

namespace nnstrain::tok {

namespace {

constexpr const char* kUsage = R"(usage: nnstrain tokenize --tokenizer PATH [options]

  --tokenizer PATH       tokenizer.json, encoder.json (+ vocab.bpe), a tiktoken file, or a folder
  --pattern gpt2|llama3  for a tiktoken file whose pattern cannot be told from its size
  --info                 describe the tokenizer (kind, vocabulary, special tokens, sha256)
  --input FILE           text to encode (default: stdin); the whole file is one text
  --jsonl                FILE holds JSON lines, each a string: one line of ids per line
  --special-tokens P     special-token text in the input: text (default), special, error
  --add-special          add what the post-processor adds (Llama 3's BOS)
  --threads N            encode on N threads (default 1); the ids do not depend on N
  --out FILE             write the ids as little-endian int32 instead of text
  --roundtrip            also decode and check the bytes come back; report mismatches
)";

struct Usage : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A file of known size is read straight into one string (a stream copy would hold
// the text twice at its peak, and a text may be many GiB); stdin and pipes through a stream.
std::string read_all(const std::string& path) {
  std::ostringstream ss;
  if (path.empty() || path == "-") {
    ss << std::cin.rdbuf();
    return ss.str();
  }
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw TokenizerError("cannot read '" + path + "'");
  const std::streamoff size = f.tellg();
  if (size < 0) {  // not seekable
    f.clear();
    f.seekg(0);
    ss << f.rdbuf();
    return ss.str();
  }
  std::string text(static_cast<size_t>(size), '\0');
  f.seekg(0);
  if (!f.read(text.data(), size)) throw TokenizerError("cannot read '" + path + "'");
  return text;
}

}  // namespace

int tokenize_main(const std::vector<std::string>& argv) {
  std::string tok_path, input, out_path, policy_s = "text";
  LoadOptions lo;
  bool info = false, jsonl = false, add_special = false, roundtrip = false;
  int threads = 1;
  try {
    for (size_t i = 0; i < argv.size(); ++i) {
      const std::string& a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argv.size()) throw Usage(a + " needs a value");
        return argv[++i];
      };
      if (a == "-h" || a == "--help") {
        std::cout << kUsage;
        return 0;
      } else if (a == "--tokenizer") tok_path = value();
      else if (a == "--pattern") lo.pattern = value();
      else if (a == "--info") info = true;
      else if (a == "--input") input = value();
      else if (a == "--jsonl") jsonl = true;
      else if (a == "--special-tokens") policy_s = value();
      else if (a == "--add-special") add_special = true;
      else if (a == "--out") out_path = value();
      else if (a == "--roundtrip") roundtrip = true;
      else if (a == "--threads") {
        const std::string v = value();
        try {
          threads = std::stoi(v);
        } catch (const std::exception&) {
          threads = 0;
        }
        if (threads < 1 || threads > 1024) throw Usage("--threads: expected 1..1024, got '" + v + "'");
      } else {
        throw Usage("unknown option '" + a + "'");
      }
    }
    if (tok_path.empty()) throw Usage("--tokenizer PATH is required");
    SpecialPolicy policy;
    try {
      policy = parse_special_policy(policy_s);
    } catch (const TokenizerError& e) {
      throw Usage(std::string("--special-tokens: ") + e.what());
    }

    const Tokenizer t = Tokenizer::load(tok_path, lo);
    if (info) {
      std::cout << t.describe() << "\n" << "sha256 " << t.sha256() << "\n";
      return 0;
    }
    const std::string text = read_all(input);
    std::vector<std::string> docs_storage;
    std::vector<std::string_view> docs;
    if (jsonl) {
      std::istringstream lines(text);
      std::string line;
      size_t lineno = 0;
      while (std::getline(lines, line)) {
        ++lineno;
        try {
          docs_storage.push_back(nlohmann::json::parse(line).get<std::string>());
        } catch (const std::exception&) {
          throw TokenizerError((input.empty() ? std::string("stdin") : input) + ":" + std::to_string(lineno) +
                               ": not a JSON string");
        }
      }
      for (const auto& d : docs_storage) docs.push_back(d);
    }
    uint64_t total = text.size();  // JSON lines: the documents' bytes, not the escaped file's
    if (jsonl) {
      total = 0;
      for (const auto& d : docs) total += d.size();
    }
    EncodeProgress progress;
    std::vector<std::vector<int32_t>> ids;
    const auto t0 = std::chrono::steady_clock::now();
    const std::clock_t c0 = std::clock();
    {
      ProgressLine line("tokenize", progress, total);
      if (jsonl) ids = t.encode_batch(docs, policy, add_special, threads, &progress);
      else if (add_special) ids.push_back(t.encode(text, policy, true));
      else ids.push_back(t.encode_large(text, policy, threads, &progress));
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double cpu = static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC;
    if (!jsonl) docs.push_back(text);
    size_t n_ids = 0;
    for (const auto& v : ids) n_ids += v.size();
    if (!out_path.empty()) {
      std::ofstream f(out_path, std::ios::binary);
      for (const auto& v : ids) f.write(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int32_t));
      if (!f) throw TokenizerError("cannot write '" + out_path + "'");
    } else {
      std::string buf;  // written every MiB: one text's ids may be billions
      auto put = [&](bool last) {
        if (!last && buf.size() < (1u << 20)) return;
        if (std::fwrite(buf.data(), 1, buf.size(), stdout) != buf.size())
          throw TokenizerError("cannot write the ids to stdout");
        buf.clear();
      };
      for (const auto& v : ids) {
        if (jsonl) buf += '[';
        for (size_t i = 0; i < v.size(); ++i) {
          if (i) buf += jsonl ? ',' : ' ';
          buf += std::to_string(v[i]);
          put(false);
        }
        if (jsonl) buf += ']';
        buf += '\n';
        put(false);
      }
      put(true);
    }
    // Encoding only (not loading, reading or writing); cpu: all threads' CPU time;
    // parts: the work items the threads shared; busiest thread: the most CPU time
    // one of them spent (cpu at 1 thread / that = the speed-up idle cores would give).
    std::fprintf(stderr,
                 "tokenize: %zu documents, %llu bytes, %zu ids, %.3f s, cpu %.3f s, %llu parts, busiest thread "
                 "%.3f s\n",
                 docs.size(), static_cast<unsigned long long>(total), n_ids, secs, cpu,
                 static_cast<unsigned long long>(progress.parts.load()), progress.busiest_thread_cpu_ns.load() * 1e-9);
    if (roundtrip) {
      size_t bad = 0, first_bad = 0;
      for (size_t i = 0; i < ids.size(); ++i) {
        std::string expect(docs[i]);
        if (add_special) expect = t.decode(t.template_prefix()) + expect + t.decode(t.template_suffix());
        if (t.decode(ids[i]) != expect) {
          if (!bad) first_bad = i;
          ++bad;
        }
      }
      std::fprintf(stderr, "roundtrip: %zu of %zu documents decode to different bytes", bad, ids.size());
      if (bad) std::fprintf(stderr, " (first: document %zu)", first_bad + 1);
      std::fprintf(stderr, "\n");
      if (bad) return 1;
    }
    return 0;
  } catch (const Usage& e) {
    std::cerr << "nnstrain tokenize: " << e.what() << "\n\n" << kUsage;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "nnstrain tokenize: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace nnstrain::tok
