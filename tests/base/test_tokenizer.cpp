// The byte-level BPE tokenizer (data/tokenizer) without Python: a tiny
// tokenizer.json written here, ids worked out by hand from its merge ranks.
// - merges as "a b" strings and as ["a", "b"] pairs load to the same tokenizer;
// - encode gives the hand-computed ids (rank order decides: "he ll" only after
//   "l l"), decode(encode(x)) == x on ASCII, multi-byte UTF-8 and emoji;
// - the special-token policies: as text (the default: its bytes), as the special
//   id, or refused with the byte offset; a TemplateProcessing BOS is added on request;
// - invalid UTF-8 is refused naming the byte offset; unknown ids refuse to decode;
//   unsupported files are refused with one line naming what is unsupported.
// - safe_cuts (one long text cut for threads) cuts only where the whole text splits.
// - a text over 4 GiB (a memfd mapped over and over, never copied) encodes whole, its
//   ends as a small text's; a piece over BPE's 2^31 - 1 bytes is refused naming it.
// The parity with Hugging Face `tokenizers` on real vocabularies is tests/reference/test_tokenizer_parity.py's.
#include <catch2/catch.hpp>

#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/tokenizer/pretokenize.h"
#include "data/tokenizer/tokenizer.h"

namespace fs = std::filesystem;
using nlohmann::json;
using nnstrain::tok::SpecialPolicy;
using nnstrain::tok::Tokenizer;
using nnstrain::tok::TokenizerError;

namespace {

// GPT-2's byte-to-character table: printable Latin-1 bytes stand for themselves,
// the other 68 bytes take the code points from U+0100 on, in byte order.
std::string byte_char(int b) {
  const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
  uint32_t cp = b;
  if (!printable) {
    int n = 0;
    for (int c = 0; c < b; ++c)
      if (!((c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF))) ++n;
    cp = 256 + n;
  }
  std::string s;
  if (cp < 0x80) {
    s += char(cp);
  } else {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  }
  return s;
}

struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "nnstrain_tok_XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// Ids: bytes 0..255, then he 256, the 257, ll 258, Ġthe 259, hell 260;
// <|endoftext|> 261 (special), <|bos|> 262 (special).
const char* const kMerges[][2] = {{"h", "e"}, {"t", "he"}, {"l", "l"}, {"Ġ", "the"}, {"he", "ll"}};

json tiny_tokenizer(bool array_merges, bool with_bos) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  int id = 256;
  json merges = json::array();
  for (const auto& m : kMerges) {
    vocab[std::string(m[0]) + m[1]] = id++;
    if (array_merges)
      merges.push_back(json::array({m[0], m[1]}));
    else
      merges.push_back(std::string(m[0]) + " " + m[1]);
  }
  json added = json::array();
  added.push_back({{"id", 261}, {"content", "<|endoftext|>"}, {"special", true}, {"single_word", false},
                   {"lstrip", false}, {"rstrip", false}, {"normalized", false}});
  added.push_back({{"id", 262}, {"content", "<|bos|>"}, {"special", true}, {"single_word", false},
                   {"lstrip", false}, {"rstrip", false}, {"normalized", false}});
  json post = nullptr;
  if (with_bos)
    post = {{"type", "TemplateProcessing"},
            {"single", json::array({{{"SpecialToken", {{"id", "<|bos|>"}, {"type_id", 0}}}},
                                    {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
            {"pair", json::array()},
            {"special_tokens", {{"<|bos|>", {{"id", "<|bos|>"}, {"ids", {262}}, {"tokens", {"<|bos|>"}}}}}}};
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
                             {"use_regex", true}}},
          {"post_processor", post},
          {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true},
                       {"use_regex", true}}},
          {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
                     {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
                     {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
                     {"vocab", vocab}, {"merges", merges}}}};
}

std::string write(const TempDir& d, const std::string& name, const json& j) {
  const auto p = (d.path / name).string();
  std::ofstream(p) << j.dump();
  return p;
}

