#include "trainer/interop/generate_command.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "base/config/trainer_args.h"
#include "data/chat_template.h"
#include "data/indexed/sample_stream.h"
#include "data/tokenizer/tokenizer.h"
#include "data/tokenizer/unicode.h"
#include "models/generate.h"
#include "models/model.h"
#include "models/registry.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/checkpoint/manifest.h"
#include "trainer/dist/device.h"
#include "trainer/interop/hf_import.h"
#include "trainer/interop/model_checkpoint.h"
#include "trainer/interop/model_source.h"

namespace fs = std::filesystem;

namespace nnstrain::interop {

namespace {

constexpr const char* kUsage = R"(usage: nnstrain generate SOURCE [options]

  SOURCE  a checkpoint folder saved under any plan (sharded, deduped, tensor parallel),
          a run's save_dir (its latest checkpoint), a merged folder (nnstrain merge,
          with or without --hf), or a Hugging Face folder (config.json + model.safetensors)

  --prompt TEXT            the text to continue (default: a newline, as nanoGPT's sample.py)
  --prompt-file PATH       the prompt read from a file
  --prompt-ids 1,2,3       the prompt as token ids (no tokenizer needed)
  --max-new-tokens N       tokens generated per sample (default 200)
  --temperature T          logits divided by T before sampling; 0 = greedy (default 1.0)
  --top-k K                sample among the K likeliest tokens (default 0: all)
  --top-p P                sample among the likeliest tokens whose probability reaches P (default 1: all)
  --seed S                 the sampling generator's seed (default 1337)
  --num-samples N          samples drawn one after another (default 1)
  --device cpu|cuda|auto   (default auto: CUDA when there is one)
  --dtype fp32|bf16|fp16   the weights' dtype while generating (default fp32)
  --tokenizer PATH         a tokenizer.json, GPT-2 encoder.json, .tiktoken file or a folder with one,
                           or a char/byte-level dataset's meta.json (default: for a checkpoint, the
                           meta.json beside its training data, or the tokenizer its indexed dataset's
                           manifest records; for a Hugging Face folder, its tokenizer)
  --stop-at-eos            end a sample at the tokenizer's end-of-text token
  --no-kv-cache            recompute the whole context for every token (nanoGPT's way; slower)
  --json                   one JSON line per sample: prompt_ids, ids (the new ones), text
  --chat                   a conversation: user turns read from standard input (one per line, or
                           --prompt for a single turn), rendered with the chat template, each answer
                           streamed until the template's end-of-turn token; the oldest exchanges are
                           dropped when the history outgrows the model's context
  --system TEXT            --chat: the system prompt
  --chat-template T        --chat: the Jinja template: a .jinja file, a tokenizer_config.json, a Hugging
                           Face folder, or llama3, chatml, mistral (built-in texts); default: the one the
                           checkpoint's dataset was prepared with, else the tokenizer folder's
                           (chat_template.jinja, or tokenizer_config.json's chat_template)
  --chat-template-kwargs J --chat: a JSON object of extra template variables (e.g. {"enable_thinking": false})
)";

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A tokenizer as generate uses it: text -> ids, and one id -> its bytes.
struct Codec {
  std::string what;
  std::function<std::vector<int64_t>(const std::string&, const std::string& option)> encode;
  std::function<std::string(int64_t)> piece;
  std::optional<int64_t> eos;
};

const std::string kReplacement = "\xEF\xBF\xBD";  // U+FFFD, for ids the tokenizer does not know

std::string code_point_name(uint32_t cp) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "U+%04X", cp);
  return buf;
}

