// The model a command runs (generate, eval): from a checkpoint, a run's
// save_dir (its latest complete checkpoint), a merged folder or a Hugging Face
// folder, with the tokenizer found beside it. One loader, so every command
// accepts the same sources with the same messages.
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

namespace nnstrain::models {
class CausalLM;
}
namespace nnstrain::checkpoint {
class Checkpoint;
}

namespace nnstrain::interop {

// The user named something that is not a model: a missing path, a save_dir
// without a complete checkpoint, a folder that is none of the kinds.
struct ModelSourceError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct ModelSource {
  std::shared_ptr<models::CausalLM> model;  // whole tensors on the CPU, one process
  std::string what;                         // "checkpoint DIR (llama, step 200)", for messages
  std::optional<std::string> tokenizer;     // its tokenizer, when one is found beside it
};

// Throws ModelSourceError for the user's mistakes above, CheckpointError or
// std::runtime_error (naming the file) for a source that is damaged or that no
// registered model reads.
ModelSource load_model_source(std::string src);

// A path the run's config names: as it is when absolute, else tried from here,
// then from each folder above the checkpoint (the run was started from one of
// them). `exists` decides what counts as found.
std::optional<std::filesystem::path> find_from_run(const std::filesystem::path& p, const checkpoint::Checkpoint& ck,
                                                   const std::function<bool(const std::filesystem::path&)>& exists);

}  // namespace nnstrain::interop