std::vector<int32_t> bytes_of(const std::string& s) {
  std::vector<int32_t> v;
  for (unsigned char c : s) v.push_back(c);
  return v;
}

}  // namespace

TEST_CASE("tokenizer: a tiny byte-level BPE tokenizer.json encodes to the hand-computed ids, both merge forms",
          "[tokenizer]") {
  TempDir d;
  const auto str = Tokenizer::load(write(d, "str.json", tiny_tokenizer(false, false)));
  const auto arr = Tokenizer::load(write(d, "arr.json", tiny_tokenizer(true, false)));
  // "the" -> t he -> the; " hello" -> Ġ he l l o -> Ġ he ll o -> Ġ hell o; " the" -> Ġ t he -> Ġ the -> Ġthe.
  const std::vector<int32_t> want = {257, 32, 260, 'o', 259};
  CHECK(str.encode("the hello the") == want);
  CHECK(arr.encode("the hello the") == want);
  // "hel": no "l l", so "he ll" never applies.
  CHECK(str.encode("hel") == std::vector<int32_t>{256, 'l'});
  CHECK(str.vocab_size() == 263);
  CHECK(str.eos_id() == std::optional<int32_t>(261));
  CHECK(str.token_id("hell") == std::optional<int32_t>(260));
}

TEST_CASE("tokenizer: decode(encode(x)) == x on ASCII, multi-byte UTF-8 and emoji", "[tokenizer]") {
  TempDir d;
  const auto t = Tokenizer::load(write(d, "t.json", tiny_tokenizer(false, false)));
  for (const std::string s : {"the hello the", "h\xC3\xA9llo w\xC3\xB6rld \xE2\x98\x83 \xF0\x9F\x98\x80\n\t  x",
                              "  leading and trailing  ", "a<|endoftext|>b", "\xE4\xB8\xAD\xE6\x96\x87 123 4567"}) {
    const auto ids = t.encode(s);
    CHECK(t.decode(ids) == s);
  }
  // A 4-byte emoji with no merges is its four byte tokens.
  CHECK(t.encode("\xF0\x9F\x98\x80") == bytes_of("\xF0\x9F\x98\x80"));
  const std::vector<int32_t> unknown = {5, 9999};
  CHECK_THROWS_AS(t.decode(unknown), TokenizerError);
}

TEST_CASE("tokenizer: special-token text as text, as the special id, or refused, and the template's BOS",
          "[tokenizer]") {
  TempDir d;
  const auto t = Tokenizer::load(write(d, "t.json", tiny_tokenizer(false, true)));
  const std::string text = "a<|endoftext|>b";
  CHECK(t.encode(text, SpecialPolicy::text) == bytes_of(text));  // no merge applies inside it
  CHECK(t.encode(text, SpecialPolicy::special) == std::vector<int32_t>{'a', 261, 'b'});
  try {
    t.encode(text, SpecialPolicy::error);
    FAIL("the special token was not refused");
  } catch (const TokenizerError& e) {
    CHECK_THAT(e.what(), Catch::Contains("at byte 1"));
  }
  CHECK(t.encode("the", SpecialPolicy::text, /*add_special=*/true) == std::vector<int32_t>{262, 257});
  CHECK(t.encode("the", SpecialPolicy::text, /*add_special=*/false) == std::vector<int32_t>{257});
  CHECK(t.bos_id() == std::optional<int32_t>(262));
  CHECK(nnstrain::tok::parse_special_policy("special") == SpecialPolicy::special);
  CHECK_THROWS_AS(nnstrain::tok::parse_special_policy("sometimes"), TokenizerError);
}

TEST_CASE("tokenizer: invalid UTF-8 is refused with its byte offset", "[tokenizer]") {
  TempDir d;
  const auto t = Tokenizer::load(write(d, "t.json", tiny_tokenizer(false, false)));
  for (const auto& [text, offset] : std::vector<std::pair<std::string, int>>{
           {"ok\xC3(", 2}, {"\xFF", 0}, {"abc\xE2\x82", 3}, {"the \xED\xA0\x80", 4} /* a surrogate */}) {
    try {
      t.encode(text);
      FAIL("invalid UTF-8 was accepted");
    } catch (const TokenizerError& e) {
      CHECK_THAT(e.what(), Catch::Contains("not valid UTF-8 at byte " + std::to_string(offset)));
    }
  }
}

