// Paged attention for single-token decode on CPU.
//
// Reads each sequence's past K/V straight out of its blocks (no gather copy), one work item per
// (sequence, KV head): the query heads of a GQA group share every K/V row they read, so each row
// is loaded once. Scores, softmax and the weighted sum of V accumulate in fp32, in a fixed
// order, so results do not depend on batch composition or thread count.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

template <typename T>
void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                   const int64_t* context_lens, T* out, int64_t num_seqs, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                   int64_t table_width, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row = num_kv_heads * head_dim;  // stride between slots in the cache
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t len = context_lens[b];
      const int64_t* table = block_tables + b * table_width;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          qf[g * head_dim + d] = to_f(q[(b * num_heads + h * group + g) * head_dim + d]) * scale;
      scores.assign(group * len, 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* kr = k_cache + (table[t / block_size] * block_size + t % block_size) * row +
                      h * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * to_f(kr[d]);
          scores[g * len + t] = s;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * len;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) mx = sg[t] > mx ? sg[t] : mx;
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          sg[t] = std::exp(sg[t] - mx);
          sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* vr = v_cache + (table[t / block_size] * block_size + t % block_size) * row +
                      h * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * to_f(vr[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          out[(b * num_heads + h * group + g) * head_dim + d] = static_cast<T>(acc[g * head_dim + d]);
    }
  });
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [B,H,D], cache [NB,BS,KVH,D] expected");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "contiguous tensors expected");
  block_tables = block_tables.to(torch::kInt64).contiguous();
  context_lens = context_lens.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(H % KVH == 0, "num_heads must be a multiple of num_kv_heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                            v_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int64_t>(),
                            context_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, H, KVH,
                            D, BS, block_tables.size(1), static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged attention, single-token decode (CPU)");
}