// A `nnstrain prepare` meta.json: char level (its `itos`) or byte level (id = byte).
Codec meta_codec(const std::string& path) {
  const auto j = checkpoint::read_json_bounded(path);
  const std::string level = j.is_object() ? j.value("level", "") : "";
  Codec c;
  if (level == "byte") {
    c.what = path + " (byte level)";
    c.encode = [](const std::string& text, const std::string&) {
      std::vector<int64_t> ids;
      for (unsigned char b : text) ids.push_back(b);
      return ids;
    };
    c.piece = [](int64_t id) { return id >= 0 && id < 256 ? std::string(1, char(id)) : kReplacement; };
    return c;
  }
  if (level != "char" || !j.contains("itos") || !j.at("itos").is_array())
    throw std::runtime_error(path + ": not a nnstrain prepare meta.json (no char-level `itos`, not byte level)");
  std::vector<std::string> itos;
  std::map<std::string, int64_t> stoi;
  for (const auto& s : j.at("itos")) {
    if (!s.is_string()) throw std::runtime_error(path + ": `itos` holds a non-string entry");
    stoi.emplace(s.get<std::string>(), static_cast<int64_t>(itos.size()));
    itos.push_back(s.get<std::string>());
  }
  c.what = path + " (char level, " + std::to_string(itos.size()) + " characters)";
  c.encode = [stoi, path, n = itos.size()](const std::string& text, const std::string& option) {
    std::vector<int64_t> ids;
    const auto* p = reinterpret_cast<const unsigned char*>(text.data());
    const auto* end = p + text.size();
    for (const auto* q = p; q < end;) {
      uint32_t cp = 0;
      const int len = tok::utf8_decode(q, end, cp);
      if (len == 0)
        throw UsageError(option + ": invalid UTF-8 at byte " + std::to_string(q - p));
      const std::string ch(reinterpret_cast<const char*>(q), len);
      const auto it = stoi.find(ch);
      if (it == stoi.end()) {
        const std::string shown = cp < 0x20 || cp == 0x7f ? "" : "'" + ch + "' ";
        throw UsageError(option + ": the character " + shown + "(" + code_point_name(cp) + ") is not in the vocabulary of " +
                         path + " (" + std::to_string(n) + " characters)");
      }
      ids.push_back(it->second);
      q += len;
    }
    return ids;
  };
  c.piece = [itos](int64_t id) { return id >= 0 && id < int64_t(itos.size()) ? itos[id] : kReplacement; };
  return c;
}

// A byte-level BPE tokenizer (data/tokenizer): prompts encoded as Hugging Face's
// tokenizer(text) does (special-token text as the token, the template's BOS added).
Codec bpe_codec(const std::string& path) {
  auto t = std::make_shared<tok::Tokenizer>(tok::Tokenizer::load(path));
  Codec c;
  c.what = path + " (" + t->describe() + ")";
  c.encode = [t](const std::string& text, const std::string& option) {
    try {
      const auto ids = t->encode(text, tok::SpecialPolicy::special, /*add_special=*/true);
      return std::vector<int64_t>(ids.begin(), ids.end());
    } catch (const tok::TokenizerError& e) {
      throw UsageError(option + ": " + e.what());
    }
  };
  c.piece = [t](int64_t id) {
    if (id < 0 || id >= t->vocab_size()) return kReplacement;
    const int32_t i = static_cast<int32_t>(id);
    try {
      return t->decode(&i, 1);
    } catch (const std::exception&) {
      return kReplacement;  // a hole in the vocabulary
    }
  };
  if (const auto e = t->eos_id()) c.eos = *e;
  return c;
}

Codec load_codec(const std::string& path) {
  if (!fs::exists(path)) throw UsageError("--tokenizer: " + path + " does not exist");
  if (fs::is_directory(path) && fs::exists(fs::path(path) / "meta.json") &&
      !fs::exists(fs::path(path) / "tokenizer.json"))
    return meta_codec((fs::path(path) / "meta.json").string());
  if (fs::path(path).filename() == "meta.json") return meta_codec(path);
  return bpe_codec(path);
}

int64_t parse_int(const std::string& option, const std::string& v, int64_t lo) {
  size_t used = 0;
  int64_t x = 0;
  try {
    x = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v.size() || v.empty()) throw UsageError(option + ": '" + v + "' is not an integer");
  if (x < lo) throw UsageError(option + ": " + v + " is below " + std::to_string(lo));
  return x;
}

