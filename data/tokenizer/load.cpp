// The three file formats a Tokenizer loads, each checked before it is trusted: any
// setting that would change the ids and that this encoder does not implement is
// refused, naming the file and the setting.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "data/sha256.h"
#include "data/tokenizer/tokenizer_impl.h"
#include "data/tokenizer/unicode.h"

namespace nnstrain::tok {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw TokenizerError("tokenizer: cannot read '" + path + "'");
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) throw TokenizerError("tokenizer: cannot read '" + path + "'");
  return ss.str();
}

// GPT-2's bytes_to_unicode: printable bytes stand for themselves, the other 68 for
// U+0100 onwards, in byte order. Inverse: a code point -> its byte, or -1.
struct ByteLevelMap {
  int cp_to_byte[0x200];
  ByteLevelMap() {
    std::fill(std::begin(cp_to_byte), std::end(cp_to_byte), -1);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      cp_to_byte[printable ? b : 256 + extra++] = b;
    }
  }
};
const ByteLevelMap kByteLevel;

// The bytes a byte-level token string stands for; false if a character is not one of
// the 256 byte characters.
bool unmap_byte_level(std::string_view s, std::string& out) {
  out.clear();
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* end = p + s.size();
  while (p < end) {
    uint32_t cp = 0;
    const int n = utf8_decode(p, end, cp);
    if (n == 0 || cp >= 0x200 || kByteLevel.cp_to_byte[cp] < 0) return false;
    out += static_cast<char>(kByteLevel.cp_to_byte[cp]);
    p += n;
  }
  return true;
}

[[noreturn]] void refuse(const std::string& path, const std::string& what) {
  throw TokenizerError("tokenizer '" + path + "': " + what);
}

std::string type_of(const json& j) {
  return j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>() : "?";
}

// A tokenizer.json or encoder.json read as nlohmann's DOM, except for the vocabulary
// and the merges (hundreds of thousands of entries: as a std::map of json values they
// took most of a Llama 3 load), which go straight into flat lists. What the DOM
// would have done is kept: a repeated key's last value wins, the vocabulary is
// walked in key order (the order its errors are found in), anything but an object
// (vocab) or an array (merges) is left to the DOM and refused from there.
struct VocabEntry {
  std::string key;
  int64_t id = 0;
  bool integer = false;  // the value was an integer (else: refused, naming the key)
};
struct MergeEntry {
  std::string a, b;  // b empty with `pair` false: the "a b" string form, in a
  bool pair = false;
  bool valid = true;  // a string or an array of two strings
};

class TokenizerJsonReader {
 public:
  using string_t = json::string_t;
  // flat_vocab: the whole document is the vocabulary (encoder.json); else model.vocab
  // and model.merges of a tokenizer.json.
  TokenizerJsonReader(json& root, bool flat_vocab) : dom_(root), flat_vocab_(flat_vocab) {}

  bool has_vocab = false, has_merges = false;
  std::vector<VocabEntry> vocab;
  std::vector<MergeEntry> merges;

  // The vocabulary in key order, a repeated key's last value kept (std::map's view).
  void finish_vocab() {
    std::stable_sort(vocab.begin(), vocab.end(), [](const VocabEntry& x, const VocabEntry& y) { return x.key < y.key; });
    size_t out = 0;
    for (size_t i = 0; i < vocab.size(); ++i) {
      if (out > 0 && vocab[out - 1].key == vocab[i].key) vocab[out - 1] = std::move(vocab[i]);
      else if (out != i) vocab[out++] = std::move(vocab[i]);
      else ++out;
    }
    vocab.resize(out);
  }

