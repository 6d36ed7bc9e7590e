// Tokenizer's state, shared by the loaders (load.cpp) and the encoder (tokenizer.cpp).
#pragma once

#include <string>
#include <vector>

#include "data/tokenizer/bpe.h"
#include "data/tokenizer/tokenizer.h"

namespace nnstrain::tok {

// Finds added tokens in text: leftmost, then longest (Hugging Face's Aho-Corasick
// LeftmostLongest), among a set of tokens.
class AddedMatcher {
 public:
  void add(const AddedToken* t);
  bool empty() const { return tokens_.empty(); }
  // The first match at or after `from`; false if none.
  bool find(std::string_view text, size_t from, size_t& at, const AddedToken*& which) const;

 private:
  std::vector<const AddedToken*> tokens_;
  std::vector<const AddedToken*> by_first_[256];  // longest first
  bool is_first_[256] = {};  // a token starts with this byte
  int first_bytes_ = 0;      // how many distinct first bytes
  unsigned char first_ = 0;  // the first byte, when all tokens share one (memchr finds candidates)
};

struct Tokenizer::Impl {
  BpeModel bpe;
  Pattern pattern = Pattern::none;
  bool add_prefix_space = false;
  std::vector<AddedToken> added;      // in file order
  AddedMatcher raw_matcher;           // normalized: false (matched on the input)
  AddedMatcher normalized_matcher;    // normalized: true (matched after normalization: none here)
  std::vector<int32_t> prefix, suffix;  // post-processor's single-sequence template
  std::vector<std::string> added_content;  // id -> content ("" when not an added token)
  std::string kind;
  std::string sha256;
  std::string source;
  bool cuttable = true;  // encode_large may cut at safe points

  void finish();  // builds the matchers and derived tables after a loader filled the rest
};

// The loaders (load.cpp).
void load_hf_json(const std::string& path, Tokenizer::Impl& t);
void load_gpt2_files(const std::string& encoder_json, const std::string& vocab_bpe, Tokenizer::Impl& t);
void load_tiktoken(const std::string& path, const LoadOptions& options, Tokenizer::Impl& t);

}  // namespace nnstrain::tok
