#include "data/indexed/config_check.h"

#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>

#include "data/chat_template.h"
#include "data/indexed/sample_stream.h"
#include "data/sha256.h"

namespace nnstrain::indexed {

namespace {

// model.init_from's chat template (chat_template.jinja, else tokenizer_config.json's),
// as prepare corpus finds it in a tokenizer folder; nullopt when there is none.
std::optional<data::ChatTemplateSpec> model_chat_template(const config::IndexedKeys& k) {
  if (k.init_from.empty()) return std::nullopt;
  try {
    return data::find_chat_template("", k.init_from);
  } catch (const std::exception& e) {
    k.args.fail("datasets", "model.init_from " + k.init_from + ": " + e.what());
  }
}

// Chat data rendered with another template than the model's own trains the model on
// a format it will not be prompted with; refused unless the dataset says it means it.
void check_chat_template(const config::ArgMap& item, const config::IndexedSource& src, const Manifest& man,
                         const std::optional<data::ChatTemplateSpec>& model, const std::string& init_from) {
  const std::string key = "allow_other_chat_template";
  if (man.chat_template_sha256.empty()) {
    if (src.allow_other_chat_template)
      item.fail(key, "true, but " + man.path + " holds no chat data (no chat_template_sha256 in its settings)");
    return;
  }
  if (!model) {
    if (src.allow_other_chat_template)
      item.fail(key, "true, but there is no model chat template to compare with (" +
                         (init_from.empty() ? std::string("model.init_from is not set")
                                            : "model.init_from " + init_from + " holds none") + ")");
    return;
  }
  const std::string model_sha = data::sha256_hex(model->text);
  if (model_sha == man.chat_template_sha256) {
    if (src.allow_other_chat_template)
      item.fail(key, "true, but " + man.path + " was prepared with model.init_from's own chat template (" +
                         model_sha.substr(0, 16) + "...); remove the key");
    return;
  }
  if (!src.allow_other_chat_template)
    item.fail("path", man.path + " was prepared with chat template " + man.chat_template_sha256.substr(0, 16) +
                          "... (" + man.chat_template_source + "), but model.init_from's is " + model_sha.substr(0, 16) +
                          "... (" + model->source + "); prepare it again with --chat-template " + init_from +
                          ", or set " + key + ": true on this dataset");
}

}  // namespace

void check_config_datasets(const config::IndexedKeys& train, const config::IndexedKeys* val) {
  std::string sha, sha_from;
  auto check = [&](const config::IndexedKeys& k) {
    const auto& a = k.values;
    bool prompts = false;
    const auto model_template = model_chat_template(k);
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
      check_chat_template(k.datasets[i], a.datasets[i], man, model_template, k.init_from);
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
