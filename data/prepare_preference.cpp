// `nnstrain prepare corpus --format preference`: TRL's preference records (standard:
// prompt/chosen/rejected strings; conversational: lists of messages, rendered with
// the chat template; the prompt may be implicit, the shared leading part) tokenized
// as TRL's DPOTrainer does: prompt, then prompt + completion, the completion
// starting where the two diverge. Each pair is one document of three sequences:
// prompt, chosen completion, rejected completion. Torch-free. docs/alignment.md.
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "data/chat_template.h"
#include "data/indexed/indexed_file.h"
#include "base/cli_options.h"
#include "data/prepare.h"
#include "data/sha256.h"
#include "data/tokenizer/tokenizer.h"

namespace nnstrain::data {

namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

constexpr const char* kPreferenceUsage = R"(usage: nnstrain prepare corpus --format preference --tokenizer PATH --input PATH [--input PATH ...] --out PREFIX [options]

JSON lines of preference pairs, TRL's formats: standard {"prompt", "chosen", "rejected"}
(strings; EOS appended to each completion) or conversational (lists of messages,
rendered with the chat template); without "prompt" the shared leading part of chosen
and rejected is the prompt (TRL's extract_prompt). Each pair is stored as three
sequences: prompt, chosen completion, rejected completion.

  --chat-template T    conversational records: as --format chat (default: the tokenizer folder's)
  --chat-template-kwargs J  extra template variables, a JSON object
  --special-tokens P   special-token text in the records' strings: text (default), special, error
  --on-error P         a malformed record: stop (default) or skip (counted in the manifest)
)";

struct PrefUsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct PrefOptions {
  std::string tokenizer, out, special = "text", on_error = "stop", chat_template, chat_kwargs;
  std::vector<std::string> inputs;
};

PrefOptions parse_pref(const std::vector<std::string>& args, bool& help) {
  PrefOptions o;
  help = !util::for_each_option<PrefUsageError>(args, [&](const std::string& a, const std::string& v) {
    if (a == "--tokenizer") o.tokenizer = v;
    else if (a == "--input") o.inputs.push_back(v);
    else if (a == "--out") o.out = v;
    else if (a == "--format") {
      if (v != "preference") throw PrefUsageError("--format: given twice");
    } else if (a == "--special-tokens") o.special = v;
    else if (a == "--on-error") o.on_error = v;
    else if (a == "--chat-template") o.chat_template = v;
    else if (a == "--chat-template-kwargs") o.chat_kwargs = v;
    else throw PrefUsageError("unknown option '" + a + "' (for --format preference)");
  });
  if (help) return o;
  if (o.tokenizer.empty()) throw PrefUsageError("--tokenizer PATH is required");
  if (o.inputs.empty()) throw PrefUsageError("--input PATH is required");
  if (o.out.empty()) throw PrefUsageError("--out PREFIX is required");
  if (o.on_error != "stop" && o.on_error != "skip") throw PrefUsageError("--on-error: expected stop or skip");
  return o;
}

std::string slurp_pref(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read '" + path + "'");
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

bool is_messages(const ojson& v) {
  return v.is_array() && !v.empty() && v[0].is_object() && v[0].contains("role");
}

// One record's three parts, implicit prompt extracted as TRL's extract_prompt
// does (the first differing element; a string's space before it goes to the completion).
struct Parts {
  ojson prompt, chosen, rejected;
  bool conversational = false;
};

Parts parse_pair(const std::string& line, const std::string& where) {
  ojson j;
  try {
    j = ojson::parse(line);
  } catch (const nlohmann::json::parse_error&) {
    throw std::runtime_error(where + ": not a JSON object");
  }
  if (!j.is_object()) throw std::runtime_error(where + ": a preference record must be a JSON object");
  for (const char* k : {"chosen", "rejected"})
    if (!j.contains(k) || !(j[k].is_string() || is_messages(j[k])))
      throw std::runtime_error(where + ": '" + k + "' is missing, or neither a string nor a list of messages");
  Parts p;
  p.conversational = is_messages(j["chosen"]);
  if (is_messages(j["rejected"]) != p.conversational)
    throw std::runtime_error(where + ": 'chosen' and 'rejected' mix a string and a list of messages");
  if (j["chosen"] == j["rejected"]) throw std::runtime_error(where + ": 'chosen' and 'rejected' are identical");
  if (j.contains("prompt")) {
    const auto& pr = j["prompt"];
    if (p.conversational ? !is_messages(pr) : !pr.is_string())
      throw std::runtime_error(where + ": 'prompt' must be " +
                               std::string(p.conversational ? "a list of messages" : "a string") + " as the completions are");
    p.prompt = pr;
    p.chosen = j["chosen"];
    p.rejected = j["rejected"];
    return p;
  }
  if (p.conversational) {
    const auto &c = j["chosen"], &r = j["rejected"];
    size_t idx = 0;
    while (idx < c.size() && idx < r.size() && c[idx] == r[idx]) ++idx;
    if (idx == 0) throw std::runtime_error(where + ": no 'prompt', and chosen and rejected share no leading message");
    p.prompt = ojson::array();
    p.chosen = ojson::array();
    p.rejected = ojson::array();
    for (size_t i = 0; i < c.size(); ++i) (i < idx ? p.prompt : p.chosen).push_back(c[i]);
    for (size_t i = idx; i < r.size(); ++i) p.rejected.push_back(r[i]);
    if (p.chosen.empty() || p.rejected.empty())
      throw std::runtime_error(where + ": no 'prompt', and one completion is a prefix of the other");
    return p;
  }
  const std::string c = j["chosen"].get<std::string>(), r = j["rejected"].get<std::string>();
  size_t idx = 0;
  while (idx < c.size() && idx < r.size() && c[idx] == r[idx]) ++idx;
  if (idx == c.size() || idx == r.size())
    throw std::runtime_error(where + ": no 'prompt', and one completion is a prefix of the other");
  if (idx > 0 && c[idx - 1] == ' ') --idx;
  p.prompt = c.substr(0, idx);
  p.chosen = c.substr(idx);
  p.rejected = r.substr(idx);
  return p;
}

ojson join_messages(const ojson& a, const ojson& b) {
  ojson out = a;
  for (const auto& m : b) out.push_back(m);
  return out;
}

}  // namespace

int prepare_preference_main(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  try {
    bool help = false;
    const PrefOptions o = parse_pref(args, help);
    if (help) {
      out << kPreferenceUsage;
      return 0;
    }
    tok::SpecialPolicy policy;
    try {
      policy = tok::parse_special_policy(o.special);
    } catch (const tok::TokenizerError& e) {
      throw PrefUsageError(std::string("--special-tokens: ") + e.what());
    }
    const tok::Tokenizer tokenizer = tok::Tokenizer::load(o.tokenizer);
    std::optional<ChatTemplate> tmpl;  // compiled at the first conversational record
    auto chat = [&]() -> const ChatTemplate& {
      if (tmpl) return *tmpl;
      try {
        const auto spec = find_chat_template(o.chat_template, o.tokenizer);
        if (!spec)
          throw PrefUsageError("conversational records: the tokenizer folder " + o.tokenizer +
                               " has no chat template; give --chat-template NAME|PATH");
        ChatTemplateOptions copt;
        copt.content_specials = policy;
        copt.kwargs_json = o.chat_kwargs;
        tmpl.emplace(make_chat_template(*spec, tokenizer, copt));
      } catch (const ChatError& e) {
        throw PrefUsageError(std::string("--chat-template: ") + e.what());
      }
      return *tmpl;
    };
    // TRL appends the processing class's eos_token: tokenizer_config.json's, else the tokenizer's own.
    std::optional<int64_t> eos = tokenizer.eos_id();
    for (const auto& [k, v] : chat_special_tokens(o.tokenizer))
      if (k == "eos_token") {
        const auto ids = tokenizer.encode(v, tok::SpecialPolicy::special, false);
        if (ids.size() == 1) eos = ids[0];
      }

    nlohmann::json inputs = nlohmann::json::array();
    for (const auto& f : o.inputs) {
      if (!fs::is_regular_file(f)) throw PrefUsageError("--input '" + f + "': no such file");
      inputs.push_back({{"path", f}, {"sha256", sha256_file_hex(f)}, {"bytes", fs::file_size(f)}, {"format", "preference"}});
    }
    const fs::path prefix(o.out);
    if (!prefix.parent_path().empty()) fs::create_directories(prefix.parent_path());
    const std::string manifest_path = o.out + ".manifest.json";
    fs::remove(manifest_path);
    const indexed::DType dtype = indexed::dtype_for_vocab(tokenizer.vocab_size());
    indexed::Writer writer(o.out, dtype);
    int64_t skipped = 0, conversational = 0, standard = 0;
    std::vector<std::string> skipped_where;
    for (const auto& file : o.inputs) {
      const std::string data = slurp_pref(file);
      size_t start = 0, lineno = 0;
      while (start < data.size()) {
        size_t end = data.find('\n', start);
        if (end == std::string::npos) end = data.size();
        ++lineno;
        const std::string line = data.substr(start, end - start);
        start = end + 1;
        if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
        const std::string where = file + ":" + std::to_string(lineno);
        try {
          const Parts p = parse_pair(line, where);
          std::vector<int32_t> pid, cid, rid;
          try {
            if (p.conversational) {
              const ChatTemplate& t = chat();
              pid = t.tokens(Conversation::from_json(p.prompt), true);
              cid = t.tokens(Conversation::from_json(join_messages(p.prompt, p.chosen)), false);
              rid = t.tokens(Conversation::from_json(join_messages(p.prompt, p.rejected)), false);
            } else {
              if (!eos) throw std::runtime_error("the tokenizer has no EOS token to end the completions with");
              // TRL appends the EOS token's text to a completion that lacks it;
              // the tokenizer splits at special tokens, so its id goes on the end.
              const std::string eos_text = tokenizer.decode(std::vector<int32_t>{int32_t(*eos)});
              auto completion = [&](const ojson& v) {
                std::string s = v.get<std::string>();
                bool had = s.size() >= eos_text.size() && s.compare(s.size() - eos_text.size(), eos_text.size(), eos_text) == 0;
                if (had) s.resize(s.size() - eos_text.size());
                auto ids = tokenizer.encode(p.prompt.get<std::string>() + s, policy, true);
                ids.push_back(int32_t(*eos));
                return ids;
              };
              pid = tokenizer.encode(p.prompt.get<std::string>(), policy, true);
              cid = completion(p.chosen);
              rid = completion(p.rejected);
            }
          } catch (const std::exception& e) {
            throw std::runtime_error(where + ": " + e.what());
          }
          const size_t plen = std::min(common_prefix(pid, cid), common_prefix(pid, rid));
          const std::vector<int32_t> prompt(pid.begin(), pid.begin() + long(plen)),
              chosen(cid.begin() + long(plen), cid.end()), rejected(rid.begin() + long(plen), rid.end());
          if (chosen.empty() || rejected.empty()) throw std::runtime_error(where + ": a completion has no tokens");
          writer.add_document({&prompt, &chosen, &rejected});
          ++(p.conversational ? conversational : standard);
        } catch (const PrefUsageError&) {
          throw;
        } catch (const std::exception& e) {
          if (o.on_error == "stop") throw;
          ++skipped;
          if (skipped_where.size() < 10) skipped_where.push_back(e.what());
        }
      }
    }
    if (writer.documents() == 0) throw std::runtime_error("no preference pairs in the input (nothing written)");
    writer.commit();
    nlohmann::json settings = {{"special_tokens", o.special}, {"on_error", o.on_error}};
    if (tmpl) {
      settings["chat_template"] = o.chat_template.empty() ? tmpl->source() : o.chat_template;
      settings["chat_template_sha256"] = tmpl->sha256();
      settings["chat_template_source"] = tmpl->source();
      if (!o.chat_kwargs.empty()) settings["chat_template_kwargs"] = nlohmann::json::parse(o.chat_kwargs);
    }
    const std::string name = prefix.filename().string();
    const nlohmann::json manifest = {
        {"format", "nnstrain indexed dataset (Megatron .bin/.idx)"},
        {"format_version", 1},
        {"bin", name + ".bin"},
        {"idx", name + ".idx"},
        {"bin_bytes", fs::file_size(o.out + ".bin")},
        {"idx_bytes", fs::file_size(o.out + ".idx")},
        {"dtype", indexed::dtype_name(dtype)},
        {"documents", writer.documents()},
        {"tokens", writer.tokens()},
        {"sequences_per_document", "preference"},
        {"kind", "preference (prompt, chosen completion, rejected completion)"},
        {"pairs", {{"standard", standard}, {"conversational", conversational}}},
        {"skipped_records", skipped},
        {"tokenizer", {{"path", o.tokenizer}, {"kind", tokenizer.kind()}, {"sha256", tokenizer.sha256()},
                       {"vocab_size", tokenizer.vocab_size()}, {"eos_id", eos ? nlohmann::json(*eos) : nlohmann::json()},
                       {"bos_id", tokenizer.bos_id() ? nlohmann::json(*tokenizer.bos_id()) : nlohmann::json()}}},
        {"inputs", inputs},
        {"settings", settings},
    };
    write_file_atomic(manifest_path, manifest.dump(1) + "\n");
    for (const auto& w : skipped_where) err << "prepare corpus: skipped " << w << "\n";
    out << "prepare corpus: " << writer.documents() << " preference pairs, " << writer.tokens() << " tokens -> " << o.out
        << ".{bin,idx}";
    if (skipped) out << "; skipped " << skipped << " malformed records";
    out << "\n";
    return 0;
  } catch (const PrefUsageError& e) {
    err << "nnstrain prepare corpus: error: " << e.what() << "\n" << kPreferenceUsage;
    return 2;
  } catch (const std::exception& e) {
    err << "nnstrain prepare corpus: error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace nnstrain::data
