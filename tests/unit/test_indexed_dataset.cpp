// dataset.type indexed's batches (data/indexed_dataset.h): prompt targets -100,
// document positions and numbers, slices of a step's global batch.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <unistd.h>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/indexed/indexed_file.h"
#include "data/indexed_dataset.h"

namespace {

constexpr int64_t kEos = 7;

// Instruction documents: document d holds ids 1000 * (d + 1) + i, its first 3 the prompt.
std::string write_alpaca(const std::string& dir) {
  const std::string prefix = dir + "/alpaca";
  nnstrain::indexed::Writer w(prefix, nnstrain::indexed::DType::int32);
  for (int d = 0; d < 12; ++d) {
    std::vector<int32_t> prompt, response;
    for (int i = 0; i < 3 + d % 4; ++i) (i < 3 ? prompt : response).push_back(1000 * (d + 1) + i);
    response.push_back(1000 * (d + 1) + 50);
    w.add_document(std::vector<const std::vector<int32_t>*>{&prompt, &response});
  }
  w.commit();
  nlohmann::json m = {{"bin", "alpaca.bin"}, {"idx", "alpaca.idx"}, {"sequences_per_document", 2},
                      {"tokenizer", {{"path", "t"}, {"sha256", "x"}, {"vocab_size", 20000}, {"eos_id", kEos}, {"bos_id", nullptr}}}};
  std::ofstream(prefix + ".manifest.json") << m.dump();
  return prefix;
}

bool is_prompt(int64_t id) { return id != kEos && id % 1000 < 3; }

}  // namespace