  bool null() { return scalar([&] { return dom_.null(); }); }
  bool boolean(bool v) { return scalar([&] { return dom_.boolean(v); }); }
  bool number_integer(json::number_integer_t v) {
    if (mode_ == Mode::vocab && skip_ == 0) return vocab_value(static_cast<int64_t>(v), true);
    return scalar([&] { return dom_.number_integer(v); });
  }
  bool number_unsigned(json::number_unsigned_t v) {
    if (mode_ == Mode::vocab && skip_ == 0) return vocab_value(static_cast<int64_t>(v), true);
    return scalar([&] { return dom_.number_unsigned(v); });
  }
  bool number_float(json::number_float_t v, const string_t& s) { return scalar([&] { return dom_.number_float(v, s); }); }
  bool binary(json::binary_t& v) { return scalar([&] { return dom_.binary(v); }); }
  bool string(string_t& v) {
    if (mode_ == Mode::merges && skip_ == 0) {
      if (!in_pair_) {
        merges.push_back({std::move(v), std::string(), false, true});
      } else {
        MergeEntry& m = merges.back();
        if (pair_items_ == 0) m.a = std::move(v);
        else if (pair_items_ == 1) m.b = std::move(v);
        ++pair_items_;
      }
      return true;
    }
    return scalar([&] { return dom_.string(v); });
  }
  bool key(string_t& k) {
    if (mode_ == Mode::vocab && skip_ == 0) {
      key_ = std::move(k);
      return true;
    }
    if (mode_ != Mode::none) return true;
    if (depth_ == 1) root_key_ = k;
    if (depth_ == 2 && in_model_ && (k == "vocab" || k == "merges")) {
      pending_ = std::move(k);  // captured if an object (vocab) or an array (merges) follows
      return true;
    }
    return dom_.key(k);
  }
  bool start_object(std::size_t n) {
    if (mode_ != Mode::none) return open_in_capture(false);
    if (flat_vocab_ && depth_ == 0) {
      has_vocab = true;
      mode_ = Mode::vocab;
      ++depth_;
      return true;
    }
    if (pending_ == "vocab") {
      pending_.clear();
      has_vocab = true;
      vocab.clear();
      mode_ = Mode::vocab;
      return true;
    }
    if (!flush_pending()) return false;
    ++depth_;
    if (depth_ == 2 && root_key_ == "model") {  // a later "model" replaces an earlier one, as in the DOM
      in_model_ = true;
      has_vocab = has_merges = false;
      vocab.clear();
      merges.clear();
    }
    return dom_.start_object(n);
  }
  bool end_object() {
    if (mode_ == Mode::vocab && skip_ == 0) {
      mode_ = Mode::none;
      if (flat_vocab_) --depth_;
      return true;
    }
    if (mode_ != Mode::none) return close_in_capture();
    if (depth_ == 2) in_model_ = false;
    --depth_;
    return dom_.end_object();
  }
  bool start_array(std::size_t n) {
    if (mode_ != Mode::none) return open_in_capture(true);
    if (pending_ == "merges") {
      pending_.clear();
      has_merges = true;
      merges.clear();
      mode_ = Mode::merges;
      return true;
    }
    if (!flush_pending()) return false;
    ++depth_;
    return dom_.start_array(n);
  }
  bool end_array() {
    if (mode_ == Mode::merges && skip_ == 0) {
      if (in_pair_) {
        in_pair_ = false;
        MergeEntry& m = merges.back();
        if (pair_items_ != 2) m.valid = false;
        return true;
      }
      mode_ = Mode::none;
      return true;
    }
    if (mode_ != Mode::none) return close_in_capture();
    --depth_;
    return dom_.end_array();
  }
  template <class Exception>
  bool parse_error(std::size_t pos, const std::string& token, const Exception& ex) {
    return dom_.parse_error(pos, token, ex);
  }

 private:
  enum class Mode { none, vocab, merges };
  template <class F>
  bool scalar(F&& to_dom) {
    if (mode_ == Mode::vocab) return skip_ > 0 || vocab_value(0, false);
    if (mode_ == Mode::merges) {
      if (skip_ > 0) return true;
      if (in_pair_) {
        merges.back().valid = false;
        ++pair_items_;
      } else {
        merges.push_back({std::string(), std::string(), false, false});
      }
      return true;
    }
    if (!flush_pending()) return false;
    return to_dom();
  }
  bool vocab_value(int64_t id, bool integer) {
    vocab.push_back({std::move(key_), id, integer});
    key_.clear();
    return true;
  }
  // An object or array inside a captured list: an entry of the wrong type (skipped
  // whole), or a merge's [a, b] pair.
  bool open_in_capture(bool array) {
    if (skip_ > 0) {
      ++skip_;
      return true;
    }
    if (mode_ == Mode::vocab) {
      vocab_value(0, false);
    } else if (array && !in_pair_) {
      merges.push_back({std::string(), std::string(), true, true});
      in_pair_ = true;
      pair_items_ = 0;
      return true;
    } else if (in_pair_) {
      merges.back().valid = false;
      ++pair_items_;
    } else {
      merges.push_back({std::string(), std::string(), false, false});
    }
    skip_ = 1;
    return true;
  }
  bool close_in_capture() {
    --skip_;
    return true;
  }
  // A "vocab" or "merges" key followed by something the lists do not take: the DOM gets it.
  bool flush_pending() {
    if (pending_.empty()) return true;
    if (pending_ == "vocab") has_vocab = false;
    else has_merges = false;
    string_t k = std::move(pending_);
    pending_.clear();
    return dom_.key(k);
  }