double parse_float(const std::string& option, const std::string& v) {
  size_t used = 0;
  double x = 0;
  try {
    x = std::stod(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v.size() || v.empty() || !std::isfinite(x)) throw UsageError(option + ": '" + v + "' is not a number");
  return x;
}

std::vector<int64_t> parse_ids(const std::string& v) {
  std::vector<int64_t> ids;
  std::stringstream ss(v);
  for (std::string item; std::getline(ss, item, ',');) ids.push_back(parse_int("--prompt-ids", item, 0));
  if (ids.empty()) throw UsageError("--prompt-ids: no ids given");
  return ids;
}

struct Options {
  std::string source, prompt = "\n", prompt_file, tokenizer, device = "auto", dtype = "fp32";
  bool chat = false;
  std::optional<std::string> system;
  std::string chat_template, chat_kwargs;
  std::optional<std::vector<int64_t>> prompt_ids;
  bool prompt_given = false, json = false, stop_at_eos = false;
  int64_t num_samples = 1, seed = 1337;
  models::GenerateOptions gen{200};
};

// Returns false for --help.
bool parse(const std::vector<std::string>& args, Options& o) {
  std::map<std::string, std::string> values;
  const std::vector<std::string> valued = {"--prompt",      "--prompt-file", "--prompt-ids", "--max-new-tokens",
                                           "--temperature", "--top-k",       "--top-p",      "--seed",
                                           "--num-samples", "--device",      "--dtype",      "--tokenizer",
                                           "--system",      "--chat-template", "--chat-template-kwargs"};
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& a = args[i];
    if (a == "-h" || a == "--help") return false;
    if (a == "--json") { o.json = true; continue; }
    if (a == "--no-kv-cache") { o.gen.kv_cache = false; continue; }
    if (a == "--stop-at-eos") { o.stop_at_eos = true; continue; }
    if (a == "--chat") { o.chat = true; continue; }
    std::string key = a, value;
    const auto eq = a.find('=');
    if (a.rfind("--", 0) == 0 && eq != std::string::npos) key = a.substr(0, eq), value = a.substr(eq + 1);
    if (std::find(valued.begin(), valued.end(), key) != valued.end()) {
      if (eq == std::string::npos) {
        if (i + 1 >= args.size()) throw UsageError(key + " needs a value");
        value = args[++i];
      }
      if (values.count(key)) throw UsageError(key + " given twice");
      values[key] = value;
    } else if (a.rfind("-", 0) == 0 || !o.source.empty()) {
      throw UsageError("unexpected argument '" + a + "'");
    } else {
      o.source = a;
    }
  }
  if (o.source.empty()) throw UsageError("need SOURCE: a checkpoint, save_dir, merged or Hugging Face folder");
  const int prompts = values.count("--prompt") + values.count("--prompt-file") + values.count("--prompt-ids");
  if (prompts > 1) throw UsageError("give one of --prompt, --prompt-file and --prompt-ids");
  o.prompt_given = prompts == 1;
  for (const auto& [k, v] : values) {
    if (k == "--prompt") o.prompt = v;
    else if (k == "--prompt-file") o.prompt_file = v;
    else if (k == "--prompt-ids") o.prompt_ids = parse_ids(v);
    else if (k == "--max-new-tokens") o.gen.max_new_tokens = parse_int(k, v, 1);
    else if (k == "--temperature") {
      o.gen.sampling.temperature = parse_float(k, v);
      if (o.gen.sampling.temperature < 0) throw UsageError(k + ": " + v + " is negative (0 = greedy)");
    } else if (k == "--top-k") o.gen.sampling.top_k = parse_int(k, v, 0);
    else if (k == "--top-p") {
      o.gen.sampling.top_p = parse_float(k, v);
      if (!(o.gen.sampling.top_p > 0 && o.gen.sampling.top_p <= 1)) throw UsageError(k + ": " + v + " is not in (0, 1]");
    } else if (k == "--seed") o.seed = parse_int(k, v, 0);
    else if (k == "--num-samples") o.num_samples = parse_int(k, v, 1);
    else if (k == "--device") {
      if (v != "cpu" && v != "cuda" && v != "auto") throw UsageError(k + ": '" + v + "' is not cpu, cuda or auto");
      o.device = v;
    } else if (k == "--dtype") {
      if (v != "fp32" && v != "bf16" && v != "fp16") throw UsageError(k + ": '" + v + "' is not fp32, bf16 or fp16");
      o.dtype = v;
    } else if (k == "--tokenizer") o.tokenizer = v;
    else if (k == "--system") o.system = v;
    else if (k == "--chat-template") o.chat_template = v;
    else if (k == "--chat-template-kwargs") o.chat_kwargs = v;
  }
  if (!o.chat && (o.system || !o.chat_template.empty() || !o.chat_kwargs.empty()))
    throw UsageError(std::string(o.system ? "--system" : !o.chat_template.empty() ? "--chat-template" : "--chat-template-kwargs") +
                     " goes with --chat");
  if (o.chat && (values.count("--prompt-file") || values.count("--prompt-ids") || o.num_samples != 1))
    throw UsageError("--chat takes user turns as text: --prompt or standard input (no --prompt-file, --prompt-ids, --num-samples)");
  return true;
}