TEST_CASE("indexed batches: prompt targets -100, documents restart positions", "[indexed_dataset]") {
  char tmpl[] = "/tmp/nnstrain_indexed_XXXXXX";
  REQUIRE(::mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl;
  nnstrain::config::IndexedArgs args;
  args.datasets = {{write_alpaca(dir), 1.0}};
  args.seq_len = 8;
  args.mask_prompt = true;
  args.document_mask = true;
  const nnstrain::data::IndexedDataset ds(args, 5, 4, "dataset.train_args");
  int64_t masked_prompt = 0, counted = 0;
  for (int64_t step = 0; step < 6; ++step) {
    const auto b = ds.train_batch(step, 0, 4);
    REQUIRE(b.x.sizes() == std::vector<int64_t>({4, 8}));
    REQUIRE(b.positions.defined());
    for (int64_t r = 0; r < 4; ++r)
      for (int64_t t = 0; t < 8; ++t) {
        const int64_t x = b.x[r][t].item<int64_t>(), y = b.y[r][t].item<int64_t>();
        const int64_t pos = b.positions[r][t].item<int64_t>(), seg = b.segments[r][t].item<int64_t>();
        // After an EOS a new document starts: position 0, the next number, and no target into it.
        const bool starts = t > 0 && b.x[r][t - 1].item<int64_t>() == kEos;
        CHECK(pos == (t == 0 || starts ? 0 : b.positions[r][t - 1].item<int64_t>() + 1));
        CHECK(seg == (t == 0 ? 0 : b.segments[r][t - 1].item<int64_t>() + (starts ? 1 : 0)));
        if (x == kEos) {
          CHECK(y == -100);
        } else if (t + 1 < 8) {
          const int64_t next = b.x[r][t + 1].item<int64_t>();
          CHECK(y == (is_prompt(next) ? -100 : next));
          masked_prompt += is_prompt(next);
          counted += !is_prompt(next);
        }
      }
    // Any slice of the step's global batch is those rows (the ranks' contract).
    const auto part = ds.train_batch(step, 1, 2);
    CHECK(torch::equal(part.x, b.x.narrow(0, 1, 2)));
    CHECK(torch::equal(part.y, b.y.narrow(0, 1, 2)));
    CHECK(torch::equal(part.positions, b.positions.narrow(0, 1, 2)));
  }
  CHECK(masked_prompt > 10);
  CHECK(counted > 10);

  // Without the switches: plain shifted targets, no per-token positions.
  args.mask_prompt = false;
  args.document_mask = false;
  const nnstrain::data::IndexedDataset plain(args, 5, 4, "dataset.train_args");
  const auto a = plain.train_batch(2, 0, 4), m = ds.train_batch(2, 0, 4);
  CHECK(!a.positions.defined());
  CHECK(torch::equal(a.x, m.x));  // the same stream
  CHECK(torch::equal(a.y.narrow(1, 0, 7), a.x.narrow(1, 1, 7)));
  // Validation batch k: the samples of its stream from floor(radical_inverse_2(k) x N)
  // on (docs/data.md), here k 3 from 3N/4, each the stream's sample at that index
  // (step 0's batch slices); and its slices are its rows.
  const auto v3 = plain.val_batch(3, 0, 4);
  const int64_t n = plain.samples_per_epoch();
  for (int64_t p = 0; p < 4; ++p) {
    INFO("row " << p << " of " << n << " samples");
    CHECK(torch::equal(v3.x[p], plain.train_batch(0, (3 * n / 4 + p) % n, 1).x[0]));
  }
  CHECK(torch::equal(plain.val_batch(3, 2, 2).x, plain.val_batch(3, 0, 4).x.narrow(0, 2, 2)));
  // Another seed, another training stream.
  const nnstrain::data::IndexedDataset other(args, 99, 4, "dataset.train_args");
  CHECK(!torch::equal(plain.train_batch(0, 0, 4).x, other.train_batch(0, 0, 4).x));
  std::system(("rm -rf " + dir).c_str());
}

TEST_CASE("chat documents: every context sequence is masked, every target sequence learned", "[indexed_dataset]") {
  // Documents of 2 to 5 sequences alternating context and target (prepare corpus
  // --format chat): ids 1000 (d + 1) + 100 k + i for sequence k, token i.
  char tmpl[] = "/tmp/nnstrain_chat_XXXXXX";
  REQUIRE(::mkdtemp(tmpl) != nullptr);
  const std::string prefix = std::string(tmpl) + "/chat";
  {
    nnstrain::indexed::Writer w(prefix, nnstrain::indexed::DType::int32);
    for (int d = 0; d < 10; ++d) {
      std::vector<std::vector<int32_t>> seqs(size_t(2 + d % 4));
      for (size_t k = 0; k < seqs.size(); ++k)
        for (int i = 0; i < 2 + (d + int(k)) % 3; ++i) seqs[k].push_back(1000 * (d + 1) + 100 * int(k) + i);
      std::vector<const std::vector<int32_t>*> ptrs;
      for (const auto& s : seqs) ptrs.push_back(&s);
      w.add_document(ptrs);
    }
    w.commit();
    nlohmann::json m = {{"bin", "chat.bin"}, {"idx", "chat.idx"}, {"sequences_per_document", "alternating"},
                        {"tokenizer", {{"path", "t"}, {"sha256", "x"}, {"vocab_size", 20000}, {"eos_id", kEos}, {"bos_id", nullptr}}}};
    std::ofstream(prefix + ".manifest.json") << m.dump();
  }
  nnstrain::config::IndexedArgs args;
  args.datasets = {{prefix, 1.0}};
  args.seq_len = 8;
  args.join = "none";
  args.mask_prompt = true;
  args.document_mask = true;
  const nnstrain::data::IndexedDataset ds(args, 3, 4, "dataset.train_args");
  int64_t context = 0, target = 0;
  for (int64_t step = 0; step < 4; ++step) {
    const auto b = ds.train_batch(step, 0, 4);
    for (int64_t r = 0; r < 4; ++r)
      for (int64_t t = 0; t + 1 < 8; ++t) {
        const int64_t next = b.x[r][t + 1].item<int64_t>(), y = b.y[r][t].item<int64_t>();
        if (b.segments[r][t + 1].item<int64_t>() != b.segments[r][t].item<int64_t>()) continue;
        const bool is_context = (next % 1000) / 100 % 2 == 0;  // sequences 0, 2, 4: context
        CHECK(y == (is_context ? -100 : next));
        (is_context ? context : target) += 1;
      }
  }
  CHECK(context > 10);
  CHECK(target > 10);
}
