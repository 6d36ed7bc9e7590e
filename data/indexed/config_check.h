// What the config loader asks of the indexed datasets a config names
// (config::ModuleChecks::indexed_datasets): the loader lives in base/, which
// reads no manifest, so this check lives here beside read_manifest.
#pragma once

#include "base/config/load.h"

namespace nnstrain::indexed {

// Each dataset's manifest and its .bin/.idx; one tokenizer for all (train and
// val); the join token exists; mask_prompt has instruction data to act on;
// chat data was rendered with model.init_from's chat template, where both are
// known, unless the dataset sets allow_other_chat_template.
// Fails through the ArgMaps it is given (config::ConfigError naming key and line).
void check_config_datasets(const config::IndexedKeys& train, const config::IndexedKeys* val);

}  // namespace nnstrain::indexed
