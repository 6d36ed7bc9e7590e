#include "data/chat/render_command.h"

#include <chrono>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "data/chat_template.h"

namespace nnstrain::data {

namespace {

using ojson = nlohmann::ordered_json;

constexpr const char* kUsage = R"(usage: nnstrain prepare chat-render BATCH.json

BATCH.json: {"tokenizer": PATH,
             "templates": [{"template": NAME|PATH} | {"text": JINJA, "source": NAME}, ...],
             "conversations": [{"messages": [...], "tools": [...], "documents": [...], "kwargs": {...}}, ...],
             "add_generation_prompt": [false, true],        (default [false])
             "special_tokens": {"bos_token": ..., ...},      (default: the tokenizer folder's)
             "content_specials": "text" | "special",        (default text)
             "train_on": "all" | "last"}
Writes one JSON line per template x conversation x add_generation_prompt:
{"template", "conversation", "add_generation_prompt", "text", "ids", "target"} or {..., "error"},
then {"seconds": ...}: the time encode() took (rendering, tokenizing and the loss mask,
what prepare corpus does per conversation), over the add_generation_prompt=false lines.
)";

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

int chat_render_main(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  if (args.size() != 1 || args[0] == "-h" || args[0] == "--help") {
    (args.size() == 1 ? out : err) << kUsage;
    return args.size() == 1 ? 0 : 2;
  }
  ojson batch;
  try {
    batch = ojson::parse(read_all(args[0]));
  } catch (const std::exception& e) {
    err << "nnstrain prepare chat-render: " << args[0] << ": " << e.what() << "\n";
    return 2;
  }
  try {
    const std::string tok_path = batch.at("tokenizer").get<std::string>();
    const auto tokenizer = tok::Tokenizer::load(tok_path);
    ChatTemplateOptions opt;
    opt.content_specials = tok::parse_special_policy(batch.value("content_specials", "text"));
    const TrainOn train_on = batch.value("train_on", "all") == "last" ? TrainOn::last_assistant : TrainOn::all_assistant;
    std::vector<bool> prompts;
    if (batch.contains("add_generation_prompt"))
      for (const auto& b : batch["add_generation_prompt"]) prompts.push_back(b.get<bool>());
    else
      prompts.push_back(false);
    std::vector<Conversation> convs;
    for (const auto& c : batch.at("conversations")) {
      const ojson* tools = c.contains("tools") ? &c["tools"] : nullptr;
      const ojson* docs = c.contains("documents") ? &c["documents"] : nullptr;
      Conversation conv = Conversation::from_json(c.at("messages"), tools, docs);
      if (c.contains("kwargs")) conv.kwargs = jinja::Value::from_json(c["kwargs"]);
      convs.push_back(std::move(conv));
    }
    double seconds = 0;
    const auto& templates = batch.at("templates");
    for (size_t ti = 0; ti < templates.size(); ++ti) {
      const auto& t = templates[ti];
      std::optional<ChatTemplate> tmpl;
      try {
        ChatTemplateSpec spec;
        if (t.contains("text")) {
          spec.text = t["text"].get<std::string>();
          spec.source = t.value("source", "template " + std::to_string(ti));
          spec.special_tokens = chat_special_tokens(tok_path);
        } else {
          spec = *find_chat_template(t.at("template").get<std::string>(), tok_path);
        }
        if (batch.contains("special_tokens")) {
          spec.special_tokens.clear();
          for (auto it = batch["special_tokens"].begin(); it != batch["special_tokens"].end(); ++it)
            spec.special_tokens.emplace_back(it.key(), it.value().get<std::string>());
        }
        tmpl.emplace(make_chat_template(spec, tokenizer, opt));
      } catch (const std::exception& e) {
        out << ojson({{"template", ti}, {"error", e.what()}}).dump(-1, ' ', false, ojson::error_handler_t::replace) << "\n";
        continue;
      }
      for (size_t ci = 0; ci < convs.size(); ++ci) {
        for (bool agp : prompts) {
          ojson line = {{"template", ti}, {"conversation", ci}, {"add_generation_prompt", agp}};
          try {
            const std::string text = tmpl->render(convs[ci], agp);
            line["text"] = text;
            line["ids"] = tmpl->tokens(convs[ci], agp);
            if (!agp) {
              try {
                const auto t0 = std::chrono::steady_clock::now();
                line["target"] = tmpl->encode(convs[ci], false, train_on, false).target;
                seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
              } catch (const std::exception& e) {
                line["target_error"] = e.what();
              }
            }
          } catch (const std::exception& e) {
            line["error"] = e.what();
          }
          out << line.dump(-1, ' ', false, ojson::error_handler_t::replace) << "\n";
        }
      }
    }
    out << ojson({{"seconds", seconds}}).dump() << "\n";
    return 0;
  } catch (const std::exception& e) {
    err << "nnstrain prepare chat-render: error: " << e.what() << "\n";
    return 2;
  }
}

}  // namespace nnstrain::data