std::string read_prompt_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError("--prompt-file: cannot read " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The chat template the checkpoint's indexed dataset was prepared with, if any.
std::string dataset_chat_template(const std::string& source) {
  try {
    std::string src = source;
    if (!fs::exists(fs::path(src) / "manifest.json") && fs::exists(fs::path(src) / "latest")) src = checkpoint::latest(src);
    if (!fs::exists(fs::path(src) / "manifest.json")) return "";
    const checkpoint::Checkpoint ck(src);
    const auto args = saved_args(ck);
    if (args.dataset.type != "indexed" || args.dataset.indexed_train.datasets.empty()) return "";
    const auto p = find_from_run(args.dataset.indexed_train.datasets.front().path, ck,
                                 [](const fs::path& f) { return fs::exists(f.string() + ".manifest.json"); });
    if (!p) return "";
    const auto j = checkpoint::read_json_bounded(p->string() + ".manifest.json");
    return j.contains("settings") ? j["settings"].value("chat_template", "") : "";
  } catch (const std::exception&) {
    return "";
  }
}

// --chat: user turns from --prompt or standard input; each answer streamed to
// standard output as it is sampled, ending at the template's end-of-turn token.
// The template: --chat-template, else the checkpoint's dataset's, else the
// tokenizer folder's (a Hugging Face model's chat_template.jinja or
// tokenizer_config.json chat_template).
int run_chat(const Options& o) {
  std::string given = o.chat_template.empty() ? dataset_chat_template(o.source) : o.chat_template;
  auto src = load_model_source(o.source);
  const std::string tok_path = !o.tokenizer.empty() ? o.tokenizer : src.tokenizer ? *src.tokenizer : "";
  if (tok_path.empty()) throw UsageError("--chat: no tokenizer for " + o.source + "; give --tokenizer PATH");
  const auto tokenizer = tok::Tokenizer::load(tok_path);
  std::optional<data::ChatTemplate> tmpl;
  try {
    std::optional<data::ChatTemplateSpec> spec;
    try {
      spec = data::find_chat_template(given, tok_path);
    } catch (const data::ChatError&) {
      if (!o.chat_template.empty()) throw;
      spec = data::find_chat_template("", tok_path);  // the dataset's template file is gone: the tokenizer's
    }
    if (!spec)
      throw UsageError("--chat: give --chat-template NAME|PATH (neither the checkpoint's dataset nor the "
                       "tokenizer folder " + tok_path + " has a chat template)");
    data::ChatTemplateOptions copt;
    copt.content_specials = tok::SpecialPolicy::text;  // what the user types cannot forge a control token
    copt.kwargs_json = o.chat_kwargs;
    tmpl.emplace(data::make_chat_template(*spec, tokenizer, copt));
  } catch (const data::ChatError& e) {
    throw UsageError(std::string("--chat-template: ") + e.what());
  }
  if (tmpl->end_of_turn() < 0)
    throw UsageError("--chat-template: " + tmpl->source() + " ends no assistant turn with a token the tokenizer knows");
  auto& model = *src.model;
  const auto device = dist::bind_device(o.device, dist::DistEnv{});
  model.to(device, o.dtype == "bf16" ? torch::kBFloat16 : o.dtype == "fp16" ? torch::kHalf : torch::kFloat);
  model.eval();
  std::cerr << "nnstrain generate: " << src.what << " on " << device << "; chat template " << tmpl->source()
            << "; tokenizer " << tok_path << "\n";
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(o.seed));
  auto opts = o.gen;
  opts.stop_id = tmpl->end_of_turn();
  std::vector<data::ChatMessage> history;
  if (o.system) history.push_back({"system", *o.system});
  const size_t kept_front = history.size();
  const bool single = o.prompt_given;
  std::string line;
  while (true) {
    if (single) {
      line = o.prompt;
    } else {
      std::cerr << "user> " << std::flush;
      if (!std::getline(std::cin, line)) break;
      if (line.empty()) continue;
    }
    history.push_back({"user", line});
    // The rendered history and room for the answer within the context window:
    // the oldest exchanges go first.
    std::vector<int32_t> ids = tmpl->encode(data::Conversation::from_messages(history), true, data::TrainOn::all_assistant, false).ids;
    while (int64_t(ids.size()) + opts.max_new_tokens > model.max_seq_len() && history.size() > kept_front + 2) {
      history.erase(history.begin() + long(kept_front), history.begin() + long(kept_front) + 2);
      ids = tmpl->encode(data::Conversation::from_messages(history), true, data::TrainOn::all_assistant, false).ids;
    }
    if (int64_t(ids.size()) >= model.max_seq_len()) {
      std::cerr << "nnstrain generate: this turn's " << ids.size() << " tokens fill the model's context of "
                << model.max_seq_len() << "; say less\n";
      history.pop_back();
      if (single) return 1;
      continue;
    }
    std::vector<int64_t> prompt(ids.begin(), ids.end());
    std::string answer;
    std::vector<int64_t> answer_ids;
    models::generate(model, prompt, opts, gen, [&](int64_t id, const at::Tensor&) {
      if (id == opts.stop_id) return;
      answer_ids.push_back(id);
      std::string piece = id < tokenizer.vocab_size() ? [&] {
        const int32_t i = int32_t(id);
        try {
          return tokenizer.decode(&i, 1);
        } catch (const std::exception&) {
          return kReplacement;
        }
      }() : kReplacement;
      answer += piece;
      if (!o.json) std::cout << piece << std::flush;  // streamed as sampled
    });
    if (o.json)
      std::cout << nlohmann::json({{"prompt_ids", prompt}, {"ids", answer_ids}, {"text", answer}})
                       .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                << std::endl;
    else
      std::cout << std::endl;
    history.push_back({"assistant", answer});
    if (single) break;
  }
  return 0;
}