  nlohmann::detail::json_sax_dom_parser<json> dom_;
  const bool flat_vocab_;
  Mode mode_ = Mode::none;
  int depth_ = 0;       // open containers the DOM sees
  bool in_model_ = false;
  std::string root_key_, pending_, key_;
  int skip_ = 0;        // open containers inside a skipped entry
  bool in_pair_ = false;
  int pair_items_ = 0;
};

// Parses `text` (a tokenizer.json, or with flat_vocab an encoder.json); refuses
// invalid JSON naming the file.
void read_tokenizer_json(const std::string& path, const std::string& text, TokenizerJsonReader& reader) {
  try {
    json::sax_parse(text, &reader);
  } catch (const json::parse_error& e) {
    refuse(path, std::string("not valid JSON: ") + e.what());
  }
  reader.finish_vocab();
}

// Fills the BPE vocabulary from byte-level token strings.
void add_vocab(const std::string& path, const TokenizerJsonReader& reader, BpeModel& bpe,
               std::vector<std::pair<std::string, int32_t>>* not_byte_level) {
  if (!reader.has_vocab) refuse(path, "model.vocab is not an object");
  bpe.reserve(reader.vocab.size());
  std::string bytes;
  for (const VocabEntry& e : reader.vocab) {
    if (!e.integer) refuse(path, "vocab entry '" + e.key + "' has no integer id");
    const int64_t id = e.id;
    if (id < 0 || id >= (1 << 30)) refuse(path, "vocab entry '" + e.key + "' has id " + std::to_string(id));
    if (!unmap_byte_level(e.key, bytes)) {
      // Tolerated only when an added token of the same text covers it (GPT-2's <|endoftext|>
      // is both); load_hf_json checks.
      if (not_byte_level) {
        not_byte_level->push_back({e.key, static_cast<int32_t>(id)});
        continue;
      }
      refuse(path, "vocab entry '" + e.key + "' is not byte-level (only byte-level BPE is supported)");
    }
    if (!bpe.add_token(bytes, static_cast<int32_t>(id)))
      refuse(path, "vocab entry '" + e.key + "' (id " + std::to_string(id) + ") repeats an id or a token");
  }
}

// Scratch for add_merge: no allocation per merge.
struct MergeScratch {
  std::string a, b, ab;
};

void add_merge(const std::string& path, size_t index, std::string_view a, std::string_view b, BpeModel& bpe,
               MergeScratch& m) {
  const bool ok = unmap_byte_level(a, m.a) && unmap_byte_level(b, m.b);
  int32_t ia = -1, ib = -1, merged = -1;
  if (ok) {
    ia = bpe.find(m.a);
    ib = bpe.find(m.b);
    m.ab.assign(m.a).append(m.b);
    merged = bpe.find(m.ab);
  }
  if (ia < 0 || ib < 0 || merged < 0)
    refuse(path, "merge " + std::to_string(index + 1) + " ('" + std::string(a) + "' '" + std::string(b) +
                     "') names a token not in the vocabulary");
  bpe.add_merge(ia, ib, static_cast<uint32_t>(index), merged);
}

void require_all_bytes(const std::string& path, const BpeModel& bpe) {
  const int missing = bpe.missing_byte();
  if (missing >= 0)
    refuse(path, "the vocabulary has no token for byte " + std::to_string(missing) +
                     " (byte-level BPE needs all 256; unknown-token fallback is not supported)");
}