TEST_CASE("tokenizer: unsupported tokenizer.json files are refused naming what is unsupported", "[tokenizer]") {
  TempDir d;
  auto wordpiece = tiny_tokenizer(false, false);
  wordpiece["model"]["type"] = "WordPiece";
  auto normalizer = tiny_tokenizer(false, false);
  normalizer["normalizer"] = {{"type", "NFC"}};
  auto bad_merge = tiny_tokenizer(false, false);
  bad_merge["model"]["merges"].push_back("x nosuchtoken");
  auto missing_byte = tiny_tokenizer(false, false);
  missing_byte["model"]["vocab"].erase(byte_char(7));
  for (const auto& [j, what] : std::vector<std::pair<json, std::string>>{
           {wordpiece, "model type 'WordPiece' is not supported"},
           {normalizer, "normalizer 'NFC' is not supported"},
           {bad_merge, "merge 6 ('x' 'nosuchtoken') names a token not in the vocabulary"},
           {missing_byte, "no token for byte 7"}}) {
    try {
      Tokenizer::load(write(d, "bad.json", j));
      FAIL("accepted: " + what);
    } catch (const TokenizerError& e) {
      const std::string m = e.what();
      CHECK_THAT(m, Catch::Contains(what));
      CHECK(m.find('\n') == std::string::npos);
    }
  }
}

// The loader reads a tokenizer.json's vocabulary and merges into flat lists (not
// the DOM); what the DOM gave is kept: a repeated key's last value (first-wins would
// give "hell" id 1, byte 1's id, and refuse the file), and each wrong entry named.
TEST_CASE("tokenizer: tokenizer.json vocabulary and merges read as the JSON DOM reads them", "[tokenizer]") {
  TempDir d;
  const std::string good = tiny_tokenizer(false, false).dump();
  auto with = [&](const std::string& from, const std::string& to) {
    std::string text = good;
    const size_t at = text.find(from);
    REQUIRE(at != std::string::npos);
    text.replace(at, from.size(), to);
    const auto path = (d.path / "t.json").string();
    std::ofstream(path) << text;
    return path;
  };
  const auto repeated = Tokenizer::load(with("\"vocab\":{", "\"vocab\":{\"hell\":1,"));
  CHECK(repeated.token_id("hell") == std::optional<int32_t>(260));
  CHECK(repeated.encode("the hello the") == std::vector<int32_t>{257, 32, 260, 'o', 259});
  // A later "vocab" or "merges" key replaces an earlier one, whatever its type.
  CHECK(Tokenizer::load(with("\"merges\":[", "\"merges\":[\"x y\"],\"merges\":[")).encode("hello") ==
        std::vector<int32_t>{260, 'o'});
  for (const auto& [from, to, what] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"\"vocab\":{", "\"vocab\":{\"zz\":\"7\",", "vocab entry 'zz' has no integer id"},
           {"\"vocab\":{", "\"vocab\":{\"zz\":[7],", "vocab entry 'zz' has no integer id"},
           {"\"vocab\":{", "\"vocab\":{\"zz\":-3,", "vocab entry 'zz' has id -3"},
           {"\"vocab\":{", "\"vocab\":5,\"unused\":{", "model.vocab is not an object"},
           {"\"merges\":[", "\"merges\":[\"h e\",[\"l\"],", "merge 2 is neither"},
           {"\"merges\":[", "\"merges\":[\"h e\",[\"l\",[\"l\"]],", "merge 2 is neither"},
           {"\"merges\":[", "\"merges\":[{\"a\":\"b\"},", "merge 1 is neither"},
           {"\"merges\":[", "\"merges\":[\"h  e\",", "merge 1 'h  e' is not two tokens separated by one space"},
           {"\"version\":\"1.0\"}", "\"version\":\"1.0\"", "not valid JSON"}}) {
    INFO(what);
    const std::string path = with(from, to);
    try {
      Tokenizer::load(path);
      FAIL("accepted: " + what);
    } catch (const TokenizerError& e) {
      CHECK_THAT(e.what(), Catch::Contains(what));
    }
  }
}

