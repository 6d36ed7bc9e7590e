// The experts' GEMMs of a Mixture-of-Experts layer as one grouped GEMM: rows
// sorted by expert (counts[g] rows for group g, in order) times each group's
// own weight. Which implementation runs is chosen per call:
//
//   grouped_mm  at::_grouped_mm: CUDA, bf16, compute capability 9.x only (sm90: on
//               Blackwell, groups without rows get wrong weight gradients in an open
//               PyTorch report, until a device check clears it), K and N multiples
//               of 8 and every operand's pointer 16-byte aligned (its kernel's rule)
//   padded_bmm  each group's rows copied into a [G, max count, K] batch, one bmm
//               (CUDA elsewhere; on the CPU when the groups are many and small)
//   loop        one mm per group on slices of the rows (the CPU otherwise: no
//               padding copy; bench/moe_cpu.py measures them); for the experts'
//               MLP (grouped_swiglu_mlp) one autograd node writing each group's
//               gradients in place, the groups dealt to the CPU's threads
//
// With no rows at all (an expert-parallel rank nobody sent tokens to) every form
// returns a zero-row result computed from x and w, so the rank's backward still
// runs (its all-to-alls and tp all-reduces: its peers wait for them).
//
// All three are differentiable (autograd through ATen ops) and equal up to
// rounding; tests/unit/test_moe.cpp checks them against each other. Under
// NNSTRAIN_KERNELS=composite (kernels.h) Auto is the loop, the reference form.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace nnstrain::models::common::kernels {

enum class GroupedGemm { Auto, GroupedMm, PaddedBmm, Loop };

// x [M, K] (M = sum(counts)), w [G, N, K]: row block g times w[g]^T -> [M, N].
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& w, const std::vector<int64_t>& counts,
                          GroupedGemm which = GroupedGemm::Auto);

// The experts' SwiGLU MLP on rows sorted by expert: row block g through
// down[g] (silu(gate[g] x) * up[g] x). The loop runs it as one autograd node,
// group by group (each group's GEMMs while its rows are in cache; on the CPU the
// groups spread over the intra-op threads); the others as three grouped_linear.
at::Tensor grouped_swiglu_mlp(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up,
                              const at::Tensor& down, const std::vector<int64_t>& counts,
                              GroupedGemm which = GroupedGemm::Auto);

// What Auto picks for these operands (never Auto). For the experts' MLP the
// choice also checks up and down (`more`: their pointers must be aligned too).
GroupedGemm choose_grouped_gemm(const at::Tensor& x, const at::Tensor& w, const std::vector<int64_t>& counts,
                                const std::vector<const at::Tensor*>& more = {});

// Whether at::_grouped_mm takes operands with these facts: compute capability
// major 9 (sm90), bf16, K and N multiples of 8, every pointer 16-byte aligned.
// Pure, so the CPU tests check the rule the CUDA choice applies.
bool grouped_mm_fits(int cc_major, bool bf16, int64_t K, int64_t N, const std::vector<const void*>& operands);

// "grouped_mm", "padded_bmm", "loop"; the kernel the last grouped_linear call
// in this process ran ("" before any), for the run's record of what ran.
const char* grouped_gemm_name(GroupedGemm g);
std::string last_grouped_gemm();

}  // namespace nnstrain::models::common::kernels
