// Pre-tokenization: cutting text into the pieces BPE encodes one at a time, exactly
// as Hugging Face `tokenizers` cuts with the GPT-2 and Llama 3 patterns (leftmost
// alternative first, as its regex engine tries them). Hand-written scanners instead of
// a regex engine: the same pieces, many times faster.
//
//   gpt2:   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//   llama3: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
//           ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace nnstrain::tok {

enum class Pattern { none, gpt2, llama3 };

// The pattern a regex string from a tokenizer.json names; false when it is neither.
bool pattern_from_regex(const std::string& regex, Pattern& out);
const char* pattern_name(Pattern p);
// The regex source text of a pattern (as tokenizer.json spells it).
const char* pattern_regex(Pattern p);

// The end of the piece of `text` (valid UTF-8) that starts at `i` (< text.size()).
// Pattern::none: the whole rest of the text is one piece. Offsets are size_t
// throughout: a text may be larger than 4 GiB.
size_t piece_end(Pattern p, std::string_view text, size_t i);

// Writes the end offsets of up to `max` pieces starting at `i` to `ends`, in order;
// returns how many (fewer than `max` only at the end of the text). The encoder's
// loop: one call per batch of pieces, the scanner inlined over the batch.
size_t piece_ends(Pattern p, std::string_view text, size_t i, size_t* ends, size_t max);

// Appends to `ends` the end offset of every piece of `text` (valid UTF-8), in order;
// the pieces cover the text. (The encoder calls piece_end instead: no list of a
// long text's pieces.)
void pretokenize(Pattern p, std::string_view text, std::vector<size_t>& ends);

// Offsets at which `text` may be cut into parts that `p` pre-tokenizes exactly as
// the whole: at a '\n' followed by anything but whitespace, before it under gpt2
// (it is a piece of its own there), after it under llama3 (it ends a piece there).
// Any script's lines qualify, not only ASCII ones. At most one per `min_gap` bytes;
// none for Pattern::none.
std::vector<size_t> safe_cuts(Pattern p, std::string_view text, size_t min_gap);

}  // namespace nnstrain::tok