void parse_pre_tokenizer(const std::string& path, const json& pt, Tokenizer::Impl& t) {
  auto byte_level = [&](const json& b, bool after_split) {
    const bool use_regex = b.value("use_regex", true);
    const bool prefix = b.value("add_prefix_space", false);
    if (after_split && use_regex) refuse(path, "pre_tokenizer: ByteLevel with use_regex after Split is not supported");
    if (after_split && prefix) refuse(path, "pre_tokenizer: ByteLevel add_prefix_space after Split is not supported");
    if (!after_split) t.pattern = use_regex ? Pattern::gpt2 : Pattern::none;
    t.add_prefix_space = prefix;
  };
  if (!pt.is_object()) refuse(path, "a pre_tokenizer is required (only byte-level BPE is supported)");
  const std::string type = type_of(pt);
  if (type == "ByteLevel") {
    byte_level(pt, false);
    return;
  }
  if (type != "Sequence") refuse(path, "pre_tokenizer type '" + type + "' is not supported (ByteLevel, or Split then ByteLevel)");
  const json& list = pt.value("pretokenizers", json::array());
  if (list.size() == 1 && type_of(list[0]) == "ByteLevel") {
    byte_level(list[0], false);
    return;
  }
  if (list.size() != 2 || type_of(list[0]) != "Split" || type_of(list[1]) != "ByteLevel")
    refuse(path, "pre_tokenizer Sequence must be [Split, ByteLevel]; got " + std::to_string(list.size()) + " steps");
  const json& split = list[0];
  if (split.value("behavior", "") != "Isolated") refuse(path, "pre_tokenizer Split behavior must be Isolated");
  if (split.value("invert", false)) refuse(path, "pre_tokenizer Split with invert is not supported");
  const json& pat = split.value("pattern", json::object());
  if (!pat.contains("Regex") || !pat["Regex"].is_string())
    refuse(path, "pre_tokenizer Split pattern must be a Regex");
  if (!pattern_from_regex(pat["Regex"].get<std::string>(), t.pattern))
    refuse(path, "pre_tokenizer Split regex is not the GPT-2 or Llama 3 pattern (no other is supported)");
  byte_level(list[1], true);
}

// TemplateProcessing's single-sequence template: special tokens around $A.
void parse_template(const std::string& path, const json& pp, Tokenizer::Impl& t) {
  const json& single = pp.value("single", json::array());
  const json& specials = pp.value("special_tokens", json::object());
  bool seen_a = false;
  for (const json& piece : single) {
    if (piece.contains("Sequence")) {
      if (piece["Sequence"].value("id", "") != "A") refuse(path, "post_processor template: only sequence $A is supported");
      seen_a = true;
    } else if (piece.contains("SpecialToken")) {
      const std::string name = piece["SpecialToken"].value("id", "");
      if (!specials.contains(name) || !specials[name].contains("ids"))
        refuse(path, "post_processor template names special token '" + name + "' without ids");
      for (const json& id : specials[name]["ids"]) (seen_a ? t.suffix : t.prefix).push_back(id.get<int32_t>());
    } else {
      refuse(path, "post_processor template piece is neither Sequence nor SpecialToken");
    }
  }
  if (!seen_a) refuse(path, "post_processor template has no $A");
}

void parse_post_processor(const std::string& path, const json& pp, Tokenizer::Impl& t) {
  if (pp.is_null()) return;
  const std::string type = type_of(pp);
  if (type == "ByteLevel") return;  // offsets only; ids unchanged
  if (type == "TemplateProcessing") return parse_template(path, pp, t);
  if (type == "Sequence") {
    for (const json& p : pp.value("processors", json::array())) parse_post_processor(path, p, t);
    return;
  }
  refuse(path, "post_processor type '" + type + "' is not supported (ByteLevel, TemplateProcessing)");
}

}  // namespace

