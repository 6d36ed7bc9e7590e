// A byte-level BPE tokenizer (GPT-2, Llama 3) whose ids are bit-identical to Hugging
// Face `tokenizers` for the files it accepts; no Python, no LibTorch.
//
// Loads: a Hugging Face tokenizer.json (BPE model; ByteLevel pre-tokenizer, or Split
// with the GPT-2 or Llama 3 pattern then ByteLevel; merges as "a b" or ["a", "b"];
// ignore_merges; added and special tokens; a TemplateProcessing BOS), GPT-2's
// encoder.json + vocab.bpe, or a tiktoken rank file (.tiktoken, Llama 3's
// tokenizer.model). Anything else is refused with a TokenizerError naming it.
// See docs/data.md ("Tokenizers").
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer/pretokenize.h"

namespace nnstrain::tok {

// A file that cannot be used, or text that cannot be encoded; one line, naming it.
struct TokenizerError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// What special-token text inside a document becomes (non-special added tokens are
// always matched, as Hugging Face does).
enum class SpecialPolicy {
  text,     // ordinary text, as tiktoken's encode_ordinary (the default: data cannot forge control tokens)
  special,  // the special token's id, as Hugging Face's encode() does
  error,    // refuse the text (tiktoken's default)
};
SpecialPolicy parse_special_policy(const std::string& s);  // throws TokenizerError
const char* special_policy_name(SpecialPolicy p);

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool normalized = false;
  bool lstrip = false;
  bool rstrip = false;
};

struct LoadOptions {
  // For tiktoken rank files, which do not record their pattern: "gpt2" or "llama3";
  // empty: chosen by the number of ranks (50256: gpt2, 128000: llama3).
  std::string pattern;
};

// Per-thread scratch and a cache of pieces already encoded (text repeats its words).
class EncodeCache {
 public:
  EncodeCache();
  ~EncodeCache();
  EncodeCache(const EncodeCache&) = delete;
  EncodeCache& operator=(const EncodeCache&) = delete;
  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// Counters a long encode advances (read by a progress line on another thread).
struct EncodeProgress {
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint64_t> docs{0};
  std::atomic<uint64_t> parts{0};  // work items handed to threads (documents' groups, or a text's parts)
  std::atomic<uint64_t> busiest_thread_cpu_ns{0};  // the most CPU time one encoding thread spent
};

class Tokenizer {
 public:
  // `path`: a tokenizer.json, an encoder.json (vocab.bpe beside it), a tiktoken file,
  // or a folder holding one of those (tokenizer.json first).
  static Tokenizer load(const std::string& path, const LoadOptions& options = {});

  // Ids of `text`, which must be UTF-8 (else TokenizerError with the byte offset).
  // add_special: add what the post-processor adds (Llama 3's BOS), as HF's
  // add_special_tokens=True.
  std::vector<int32_t> encode(std::string_view text, SpecialPolicy policy = SpecialPolicy::text,
                              bool add_special = false) const;
  void encode(std::string_view text, SpecialPolicy policy, bool add_special, EncodeCache& cache,
              std::vector<int32_t>& out) const;
  // Documents encoded on `threads` threads; the result does not depend on the count.
  std::vector<std::vector<int32_t>> encode_batch(const std::vector<std::string_view>& docs,
                                                 SpecialPolicy policy, bool add_special, int threads,
                                                 EncodeProgress* progress = nullptr) const;
  // One long text cut at safe points (pretokenize.h: safe_cuts) and encoded on
  // `threads` threads; identical to encode(text, policy).
  std::vector<int32_t> encode_large(std::string_view text, SpecialPolicy policy, int threads,
                                    EncodeProgress* progress = nullptr) const;

  // The bytes the ids stand for (special tokens as their text). Throws on an unknown id.
  std::string decode(const int32_t* ids, size_t n) const;
  std::string decode(const std::vector<int32_t>& ids) const { return decode(ids.data(), ids.size()); }

  int32_t vocab_size() const;                       // largest id + 1
  std::optional<int32_t> token_id(std::string_view text) const;  // a vocabulary or added token
  std::optional<int32_t> bos_id() const;            // the post-processor's first special token
  // What add_special puts before and after a text (the post-processor's template).
  const std::vector<int32_t>& template_prefix() const;
  const std::vector<int32_t>& template_suffix() const;
  std::optional<int32_t> eos_id() const;            // <|endoftext|>, <|end_of_text|> or </s>
  const std::vector<AddedToken>& added_tokens() const;
  Pattern pattern() const;
  const std::string& kind() const;    // "tokenizer.json", "gpt2 encoder.json+vocab.bpe", "tiktoken"
  const std::string& sha256() const;  // of the file(s) read, and the pattern for tiktoken files
  std::string describe() const;       // one line: kind, pattern, vocabulary, merges, added tokens

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

}  // namespace nnstrain::tok