int run(const Options& o) {
  if (o.chat) return run_chat(o);
  std::optional<std::string> prompt_text;
  if (!o.prompt_ids) prompt_text = o.prompt_file.empty() ? o.prompt : read_prompt_file(o.prompt_file);
  if (prompt_text && prompt_text->empty()) throw UsageError("the prompt is empty (give at least one token)");
  // An explicit tokenizer is checked before the (possibly long) model load.
  std::optional<Codec> codec;
  if (!o.tokenizer.empty()) codec = load_codec(o.tokenizer);

  auto src = load_model_source(o.source);
  if (!codec && src.tokenizer) codec = load_codec(*src.tokenizer);
  auto& model = *src.model;
  const int64_t vocab = model.vocab_size();

  std::vector<int64_t> prompt;
  if (o.prompt_ids) {
    prompt = *o.prompt_ids;
  } else {
    if (!codec)
      throw UsageError("no tokenizer for " + o.source + " (" + (o.prompt_given ? "" : "the default prompt is text; ") +
                       "give --tokenizer PATH, a tokenizer.json or the dataset's meta.json, or --prompt-ids)");
    prompt = codec->encode(*prompt_text, o.prompt_file.empty() ? "--prompt" : "--prompt-file");
    if (prompt.empty()) throw UsageError("the prompt encodes to no tokens");
  }
  for (auto id : prompt)
    if (id >= vocab)
      throw UsageError(std::string(o.prompt_ids ? "--prompt-ids" : "the tokenizer") + ": token id " +
                       std::to_string(id) + " is outside the model's vocabulary of " + std::to_string(vocab));
  if (o.stop_at_eos) {
    if (!codec || !codec->eos) throw UsageError("--stop-at-eos: the tokenizer has no end-of-text token");
  }

  const auto device = dist::bind_device(o.device, dist::DistEnv{});
  const auto dtype = o.dtype == "bf16" ? torch::kBFloat16 : o.dtype == "fp16" ? torch::kHalf : torch::kFloat;
  model.to(device, dtype);
  model.eval();
  if (int64_t(prompt.size()) > model.max_seq_len())
    std::cerr << "nnstrain generate: the prompt's " << prompt.size() << " tokens exceed the model's context of "
              << model.max_seq_len() << "; only the last " << model.max_seq_len() << " are seen\n";
  std::cerr << "nnstrain generate: " << src.what << " on " << device << " (" << o.dtype << ")"
            << "; tokenizer: " << (codec ? codec->what : std::string("none (ids only)")) << "\n";

  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(o.seed));
  auto opts = o.gen;
  if (o.stop_at_eos) opts.stop_id = *codec->eos;
  auto text_of = [&](const std::vector<int64_t>& ids) {
    std::string s;
    for (auto id : ids) s += codec->piece(id);
    return s;
  };
  int64_t total = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < o.num_samples; ++i) {
    const auto ids = models::generate(model, prompt, opts, gen);
    total += static_cast<int64_t>(ids.size());
    if (o.json) {
      nlohmann::json j = {{"sample", i}, {"prompt_ids", prompt}, {"ids", ids}};
      if (codec) j["text"] = (prompt_text ? *prompt_text : text_of(prompt)) + text_of(ids);
      std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
    } else {
      if (i > 0) std::cout << "\n---------------\n";
      if (codec) {
        std::cout << (prompt_text ? *prompt_text : text_of(prompt)) << text_of(ids);
      } else {
        for (size_t k = 0; k < ids.size(); ++k) std::cout << (k ? " " : "") << ids[k];
      }
      std::cout << std::endl;
    }
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cerr << "nnstrain generate: " << total << " tokens in " << s << " s (" << (s > 0 ? total / s : 0.0)
            << " tokens/s" << (opts.kv_cache ? ", KV cache" : ", no KV cache") << ")\n";
  return 0;
}

}  // namespace

int generate_main(const std::vector<std::string>& args) {
  Options o;
  try {
    if (!parse(args, o)) {
      std::cout << kUsage;
      return 0;
    }
    return run(o);
  } catch (const UsageError& e) {
    std::cerr << "nnstrain generate: " << e.what() << " (see nnstrain generate --help)\n";
    return 2;
  } catch (const ModelSourceError& e) {
    std::cerr << "nnstrain generate: " << e.what() << "\n";
    return 2;
  } catch (const c10::Error& e) {
    std::string m = e.what_without_backtrace();
    std::cerr << "nnstrain generate: error: " << m.substr(0, m.find('\n')) << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::string m = e.what();
    std::cerr << "nnstrain generate: error: " << m.substr(0, m.find('\n')) << "\n";
    return 1;
  }
}

}  // namespace nnstrain::interop
