// `nnstrain prepare corpus`: text corpora -> tokenized Megatron .bin/.idx plus a
// manifest binding them to the tokenizer, the inputs and the settings. Torch-free.
// See docs/data.md ("Corpora").
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <malloc.h>
#include <optional>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#ifdef NNSTRAIN_ZSTD
#include <zstd.h>
#endif

#include "data/chat/jinja_value.h"
#include "data/chat_template.h"
#include "data/indexed/indexed_file.h"
#include "base/cli_options.h"
#include "data/prepare.h"
#include "data/sha256.h"
#include "data/tokenizer/progress.h"
#include "data/tokenizer/tokenizer.h"

namespace nnstrain::data {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int kFormatVersion = 1;
constexpr size_t kBatchBytes = 32 << 20;  // text tokenized per batch (bounded memory)
constexpr size_t kChatBatchBytes = 2 << 20;  // chat records per batch (JSON bytes)

constexpr const char* kUsage = R"(usage: nnstrain prepare corpus --tokenizer PATH --input PATH [--input PATH ...] --out PREFIX [options]

Tokenizes documents into Megatron-compatible PREFIX.bin / PREFIX.idx and writes
PREFIX.manifest.json (tokenizer hash, input hashes, settings) last.

  --format F           auto (default: by extension), jsonl, text, alpaca, chat, preference
                         (preference: TRL's prompt/chosen/rejected pairs; --format preference --help)
                         jsonl:  one JSON object per line, the document in --text-key (.zst too)
                         text:   each file one document, or split on --separator
                         alpaca: records {instruction, input, output} (a JSON array, or JSON lines);
                                 each document is two sequences, prompt then response
                         chat:   JSON lines of conversations, OpenAI {"messages": [{role, content, ...}],
                                 "tools": [...]} or ShareGPT {"conversations": [{from, value}]}; each
                                 document's sequences alternate context, target (the assistant's turns)
  --chat-template T    chat: the Jinja template: a .jinja file, a tokenizer_config.json, a Hugging
                         Face folder, or llama3, chatml (Qwen2's), mistral (built-in texts); default:
                         the tokenizer folder's (chat_template.jinja, tokenizer_config.json)
  --chat-template-kwargs J  chat: a JSON object of extra template variables (e.g. {"enable_thinking": false})
  --train-on W         chat: all (default: every assistant turn) or last (the last one only)
  --max-tokens N       chat: a conversation longer than N tokens follows --overlong
  --overlong R         chat: truncate (default: its first N tokens) or split (at user turns,
                         pieces of at most N tokens; a single exchange over N is truncated)
  --text-key K         the JSONL field holding the text (default: text)
  --separator S        text: split each file on S ("\n\n" etc. as written; default: one document per file)
  --special-tokens P   special-token text in documents (chat: in the conversation's strings; the
                         template's own are tokens): text (default), special, error
  --on-error P         a malformed record: stop (default) or skip (counted in the manifest)
  --threads N          tokenizer threads (default: all cores)
  --pattern P          for a tiktoken file: gpt2 or llama3
A folder given to --input means every file in it (sorted, recursively).
)";

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Options {
  std::string tokenizer, out, format = "auto", text_key = "text", separator, special = "text", on_error = "stop";
  std::string pattern;
  std::string chat_template, chat_kwargs, train_on = "all", overlong = "truncate";
  int64_t max_tokens = 0;  // 0: no limit
  bool has_separator = false;
  std::vector<std::string> inputs;
  int threads = 0;
};

std::string unescape(const std::string& s) {  // \n \t \\ in --separator
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size()) {
      const char c = s[++i];
      out += c == 'n' ? '\n' : c == 't' ? '\t' : c == 'r' ? '\r' : c;
    } else {
      out += s[i];
    }
  }
  return out;
}

