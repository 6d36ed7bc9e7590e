#include "trainer/eval/text_codec.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "data/tokenizer/tokenizer.h"
#include "data/tokenizer/unicode.h"

namespace fs = std::filesystem;

namespace nnstrain::eval {

namespace {

class BpeCodec : public TextCodec {
 public:
  explicit BpeCodec(const std::string& path) : t_(tok::Tokenizer::load(path)) {
    what = path + " (" + t_.describe() + ")";
    for (const auto& a : t_.added_tokens())
      if (a.special) special_.insert(a.id);
    // Hugging Face's bos_token / eos_token: tokenizer_config.json beside it.
    const fs::path dir = fs::is_directory(path) ? fs::path(path) : fs::path(path).parent_path();
    std::optional<int64_t> bos;
    eos = t_.eos_id() ? std::optional<int64_t>(*t_.eos_id()) : std::nullopt;
    std::ifstream in(dir / "tokenizer_config.json");
    if (in) {
      const auto j = nlohmann::json::parse(in, nullptr, false);
      auto id_of = [&](const char* key) -> std::optional<int64_t> {
        if (!j.is_object() || !j.contains(key)) return std::nullopt;
        const auto& v = j[key];
        const std::string s = v.is_string() ? v.get<std::string>() : v.is_object() ? v.value("content", "") : "";
        if (s.empty()) return std::nullopt;
        const auto id = t_.token_id(s);
        return id ? std::optional<int64_t>(*id) : std::nullopt;
      };
      bos = id_of("bos_token");
      if (j.is_object() && j.contains("eos_token")) eos = id_of("eos_token");
    }
    prefix = bos ? *bos : eos ? *eos : 0;
    const int32_t p = static_cast<int32_t>(prefix);
    try {
      prefix_text_ = t_.decode(&p, 1);
    } catch (const std::exception&) {
    }
  }
  std::vector<int64_t> encode(const std::string& text, bool add_special) const override {
    const bool starts_with_prefix = !prefix_text_.empty() && text.rfind(prefix_text_, 0) == 0;
    const auto ids = t_.encode(text, tok::SpecialPolicy::special, add_special && !starts_with_prefix);
    return {ids.begin(), ids.end()};
  }
  std::string decode(const std::vector<int64_t>& ids, bool skip_special) const override {
    std::vector<int32_t> keep;
    for (auto id : ids)
      if (!(skip_special && special_.count(static_cast<int32_t>(id)))) keep.push_back(static_cast<int32_t>(id));
    return t_.decode(keep);
  }

 private:
  tok::Tokenizer t_;
  std::set<int32_t> special_;
  std::string prefix_text_;
};

class MetaCodec : public TextCodec {
 public:
  explicit MetaCodec(const std::string& path) {
    std::ifstream in(path);
    const auto j = nlohmann::json::parse(in, nullptr, false);
    const std::string level = j.is_object() ? j.value("level", "") : "";
    byte_ = level == "byte";
    if (!byte_) {
      if (level != "char" || !j.contains("itos") || !j["itos"].is_array())
        throw std::runtime_error(path + ": not a nnstrain prepare meta.json (char or byte level)");
      for (const auto& s : j["itos"]) {
        stoi_.emplace(s.get<std::string>(), static_cast<int64_t>(itos_.size()));
        itos_.push_back(s.get<std::string>());
      }
    }
    what = path + (byte_ ? " (byte level)" : " (char level, " + std::to_string(itos_.size()) + " characters)");
  }
  std::vector<int64_t> encode(const std::string& text, bool) const override {
    std::vector<int64_t> ids;
    if (byte_) {
      for (unsigned char c : text) ids.push_back(c);
      return ids;
    }
    const auto* p = reinterpret_cast<const unsigned char*>(text.data());
    const auto* end = p + text.size();
    for (const auto* q = p; q < end;) {
      uint32_t cp = 0;
      const int len = tok::utf8_decode(q, end, cp);
      if (len == 0) throw std::runtime_error("invalid UTF-8");
      const auto it = stoi_.find(std::string(reinterpret_cast<const char*>(q), len));
      if (it == stoi_.end())
        throw std::runtime_error("the character '" + std::string(reinterpret_cast<const char*>(q), len) +
                                 "' is not in the vocabulary of " + what);
      ids.push_back(it->second);
      q += len;
    }
    return ids;
  }
  std::string decode(const std::vector<int64_t>& ids, bool) const override {
    std::string s;
    for (auto id : ids) {
      if (byte_) s += char(id);
      else if (id >= 0 && id < int64_t(itos_.size())) s += itos_[id];
    }
    return s;
  }

 private:
  bool byte_ = false;
  std::vector<std::string> itos_;
  std::map<std::string, int64_t> stoi_;
};

}  // namespace

std::unique_ptr<TextCodec> load_text_codec(const std::string& path) {
  if (!fs::exists(path)) throw std::runtime_error(path + ": no such tokenizer");
  if (fs::is_directory(path) && fs::exists(fs::path(path) / "meta.json") && !fs::exists(fs::path(path) / "tokenizer.json"))
    return std::make_unique<MetaCodec>((fs::path(path) / "meta.json").string());
  if (fs::path(path).filename() == "meta.json") return std::make_unique<MetaCodec>(path);
  return std::make_unique<BpeCodec>(path);
}

}  // namespace nnstrain::eval
