#include "models/gpt/gpt.h"

#include <cmath>

#include "models/common/context_attention.h"
#include "models/common/kernels/kernels.h"


namespace F = torch::nn::functional;

namespace nnstrain::models::gpt {

namespace {
// nanoGPT: residual projections get std 0.02 / sqrt(2 * n_layer) (GPT-2 paper), other matrices 0.02.
common::InitRule proj_init(const GptConfig& cfg) { return common::InitRule::normal(0.02 / std::sqrt(2.0 * cfg.n_layer)); }
const common::InitRule kInit = common::InitRule::normal(0.02);
// scaled_dot_product_attention's optional mask: none for an undefined tensor.
std::optional<torch::Tensor> attn_mask(const torch::Tensor& mask) {
  return mask.defined() ? std::optional<torch::Tensor>(mask) : std::nullopt;
}
}  // namespace

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GptConfig& cfg, const common::ShardingContext& ctx)
    : head_dim(cfg.n_embd / cfg.n_head), heads(ctx.local(cfg.n_head, "n_head")), dropout(cfg.dropout), ctx(ctx) {
  const int64_t C = cfg.n_embd;
  c_attn = register_module("c_attn", common::ColumnParallelLinear(ctx, C, std::vector<int64_t>{C, C, C}, head_dim, cfg.bias, kInit));
  c_proj = register_module("c_proj", common::RowParallelLinear(ctx, C, C, head_dim, cfg.bias, proj_init(cfg)));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& mask) {
  auto qkv = c_attn(x);  // [B, T, 3 * this rank's width]: all T tokens under sequence parallelism too
  const auto B = qkv.size(0), T = qkv.size(1);
  const int64_t width = heads * head_dim;
  auto parts = qkv.split(width, -1);
  auto shape = [&](const torch::Tensor& t) { return t.view({B, T, heads, head_dim}).transpose(1, 2); };
  const double p = is_training() ? dropout : 0.0;
  torch::Tensor y;
  if (ctx.cp_comm) {
    // This rank's tokens of a sequence split over the cp ranks (no dropout: refused at load).
    TORCH_CHECK(p == 0, "attention dropout under context parallelism is not supported");
    common::CpAttentionOptions o;
    o.comm_type = ctx.cp_comm_type;
    o.layout = ctx.cp_layout;
    if (mask.defined() && mask.dim() == 2) o.segments = mask;  // Documents::attention_input
    y = common::context_parallel_attention(shape(parts[0]), shape(parts[1]), shape(parts[2]), /*causal=*/true,
                                           ctx.cp_comm, o);
  } else if (mask.defined() && mask.dim() == 2) {  // segments (Documents::attention_input): masked by tiles
    y = common::document_attention(shape(parts[0]), shape(parts[1]), shape(parts[2]), mask);
  } else {
    // Attention-probability dropout on this rank's heads: a sharded region, so
    // under tp > 1 its masks come from this rank's own generator state.
    auto fork = p > 0 && ctx.rng ? ctx.rng->fork(x.device()) : common::ParallelRng::Fork();
    y = at::scaled_dot_product_attention(shape(parts[0]), shape(parts[1]), shape(parts[2]), attn_mask(mask), p,
                                         /*is_causal=*/!mask.defined());
  }
  y = y.transpose(1, 2).contiguous().view({B, T, width});
  return common::region_dropout(ctx, c_proj(y), dropout, is_training());
}

torch::Tensor CausalSelfAttentionImpl::forward_cached(const torch::Tensor& x, common::KvCache& cache, size_t layer) {
  auto qkv = c_attn(x);
  const auto B = qkv.size(0), T = qkv.size(1);
  const int64_t width = heads * head_dim;
  auto parts = qkv.split(width, -1);
  auto shape = [&](const torch::Tensor& t) { return t.view({B, T, heads, head_dim}).transpose(1, 2); };
  const auto past = cache.length();
  const auto [k, v] = cache.append(layer, shape(parts[1]), shape(parts[2]));
  auto y = common::cached_attention(shape(parts[0]), k, v, past);
  return c_proj(y.transpose(1, 2).contiguous().view({B, T, width}));
}

MlpImpl::MlpImpl(const GptConfig& cfg, const common::ShardingContext& ctx) : dropout(cfg.dropout), ctx(ctx) {
  const int64_t C = cfg.n_embd;
  c_fc = register_module("c_fc", common::ColumnParallelLinear(ctx, C, std::vector<int64_t>{4 * C}, 1, cfg.bias, kInit));
  c_proj = register_module("c_proj", common::RowParallelLinear(ctx, 4 * C, C, 1, cfg.bias, proj_init(cfg)));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  // nanoGPT's exact (erf) GELU, not GPT-2's tanh form.
  return common::region_dropout(ctx, c_proj(common::kernels::gelu(c_fc(x), /*tanh_approximation=*/false)), dropout,
                                is_training());
}