Options parse(const std::vector<std::string>& args, bool& help) {
  Options o;
  help = !util::for_each_option<UsageError>(args, [&](const std::string& a, const std::string& v) {
    if (a == "--tokenizer") o.tokenizer = v;
    else if (a == "--input") o.inputs.push_back(v);
    else if (a == "--out") o.out = v;
    else if (a == "--format") o.format = v;
    else if (a == "--text-key") o.text_key = v;
    else if (a == "--separator") o.separator = unescape(v), o.has_separator = true;
    else if (a == "--special-tokens") o.special = v;
    else if (a == "--on-error") o.on_error = v;
    else if (a == "--pattern") o.pattern = v;
    else if (a == "--chat-template") o.chat_template = v;
    else if (a == "--chat-template-kwargs") o.chat_kwargs = v;
    else if (a == "--train-on") o.train_on = v;
    else if (a == "--overlong") o.overlong = v;
    else if (a == "--max-tokens") {
      try {
        o.max_tokens = std::stoll(v);
      } catch (const std::exception&) {
        o.max_tokens = -1;
      }
      if (o.max_tokens < 2) throw UsageError("--max-tokens: expected an integer of at least 2, got '" + v + "'");
    }
    else if (a == "--threads") {
      try {
        o.threads = std::stoi(v);
      } catch (const std::exception&) {
        o.threads = -1;
      }
      if (o.threads < 1 || o.threads > 1024) throw UsageError("--threads: expected 1..1024, got '" + v + "'");
    } else {
      throw UsageError("unknown option '" + a + "'");
    }
  });
  if (help) return o;
  if (o.tokenizer.empty()) throw UsageError("--tokenizer PATH is required");
  if (o.inputs.empty()) throw UsageError("--input PATH is required");
  if (o.out.empty()) throw UsageError("--out PREFIX is required");
  if (o.format != "auto" && o.format != "jsonl" && o.format != "text" && o.format != "alpaca" && o.format != "chat")
    throw UsageError("--format: '" + o.format + "' (expected auto, jsonl, text, alpaca or chat)");
  if (o.format != "chat" && (!o.chat_template.empty() || !o.chat_kwargs.empty()))
    throw UsageError(std::string(o.chat_template.empty() ? "--chat-template-kwargs" : "--chat-template") +
                     " goes with --format chat");
  if (o.train_on != "all" && o.train_on != "last") throw UsageError("--train-on: expected all or last");
  if (o.overlong != "truncate" && o.overlong != "split") throw UsageError("--overlong: expected truncate or split");
  if (o.on_error != "stop" && o.on_error != "skip") throw UsageError("--on-error: expected stop or skip");
  if (o.has_separator && o.separator.empty()) throw UsageError("--separator must not be empty");
  if (o.threads == 0) o.threads = std::max(1u, std::thread::hardware_concurrency());
  return o;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string format_of(const std::string& path, const std::string& requested) {
  if (ends_with(path, ".parquet"))
    throw UsageError("'" + path + "': Parquet is not supported; convert it to JSON lines first, e.g. "
                     "python -c \"import pandas as pd; pd.read_parquet('in.parquet').to_json('out.jsonl', "
                     "orient='records', lines=True)\"");
  if (requested != "auto") return requested;
  if (ends_with(path, ".jsonl") || ends_with(path, ".jsonl.zst") || ends_with(path, ".zst")) return "jsonl";
  if (ends_with(path, ".json")) return "alpaca";
  return "text";
}

std::vector<std::string> expand_inputs(const std::vector<std::string>& inputs) {
  std::vector<std::string> files;
  for (const auto& in : inputs) {
    std::error_code ec;
    if (fs::is_directory(in, ec)) {
      std::vector<std::string> found;
      for (auto it = fs::recursive_directory_iterator(in, ec); it != fs::recursive_directory_iterator(); ++it)
        if (it->is_regular_file() && it->path().filename().string()[0] != '.') found.push_back(it->path().string());
      std::sort(found.begin(), found.end());
      if (found.empty()) throw UsageError("--input '" + in + "': the folder holds no files");
      files.insert(files.end(), found.begin(), found.end());
    } else if (fs::is_regular_file(in, ec)) {
      files.push_back(in);
    } else {
      throw UsageError("--input '" + in + "': no such file or folder");
    }
  }
  return files;
}

// Straight into one string of the file's size: a stream copy would hold the text
// twice at its peak, and one text may be many GiB.
std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw std::runtime_error("cannot read '" + path + "': " + std::strerror(errno));
  const std::streamoff size = f.tellg();
  if (size < 0) throw std::runtime_error("cannot tell the size of '" + path + "'");
  std::string data(static_cast<size_t>(size), '\0');
  f.seekg(0);
  if (!f.read(data.data(), size)) throw std::runtime_error("read error in '" + path + "'");
  return data;
}

