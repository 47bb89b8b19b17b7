// octavo's compiled CPU ops (see octavo/model/cpu_ops.py).
#pragma once

#include <torch/extension.h>

#include <string>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                           c10::optional<torch::Tensor> first_pos, int64_t window,
                           double softcap);

// the decode path this build carries: "avx512", "avx2" or "portable"
std::string compiled_isa();

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);

torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                            double eps);

void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t num_heads,
           int64_t num_kv_heads, int64_t head_dim);

torch::Tensor silu_and_mul(torch::Tensor gate_up);