BlockImpl::BlockImpl(const GptConfig& cfg, const common::ShardingContext& ctx) {
  ln_1 = register_module("ln_1", common::LayerNorm(cfg.n_embd, cfg.bias, 1e-5, ctx));
  attn = register_module("attn", CausalSelfAttention(cfg, ctx));
  ln_2 = register_module("ln_2", common::LayerNorm(cfg.n_embd, cfg.bias, 1e-5, ctx));
  mlp = register_module("mlp", Mlp(cfg, ctx));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, const torch::Tensor& mask) {
  auto y = x + attn->forward(ln_1(x), mask);
  return y + mlp(ln_2(y));
}

torch::Tensor BlockImpl::forward_cached(const torch::Tensor& x, common::KvCache& cache, size_t layer) {
  auto y = x + attn->forward_cached(ln_1(x), cache, layer);
  return y + mlp(ln_2(y));
}

Gpt::Gpt(const GptConfig& cfg, const common::ShardingContext& ctx) : cfg_(cfg), ctx_(ctx) {
  wte = register_module("wte", common::VocabParallelEmbedding(ctx, cfg.vocab_size, cfg.n_embd, kInit));
  wpe = register_module("wpe", common::Embedding(cfg.block_size, cfg.n_embd, kInit, ctx.options));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg.n_layer; ++i) h->push_back(Block(cfg, ctx));
  ln_f = register_module("ln_f", common::LayerNorm(cfg.n_embd, cfg.bias, 1e-5, ctx));
  lm_head = common::ParallelLmHead(ctx, cfg.vocab_size, cfg.n_embd, /*own_weight=*/false, kInit);
}

torch::Tensor Gpt::embed(const torch::Tensor& idx, const Documents& docs) {
  const auto T = idx.size(1);
  const int cp = ctx_.cp_comm ? ctx_.cp_comm->size() : 1;
  TORCH_CHECK(T * cp <= cfg_.block_size, "sequence of ", T * cp, " tokens exceeds block_size ", cfg_.block_size);
  // Packed documents: each token's position within its document ([B, T, C] embeddings).
  // Under context parallelism this rank's tokens' global positions.
  const auto ids = cp > 1 ? torch::tensor(common::cp_position_ids(T * cp, cp, ctx_.cp_comm->rank(), ctx_.cp_layout),
                                          idx.options().dtype(torch::kLong))
                          : torch::arange(T, idx.options().dtype(torch::kLong));
  auto pos = docs.defined() ? wpe(docs.positions) : wpe(ids).unsqueeze(0);
  // Under sequence parallelism wte gives this rank's tokens; so does the position
  // embedding's entry into the region (its gradient all-gathered back whole).
  const auto positions = common::to_sequence_shard(ctx_, pos, idx.size(0));
  return common::region_dropout(ctx_, wte(idx) + positions, cfg_.dropout, is_training());
}

torch::Tensor Gpt::blocks(const torch::Tensor& input, int64_t begin, int64_t end, int64_t, const Documents& docs) {
  auto x = input;
  // Segments (common::document_attention picks the kernel) unless attention dropout needs the dense mask.
  const bool by_tiles = ctx_.cp_comm || cfg_.dropout == 0;
  const auto mask = docs.defined() ? docs.attention_input(by_tiles) : torch::Tensor();
  for (auto i = static_cast<size_t>(begin); i < static_cast<size_t>(end); ++i) {
    auto block = h->ptr<BlockImpl>(i);
    x = run_block(i, [block, mask](const torch::Tensor& t) { return block->forward(t, mask); }, x, ctx_.rng.get());
  }
  return x;
}

torch::Tensor Gpt::head_loss(const torch::Tensor& x, const torch::Tensor& targets) {
  return lm_head->loss(ln_f(x), wte->weight, targets, runtime_.loss, runtime_.loss_chunk_size);
}

torch::Tensor Gpt::hidden(const torch::Tensor& idx, const Documents& docs) {
  return ln_f(blocks(embed(idx, docs), 0, cfg_.n_layer, idx.size(1), docs));
}

torch::Tensor Gpt::loss(const torch::Tensor& idx, const torch::Tensor& targets) { return loss(idx, targets, {}); }

torch::Tensor Gpt::loss(const torch::Tensor& idx, const torch::Tensor& targets, const Documents& docs) {
  return head_loss(blocks(embed(idx, docs), 0, cfg_.n_layer, idx.size(1), docs), targets);
}

torch::Tensor Gpt::logits(const torch::Tensor& idx) { return lm_head->logits(hidden(idx), wte->weight); }

torch::Tensor Gpt::head_logits(const torch::Tensor& h) { return lm_head->logits(ln_f(h), wte->weight); }

torch::Tensor Gpt::decode_logits(const torch::Tensor& idx, common::KvCache& cache) {
  TORCH_CHECK(!ctx_.parallel(), "decode_logits: a tensor-parallel model (load it whole to generate)");
  const auto past = cache.length(), T = idx.size(1);
  TORCH_CHECK(past + T <= cfg_.block_size, "position ", past + T, " exceeds block_size ", cfg_.block_size);
  const auto pos = torch::arange(past, past + T, idx.options().dtype(torch::kLong));
  auto x = wte(idx) + wpe(pos).unsqueeze(0);
  for (size_t i = 0; i < h->size(); ++i) x = h->ptr<BlockImpl>(i)->forward_cached(x, cache, i);
  cache.advance(T);
  return lm_head->logits(ln_f(x), wte->weight);
}

