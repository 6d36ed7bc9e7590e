// `nnstrain prepare`: text -> nanoGPT-format token files (train.bin, val.bin, meta.json).
//
//   nnstrain prepare shakespeare_char [--input PATH] [--out DIR]
//   nnstrain prepare text --input FILE --out DIR [--level char|byte] [--val-fraction 0.1]
//
// Torch-free (part of nnstrain_base). See docs/data.md.
#pragma once

#include <iosfwd>
#include <string>
#include <vector>

namespace nnstrain::data {

// The tiny Shakespeare corpus nanoGPT's shakespeare_char example uses.
inline constexpr const char* kShakespeareUrl =
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt";
inline constexpr const char* kShakespeareSha256 =
    "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed";

// `args` are the words after `prepare` (a leading "prepare" is tolerated).
// Returns the process exit status: 0 done (or already up to date), 1 failure
// (hash mismatch, I/O, download), 2 usage error (unknown dataset, missing file, bad option).
int prepare_main(const std::vector<std::string>& args);
// The same, with the report and the errors written to the given streams (for tests).
int prepare_main(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

// `nnstrain prepare corpus ...` (prepare_corpus.cpp): tokenized Megatron .bin/.idx files.
int prepare_corpus_main(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);
// `prepare corpus --format preference` (prepare_preference.cpp): TRL's preference pairs.
int prepare_preference_main(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

// Writes `bytes` to a temporary file beside `path`, fsyncs it and renames it over
// `path`: readers see the old file or the whole new one. Throws std::runtime_error.
void write_file_atomic(const std::string& path, const std::string& bytes);

}  // namespace nnstrain::data
