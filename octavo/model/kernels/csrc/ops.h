// octavo's compiled CPU ops (see octavo/model/kernels/cpu_ops.py).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Optional.h>

#include <string>
#include <vector>

// The paged KV cache's formats (octavo/model/layers/kv_quant.py): the model dtype, int8 rows
// with their fp32 scale after the values, or fp8 with a scale per KV head (k_scale / v_scale,
// [num_kv_heads] float32). The attention kernels take the format from the caches' dtype.
enum class KVKind { kPlain, kInt8, kFp8E4M3, kFp8E5M2 };

struct KVCacheFormat {
  KVKind kind;
  const float* k_scales;  // fp8: [num_kv_heads], else null
  const float* v_scales;
  at::Tensor k_hold, v_hold;  // keep the scales' fp32 copies alive
};

// the caches' format, checked against q's head_dim and dtype (kv_write.cpp)
KVCacheFormat kv_cache_format(const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const c10::optional<at::Tensor>& k_scale,
                              const c10::optional<at::Tensor>& v_scale);

// the step's K/V [T, kv_heads, head_dim] into int8 or fp8 caches at the slot mapping,
// quantized per token (kv_write.cpp; a negative slot skips its token)
void kv_write(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
              at::Tensor slot_mapping, c10::optional<at::Tensor> k_scale,
              c10::optional<at::Tensor> v_scale);

at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                           at::Tensor block_tables, at::Tensor context_lens, double scale,
                           c10::optional<at::Tensor> first_pos, int64_t window,
                           double softcap, c10::optional<at::Tensor> k_scale,
                           c10::optional<at::Tensor> v_scale);

// every prefill chunk of a step: q [T,H,D] (chunk c's rows are query_start[c]..query_start[c+1]),
// its keys at positions 0..start_pos[c]+len-1 through block_tables[c], causal inside the chunk;
// bf16_dot: bf16 takes AVX-512 bf16 dot products where the CPU has them (else widened to fp32)
at::Tensor paged_prefill(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                         at::Tensor block_tables, at::Tensor query_start, at::Tensor start_pos,
                         double scale, int64_t window, double softcap, bool bf16_dot,
                         c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale);

// whether paged_prefill's bf16 takes bf16 dot products on this CPU with this build
bool prefill_bf16_dot();

// the decode path this build carries: "avx512", "avx2" or "portable"
std::string compiled_isa();

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);

at::Tensor add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight,
                            double eps);

void rope_(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t num_heads,
           int64_t num_kv_heads, int64_t head_dim);

at::Tensor silu_and_mul(at::Tensor gate_up);

// one decode step of the recurrent layers for a batch (recurrent_step.cpp): each sequence's
// float32 state read and written in place in its slot; out is written
void gated_delta_step(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g, at::Tensor beta,
                      at::Tensor state, at::Tensor slots, at::Tensor out);
void ssd_step(at::Tensor x, at::Tensor dt, at::Tensor a, at::Tensor b, at::Tensor c,
              at::Tensor d, at::Tensor state, at::Tensor slots, at::Tensor out);

// W8A8 linear layers: per-row symmetric int8 quantization -> (q int8 [rows, cols], scale
// float32 [rows, 1]); and int32 sums -> dtype (sum * x_scale[row] * w_scale[col] + bias)
std::vector<at::Tensor> quantize_rows_int8(at::Tensor x, double qmax);

at::Tensor int8_epilogue(at::Tensor acc, at::Tensor x_scale, at::Tensor w_scale,
                         c10::optional<at::Tensor> bias, at::ScalarType dtype);

// linear layers with block-quantized weights (block_linear.cpp): kind 0 4-bit (q uint8
// [N, K/2], scale and mins float16 [N, K/group]), kind 1 8-bit (q int8 [N, K], scale);
// x [M, K] float32 or bfloat16 -> [M, N] in x's dtype; int8_activations: x quantized per
// block of 32 and integer dot products (GGUF's arithmetic), else fp32 x fp32
at::Tensor block_linear(at::Tensor x, int64_t kind, at::Tensor q, at::Tensor scale,
                        c10::optional<at::Tensor> mins, int64_t group,
                        c10::optional<at::Tensor> bias, bool int8_activations);