// The piece cache (pieces of up to 16 bytes keyed by their bytes; longer ones to 64
// in another; cleared when full) gives what encoding the pieces afresh gives: texts
// of distinct pieces encoded with one cache that has seen them all before (hits,
// and over its bound: cleared, misses again) equal the same texts each encoded with
// a fresh cache (every piece a miss: BPE). Each text ends in a piece of its own
// length (fewer than 16 bytes left after it: keys read byte by byte).
TEST_CASE("tokenizer: the piece cache gives BPE's ids, at the end of a text and past its bound", "[tokenizer]") {
  TempDir d;
  const auto t = Tokenizer::load(write(d, "t.json", tiny_tokenizer(false, false)));
  std::vector<std::string> texts;
  std::string text;
  const std::string letters = "helot";  // "he", "the", "ll", "hell" merge inside the pieces
  for (int i = 0; i < 150000; ++i) {    // more distinct pieces than the cache holds (2^17)
    std::string word = " ";
    for (int v = i; v > 0 || word.size() == 1; v /= 5) word += letters[v % 5];
    text += word;
    if (i % 1000 == 999) {
      const size_t k = 1 + (i / 1000) % 70;  // a last piece of 1..70 bytes, none of it a word above
      text += " " + std::string(k, 'l');
      texts.push_back(text);
      text.clear();
    }
  }
  nnstrain::tok::EncodeCache cache;
  for (int round = 0; round < 2; ++round) {
    size_t differ = 0;
    for (const auto& x : texts) {
      std::vector<int32_t> ids;
      t.encode(x, SpecialPolicy::text, false, cache, ids);
      if (ids != t.encode(x)) ++differ;
    }
    CHECK(differ == 0);
  }
  CHECK(t.decode(t.encode(texts[3])) == texts[3]);
}

// safe_cuts: every cut is where pre-tokenizing the whole text puts a piece
// boundary anyway, and pre-tokenizing the parts one by one gives the whole
// text's pieces; lines in any script give cuts (not only ASCII-initial ones).
// The ids of cut texts against Hugging Face's are tests/reference's
// test_multilingual_text_threads_do_not_change_ids.
TEST_CASE("tokenizer: safe_cuts cut only where both patterns split anyway, in any script", "[tokenizer]") {
  using nnstrain::tok::Pattern;
  const std::vector<std::string> lines = {"word", "Привіт світ", "中文字符 日本語", "  indented", "x²½ ٣٤٥",
                                          "'s contraction", "12345 digits", "İstanbul.", "!?", "\t tab"};
  const std::vector<std::string> ends = {"\n", "\n\n", "  \n", "\r\n", " \n \n", ".\n", "\n\t", "\n\n\n", "\u3000\n"};
  std::string text;
  for (size_t i = 0; i < 600; ++i) text += lines[(i * 7) % lines.size()] + ends[(i * 3 + i / 11) % ends.size()];
  for (Pattern p : {Pattern::gpt2, Pattern::llama3}) {
    INFO(nnstrain::tok::pattern_name(p));
    std::vector<size_t> whole;
    nnstrain::tok::pretokenize(p, text, whole);
    const auto cuts = nnstrain::tok::safe_cuts(p, text, 1);
    CHECK(cuts.size() > 300);
    std::vector<size_t> parts;
    size_t from = 0;
    for (size_t c : cuts) {
      REQUIRE(c > from);
      REQUIRE(text[p == Pattern::gpt2 ? c : c - 1] == '\n');
      CHECK(std::binary_search(whole.begin(), whole.end(), c));
      std::vector<size_t> e;
      nnstrain::tok::pretokenize(p, std::string_view(text).substr(from, c - from), e);
      for (size_t x : e) parts.push_back(from + x);
      from = c;
    }
    std::vector<size_t> e;
    nnstrain::tok::pretokenize(p, std::string_view(text).substr(from), e);
    for (size_t x : e) parts.push_back(from + x);
    CHECK(parts == whole);
    // Lines that start with no ASCII letter are cut too (the old rule's only points).
    const std::string cyrillic = "Привіт\nсвіт\nмир\n";
    CHECK(nnstrain::tok::safe_cuts(p, cyrillic, 1).size() == 2);
    CHECK(nnstrain::tok::safe_cuts(Pattern::none, text, 1).empty());
  }
  // A blank line before a letter: gpt2 splits "\n\n" into two pieces there, so the
  // cut goes between them (after both would encode "\n\n" as one piece).
  CHECK(nnstrain::tok::safe_cuts(Pattern::gpt2, "para.\n\nNext", 1) == std::vector<size_t>{6});
  CHECK(nnstrain::tok::safe_cuts(Pattern::llama3, "para.\n\nNext", 1) == std::vector<size_t>{7});
}

