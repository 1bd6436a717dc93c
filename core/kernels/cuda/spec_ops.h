// at::Tensor wrappers of core/kernels/cuda/spec_kernels.cuh (CUDA builds only); callers use core/kernels/ops.h.
#pragma once
#include <ATen/ATen.h>

#include <vector>

#include "core/kernels/ops.h"

namespace kakeya::ops::cuda {

void greedy_accept(const at::Tensor& scores, const at::Tensor& block, at::Tensor& report);
void argmax_rows(const at::Tensor& scores, const at::Tensor& map, at::Tensor& out);
void advance_block(const at::Tensor& report, at::Tensor& block, at::Tensor& pos0, at::Tensor& qpos,
                   const CarriedEmbedding* emb);
// ops::linear_argmax for one row in the fused kernels; false when the shapes or dtypes are not for them.
bool linear_argmax(const at::Tensor& x, const at::Tensor& w, at::Tensor& out);
// ops::linear_argmax through the head's int8 screen; false when the shapes or dtypes are not for it.
bool screened_argmax(const at::Tensor& x, const at::Tensor& w, const HeadScreen& screen, at::Tensor& out);
void advance_step(const at::Tensor& next, at::Tensor& out, at::Tensor& step, at::Tensor& cur, at::Tensor& pos);
void concat_rows(const std::vector<at::Tensor>& parts, at::Tensor* out, at::Tensor* ring, const at::Tensor& pos);

}  // namespace kakeya::ops::cuda