// whether block_linear computes batches of 17 rows or more on int8 activations (group 32) in
// its integer tiles (block_tile.h: AVX-512 VNNI; block_tile_avx2.h: the AVX2 build, and the
// AVX-512 build on a CPU without avx512_vnni); else they take the widened tiles + GEMM (Python)
bool block_int8_tiles();
// which tiles those are here: "avx512_vnni", "avx2" or "none" (the portable build)
std::string block_tiles_path();
// the AVX-512 build: whether its VNNI tiles may run (on by default; off, it takes the AVX2
// tiles, as on a CPU without avx512_vnni); returns the previous setting (false elsewhere)
bool block_tiles_set_vnni(bool enabled);

// rows [row_begin, row_end) of such a weight widened to float32 (into `out` when given)
at::Tensor block_dequantize(int64_t kind, at::Tensor q, at::Tensor scale,
                            c10::optional<at::Tensor> mins, int64_t group, int64_t row_begin,
                            int64_t row_end, c10::optional<at::Tensor> out);

// int8 x int8 -> exact int32 [M, N] = xq [M, K] . wq [N, K]^T for decode-sized M (int8_gemv.cpp):
// the same sums as torch._int_mm
at::Tensor int8_gemv(at::Tensor xq, at::Tensor wq);

// the W8A8 products: int8_gemv up to kInt8GemvRows rows (decode), oneDNN's int8 GEMM
// (at::_int_mm) above; exact either way, so the choice changes no result
constexpr int64_t kInt8GemvRows = 16;
at::Tensor int8_mm(at::Tensor xq, at::Tensor wq);

// a whole W8A8 linear layer, x [rows, K] -> x's dtype: quantize_rows_int8 (qmax 127), int8_mm,
// int8_epilogue (Int8Linear.forward and the C++ decode loop both call this)
at::Tensor int8_linear(at::Tensor x, at::Tensor wq, at::Tensor w_scale,
                       c10::optional<at::Tensor> bias);

// a linear layer of 1 to 64 rows read from oneDNN's packed weight in blocks of `block` (64 or
// 32) outputs (packed_gemv.cpp gives the layout; linear.py checks it per shape):
// x [rows, K] float32 or bfloat16 -> [rows, N]
at::Tensor packed_gemv(at::Tensor x, int64_t weight_ptr, int64_t n, int64_t k_padded,
                       c10::optional<at::Tensor> bias, int64_t block);
// the most rows of `dtype` in blocks of `block` this build gives packed_gemv in a model (0: none;
// oneDNN computes)
int64_t packed_gemv_max_rows(at::ScalarType dtype, int64_t block);
// whether this build computes `dtype` in packed_gemv on this CPU
bool packed_gemv_supports(at::ScalarType dtype);
// whether packed_gemv computes bf16 in oneDNN's AMX layout (blocks of 32) with AMX tiles here
bool packed_gemv_has_amx();
// let packed_gemv use AMX where it can (the default) or not; returns the previous setting
bool packed_gemv_set_amx(bool enabled);

// linear layers with weights in GGUF's K-quant super-blocks (kquant_linear.cpp): kind 2 Q4_K,
// 3 Q5_K, 4 Q6_K; q uint8 [N, K / 256 * bytes per super-block], the file's bytes. x [M, K]
// float32 or bfloat16 is quantized per 256 to int8 and the dot products are integer ones
at::Tensor kquant_linear(at::Tensor x, int64_t kind, at::Tensor q,
                         c10::optional<at::Tensor> bias);
// rows [row_begin, row_end) of such a weight as float32 (into `out` when given)
at::Tensor kquant_dequantize(int64_t kind, at::Tensor q, int64_t row_begin, int64_t row_end,
                             c10::optional<at::Tensor> out);
// x [M, K] as kquant_linear quantizes it: (q int8 [M, K], d float32 [M, K/256],
// sums of every 16 q int16 [M, K/16])
std::vector<at::Tensor> kquant_quantize_x(at::Tensor x);
// a K-quant weight's file super-blocks [N, K / 256 * 144 / 176 / 210] -> the in-memory layout
// kquant_linear takes (kquant_repack.cpp; kquant.py's repack)
at::Tensor kquant_repack(int64_t kind, at::Tensor raw);
// which of kquant_linear's paths runs here: "avx512_vnni" (with "+amx_int8" where prefill-sized
// batches take AMX tiles), "avx2" or "portable"
std::string kquant_kernel();
// whether kquant_linear can take AMX tiles here; let it (the default) or not, returning the
// previous setting (the tests' and benchmarks' A/B)
bool kquant_has_amx();
bool kquant_set_amx(bool enabled);
