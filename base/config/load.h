// Loading a TrainerArgs YAML file: overrides, vars, validation, the resolved config.
// Every error is a ConfigError naming the file, the key path and its line (or
// "(command line)" for an override). Reference: docs/config.md.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "base/config/arg_map.h"
#include "base/config/trainer_args.h"

namespace nnstrain::config {

// What the model registry offers the loader (the loader never names a model).
struct ModelCatalog {
  std::vector<std::string> names;  // registered model types, for messages
  // Parse `model.args` for `type`; called only for a registered type. The loader
  // calls args.finish() afterwards, so unknown model args are reported too.
  // Left empty, model.args is taken unvalidated and ModelArgs::args stays null.
  std::function<std::shared_ptr<const ModelConfig>(const std::string& type, ArgMap& args)> parse;
  // model.init_from: DIR -> the folder's model type (its config.json's model_type)
  // and its model.args as JSON text, which fill the keys model.args leaves out;
  // a key given there too must agree, unless it is one of `free` (training
  // settings such as the init's std or a loss coefficient, which model.args may
  // change). Throws std::runtime_error naming the file and key it cannot read.
  // Left empty, init_from fills nothing.
  struct Folder {
    std::string type, args_json;
    std::vector<std::string> free;
  };
  std::function<Folder(const std::string& dir)> folder_args;
};

// The optimizer registry as the config loader sees it. AdamW is the loader's
// own (optimizer.args); another registered type parses its `optimizer` mapping
// (its args, and adamw_args through read_adamw_args). Left empty, only adamw is known.
struct OptimizerCatalog {
  std::vector<std::string> names;
  std::function<std::shared_ptr<const OptimizerConfig>(const std::string& type, ArgMap& optimizer, OptimizerArgs& o)>
      parse;
};
// AdamW's keys (lr, betas, eps, weight_decay, impl) from `args` into o.
void read_adamw_args(ArgMap& args, OptimizerArgs& o);

// One side of dataset.type indexed (train_args or val_args) as read: the mapping,
// each `datasets` item (errors about a dataset name its path's line) and the values.
struct IndexedKeys {
  const ArgMap& args;
  const std::vector<ArgMap>& datasets;
  const IndexedArgs& values;
  const std::string& init_from;  // model.init_from ("": none): its chat template against the datasets'
};

// The checks that need a module above base/ (base/ includes nothing from trainer/,
// data/ or models/; tests/suite/test_layering.py holds it to that). Each module
// hands the loader its own, as models/ hands it the catalog, and the loader calls
// it where it always checked that key, so the error is the same ConfigError naming
// the key and its line. A config that needs an unset one throws std::logic_error.
struct ModuleChecks {
  // pas_config with pp_size > 1 and the step's micro-batches known: can the
  // scheduler run pp_size ranks, the stages and `micros` micro-batches?
  // parallel::pipeline::check_config_schedule (trainer/pipeline/config_check.h).
  void (*pipeline_schedule)(const ArgMap& pas, const PipelineArgs& pipeline, int micros) = nullptr;
  // dataset.type indexed with check_files: each dataset's manifest and files, one
  // tokenizer for all, the join token, instruction data for mask_prompt.
  // indexed::check_config_datasets (data/indexed/config_check.h). `val` may be null.
  void (*indexed_datasets)(const IndexedKeys& train, const IndexedKeys* val) = nullptr;
};

struct LoadOptions {
  std::vector<std::pair<std::string, std::string>> overrides;  // {"optimizer.args.lr", "3e-4"}
  ModelCatalog models;
  OptimizerCatalog optimizers;
  ModuleChecks checks;
  int world_size = 1;              // from the launcher; runtime_ngpus defaults to it
  bool check_files = true;         // data files must exist
  bool reject_unimplemented = true;  // call check_implemented() (off: `nnstrain plan` for future setups)
};

// Throws ConfigError.
TrainerArgs load_trainer_args(const std::string& file, const LoadOptions& opts);
// The same on a file's text, already read: `file` names it in messages and gives
// run_dir's default. load_trainer_args reads the file and calls this (so does the fuzzer).
TrainerArgs load_trainer_args_from_text(const std::string& text, const std::string& file, const LoadOptions& opts);

// "--a.b.c value" / "--a.b.c=value" tokens (argv leftovers) -> overrides, in order.
// Throws ConfigError on a key without a value or a token that is not an override.
std::vector<std::pair<std::string, std::string>> parse_overrides(const std::vector<std::string>& tokens);

// lr_scheduler.type wsd in a run of `total` iterations (steps, or epochs under
// interval epoch): the decay phase's length, decay_steps or decay_ratio x total
// rounded to the nearest iteration.
int64_t wsd_decay_length(const LrSchedulerArgs& s, int64_t total);
// For type wsd: throws ConfigError naming lr_scheduler.args.decay_steps (or
// decay_ratio) when warmup and decay do not fit in `total`; `total_from` says where
// total came from ("max_epochs 3 x 5 steps per epoch"). The loader checks this where
// the config alone gives the run's length; start-up calls it where it needs the data.
void check_wsd_fits(const LrSchedulerArgs& s, int64_t total, const std::string& total_from);

// Rejects, naming the key, what the engine cannot do yet. One check per line: delete
// a line when its feature lands.
void check_implemented(const TrainerArgs& args);

}  // namespace nnstrain::config
