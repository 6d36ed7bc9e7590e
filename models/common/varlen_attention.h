// Packed documents at cp 1 through flash attention's variable-length form: the
// B x T tokens packed into one [B T, H, D] run, each (batch row, document) a
// sequence of its own delimited by cumulative lengths (cu_seqlens), causal
// within it. Nothing masked is computed and no [T, T] mask is built; this is
// what Megatron's THD format and flash-attn's varlen API do.
//
// The kernel: ATen's _flash_attention_forward / _backward (CUDA, fp16 or bf16,
// head_dim a multiple of 8 up to 256, compute capability 8.0+, GQA native).
// On the CPU the same packing runs a reference: one causal SDPA per document,
// which the tests compare with the tiled document attention, so the packing,
// the lengths and the unpacking are checked where no GPU is.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <utility>

namespace nnstrain::models::common {

// Whether the CUDA varlen flash kernel takes q [B, Hq, T, D] and k [B, Hkv, T, D].
bool varlen_flash_fits(const at::Tensor& q, const at::Tensor& k);

// segments [B, T] (non-decreasing document numbers per row, any device): the
// cumulative lengths [n + 1] int32 of the n (row, document) runs in [B, T]
// order, on `device`, and the longest run.
std::pair<at::Tensor, int64_t> document_cu_seqlens(const at::Tensor& segments, const at::Device& device);

// Causal attention within each document: q [B, Hq, T, D], k, v [B, Hkv, T, D]
// (Hq a multiple of Hkv) -> [B, Hq, T, D]. CUDA: the flash kernel (callers check
// varlen_flash_fits); elsewhere the per-document reference. Differentiable.
at::Tensor varlen_document_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& segments, std::optional<double> scale = std::nullopt);

// How many varlen calls this process has made (forward), for the run's record.
int64_t varlen_attention_calls();

}  // namespace nnstrain::models::common
