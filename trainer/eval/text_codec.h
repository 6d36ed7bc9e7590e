// Text to ids and back as lm-evaluation-harness's Hugging Face backend sees a
// tokenizer: encode() adds the tokenizer's own special tokens (its template's
// BOS) unless the text starts with the prefix token's text; the prefix token
// (what an empty context or a rolling window conditions on) is the BOS of
// tokenizer_config.json, else its EOS; decode() skips special tokens. A char-
// or byte-level meta.json (`nnstrain prepare`) has no specials: prefix id 0.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace nnstrain::eval {

class TextCodec {
 public:
  virtual ~TextCodec() = default;
  // add_special: the tokenizer's template tokens (Hugging Face's add_special_tokens).
  virtual std::vector<int64_t> encode(const std::string& text, bool add_special = true) const = 0;
  virtual std::string decode(const std::vector<int64_t>& ids, bool skip_special) const = 0;
  std::optional<int64_t> eos;  // the end-of-text id (generation stops at it)
  int64_t prefix = 0;
  std::string what;
};

// A tokenizer.json (or folder with one), GPT-2 encoder.json, .tiktoken, or meta.json.
std::unique_ptr<TextCodec> load_text_codec(const std::string& path);

}  // namespace nnstrain::eval
