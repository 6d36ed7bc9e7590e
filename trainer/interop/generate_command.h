// `nnstrain generate SOURCE [--prompt TEXT | --prompt-file F | --prompt-ids 1,2]
// [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]
// [--num-samples N] [--device cpu|cuda|auto] [--tokenizer PATH] ...`: text
// sampled from a trained model (docs/generate.md). SOURCE is a checkpoint of any
// plan (sharded, deduped, tensor parallel: read whole, as merge reads it), a
// run's save_dir (its latest), a merged folder, or a Hugging Face folder.
#pragma once

#include <string>
#include <vector>

namespace nnstrain::interop {

// args: what follows "generate". Returns the exit status (0, 1 error, 2 usage).
int generate_main(const std::vector<std::string>& args);

}  // namespace nnstrain::interop
