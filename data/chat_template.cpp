#include "data/chat_template.h"

#include "data/sha256.h"

#include <algorithm>

namespace nnstrain::data {

namespace {

// The code point of the UTF-8 sequence starting at s[i] and its length (1 for a stray byte).
std::pair<uint32_t, size_t> code_point_at(const std::string& s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  if (i + n > s.size()) n = 1;
  uint32_t cp = n == 1 ? c : c & (0x7f >> n);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
  return {cp, n};
}

// Python's str.isspace().
bool is_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

const char* kQwenDefaultSystem = "You are a helpful assistant.";

}  // namespace

std::string strip_unicode_whitespace(const std::string& s) {
  size_t begin = 0, end = s.size();
  while (begin < end) {
    auto [cp, n] = code_point_at(s, begin);
    if (!is_space(cp)) break;
    begin += n;
  }
  // From the back: find each code point's start, then test it.
  while (end > begin) {
    size_t start = end - 1;
    while (start > begin && (static_cast<unsigned char>(s[start]) & 0xc0) == 0x80) --start;
    auto [cp, n] = code_point_at(s, start);
    if (start + n != end || !is_space(cp)) break;
    end = start;
  }
  return s.substr(begin, end - begin);
}

const std::vector<std::string>& ChatTemplate::names() {
  static const std::vector<std::string> n{"llama3", "chatml", "mistral"};
  return n;
}

std::string ChatTemplate::identify(const std::string& jinja) {
  // SHA-256 of each model's template string as its tokenizer_config.json holds it
  // (tests/integration/chat_common.py TEMPLATES): Meta-Llama-3-Instruct's, Qwen2's
  // ChatML, Mistral-Instruct's. Exact text only: a variant (a default system date,
  // tool calls) renders differently, so it is not taken for one of these.
  static const std::pair<const char*, const char*> known[] = {
      {"ba03a121d097859c7b5b9cd03af99aafe95275210d2876f642ad9929a150f122", "llama3"},
      {"793202280c0910ab26bc6eb57c8212c2417324c6d8c4efd0d10d59092ab3e3eb", "chatml"},
      {"796853172235ab3aaa4810013ddfe2eab481bda3306dad4f700c00d436eed596", "mistral"},
  };
  const auto h = sha256_hex(jinja);
  for (const auto& [hash, name] : known)
    if (h == hash) return name;
  return "";
}

ChatTemplate::ChatTemplate(const std::string& name, const tok::Tokenizer& tokenizer) : name_(name), tok_(&tokenizer) {
  std::vector<std::string> needs;
  std::string eot;
  if (name == "llama3") {
    bos_ = "<|begin_of_text|>";
    eot = "<|eot_id|>";
    needs = {bos_, "<|start_header_id|>", "<|end_header_id|>", eot};
  } else if (name == "chatml") {
    eot = "<|im_end|>";
    needs = {"<|im_start|>", eot};
  } else if (name == "mistral") {
    bos_ = "<s>";
    eos_ = eot = "</s>";
    needs = {bos_, eos_};
  } else {
    throw ChatError("chat template '" + name + "' is not known (expected llama3, chatml or mistral)");
  }
  for (const auto& t : needs)
    if (!tokenizer.token_id(t))
      throw ChatError("chat template " + name + " needs the special token " + t + ", which the tokenizer lacks");
  end_of_turn_ = *tokenizer.token_id(eot);
}

std::vector<ChatTemplate::Part> ChatTemplate::parts(const std::vector<ChatMessage>& messages,
                                                    bool add_generation_prompt, TrainOn train_on) const {
  size_t last_assistant = messages.size();
  for (size_t i = 0; i < messages.size(); ++i) {
    const auto& r = messages[i].role;
    if (r != "system" && r != "user" && r != "assistant")
      throw ChatError("message " + std::to_string(i + 1) + ": unknown role '" + r +
                      "' (expected system, user or assistant)");
    if (r == "assistant") last_assistant = i;
  }
  if (!add_generation_prompt && last_assistant == messages.size()) throw ChatError("the conversation has no assistant turn");
  auto trained = [&](size_t i) {
    return messages[i].role == "assistant" && (train_on == TrainOn::all_assistant || i == last_assistant);
  };
  std::vector<Part> out;
  auto text = [&](std::string t, bool target = false) { out.push_back({std::move(t), false, target, false}); };
  auto special = [&](const std::string& t, bool target = false) { out.push_back({t, true, target, false}); };

  if (name_ == "llama3") {
    for (size_t i = 0; i < messages.size(); ++i) {
      const bool t = trained(i);
      if (i == 0) special(bos_);
      special("<|start_header_id|>");
      out.back().user_turn_start = messages[i].role == "user";
      text(messages[i].role);
      special("<|end_header_id|>");
      text("\n\n");
      text(strip_unicode_whitespace(messages[i].content), t);
      special("<|eot_id|>", t);
    }
    if (add_generation_prompt) {
      special("<|start_header_id|>");
      text("assistant");
      special("<|end_header_id|>");
      text("\n\n");
    }
  } else if (name_ == "chatml") {
    for (size_t i = 0; i < messages.size(); ++i) {
      const bool t = trained(i);
      if (i == 0 && messages[0].role != "system") {  // Qwen2's template adds a default system prompt
        special("<|im_start|>");
        text(std::string("system\n") + kQwenDefaultSystem);
        special("<|im_end|>");
        text("\n");
      }
      special("<|im_start|>");
      out.back().user_turn_start = messages[i].role == "user";
      text(messages[i].role + "\n");
      text(messages[i].content, t);
      special("<|im_end|>", t);
      text("\n");
    }
    if (add_generation_prompt) {
      special("<|im_start|>");
      text("assistant\n");
    }
  } else {  // mistral: an optional system message, then user and assistant alternating
    size_t first = 0;
    std::string system;
    bool has_system = false;
    if (!messages.empty() && messages[0].role == "system") system = messages[0].content, has_system = true, first = 1;
    special(bos_);
    for (size_t i = first; i < messages.size(); ++i) {
      const auto& m = messages[i];
      if (m.role == "system")
        throw ChatError("message " + std::to_string(i + 1) + ": template mistral takes a system message first only");
      if ((m.role == "user") != ((i - first) % 2 == 0))
        throw ChatError("message " + std::to_string(i + 1) +
                        ": template mistral needs user and assistant turns alternating, user first");
      if (m.role == "user") {
        text(i == first && has_system ? " [INST] " + system + "\n\n" + m.content + " [/INST]"
                                      : " [INST] " + m.content + " [/INST]");
        out.back().user_turn_start = true;
      } else {
        const bool t = trained(i);
        text(" ");
        text(m.content, t);
        special(eos_, t);
      }
    }
  }
  return out;
}

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const {
  std::string s;
  for (const auto& p : parts(messages, add_generation_prompt, TrainOn::all_assistant)) s += p.text;
  return s;
}

ChatTokens ChatTemplate::encode(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                                TrainOn train_on) const {
  ChatTokens out;
  // Text between special tokens is encoded in one piece, as Hugging Face
  // encodes the rendered text; a token is a target if any of its bytes is.
  std::string segment;
  std::vector<std::pair<size_t, size_t>> targets;  // byte ranges of segment
  tok::EncodeCache cache;
  std::vector<int32_t> ids;
  auto flush = [&] {
    if (segment.empty()) return;
    ids.clear();
    tok_->encode(segment, tok::SpecialPolicy::text, false, cache, ids);
    size_t at = 0;
    for (int32_t id : ids) {
      const size_t len = tok_->decode(&id, 1).size(), end = at + len;
      bool t = false;
      for (const auto& [a, b] : targets) t = t || (a < end && at < b);
      out.ids.push_back(id);
      out.target.push_back(t);
      at = end;
    }
    segment.clear();
    targets.clear();
  };
  for (const auto& p : parts(messages, add_generation_prompt, train_on)) {
    if (p.special) {
      flush();
      if (p.user_turn_start) out.turn_starts.push_back(out.ids.size());
      out.ids.push_back(*tok_->token_id(p.text));
      out.target.push_back(p.target);
      continue;
    }
    if (p.user_turn_start && segment.empty()) out.turn_starts.push_back(out.ids.size());
    if (p.target && !p.text.empty()) targets.emplace_back(segment.size(), segment.size() + p.text.size());
    segment += p.text;
  }
  flush();
  return out;
}

}  // namespace nnstrain::data