// ---------------------------------------------------------------- texts over 4 GiB

namespace {

// A read-only text of (chunks) x 1 MiB in about three MiB of memory: each MiB of the
// address range is a shared mapping of one of three regions of a memfd (the head,
// the repeated middle, the tail). Nothing is copied: the tokenizer reads the
// mapping through a string_view, as it reads any text.
class RepeatedText {
 public:
  static constexpr size_t kChunk = size_t{1} << 20;
  // middle: kChunk bytes, repeated `repeats` times between the last byte of `head_end`
  // and the first bytes of `tail_start` (each shorter than kChunk).
  RepeatedText(const std::string& middle, size_t repeats, const std::string& head_end, const std::string& tail_start)
      : chunks_(repeats + 2) {
    REQUIRE(middle.size() == kChunk);
    fd_ = ::memfd_create("nnstrain_large_text", MFD_CLOEXEC);
    REQUIRE(fd_ >= 0);
    REQUIRE(::ftruncate(fd_, 3 * kChunk) == 0);
    std::string head(kChunk - head_end.size(), '\0');
    head += head_end;
    std::string tail = tail_start;
    tail.resize(kChunk, '\0');
    for (const auto& [region, bytes] : {std::pair<size_t, const std::string*>{0, &head}, {1, &middle}, {2, &tail}})
      REQUIRE(::pwrite(fd_, bytes->data(), kChunk, static_cast<off_t>(region * kChunk)) == static_cast<ssize_t>(kChunk));
    // Reserve the range, then lay the chunks over it.
    void* base = ::mmap(nullptr, chunks_ * kChunk, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    REQUIRE(base != MAP_FAILED);
    base_ = static_cast<char*>(base);
    size_t mapped = 0;
    for (size_t c = 0; c < chunks_; ++c) {
      const size_t region = c == 0 ? 0 : c + 1 == chunks_ ? 2 : 1;
      void* at = ::mmap(base_ + c * kChunk, kChunk, PROT_READ, MAP_SHARED | MAP_FIXED, fd_,
                        static_cast<off_t>(region * kChunk));
      mapped += at == base_ + c * kChunk;
    }
    REQUIRE(mapped == chunks_);
    text_ = std::string_view(base_ + kChunk - head_end.size(), head_end.size() + repeats * kChunk + tail_start.size());
  }
  ~RepeatedText() {
    ::munmap(base_, chunks_ * kChunk);
    ::close(fd_);
  }
  RepeatedText(const RepeatedText&) = delete;
  RepeatedText& operator=(const RepeatedText&) = delete;
  std::string_view text() const { return text_; }

 private:
  size_t chunks_;
  int fd_ = -1;
  char* base_ = nullptr;
  std::string_view text_;
};

// Anonymous memory this process holds (a copy of the text would show here; the
// shared mapping of the memfd does not).
int64_t rss_anon_kib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("RssAnon:", 0) == 0) return std::stoll(line.substr(8));
  FAIL("no RssAnon in /proc/self/status");
  return 0;
}

}  // namespace

