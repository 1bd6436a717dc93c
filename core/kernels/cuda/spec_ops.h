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
void concat_rows(const std::vector<at::Tensor>& parts, at::Tensor* out, at::Tensor* ring, const at::Tensor& pos);

}  // namespace kakeya::ops::cuda