void load_hf_json(const std::string& path, Tokenizer::Impl& t) {
  const std::string text = read_file(path);
  json j;
  TokenizerJsonReader reader(j, false);
  read_tokenizer_json(path, text, reader);
  if (!j.is_object() || !j.contains("model")) refuse(path, "no 'model' (not a Hugging Face tokenizer.json)");
  for (const char* key : {"truncation", "padding"})
    if (j.contains(key) && !j[key].is_null()) refuse(path, std::string(key) + " is set (not supported; set it to null)");
  if (j.contains("normalizer") && !j["normalizer"].is_null())
    refuse(path, "normalizer '" + type_of(j["normalizer"]) + "' is not supported (byte-level BPE uses none)");
  const json& m = j["model"];
  const std::string mtype = m.value("type", std::string("BPE"));
  if (mtype != "BPE") refuse(path, "model type '" + mtype + "' is not supported (only BPE)");
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() != 0.0)
    refuse(path, "model.dropout is set (BPE dropout is not supported)");
  if (m.value("byte_fallback", false)) refuse(path, "model.byte_fallback is not supported");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (m.contains(key) && !m[key].is_null() && m[key] != "")
      refuse(path, std::string("model.") + key + " is not supported");
  parse_pre_tokenizer(path, j.value("pre_tokenizer", json()), t);
  if (j.contains("decoder") && !j["decoder"].is_null() && type_of(j["decoder"]) != "ByteLevel")
    refuse(path, "decoder '" + type_of(j["decoder"]) + "' is not supported (ByteLevel)");

  std::vector<std::pair<std::string, int32_t>> not_byte_level;
  add_vocab(path, reader, t.bpe, &not_byte_level);
  require_all_bytes(path, t.bpe);
  MergeScratch scratch;
  if (reader.has_merges) {
    t.bpe.reserve_merges(reader.merges.size());
    for (size_t i = 0; i < reader.merges.size(); ++i) {
      const MergeEntry& mg = reader.merges[i];
      if (!mg.valid) refuse(path, "merge " + std::to_string(i + 1) + " is neither \"a b\" nor [\"a\", \"b\"]");
      if (mg.pair) {
        add_merge(path, i, mg.a, mg.b, t.bpe, scratch);
        continue;
      }
      const std::string& str = mg.a;
      const size_t sp = str.find(' ');
      if (sp == std::string::npos || str.find(' ', sp + 1) != std::string::npos)
        refuse(path, "merge " + std::to_string(i + 1) + " '" + str + "' is not two tokens separated by one space");
      add_merge(path, i, std::string_view(str).substr(0, sp), std::string_view(str).substr(sp + 1), t.bpe, scratch);
    }
  } else {  // absent (no merges), or not an array: as the DOM gives it
    const json& merges = m.value("merges", json::array());
    for (size_t i = 0; i < merges.size(); ++i) {
      const json& mg = merges[i];
      if (mg.is_string()) {
        const std::string str = mg.get<std::string>();
        const size_t sp = str.find(' ');
        if (sp == std::string::npos || str.find(' ', sp + 1) != std::string::npos)
          refuse(path, "merge " + std::to_string(i + 1) + " '" + str + "' is not two tokens separated by one space");
        add_merge(path, i, std::string_view(str).substr(0, sp), std::string_view(str).substr(sp + 1), t.bpe, scratch);
      } else if (mg.is_array() && mg.size() == 2 && mg[0].is_string() && mg[1].is_string()) {
        add_merge(path, i, mg[0].get<std::string>(), mg[1].get<std::string>(), t.bpe, scratch);
      } else {
        refuse(path, "merge " + std::to_string(i + 1) + " is neither \"a b\" nor [\"a\", \"b\"]");
      }
    }
  }
  t.bpe.set_ignore_merges(m.value("ignore_merges", false));

  for (const json& a : j.value("added_tokens", json::array())) {
    AddedToken tok;
    tok.content = a.value("content", "");
    tok.id = a.value("id", -1);
    tok.special = a.value("special", false);
    tok.normalized = a.value("normalized", !tok.special);
    tok.lstrip = a.value("lstrip", false);
    tok.rstrip = a.value("rstrip", false);
    if (tok.content.empty() || tok.id < 0) refuse(path, "an added token has no content or id");
    if (a.value("single_word", false)) refuse(path, "added token '" + tok.content + "': single_word is not supported");
    if (t.bpe.has_id(tok.id)) {
      std::string bytes;
      if (!unmap_byte_level(tok.content, bytes) || t.bpe.bytes(tok.id) != bytes)
        refuse(path, "added token '" + tok.content + "' reuses id " + std::to_string(tok.id) + " of another token");
    }
    t.added.push_back(tok);
  }
  for (const auto& entry : not_byte_level) {
    // (No structured binding: C++17 lambdas cannot capture one; clang refuses it.)
    const auto& vocab_text = entry.first;
    const auto vocab_id = entry.second;
    const bool covered = std::any_of(t.added.begin(), t.added.end(), [&](const AddedToken& a) {
      return a.id == vocab_id && a.content == vocab_text;
    });
    if (!covered) refuse(path, "vocab entry '" + vocab_text + "' is not byte-level (only byte-level BPE is supported)");
  }
  parse_post_processor(path, j.value("post_processor", json()), t);
  t.kind = "tokenizer.json";
  t.source = path;
  t.sha256 = data::sha256_hex(text);
}