double Gpt::flops_per_token(int64_t seq_len) const {
  // 6 FLOPs per parameter per token (position embeddings do no matmul), plus attention.
  const double n = static_cast<double>(cfg_.n_layer) * 12 * cfg_.n_embd * cfg_.n_embd +
                   static_cast<double>(cfg_.vocab_size) * cfg_.n_embd;
  return 6 * n + 12.0 * cfg_.n_layer * cfg_.n_embd * seq_len;
}

ModelDims Gpt::dims() const {
  return {cfg_.n_embd, cfg_.n_layer, cfg_.n_head, cfg_.n_head, 4 * cfg_.n_embd, cfg_.vocab_size, cfg_.block_size, true};
}

std::vector<HfTensor> Gpt::hf_tensors() const {
  std::vector<HfTensor> t{{"wte.weight", "transformer.wte.weight", false},
                          {"wpe.weight", "transformer.wpe.weight", false},
                          {"ln_f.weight", "transformer.ln_f.weight", false}};
  if (cfg_.bias) t.push_back({"ln_f.bias", "transformer.ln_f.bias", false});
  for (int64_t i = 0; i < cfg_.n_layer; ++i) {
    const auto ours = "h." + std::to_string(i) + ".", theirs = "transformer." + ours;
    for (const char* ln : {"ln_1", "ln_2"}) {
      t.push_back({ours + ln + ".weight", theirs + ln + ".weight", false});
      if (cfg_.bias) t.push_back({ours + ln + ".bias", theirs + ln + ".bias", false});
    }
    // GPT-2's Conv1D keeps weights as [in, out].
    for (const char* lin : {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}) {
      t.push_back({ours + lin + ".weight", theirs + lin + ".weight", true});
      if (cfg_.bias) t.push_back({ours + lin + ".bias", theirs + lin + ".bias", false});
    }
  }
  return t;
}

nlohmann::json Gpt::hf_config() const {
  return {{"architectures", {"GPT2LMHeadModel"}},
          {"model_type", "gpt2"},
          {"vocab_size", cfg_.vocab_size},
          {"n_positions", cfg_.block_size},
          {"n_embd", cfg_.n_embd},
          {"n_layer", cfg_.n_layer},
          {"n_head", cfg_.n_head},
          {"n_inner", nullptr},
          {"activation_function", "gelu"},  // nanoGPT uses exact GELU, not GPT-2's tanh form
          {"resid_pdrop", cfg_.dropout},
          {"embd_pdrop", cfg_.dropout},
          {"attn_pdrop", cfg_.dropout},
          {"layer_norm_epsilon", 1e-5},
          {"tie_word_embeddings", true},
          {"bos_token_id", nullptr},  // GPT-2's 50256 lies outside small vocabularies
          {"eos_token_id", nullptr},
          {"torch_dtype", "float32"}};
}

namespace {

std::shared_ptr<const config::ModelConfig> parse_args(config::ArgMap& a) {
  auto c = std::make_shared<GptConfig>();
  c->vocab_size = a.get_int("vocab_size", c->vocab_size, 1);
  c->block_size = a.get_int("block_size", c->block_size, 1);
  c->n_layer = a.get_int("n_layer", c->n_layer, 1);
  c->n_head = a.get_int("n_head", c->n_head, 1);
  c->n_embd = a.get_int("n_embd", c->n_embd, 1);
  c->dropout = a.get_float("dropout", c->dropout, 0.0, 1.0);
  c->bias = a.get_bool("bias", c->bias);
  if (c->n_embd % c->n_head != 0)
    a.fail("n_embd", "n_embd " + std::to_string(c->n_embd) + " is not divisible by n_head " +
                         std::to_string(c->n_head));
  return c;
}

std::shared_ptr<const config::ModelConfig> from_hf(const nlohmann::json& j) {
  auto c = std::make_shared<GptConfig>();
  c->vocab_size = j.at("vocab_size");
  c->block_size = j.value("n_positions", j.value("n_ctx", int64_t{1024}));
  c->n_layer = j.at("n_layer");
  c->n_head = j.at("n_head");
  c->n_embd = j.at("n_embd");
  c->dropout = 0.0;
  c->bias = true;  // GPT-2 always has biases
  return c;
}

}  // namespace

ModelEntry registry_entry() {
  return {"gpt", parse_args,
          nullptr,  // registry: build_sharded + fresh initialisation
          [](const config::ModelConfig& c, const common::ShardingContext& ctx) -> std::shared_ptr<CausalLM> {
            return std::make_shared<Gpt>(dynamic_cast<const GptConfig&>(c), ctx);
          },
          from_hf};
}

}  // namespace nnstrain::models::gpt
