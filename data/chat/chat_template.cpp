#include "data/chat/chat_template.h"

#include <algorithm>
#include <atomic>
#include <mutex>

#include <nlohmann/json.hpp>

#include "data/chat/jinja_lexer.h"
#include "data/chat/jinja_parser.h"
#include "data/chat/jinja_runtime.h"
#include "data/chat/jinja_strings.h"
#include "data/sha256.h"

namespace nnstrain::data {

namespace {

using jinja::Value;

// Around special-token text from the conversation's own strings, so the
// tokenizer can tell it from the template's: private-use code points U+F0000
// and U+F0001 (the convention transformers' sanitize_control_tokens uses).
const std::string kMarkStart = "\xf3\xb0\x80\x80", kMarkEnd = "\xf3\xb0\x80\x81";

std::string without_markers(const std::string& s) {
  if (s.find("\xf3\xb0\x80") == std::string::npos) return s;
  std::string out;
  for (size_t i = 0; i < s.size();) {
    if (s.compare(i, 4, kMarkStart) == 0 || s.compare(i, 4, kMarkEnd) == 0) {
      i += 4;
      continue;
    }
    out += s[i++];
  }
  return out;
}

size_t common_prefix(const std::string& a, const std::string& b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

bool is_ws(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

// transformers' _alias_reasoning_fields: {"thinking": r, **message, "reasoning_content": r}.
Value alias_reasoning(const Value& m) {
  static const std::string fields[] = {"reasoning_content", "thinking", "reasoning"};
  const Value* r = nullptr;
  for (const std::string& f : fields)
    if (const Value* v = m.map().find(f); v && !v->is_none()) {
      r = v;
      break;
    }
  if (!r) return m;
  Value out = Value::dict();
  out.map().items.emplace_back(Value("thinking"), *r);
  for (const auto& kv : m.map().items) out.map().set(kv.first, kv.second);
  out.map().set(Value("reasoning_content"), *r);
  return out;
}

Value drop_nulls(const Value& m) {
  if (std::none_of(m.map().items.begin(), m.map().items.end(), [](const auto& kv) { return kv.second.is_none(); }))
    return m;
  Value out = Value::dict();
  for (const auto& kv : m.map().items)
    if (!kv.second.is_none()) out.map().items.push_back(kv);
  return out;
}

}  // namespace

std::string strip_unicode_whitespace(const std::string& s) { return jinja::py_strip(s, nullptr, true, true); }

// --- conversations -------------------------------------------------------------

Conversation Conversation::from_json(const nlohmann::ordered_json& messages, const nlohmann::ordered_json* tools,
                                     const nlohmann::ordered_json* documents) {
  Conversation c;
  jinja::List l;
  for (const auto& m : messages) {
    if (!m.is_object()) throw ChatError("a message is not a JSON object");
    l.push_back(alias_reasoning(drop_nulls(Value::from_json(m))));
  }
  c.messages = Value(std::move(l));
  if (tools && !tools->is_null()) c.tools = Value::from_json(*tools);
  if (documents && !documents->is_null()) c.documents = Value::from_json(*documents);
  return c;
}

Conversation Conversation::from_values(const Value& messages, const Value* tools, const Value* documents) {
  Conversation c;
  jinja::List l;
  l.reserve(messages.list().size());
  for (const auto& m : messages.list()) {
    if (!m.is_dict()) throw ChatError("a message is not a JSON object");
    l.push_back(alias_reasoning(drop_nulls(m)));
  }
  c.messages = Value(std::move(l));
  if (tools && !tools->is_none()) c.tools = *tools;
  if (documents && !documents->is_none()) c.documents = *documents;
  return c;
}

Conversation Conversation::from_messages(const std::vector<ChatMessage>& messages) {
  Conversation c;
  jinja::List l;
  for (const auto& m : messages) {
    Value d = Value::dict();
    d.map().items.emplace_back(Value("role"), Value(m.role));
    d.map().items.emplace_back(Value("content"), Value(m.content));
    l.push_back(std::move(d));
  }
  c.messages = Value(std::move(l));
  return c;
}

Conversation Conversation::prefix(size_t n) const {
  Conversation c = *this;
  const auto& all = messages.list();
  c.messages = Value(jinja::List(all.begin(), all.begin() + long(std::min(n, all.size()))));
  return c;
}

std::string Conversation::role(size_t i) const {
  const auto& m = messages.list()[i];
  if (!m.is_dict()) return "";
  const Value* r = m.map().find(std::string("role"));
  return r && r->is_string() ? r->str() : "";
}

// --- the template ----------------------------------------------------------------

struct ChatTemplate::Scratch {
  std::mutex mu;
  std::vector<std::unique_ptr<tok::EncodeCache>> caches;  // idle ones
  std::unique_ptr<std::atomic<int32_t>[]> token_len;      // -1: not yet known
  size_t vocab = 0;
  std::vector<uint32_t> first_bytes[256];  // control_tokens_ indices (longest first) by first byte
  std::vector<std::pair<Value, Value>> base_globals;  // the special tokens, then the template's kwargs

  std::unique_ptr<tok::EncodeCache> take() {
    std::lock_guard<std::mutex> g(mu);
    if (caches.empty()) return std::make_unique<tok::EncodeCache>();
    auto c = std::move(caches.back());
    caches.pop_back();
    return c;
  }
  void give(std::unique_ptr<tok::EncodeCache> c) {
    std::lock_guard<std::mutex> g(mu);
    caches.push_back(std::move(c));
  }
};

ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;

ChatTemplate::ChatTemplate(const std::string& text, std::string source, const tok::Tokenizer& tokenizer,
                           ChatTemplateOptions options)
    : source_(std::move(source)), sha256_(sha256_hex(text)), tok_(&tokenizer), opt_(std::move(options)) {
  try {
    tpl_ = std::make_unique<jinja::Template>(jinja::parse(jinja::lex(text)));
  } catch (const jinja::Error& e) {
    throw ChatError(source_ + ":" + std::to_string(e.line) + ":" + std::to_string(e.col) + ": " + e.what());
  }
  kwargs_ = Value::dict();
  if (!opt_.kwargs_json.empty()) {
    nlohmann::ordered_json j;
    try {
      j = nlohmann::ordered_json::parse(opt_.kwargs_json);
    } catch (const std::exception& e) {
      throw ChatError("the template's keyword arguments are not valid JSON: " + std::string(e.what()));
    }
    if (!j.is_object()) throw ChatError("the template's keyword arguments must be a JSON object");
    kwargs_ = Value::from_json(j);
  }
  // Control tokens (what content cannot forge): the special added tokens, and
  // the other added tokens the template's text holds (as transformers picks them).
  for (const auto& t : tokenizer.added_tokens()) {
    bool blank = std::all_of(t.content.begin(), t.content.end(), [](char c) { return is_ws(c); });
    if (t.content.empty() || blank) continue;
    if (t.special || text.find(t.content) != std::string::npos) control_tokens_.push_back(t.content);
  }
  std::stable_sort(control_tokens_.begin(), control_tokens_.end(),
                   [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
  scratch_ = std::make_unique<Scratch>();
  scratch_->vocab = size_t(std::max<int32_t>(tokenizer.vocab_size(), 0));
  scratch_->token_len = std::make_unique<std::atomic<int32_t>[]>(scratch_->vocab);
  for (size_t i = 0; i < scratch_->vocab; ++i) scratch_->token_len[i].store(-1, std::memory_order_relaxed);
  for (size_t i = 0; i < control_tokens_.size(); ++i)
    scratch_->first_bytes[static_cast<unsigned char>(control_tokens_[i][0])].push_back(uint32_t(i));
  {
    Value g = Value::dict();
    for (const auto& [k, v] : opt_.special_tokens) g.map().set(Value(k), Value(v));
    for (const auto& kv : kwargs_.map().items) g.map().set(kv.first, kv.second);
    scratch_->base_globals = g.map().items;
  }
  // The end of an assistant turn: the first added token after a probe answer.
  try {
    const std::string probe = "nnstrain probe answer";
    Conversation c = Conversation::from_messages({{"user", "nnstrain probe question"}, {"assistant", probe}});
    const std::string r = render(c, false);
    const size_t at = r.rfind(probe);
    if (at != std::string::npos) {
      const std::string rest = r.substr(at + probe.size());
      size_t best = std::string::npos;
      int32_t best_id = -1;
      for (const auto& t : tokenizer.added_tokens()) {
        const size_t k = rest.find(t.content);
        if (k != std::string::npos && !t.content.empty() && (k < best || (k == best && t.content.size() > 0))) {
          if (k < best) best = k, best_id = t.id;
        }
      }
      if (best != std::string::npos && rest.substr(0, best).find_first_not_of(" \n\t\r") == std::string::npos)
        end_of_turn_ = best_id;
    }
  } catch (const std::exception&) {
    // a template that refuses the probe: fall back to EOS
  }
  if (end_of_turn_ < 0 && tokenizer.eos_id()) end_of_turn_ = *tokenizer.eos_id();
}

bool ChatTemplate::has_generation_blocks() const { return tpl_->has_generation; }

void ChatTemplate::rethrow(const std::exception& e) const {
  if (const auto* j = dynamic_cast<const jinja::Error*>(&e)) {
    if (j->raised) throw ChatError(source_ + ":" + std::to_string(j->line) + ":" + std::to_string(j->col) +
                                   ": raise_exception: " + j->what());
    throw ChatError(source_ + ":" + std::to_string(j->line) + ":" + std::to_string(j->col) + ": " + j->what());
  }
  throw ChatError(e.what());
}

Conversation ChatTemplate::marked(const Conversation& c) const {
  if (opt_.content_specials == tok::SpecialPolicy::special) return c;
  // Every string of the conversation (not dict keys), markers first dropped so none can be forged;
  // a list or dict none of whose strings change is kept as it is.
  const Scratch& sc = *scratch_;
  auto hit_at = [&](const std::string& s, size_t i) -> const std::string* {
    for (uint32_t k : sc.first_bytes[static_cast<unsigned char>(s[i])]) {
      const std::string& t = control_tokens_[k];
      if (s.compare(i, t.size(), t) == 0) return &t;
    }
    return nullptr;
  };
  std::function<Value(const Value&)> mark = [&](const Value& v) -> Value {
    if (v.is_string()) {
      std::string stripped;
      const bool forged = v.str().find("\xf3\xb0\x80") != std::string::npos;
      if (forged) stripped = without_markers(v.str());
      const std::string& s = forged ? stripped : v.str();
      size_t first = std::string::npos;
      for (size_t i = 0; i < s.size() && first == std::string::npos; ++i)
        if (hit_at(s, i)) first = i;
      if (first == std::string::npos) return s.size() == v.str().size() ? v : Value(s);
      if (opt_.content_specials == tok::SpecialPolicy::error)
        throw ChatError("the conversation holds special-token text (--special-tokens error)");
      std::string out = s.substr(0, first);
      for (size_t i = first; i < s.size();) {
        if (const std::string* hit = hit_at(s, i)) {
          out += kMarkStart + *hit + kMarkEnd;
          i += hit->size();
        } else {
          out += s[i++];
        }
      }
      return Value(std::move(out));
    }
    if (v.is_list()) {
      jinja::List l;
      bool changed = false;
      const auto& src = v.list();
      for (size_t i = 0; i < src.size(); ++i) {
        Value x = mark(src[i]);
        if (!changed && x.identity() != src[i].identity()) {
          changed = true;
          l.assign(src.begin(), src.begin() + long(i));
        }
        if (changed) l.push_back(std::move(x));
      }
      if (!changed) return v;
      return v.is_tuple() ? Value::tuple(std::move(l)) : Value(std::move(l));
    }
    if (v.is_dict()) {
      Value d;
      const auto& src = v.map().items;
      for (size_t i = 0; i < src.size(); ++i) {
        Value x = mark(src[i].second);
        if (d.is_undefined() && x.identity() != src[i].second.identity()) {
          d = Value::dict();
          d.map().items.assign(src.begin(), src.begin() + long(i));
        }
        if (!d.is_undefined()) d.map().items.emplace_back(src[i].first, std::move(x));
      }
      return d.is_undefined() ? v : d;
    }
    return v;
  };
  Conversation m;
  m.kwargs = mark(c.kwargs);
  m.messages = mark(c.messages);
  m.tools = mark(c.tools);
  m.documents = mark(c.documents);
  return m;
}

Value ChatTemplate::globals(const Conversation& c, bool add_generation_prompt) const {
  Value g = Value::dict();
  auto& items = g.map().items;
  // apply_chat_template: {**special_tokens_map, **kwargs}, then messages, tools,
  // documents, add_generation_prompt. The first two are the template's (built once).
  items.reserve(scratch_->base_globals.size() + c.kwargs.map().items.size() + 4);
  items = scratch_->base_globals;
  for (const auto& kv : c.kwargs.map().items) g.map().set(kv.first, kv.second);
  static const Value k_messages("messages"), k_tools("tools"), k_documents("documents"),
      k_agp("add_generation_prompt");
  g.map().set(k_messages, c.messages);
  g.map().set(k_tools, c.tools);
  g.map().set(k_documents, c.documents);
  g.map().set(k_agp, Value(add_generation_prompt));
  (void)items;
  return g;
}

ChatTemplate::Rendered ChatTemplate::render_marked(const Conversation& c, bool add_generation_prompt) const {
  try {
    auto r = jinja::render(*tpl_, globals(c, add_generation_prompt));
    return {std::move(r.text), std::move(r.generation)};
  } catch (const ChatError&) {
    throw;
  } catch (const std::exception& e) {
    rethrow(e);
  }
}

std::string ChatTemplate::render(const Conversation& c, bool add_generation_prompt) const {
  return without_markers(render_marked(marked(c), add_generation_prompt).text);
}

// Ids of the marked text with each token's byte range in it: the text between
// markers encoded with special tokens recognised, a marked token as plain text.
void ChatTemplate::tokenize(const std::string& s, std::vector<int32_t>& ids, std::vector<size_t>& starts,
                            std::vector<size_t>& ends) const {
  Scratch& sc = *scratch_;
  std::unique_ptr<tok::EncodeCache> cache = sc.take();
  struct Give {  // the cache goes back to the pool, also when encoding throws
    Scratch& sc;
    std::unique_ptr<tok::EncodeCache>& c;
    ~Give() { sc.give(std::move(c)); }
  } give{sc, cache};
  std::vector<int32_t> piece_ids;
  // At most a token per byte; the ids are kept (a batch of them), so less is reserved for those.
  ids.reserve(ids.size() + s.size() / 3 + 16);
  starts.reserve(starts.size() + s.size() + 1);
  ends.reserve(ends.size() + s.size() + 1);
  auto token_len = [&](int32_t id) -> size_t {
    if (id < 0 || size_t(id) >= sc.vocab) return tok_->decode(&id, 1).size();
    int32_t n = sc.token_len[size_t(id)].load(std::memory_order_relaxed);
    if (n < 0) {
      n = int32_t(tok_->decode(&id, 1).size());
      sc.token_len[size_t(id)].store(n, std::memory_order_relaxed);
    }
    return size_t(n);
  };
  auto piece = [&](size_t a, size_t b, tok::SpecialPolicy policy) {
    if (b <= a) return;
    piece_ids.clear();
    tok_->encode(std::string_view(s).substr(a, b - a), policy, false, *cache, piece_ids);
    size_t at = a;
    for (int32_t id : piece_ids) {
      const size_t len = token_len(id);
      ids.push_back(id);
      starts.push_back(at);
      ends.push_back(std::min(b, at + len));
      at += len;
    }
  };
  size_t at = 0;
  while (at < s.size()) {
    const size_t m = s.find(kMarkStart, at);
    if (m == std::string::npos) {
      piece(at, s.size(), tok::SpecialPolicy::special);
      break;
    }
    piece(at, m, tok::SpecialPolicy::special);
    const size_t e = s.find(kMarkEnd, m + 4);
    if (e == std::string::npos) {  // a lone marker (a template split it off): dropped, it still breaks the text
      at = m + 4;
      continue;
    }
    const size_t next_start = s.find(kMarkStart, m + 4);
    if (next_start != std::string::npos && next_start < e) {
      at = m + 4;
      continue;
    }
    piece(m + 4, e, tok::SpecialPolicy::text);
    at = e + 4;
  }
}

std::vector<std::pair<size_t, size_t>> ChatTemplate::assistant_spans(const Conversation& c, const Rendered& full,
                                                                     TrainOn train_on) const {
  std::vector<std::pair<size_t, size_t>> spans;
  if (tpl_->has_generation) {
    spans = full.generation;
    if (train_on == TrainOn::last_assistant && spans.size() > 1) spans.erase(spans.begin(), spans.end() - 1);
    return spans;
  }
  size_t last = c.size();
  for (size_t i = 0; i < c.size(); ++i)
    if (c.role(i) == "assistant") last = i;
  for (size_t i = 0; i < c.size(); ++i) {
    if (c.role(i) != "assistant" || (train_on == TrainOn::last_assistant && i != last)) continue;
    // What message i adds after the assistant's header: render(..i, prompt) vs render(..i+1).
    std::string a, b;
    try {
      a = render_marked(c.prefix(i), true).text;
      // The whole conversation (encode renders it without the prompt): that rendering again.
      b = i + 1 == c.size() ? full.text : render_marked(c.prefix(i + 1), false).text;
    } catch (const ChatError& e) {
      throw ChatError("rendering the conversation up to message " + std::to_string(i + 1) + ": " + e.what());
    }
    size_t s = common_prefix(a, b), e = b.size();
    while (e > s && is_ws(b[e - 1])) --e;  // a newline after the end-of-turn token is the next turn's
    {  // white space the template puts before the content (Mistral's " ") is not the answer's
      const Value* content = c.messages.list()[i].map().find(std::string("content"));
      const std::string text = content && content->is_string() ? content->str() : "";
      size_t k = s;
      while (k < e && is_ws(b[k])) ++k;
      const size_t at = text.empty() ? std::string::npos : b.find(text, s);
      s = at != std::string::npos && at <= k ? at : k;  // up to the content, which keeps its own white space
    }
    if (full.text.compare(0, b.size(), b) == 0) {
      if (e > s) spans.emplace_back(s, e);
      continue;
    }
    // The template renders this turn otherwise once later turns follow (Qwen3
    // drops earlier turns' thinking): the turn's content, where it is rendered
    // after the same header, and what follows it in the turn's own rendering.
    s = std::min(s, common_prefix(a, full.text));
    // Found by its content, else (no text content: a tool call) up to the first
    // end of the added token its own rendering ends with.
    const Value* content = c.messages.list()[i].map().find(std::string("content"));
    std::string text = content && content->is_string() ? content->str() : "";
    size_t at = std::string::npos, in_b = std::string::npos;
    if (!strip_unicode_whitespace(text).empty()) {
      at = full.text.find(text, s), in_b = b.rfind(text);
      if (at == std::string::npos || in_b == std::string::npos) {  // the template strips it
        text = strip_unicode_whitespace(text);
        at = full.text.find(text, s), in_b = b.rfind(text);
      }
    }
    size_t end;
    if (at != std::string::npos && in_b != std::string::npos) {
      end = at + text.size();
      const std::string tail = b.substr(in_b + text.size(), e > in_b + text.size() ? e - in_b - text.size() : 0);
      if (full.text.compare(end, tail.size(), tail) == 0) end += tail.size();
    } else {
      std::string closing;
      for (const auto& t : tok_->added_tokens())
        if (t.content.size() > closing.size() && e >= s + t.content.size() &&
            b.compare(e - t.content.size(), t.content.size(), t.content) == 0)
          closing = t.content;
      const size_t k = closing.empty() ? std::string::npos : full.text.find(closing, s);
      if (k == std::string::npos)
        throw ChatError("message " + std::to_string(i + 1) +
                        ": the template renders this assistant turn differently once later turns follow, and "
                        "nnstrain cannot find it in the conversation's rendering; use --train-on last");
      end = k + closing.size();
    }
    spans.emplace_back(s, end);
  }
  return spans;
}

std::vector<int32_t> ChatTemplate::tokens(const Conversation& conv, bool add_generation_prompt) const {
  const Rendered r = render_marked(marked(conv), add_generation_prompt);
  std::vector<int32_t> ids;
  std::vector<size_t> starts, ends;
  try {
    tokenize(r.text, ids, starts, ends);
  } catch (const tok::TokenizerError& e) {
    throw ChatError(e.what());
  }
  return ids;
}

ChatTokens ChatTemplate::encode(const Conversation& conv, bool add_generation_prompt, TrainOn train_on,
                                bool with_turn_starts) const {
  const Conversation c = marked(conv);
  const Rendered full = render_marked(c, add_generation_prompt);
  ChatTokens out;
  std::vector<size_t> starts, ends;
  try {
    tokenize(full.text, out.ids, starts, ends);
  } catch (const tok::TokenizerError& e) {
    throw ChatError(e.what());
  }
  out.target.assign(out.ids.size(), 0);
  if (add_generation_prompt) return out;
  const auto spans = assistant_spans(c, full, train_on);
  // A token is a target if it overlaps a span (as transformers' mask is built).
  size_t k = 0;
  for (size_t t = 0; t < out.ids.size(); ++t) {
    while (k < spans.size() && starts[t] >= spans[k].second) ++k;
    if (k == spans.size()) break;
    if (ends[t] > spans[k].first) out.target[t] = 1;
  }
  if (with_turn_starts) {
    for (size_t j = 1; j < c.size(); ++j) {
      if (c.role(j) != "user") continue;
      std::string before;
      try {
        before = render_marked(c.prefix(j), false).text;
      } catch (const std::exception&) {
        continue;  // a prefix the template refuses: no cut there
      }
      const size_t pos = common_prefix(before, full.text);
      const auto it = std::lower_bound(starts.begin(), starts.end(), pos);
      if (it != starts.end()) out.turn_starts.push_back(size_t(it - starts.begin()));
    }
  }
  return out;
}

}  // namespace nnstrain::data