// The file's bytes, decompressed when it ends in .zst.
std::string read_input(const std::string& path) {
  std::string raw = read_file(path);
  if (!ends_with(path, ".zst")) return raw;
#ifdef NNSTRAIN_ZSTD
  std::string out;
  ZSTD_DStream* ds = ZSTD_createDStream();
  ZSTD_initDStream(ds);
  ZSTD_inBuffer in{raw.data(), raw.size(), 0};
  std::vector<char> buf(ZSTD_DStreamOutSize());
  size_t rc = 1;
  while (in.pos < in.size) {
    ZSTD_outBuffer o{buf.data(), buf.size(), 0};
    rc = ZSTD_decompressStream(ds, &o, &in);
    if (ZSTD_isError(rc)) {
      ZSTD_freeDStream(ds);
      throw std::runtime_error("'" + path + "': zstd: " + ZSTD_getErrorName(rc));
    }
    out.append(buf.data(), o.pos);
  }
  ZSTD_freeDStream(ds);
  if (rc != 0) throw std::runtime_error("'" + path + "': zstd stream is truncated");
  return out;
#else
  throw UsageError("'" + path + "': this build has no zstd (install libzstd-dev and rebuild)");
#endif
}

// One document (or an instruction record's prompt and response, or a
// conversation) and where it came from.
struct Record {
  std::string text, response;
  std::string where;  // file:line
  Conversation conversation;
  size_t chat_bytes = 0;
};

// An OpenAI {"messages": [{role, content, ...}], "tools": [...], "documents": [...]}
// or ShareGPT {"conversations": [{from, value}]} record (ShareGPT's human and gpt
// are user and assistant). Messages pass to the template as they are: what a
// role or a field means is the template's business.
Record chat_record(const std::string& line, const std::string& where) {
  // Parsed straight into the template's values (no JSON tree in between).
  jinja::Value j;
  bool parsed = false;
  try {
    parsed = jinja::Value::parse_json(line, j);
  } catch (const std::exception&) {
  }
  if (!parsed) throw std::runtime_error(where + ": not a JSON object");
  if (!j.is_dict()) throw std::runtime_error(where + ": a chat record must be a JSON object");
  const jinja::Value* openai_list = j.map().find(std::string("messages"));
  const bool openai = openai_list != nullptr;
  const jinja::Value* list_v = openai ? openai_list : j.map().find(std::string("conversations"));
  if (!list_v) throw std::runtime_error(where + ": no 'messages' (OpenAI) or 'conversations' (ShareGPT) field");
  const char* list = openai ? "messages" : "conversations";
  if (!list_v->is_list() || list_v->is_tuple() || list_v->list().empty())
    throw std::runtime_error(where + ": '" + list + "' is not a non-empty array");
  jinja::List messages;
  messages.reserve(list_v->list().size());
  for (size_t i = 0; i < list_v->list().size(); ++i) {
    const jinja::Value& m = list_v->list()[i];
    auto at = [&] { return where + ": " + list + "[" + std::to_string(i) + "]"; };  // built only to fail
    auto field = [&](const char* k) { return m.is_dict() ? m.map().find(std::string(k)) : nullptr; };
    if (openai) {
      const jinja::Value* role = field("role");
      if (!role || !role->is_string())
        throw std::runtime_error(at() + ": expected an object with a string \"role\"");
      messages.push_back(m);
      continue;
    }
    const jinja::Value* from = field("from");
    const jinja::Value* value = field("value");
    if (!from || !from->is_string() || !value || !value->is_string())
      throw std::runtime_error(at() + ": expected {\"from\": string, \"value\": string}");
    std::string role = from->str();
    role = role == "human" ? "user" : role == "gpt" ? "assistant" : role;
    jinja::Value d = jinja::Value::dict();
    d.map().items.emplace_back(jinja::Value("role"), jinja::Value(std::move(role)));
    d.map().items.emplace_back(jinja::Value("content"), *value);
    messages.push_back(std::move(d));
  }
  Record r{"", "", where, {}, line.size()};
  try {
    r.conversation = Conversation::from_values(jinja::Value(std::move(messages)), j.map().find(std::string("tools")),
                                               j.map().find(std::string("documents")));
  } catch (const std::exception& e) {
    throw std::runtime_error(where + ": " + e.what());
  }
  return r;
}