void load_gpt2_files(const std::string& encoder_json, const std::string& vocab_bpe, Tokenizer::Impl& t) {
  const std::string enc_text = read_file(encoder_json), bpe_text = read_file(vocab_bpe);
  json enc;
  TokenizerJsonReader reader(enc, true);
  read_tokenizer_json(encoder_json, enc_text, reader);
  add_vocab(encoder_json, reader, t.bpe, nullptr);
  require_all_bytes(encoder_json, t.bpe);
  MergeScratch scratch;
  size_t rank = 0, lineno = 0;
  for (size_t at = 0; at < bpe_text.size();) {  // lines as std::getline cuts them
    size_t nl = bpe_text.find('\n', at);
    if (nl == std::string::npos) nl = bpe_text.size();
    const std::string_view line(bpe_text.data() + at, nl - at);
    at = nl + 1;
    ++lineno;
    if (line.rfind("#version", 0) == 0 || line.empty()) continue;
    const size_t sp = line.find(' ');
    if (sp == std::string::npos || line.find(' ', sp + 1) != std::string::npos)
      refuse(vocab_bpe, "line " + std::to_string(lineno) + " is not two tokens separated by one space");
    try {
      add_merge(vocab_bpe, rank, line.substr(0, sp), line.substr(sp + 1), t.bpe, scratch);
    } catch (const TokenizerError&) {
      refuse(vocab_bpe, "line " + std::to_string(lineno) + " names a token not in " + encoder_json);
    }
    ++rank;
  }
  t.pattern = Pattern::gpt2;
  if (const int32_t eot = t.bpe.find("<|endoftext|>"); eot >= 0) {
    AddedToken tok;
    tok.content = "<|endoftext|>";
    tok.id = eot;
    tok.special = true;
    t.added.push_back(tok);
  }
  t.kind = "gpt2 encoder.json+vocab.bpe";
  t.source = encoder_json;
  t.sha256 = data::sha256_hex(data::sha256_hex(enc_text) + data::sha256_hex(bpe_text));
}

namespace {

int base64_value(unsigned char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

bool base64_decode(std::string_view s, std::string& out) {
  out.clear();
  uint32_t acc = 0;
  int bits = 0;
  size_t i = 0;
  for (; i < s.size() && s[i] != '='; ++i) {
    const int v = base64_value(static_cast<unsigned char>(s[i]));
    if (v < 0) return false;
    acc = (acc << 6) | v;
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xFF);
    }
  }
  for (; i < s.size(); ++i)
    if (s[i] != '=') return false;
  return !out.empty();
}

// Meta's Llama 3 tokenizer.py: 256 special tokens after the 128000 ranks.
std::vector<std::string> llama3_specials() {
  std::vector<std::string> s = {"<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                                "<|reserved_special_token_1|>", "<|reserved_special_token_2|>",
                                "<|reserved_special_token_3|>", "<|start_header_id|>", "<|end_header_id|>",
                                "<|reserved_special_token_4|>", "<|eot_id|>"};
  for (int i = 5; i < 256 - 5; ++i) s.push_back("<|reserved_special_token_" + std::to_string(i) + "|>");
  return s;
}

}  // namespace