// The pieces of a text over 4 GiB and where they start are 64-bit (issue 36: 32-bit
// offsets wrapped and the text past 4 GiB vanished). "x", then 4 GiB of lines of
// 4095 'a's, then " y": its ids are the small text "x" + one MiB of those lines +
// " y"'s, with the MiB's ids 4096 times. Through encode_large on one thread: the
// path of `nnstrain tokenize --input FILE` and, through the same encode_body, of
// `prepare corpus` (more threads cut the text into parts well under 4 GiB).
// About 10 s of one core; memory: the memfd's 3 MiB, 8 MiB of page tables, the ids
// (RSS shows 4 GiB of shared pages: the same 3 MiB counted once per mapping).
TEST_CASE("tokenizer: a text over 4 GiB encodes whole and its ends match a small text's", "[tokenizer][large_text]") {
  TempDir d;
  json j = tiny_tokenizer(false, false);
  const std::string line(4095, 'a');
  j["model"]["vocab"][line] = 263;          // a long piece that is one token: one id per 4 KiB
  j["model"]["ignore_merges"] = true;       // (found whole in the vocabulary, as Llama 3 does)
  const auto t = Tokenizer::load(write(d, "long.json", j));
  std::string middle;
  while (middle.size() < RepeatedText::kChunk) middle += "\n" + line;
  constexpr size_t kRepeats = 4096;  // 4 GiB of middle
  const RepeatedText big(middle, kRepeats, "x", " y");
  REQUIRE(big.text().size() > (size_t{1} << 32));

  const std::string small_text = "x" + middle + " y";
  const std::vector<int32_t> small = t.encode(small_text);
  const size_t per_middle = small.size() - 3;  // ids of one MiB of middle
  // The small text's ids worked out by hand: x, then "\n" and the line 256 times, then Ġ y.
  REQUIRE(per_middle == 512);
  CHECK(small.front() == 'x');
  CHECK(small[1] == '\n');
  CHECK(small[2] == 263);
  CHECK(small[small.size() - 2] == ' ');
  CHECK(small.back() == 'y');

  const int64_t anon_before = rss_anon_kib();
  const std::vector<int32_t> ids = t.encode_large(big.text(), SpecialPolicy::text, 1);
  REQUIRE(ids.size() == small.size() + (kRepeats - 1) * per_middle);
  const size_t k = 1 + per_middle;  // the head and one MiB; then the same from the end
  CHECK(std::equal(small.begin(), small.begin() + k, ids.begin()));
  CHECK(std::equal(small.end() - k, small.end(), ids.end() - k));
  CHECK(std::count(ids.begin(), ids.end(), 263) == static_cast<std::ptrdiff_t>(kRepeats * 256));
  // No copy of the text was made: the ids (8 MiB) and little else.
  CHECK(rss_anon_kib() - anon_before < 256 * 1024);
}

// The text of issue 36, "x", 2^32 NUL bytes and " y", encoded to 3 ids. Its NUL run is
// one pre-tokenized piece of 4 GiB, over what BPE takes (2^31 - 1 bytes: 16 bytes
// of merge state per byte): refused, naming the piece, where it starts and the limit.
TEST_CASE("tokenizer: a piece over the BPE limit is refused naming it (never cut short)", "[tokenizer][large_text]") {
  TempDir d;
  const auto t = Tokenizer::load(write(d, "tiny.json", tiny_tokenizer(false, false)));
  const RepeatedText big(std::string(RepeatedText::kChunk, '\0'), 4096, "x", " y");
  REQUIRE(big.text().size() == (size_t{1} << 32) + 3);
  try {
    const auto ids = t.encode_large(big.text(), SpecialPolicy::text, 1);
    FAIL("encoded to " << ids.size() << " ids");
  } catch (const TokenizerError& e) {
    const std::string msg = e.what();
    CHECK(msg == "a pre-tokenized piece of 4294967296 bytes at byte 1: BPE encodes pieces of at most 2147483647 bytes "
                 "(2^31 - 1)");
  }
}