// A conversation's ids cut to at most max_tokens per document (0: no limit):
// its first max_tokens (truncate), or pieces ending before a user turn, each
// the longest that fits and holds an assistant turn (split), an exchange longer
// than max_tokens on its own truncated. Pieces left without a target are
// dropped (counted).
struct OverlongCounts {
  int64_t truncated = 0, split = 0, dropped = 0;
};
std::vector<std::pair<size_t, size_t>> cut_conversation(const ChatTokens& c, int64_t max_tokens, bool split,
                                                        OverlongCounts& counts) {
  const size_t n = c.ids.size(), cap = size_t(max_tokens);
  std::vector<std::pair<size_t, size_t>> pieces;
  if (max_tokens <= 0 || n <= cap) {
    pieces.emplace_back(0, n);
  } else if (!split) {
    pieces.emplace_back(0, cap);
    ++counts.truncated;
  } else {
    std::vector<size_t> cuts;
    for (size_t t : c.turn_starts)
      if (t > 0 && t < n) cuts.push_back(t);
    cuts.push_back(n);
    // Prefix sums of the targets: a piece must hold one (a cut before the first
    // user turn, after the BOS or a system turn alone, is no cut).
    std::vector<size_t> targets(n + 1, 0);
    for (size_t i = 0; i < n; ++i) targets[i + 1] = targets[i] + (c.target[i] ? 1 : 0);
    size_t s = 0;
    while (s < n) {
      size_t best = 0, next = n;
      for (size_t k : cuts) {
        if (k <= s || targets[k] == targets[s]) continue;
        next = std::min(next, k);
        if (k - s <= cap) best = std::max(best, k);
      }
      if (best) {
        pieces.emplace_back(s, best);
        s = best;
      } else {  // the next exchange alone is over the cap (or no answer follows)
        const size_t end = std::min(n, s + cap);
        pieces.emplace_back(s, end);
        if (end < next) ++counts.truncated;
        s = next;
      }
    }
    if (pieces.size() > 1) ++counts.split;
  }
  std::vector<std::pair<size_t, size_t>> kept;
  for (const auto& [a, b] : pieces) {
    if (std::any_of(c.target.begin() + long(a), c.target.begin() + long(b), [](uint8_t t) { return t != 0; }))
      kept.emplace_back(a, b);
    else
      ++counts.dropped;
  }
  return kept;
}

// Ids [a, b) as sequences alternating context, target, context, ... (the first
// possibly empty): how a chat document stores its loss mask.
std::vector<std::vector<int32_t>> alternating_sequences(const ChatTokens& c, size_t a, size_t b) {
  std::vector<std::vector<int32_t>> seqs(1);
  for (size_t i = a; i < b; ++i) {
    if (bool(c.target[i]) != (seqs.size() % 2 == 0)) seqs.emplace_back();
    seqs.back().push_back(c.ids[i]);
  }
  return seqs;
}

// The Stanford Alpaca prompt (the template its training used), with and without input.
std::string alpaca_prompt(const std::string& instruction, const std::string& input) {
  if (input.empty())
    return "Below is an instruction that describes a task. Write a response that appropriately completes the "
           "request.\n\n### Instruction:\n" + instruction + "\n\n### Response:\n";
  return "Below is an instruction that describes a task, paired with an input that provides further context. "
         "Write a response that appropriately completes the request.\n\n### Instruction:\n" + instruction +
         "\n\n### Input:\n" + input + "\n\n### Response:\n";
}

