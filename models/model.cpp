#include "models/model.h"

#include <algorithm>
#include <map>
#include <optional>
#include <stdexcept>

namespace nnstrain::models {

torch::Tensor CausalLM::decode_logits(const torch::Tensor&, common::KvCache&) {
  throw std::runtime_error("this model has no incremental decoding (KV cache)");
}

int CausalLM::block_of(const std::string& name) const {
  const auto prefix = blocks_name() + ".";
  if (name.rfind(prefix, 0) != 0) return -1;
  const auto rest = name.substr(prefix.size());
  const auto dot = rest.find('.');
  const auto index = rest.substr(0, dot);
  if (index.empty() || !std::all_of(index.begin(), index.end(), [](char c) { return c >= '0' && c <= '9'; })) return -1;
  return std::stoi(index);
}

torch::Tensor CausalLM::embed(const torch::Tensor&, const Documents&) {
  throw std::runtime_error("this model cannot be split into pipeline stages");
}
torch::Tensor CausalLM::blocks(const torch::Tensor&, int64_t, int64_t, int64_t, const Documents&) {
  throw std::runtime_error("this model cannot be split into pipeline stages");
}
torch::Tensor CausalLM::head_loss(const torch::Tensor&, const torch::Tensor&) {
  throw std::runtime_error("this model cannot be split into pipeline stages");
}
torch::Tensor CausalLM::head_logits(const torch::Tensor&) {
  throw std::runtime_error("this model cannot be split into pipeline stages");
}

std::vector<std::string> CausalLM::params_of(const HeldPieces& pieces) const {
  const auto ties = head_ties();
  std::vector<std::string> out;
  bool after_blocks = false;
  for (const auto& p : const_cast<CausalLM&>(*this).named_parameters()) {
    const auto& name = p.key();
    const int b = block_of(name);
    after_blocks = after_blocks || b >= 0;
    bool held;
    if (b >= 0) held = pieces.blocks.empty() || (b < static_cast<int>(pieces.blocks.size()) && pieces.blocks[b]);
    else if (after_blocks) held = pieces.head;
    else held = pieces.embed || (pieces.head && std::find(ties.begin(), ties.end(), name) != ties.end());
    if (held) out.push_back(name);
  }
  return out;
}

void CausalLM::hold_only(const HeldPieces& pieces) {
  held_ = params_of(pieces);
  std::sort(held_->begin(), held_->end());
}

bool CausalLM::holds(const std::string& name) const {
  return !held_ || std::binary_search(held_->begin(), held_->end(), name);
}

std::vector<common::ParamLayout> CausalLM::param_layouts() const {
  auto& self = const_cast<CausalLM&>(*this);  // named_modules() is not const in LibTorch
  std::map<std::string, common::ParamLayout> by_name;
  for (const auto& item : self.named_modules("", /*include_self=*/false)) {
    const auto* m = dynamic_cast<const common::ShardedModule*>(item.value().get());
    if (!m) continue;
    for (auto l : m->layouts()) {
      l.name = item.key() + "." + l.name;
      l.split.param = l.name;
      by_name.emplace(l.name, std::move(l));  // a module reached twice declares the same
    }
  }
  std::vector<common::ParamLayout> out;
  for (const auto& p : self.named_parameters()) {
    if (!holds(p.key())) continue;
    auto it = by_name.find(p.key());
    if (it == by_name.end())
      throw std::logic_error("parameter '" + p.key() + "' belongs to no layer of models/common/layers.h, so nothing "
                             "declares how it is split or initialised");
    out.push_back(it->second);
  }
  return out;
}

std::vector<ParamSplit> CausalLM::split_declaration() const {
  std::vector<ParamSplit> out;
  for (const auto& l : param_layouts())
    if (l.split.style != SplitStyle::Replicate) out.push_back(l.split);
  return out;
}

}  // namespace nnstrain::models