void load_tiktoken(const std::string& path, const LoadOptions& options, Tokenizer::Impl& t) {
  const std::string text = read_file(path);
  std::istringstream lines(text);
  std::string line, bytes;
  size_t lineno = 0;
  std::vector<std::string> by_rank;
  while (std::getline(lines, line)) {
    ++lineno;
    if (line.empty()) continue;
    const size_t sp = line.find(' ');
    char* end = nullptr;
    const long rank = sp == std::string::npos ? -1 : std::strtol(line.c_str() + sp + 1, &end, 10);
    if (sp == std::string::npos || rank < 0 || *end != '\0' ||
        !base64_decode(std::string_view(line).substr(0, sp), bytes))
      refuse(path, "line " + std::to_string(lineno) + " is not '<base64 token> <rank>' (not a tiktoken file)");
    if (!t.bpe.add_token(bytes, static_cast<int32_t>(rank)))
      refuse(path, "line " + std::to_string(lineno) + " repeats a token or a rank");
    if (static_cast<size_t>(rank) >= by_rank.size()) by_rank.resize(rank + 1);
    by_rank[rank] = bytes;
  }
  require_all_bytes(path, t.bpe);
  // tiktoken merges the adjacent pair whose concatenation has the lowest rank: every
  // split of a token into two tokens is a merge of that rank.
  for (size_t r = 0; r < by_rank.size(); ++r) {
    const std::string& tokbytes = by_rank[r];
    for (size_t k = 1; k < tokbytes.size(); ++k) {
      const int32_t a = t.bpe.find(std::string_view(tokbytes).substr(0, k));
      const int32_t b = t.bpe.find(std::string_view(tokbytes).substr(k));
      if (a >= 0 && b >= 0) t.bpe.add_merge(a, b, static_cast<uint32_t>(r), static_cast<int32_t>(r));
    }
  }
  t.bpe.set_ignore_merges(true);  // tiktoken takes a whole piece found in the ranks as is
  const size_t n = t.bpe.size();
  std::string pattern = options.pattern;
  if (pattern.empty()) {
    if (n == 50256) pattern = "gpt2";
    else if (n == 128000) pattern = "llama3";
    else
      refuse(path, std::to_string(n) + " ranks: cannot tell its pattern; name it (gpt2 or llama3)");
  }
  if (pattern == "gpt2") t.pattern = Pattern::gpt2;
  else if (pattern == "llama3") t.pattern = Pattern::llama3;
  else refuse(path, "pattern '" + pattern + "' is not supported (gpt2 or llama3)");
  std::vector<std::string> specials;
  if (n == 50256 && t.pattern == Pattern::gpt2) specials = {"<|endoftext|>"};
  if (n == 128000 && t.pattern == Pattern::llama3) specials = llama3_specials();
  for (size_t i = 0; i < specials.size(); ++i) {
    AddedToken tok;
    tok.content = specials[i];
    tok.id = static_cast<int32_t>(n + i);
    tok.special = true;
    t.added.push_back(tok);
  }
  t.kind = "tiktoken";
  t.source = path;
  t.sha256 = data::sha256_hex(data::sha256_hex(text) + "|pattern=" + pattern_name(t.pattern));
}

Tokenizer Tokenizer::load(const std::string& path, const LoadOptions& options) {
  auto impl = std::make_shared<Impl>();
  std::error_code ec;
  const fs::path p(path);
  auto sibling = [&](const fs::path& dir, const char* name) { return (dir / name).string(); };
  if (fs::is_directory(p, ec)) {
    if (fs::exists(p / "tokenizer.json")) load_hf_json(sibling(p, "tokenizer.json"), *impl);
    else if (fs::exists(p / "encoder.json") && fs::exists(p / "vocab.bpe"))
      load_gpt2_files(sibling(p, "encoder.json"), sibling(p, "vocab.bpe"), *impl);
    else if (fs::exists(p / "tokenizer.model")) load_tiktoken(sibling(p, "tokenizer.model"), options, *impl);
    else
      throw TokenizerError("tokenizer '" + path +
                           "': the folder holds no tokenizer.json, encoder.json + vocab.bpe, or tokenizer.model");
  } else if (!fs::exists(p, ec)) {
    throw TokenizerError("tokenizer '" + path + "': no such file or folder");
  } else if (p.filename() == "encoder.json") {
    const fs::path bpe = p.parent_path() / "vocab.bpe";
    if (!fs::exists(bpe)) throw TokenizerError("tokenizer '" + path + "': no vocab.bpe beside it");
    load_gpt2_files(path, bpe.string(), *impl);
  } else if (p.extension() == ".json") {
    load_hf_json(path, *impl);
  } else if (p.extension() == ".tiktoken" || p.extension() == ".model") {
    load_tiktoken(path, options, *impl);
  } else {
    throw TokenizerError("tokenizer '" + path +
                         "': not a tokenizer.json, encoder.json or tiktoken file (.tiktoken, tokenizer.model)");
  }
  impl->finish();
  Tokenizer t;
  t.impl_ = std::move(impl);
  return t;
}

}  // namespace nnstrain::tok