void alpaca_record(const json& j, const std::string& where, std::vector<Record>& out) {
  if (!j.is_object()) throw std::runtime_error(where + ": an alpaca record must be a JSON object");
  auto field = [&](const char* k, bool required) -> std::string {
    if (!j.contains(k) || j[k].is_null()) {
      if (required) throw std::runtime_error(where + ": no '" + k + "' field");
      return "";
    }
    if (!j[k].is_string()) throw std::runtime_error(where + ": '" + k + "' is not a string");
    return j[k].get<std::string>();
  };
  out.push_back({alpaca_prompt(field("instruction", true), field("input", false)), field("output", true), where});
}

}  // namespace

int prepare_corpus_main(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  for (size_t i = 0; i < args.size(); ++i)  // preference pairs: a format of their own (prepare_preference.cpp)
    if (args[i] == "--format=preference" || (args[i] == "--format" && i + 1 < args.size() && args[i + 1] == "preference"))
      return prepare_preference_main(args, out, err);
  Options o;
  try {
    bool help = false;
    o = parse(args, help);
    if (help) {
      out << kUsage;
      return 0;
    }
    const std::vector<std::string> files = expand_inputs(o.inputs);
    std::vector<std::string> formats;
    for (const auto& f : files) formats.push_back(format_of(f, o.format));
    const bool instruction = std::count(formats.begin(), formats.end(), "alpaca") > 0;
    if (instruction && std::count(formats.begin(), formats.end(), "alpaca") != static_cast<long>(formats.size()))
      throw UsageError("alpaca inputs cannot be mixed with plain documents in one dataset");
    const bool chat = o.format == "chat";
    tok::SpecialPolicy policy;
    try {
      policy = tok::parse_special_policy(o.special);
    } catch (const tok::TokenizerError& e) {
      throw UsageError(std::string("--special-tokens: ") + e.what());
    }
    tok::LoadOptions lo;
    lo.pattern = o.pattern;
    const tok::Tokenizer tokenizer = tok::Tokenizer::load(o.tokenizer, lo);
    std::optional<ChatTemplate> tmpl;
    if (chat) {
      // Rendering allocates and frees a few hundred KiB per conversation: glibc would
      // hand that back to the kernel and grow the thread's heap again (mprotect calls
      // and page faults) for the next one.
      mallopt(M_TRIM_THRESHOLD, 256 << 20);
      mallopt(M_TOP_PAD, 16 << 20);
      try {
        const auto spec = find_chat_template(o.chat_template, o.tokenizer);
        if (!spec)
          throw UsageError("--format chat: the tokenizer folder " + o.tokenizer +
                           " has no chat template (chat_template.jinja or tokenizer_config.json's); give "
                           "--chat-template NAME|PATH");
        ChatTemplateOptions copt;
        copt.content_specials = policy;
        copt.kwargs_json = o.chat_kwargs;
        tmpl.emplace(make_chat_template(*spec, tokenizer, copt));
      } catch (const ChatError& e) {
        throw UsageError(std::string("--chat-template: ") + e.what());
      }
    }
    const TrainOn train_on = o.train_on == "last" ? TrainOn::last_assistant : TrainOn::all_assistant;
    OverlongCounts overlong;

    // What this output is a function of; a manifest recording the same needs no rerun.
    json inputs = json::array();
    uint64_t total_bytes = 0;
    for (size_t i = 0; i < files.size(); ++i) {
      inputs.push_back({{"path", files[i]}, {"sha256", sha256_file_hex(files[i])},
                        {"bytes", fs::file_size(files[i])}, {"format", formats[i]}});
      total_bytes += fs::file_size(files[i]);
    }
    json settings = {{"special_tokens", o.special}, {"on_error", o.on_error}};
    if (!instruction && !chat) settings["text_key"] = o.text_key;
    if (chat) {
      settings["chat_template"] = o.chat_template.empty() ? tmpl->source() : o.chat_template;
      settings["chat_template_sha256"] = tmpl->sha256();
      settings["chat_template_source"] = tmpl->source();
      if (!o.chat_kwargs.empty()) settings["chat_template_kwargs"] = json::parse(o.chat_kwargs);
      settings["train_on"] = o.train_on;
      settings["max_tokens"] = o.max_tokens;
      settings["overlong"] = o.overlong;
    }
    if (o.has_separator) settings["separator"] = o.separator;
    if (instruction) settings["template"] = "alpaca";
    const json tok_info = {{"path", o.tokenizer}, {"kind", tokenizer.kind()}, {"sha256", tokenizer.sha256()},
                           {"vocab_size", tokenizer.vocab_size()},
                           {"eos_id", tokenizer.eos_id() ? json(*tokenizer.eos_id()) : json()},
                           {"bos_id", tokenizer.bos_id() ? json(*tokenizer.bos_id()) : json()}};
    const fs::path prefix(o.out);
    const std::string name = prefix.filename().string();
    const std::string manifest_path = o.out + ".manifest.json";
    if (fs::exists(manifest_path)) {
      try {
        const json m = json::parse(read_file(manifest_path));
        if (m.value("format_version", 0) == kFormatVersion && m["tokenizer"]["sha256"] == tok_info["sha256"] &&
            m["inputs"] == inputs && m["settings"] == settings &&
            fs::exists(o.out + ".bin") && fs::file_size(o.out + ".bin") == m["bin_bytes"].get<uint64_t>() &&
            fs::exists(o.out + ".idx") && fs::file_size(o.out + ".idx") == m["idx_bytes"].get<uint64_t>()) {
          out << "prepare corpus: " << o.out << ".{bin,idx} are up to date (" << m["documents"] << " documents, "
              << m["tokens"] << " tokens); nothing written\n";
          return 0;
        }
      } catch (const std::exception&) {
        // unreadable: rebuild
      }
      fs::remove(manifest_path);  // the old outputs are being replaced: never leave it naming them
    }
    if (!prefix.parent_path().empty()) fs::create_directories(prefix.parent_path());

    const indexed::DType dtype = indexed::dtype_for_vocab(tokenizer.vocab_size());
    indexed::Writer writer(o.out, dtype);
    tok::EncodeProgress progress;
    int64_t skipped = 0;
    std::vector<std::string> skipped_where;
    {
      tok::ProgressLine line("prepare corpus", progress, total_bytes);
      std::vector<Record> batch;
      size_t batch_bytes = 0;
      auto flush = [&] {
        if (chat) {
          // Rendered and encoded on the threads, written in input order.
          std::vector<ChatTokens> enc(batch.size());
          std::vector<std::string> errors(batch.size());
          std::vector<std::thread> pool;
          const size_t nt = std::min<size_t>(size_t(o.threads), std::max<size_t>(batch.size(), 1));
          auto work = [&](size_t w) {
            for (size_t k = w; k < batch.size(); k += nt) {
              try {
                enc[k] = tmpl->encode(batch[k].conversation, false, train_on, o.overlong == "split");
                if (std::none_of(enc[k].target.begin(), enc[k].target.end(), [](uint8_t t) { return t != 0; }))
                  throw ChatError("the conversation has no assistant turn");
              } catch (const std::exception& e) {
                errors[k] = e.what();
              }
            }
          };
          // One thread: this one (its heap grows by M_TOP_PAD steps; a new thread's by pages).
          if (nt == 1) work(0);
          for (size_t w = 0; nt > 1 && w < nt; ++w) pool.emplace_back(work, w);
          for (auto& t : pool) t.join();
          for (size_t k = 0; k < batch.size(); ++k) {
            if (!errors[k].empty()) {
              const std::string what = batch[k].where + ": " + errors[k];
              if (o.on_error == "stop") throw std::runtime_error(what);
              ++skipped;
              if (skipped_where.size() < 10) skipped_where.push_back(what);
              continue;
            }
            for (const auto& [a, b] : cut_conversation(enc[k], o.max_tokens, o.overlong == "split", overlong)) {
              const auto seqs = alternating_sequences(enc[k], a, b);
              std::vector<const std::vector<int32_t>*> ptrs;
              for (const auto& q : seqs) ptrs.push_back(&q);
              writer.add_document(ptrs);
            }
          }
          batch.clear();
          batch_bytes = 0;
          return;
        }
        std::vector<std::string_view> texts;
        for (const auto& r : batch) {
          texts.push_back(r.text);
          if (instruction) texts.push_back(r.response);
        }
        std::vector<std::vector<int32_t>> ids;
        std::vector<const Record*> owners;  // owners[k]: the record of document k
        try {
          // One long text (a file without --separator) is cut at safe points so
          // every thread shares it; the ids are the same as encoding it whole.
          if (texts.size() == 1 && texts[0].size() >= kBatchBytes)
            ids.push_back(tokenizer.encode_large(texts[0], policy, o.threads));
          else
            ids = tokenizer.encode_batch(texts, policy, false, o.threads);
          for (const auto& r : batch) owners.push_back(&r);
        } catch (const tok::TokenizerError&) {
          // Find the record at fault, to name it (and skip it under --on-error skip).
          ids.clear();
          tok::EncodeCache cache;
          for (const auto& r : batch) {
            std::vector<int32_t> a, b;
            try {
              tokenizer.encode(r.text, policy, false, cache, a);
              if (instruction) tokenizer.encode(r.response, policy, false, cache, b);
            } catch (const tok::TokenizerError& e) {
              if (o.on_error == "stop") throw std::runtime_error(r.where + ": " + e.what());
              ++skipped;
              if (skipped_where.size() < 10) skipped_where.push_back(r.where + ": " + e.what());
              continue;
            }
            ids.push_back(std::move(a));
            if (instruction) ids.push_back(std::move(b));
            owners.push_back(&r);
          }
        }
        const size_t per_doc = instruction ? 2 : 1;
        for (size_t k = 0; k < owners.size(); ++k) {
          std::vector<const std::vector<int32_t>*> seqs;
          for (size_t j = 0; j < per_doc; ++j) seqs.push_back(&ids[k * per_doc + j]);
          try {
            writer.add_document(seqs);
          } catch (const indexed::IndexLimitError& e) {  // a document the format cannot hold: name it
            throw std::runtime_error(owners[k]->where + ": " + e.what());
          }
        }
        batch.clear();
        batch_bytes = 0;
      };
      auto bad_record = [&](const std::string& what) {
        if (o.on_error == "stop") throw std::runtime_error(what);
        ++skipped;
        if (skipped_where.size() < 10) skipped_where.push_back(what);
      };
      auto add = [&](Record r) {
        size_t bytes = r.text.size() + r.response.size();
        bytes += r.chat_bytes;
        // A long text goes on its own, so flush can cut it for the threads.
        if (bytes >= kBatchBytes && !batch.empty()) flush();
        batch_bytes += bytes;
        progress.bytes += bytes;
        progress.docs += 1;
        batch.push_back(std::move(r));
        // Conversations: a batch in memory is many times its text (values, ids, offsets);
        // a small one stays in cache and its memory is reused by the next.
        if (batch_bytes >= (chat ? kChatBatchBytes : kBatchBytes)) flush();
      };
      for (size_t fi = 0; fi < files.size(); ++fi) {
        const std::string& file = files[fi];
        std::string data = read_input(file);
        if (formats[fi] == "text") {
          if (!o.has_separator) {
            add({std::move(data), "", file});  // moved, not copied: the file may be many GiB
            continue;
          }
          size_t start = 0, lineno = 1;
          while (start <= data.size()) {
            size_t end = data.find(o.separator, start);
            if (end == std::string::npos) end = data.size();
            std::string doc = data.substr(start, end - start);
            if (!doc.empty()) add({std::move(doc), "", file + ":" + std::to_string(lineno)});
            lineno += std::count(data.begin() + start, data.begin() + std::min(data.size(), end + o.separator.size()), '\n');
            start = end + o.separator.size();
          }
          continue;
        }
        const bool array = formats[fi] == "alpaca" && data.find_first_not_of(" \t\r\n") != std::string::npos &&
                           data[data.find_first_not_of(" \t\r\n")] == '[';
        if (array) {  // alpaca_data.json: one JSON array
          json arr;
          try {
            arr = json::parse(data);
          } catch (const json::parse_error& e) {
            throw std::runtime_error(file + ": not valid JSON (" + e.what() + ")");
          }
          for (size_t k = 0; k < arr.size(); ++k) {
            std::vector<Record> rec;
            try {
              alpaca_record(arr[k], file + ": record " + std::to_string(k + 1), rec);
            } catch (const std::runtime_error& e) {
              bad_record(e.what());
              continue;
            }
            add(std::move(rec[0]));
          }
          continue;
        }
        size_t start = 0, lineno = 0;
        while (start < data.size()) {
          size_t end = data.find('\n', start);
          if (end == std::string::npos) end = data.size();
          ++lineno;
          const std::string_view line_text(data.data() + start, end - start);
          start = end + 1;
          if (line_text.find_first_not_of(" \t\r") == std::string_view::npos) continue;
          const std::string where = file + ":" + std::to_string(lineno);
          if (formats[fi] == "chat") {
            Record rec;
            try {
              rec = chat_record(std::string(line_text), where);
            } catch (const std::runtime_error& e) {
              if (o.on_error == "stop") flush();  // an earlier record's rendering error comes first
              bad_record(e.what());
              continue;
            }
            add(std::move(rec));
            continue;
          }
          json j;
          try {
            j = json::parse(line_text);
          } catch (const json::parse_error&) {
            bad_record(where + ": not a JSON object");
            continue;
          }
          if (formats[fi] == "alpaca") {
            std::vector<Record> rec;
            try {
              alpaca_record(j, where, rec);
            } catch (const std::runtime_error& e) {
              bad_record(e.what());
              continue;
            }
            add(std::move(rec[0]));
            continue;
          }
          if (!j.is_object() || !j.contains(o.text_key) || !j[o.text_key].is_string()) {
            bad_record(where + ": no string field '" + o.text_key + "'");
            continue;
          }
          add({j[o.text_key].get<std::string>(), "", where});
        }
      }
      flush();
    }
    if (writer.documents() == 0) throw std::runtime_error("no documents in the input (nothing written)");
    writer.commit();
    const json manifest = {
        {"format", "nnstrain indexed dataset (Megatron .bin/.idx)"},
        {"format_version", kFormatVersion},
        {"bin", name + ".bin"},
        {"idx", name + ".idx"},
        {"bin_bytes", fs::file_size(o.out + ".bin")},
        {"idx_bytes", fs::file_size(o.out + ".idx")},
        {"dtype", indexed::dtype_name(dtype)},
        {"documents", writer.documents()},
        {"tokens", writer.tokens()},
        {"sequences_per_document", chat ? json("alternating") : json(instruction ? 2 : 1)},
        {"kind", chat ? "chat (sequences alternate context, target)"
                      : instruction ? "instruction (prompt, response)" : "documents"},
        {"skipped_records", skipped},
        {"tokenizer", tok_info},
        {"inputs", inputs},
        {"settings", settings},
    };
    json m = manifest;
    if (chat)
      m["overlong_conversations"] = {{"truncated", overlong.truncated}, {"split", overlong.split},
                                     {"pieces_without_target_dropped", overlong.dropped}};
    write_file_atomic(manifest_path, m.dump(1) + "\n");
    for (const auto& w : skipped_where) err << "prepare corpus: skipped " << w << "\n";
    out << "prepare corpus: " << writer.documents() << " documents, " << writer.tokens() << " tokens ("
        << indexed::dtype_name(dtype) << ") -> " << o.out << ".{bin,idx}";
    if (skipped) out << "; skipped " << skipped << " malformed records";
    out << "\n";
    return 0;
  } catch (const UsageError& e) {
    err << "nnstrain prepare corpus: error: " << e.what() << "\n" << kUsage;
    return 2;
  } catch (const std::exception& e) {
    err << "nnstrain prepare corpus: error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace nnstrain::data
