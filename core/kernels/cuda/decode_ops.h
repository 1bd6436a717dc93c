// at::Tensor wrappers of core/kernels/cuda/decode_kernels.cuh (CUDA builds only); the
// model calls them through core/kernels/ops.h.
#pragma once
#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "core/kernels/ops.h"

namespace kakeya::ops::cuda {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool unit_offset);
void store_positions(at::Tensor& dst, const at::Tensor& positions, int64_t ring);
std::pair<at::Tensor, at::Tensor> embed_rms_norm(const at::Tensor& table, const at::Tensor& ids,
                                                 const at::Tensor& scale, const at::Tensor& w, double eps,
                                                 bool unit_offset);
std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& x, const at::Tensor& w_post,
                                               const at::Tensor& w_next, double eps, bool unit_offset,
                                               const RowCopy* copy);
at::Tensor act_mul(const at::Tensor& gu, bool gelu_tanh);
// ops::add_rms_norm_linear for one row in one kernel; an undefined pair when the shapes or dtypes
// are not for it (the caller runs the two ops).
std::pair<at::Tensor, at::Tensor> add_rms_norm_linear(const at::Tensor& h, const at::Tensor& x, const at::Tensor& w_post,
                                                      const at::Tensor& w_next, double eps, bool unit_offset,
                                                      const Linear& lin);
void prefetch_l2(const std::vector<at::Tensor>& tensors);
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias);
at::Tensor linear_act_mul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, bool gelu_tanh);
at::Tensor qk_norm_rope_store(const at::Tensor& qkv, const at::Tensor& positions, const QKRopeArgs& a,
                              at::Tensor& k_cache, at::Tensor& v_cache);
// RestoreStore (core/kernels/ops.h): the per-layer descriptors on the device, then one launch per run
// (k_raw/v_raw undefined: copy(), every position from its layer's exact ring).
at::Tensor restore_store_descriptors(const std::vector<RestoreStore::Layer>& layers);
void restore_store(const at::Tensor& desc, const std::vector<RestoreStore::Layer>& layers, const at::Tensor& k_raw,
                   const at::Tensor& v_raw, const at::Tensor& positions);
void code_rows(at::Tensor& k, at::Tensor& v, const at::Tensor& src_slots, const at::Tensor& dst_rows, CodedSlots& to,
               int64_t sink, int64_t sink_slot0);
// ops::dequantize_rows on the device: codes [..., code_bytes] uint8, side [..., side_halves] f16 ->
// [..., D] in dtype (f32 or bf16), D = 64, 128, 256 or 512 (dequantize_rows_supported).
bool dequantize_rows_supported(int64_t D, at::ScalarType dtype);
at::Tensor dequantize_rows(const at::Tensor& codes, const at::Tensor& side, const RowCode& code, at::ScalarType dtype);
// ops::plan_experts / ops::expert_linear on the device: the int32 plan of decode_kernels.cuh from
// [P] int64 expert indices; the expert GEMV over it, or an undefined tensor when the shape is not
// for the kernel (the caller gathers).
at::Tensor expert_plan(const at::Tensor& experts, int64_t num_experts);
at::Tensor expert_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& plan, int64_t pairs, int64_t x_div,
                         int64_t most_per_expert, bool gated, bool gelu_tanh);
// ops::route_experts on the device (two launches, the plan built by the second); false when
// the shape or dtypes are not for the kernels (the caller takes the reference ops).
bool route_experts(const at::Tensor& h, const at::Tensor& scale, const at::Tensor& proj, const at::Tensor& pes,
                   int64_t top_k, double eps, ExpertRoute& out, bool with_plan);
std::pair<at::Tensor, at::Tensor> moe_residual(const at::Tensor& h, const at::Tensor& f, const at::Tensor& y,
                                               const at::Tensor& r, const MoeNorms& n, const at::Tensor& w_next,
                                               double eps, bool unit_offset, const RowCopy* copy);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_pos,
                            const at::Tensor& q_pos, int64_t window, double scale, double softcap,
                            const CopyRule& copies, const AttnTail& tail);

}  // namespace kakeya::ops::cuda
