// `nnstrain prepare chat-render BATCH.json`: templates x conversations rendered
// and tokenized in one process, one JSON line per rendering (text, ids, target
// mask, or the error): to see what a template makes of one's data before
// preparing a corpus, and how the parity tests drive the engine. Torch-free.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace nnstrain::data {

int chat_render_main(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace nnstrain::data
