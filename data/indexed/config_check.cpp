#include "data/indexed/config_check.h"

#include <filesystem>
#include <stdexcept>
#include <string>

#include "data/indexed/sample_stream.h"

namespace nnstrain::indexed {

void check_config_datasets(const config::IndexedKeys& train, const config::IndexedKeys* val) {
  std::string sha, sha_from;
  auto check = [&](const config::IndexedKeys& k) {
    const auto& a = k.values;
    bool prompts = false;
    for (size_t i = 0; i < a.datasets.size(); ++i) {
      Manifest man;
      try {
        man = read_manifest(a.datasets[i].path);
        for (const char* ext : {".bin", ".idx"})
          if (!std::filesystem::is_regular_file(man.prefix + ext))
            throw std::runtime_error("'" + man.prefix + ext + "' (named by " + man.path + ") not found");
      } catch (const std::exception& e) {
        k.datasets[i].fail("path", e.what());
      }
      if (sha.empty()) sha = man.tokenizer_sha256, sha_from = man.path;
      else if (man.tokenizer_sha256 != sha)
        k.datasets[i].fail("path", man.path + " was tokenised by tokenizer " + man.tokenizer_sha256.substr(0, 16) +
                                       "..., but " + sha_from + " by " + sha.substr(0, 16) +
                                       "...; every dataset of a run needs the same tokenizer");
      if (a.join != "none") {
        const auto& id = a.join == "eos" ? man.eos_id : man.bos_id;
        if (!id)
          k.args.fail("join", a.join + ": the tokenizer of " + man.path + " (" + man.tokenizer_path + ") has no " +
                                  (a.join == "eos" ? "EOS" : "BOS") + " token; use " +
                                  (a.join == "eos" ? "bos" : "eos") + " or none");
      }
      prompts = prompts || man.sequences_per_document != 1;
    }
    if (a.mask_prompt && !prompts)
      k.args.fail("mask_prompt", "true, but no dataset holds instruction or chat data (prompt, response) to mask; "
                                 "prepare it with nnstrain prepare corpus --format alpaca, or set false");
  };
  check(train);
  if (val) check(*val);
}

}  // namespace nnstrain::indexed
