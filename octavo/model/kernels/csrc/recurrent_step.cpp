// One decode step of the recurrent layers (Gated DeltaNet, Mamba-2) for a batch of sequences,
// reading and writing each sequence's float32 state in place in its slot of the state tensor
// (octavo/model/layers/recurrent/state.py), so no state is gathered or scattered. The math and
// the op order are those of layers/recurrent/gated_delta.py's recurrent_gated_delta and
// ssd.py's recurrent_ssd, which stay the fallback; one task per (sequence, head).
#include <ATen/Parallel.h>

#include <cmath>

#include "ops.h"

namespace {

void check_f32(const at::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == dim, name,
              ": a contiguous float32 tensor of ", dim, " dimensions expected");
}

void check_slots(const at::Tensor& slots, const at::Tensor& state, int64_t batch) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == batch &&
                  slots.is_contiguous(),
              "slots: one int64 slot per sequence expected");
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < batch; ++i) {
    TORCH_CHECK(s[i] >= 0 && s[i] < state.size(0), "state slot ", s[i], " out of range [0, ",
                state.size(0), ")");
  }
}

}  // namespace

void gated_delta_step(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g, at::Tensor beta,
                      at::Tensor state, at::Tensor slots, at::Tensor out) {
  check_f32(q, 3, "q");
  check_f32(k, 3, "k");
  check_f32(v, 3, "v");
  check_f32(g, 2, "g");
  check_f32(beta, 2, "beta");
  check_f32(state, 4, "state");
  check_f32(out, 3, "out");
  const int64_t batch = q.size(0), heads = q.size(1), dk = q.size(2), dv = v.size(2);
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(0) == batch && v.size(1) == heads &&
                  g.size(0) == batch && g.size(1) == heads && beta.sizes() == g.sizes() &&
                  out.sizes() == v.sizes(),
              "gated_delta_step: q, k [B,H,dk], v, out [B,H,dv], g, beta [B,H] expected");
  TORCH_CHECK(state.size(1) == heads && state.size(2) == dk && state.size(3) == dv,
              "gated_delta_step: state [slots,H,dk,dv] expected");
  check_slots(slots, state, batch);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  float* st = state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float qscale = 1.0f / std::sqrt(static_cast<float>(dk));
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qn(dk), kn(dk), delta(dv);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      const float* qi = qp + bh * dk;
      const float* ki = kp + bh * dk;
      const float* vi = vp + bh * dv;
      float qs = 0.f, ks = 0.f;
      for (int64_t i = 0; i < dk; ++i) {
        qs += qi[i] * qi[i];
        ks += ki[i] * ki[i];
      }
      const float qr = 1.0f / std::sqrt(qs + 1e-6f), kr = 1.0f / std::sqrt(ks + 1e-6f);
      for (int64_t i = 0; i < dk; ++i) {
        qn[i] = qi[i] * qr * qscale;
        kn[i] = ki[i] * kr;
      }
      float* s = st + (sp[b] * heads + h) * dk * dv;  // [dk, dv]
      const float decay = std::exp(gp[bh]);
      for (int64_t j = 0; j < dv; ++j) delta[j] = 0.f;
      for (int64_t i = 0; i < dk; ++i) {
        float* row = s + i * dv;
        const float kk = kn[i];
        for (int64_t j = 0; j < dv; ++j) {
          row[j] *= decay;
          delta[j] += row[j] * kk;  // S^T k
        }
      }
      const float bt = bp[bh];
      for (int64_t j = 0; j < dv; ++j) delta[j] = (vi[j] - delta[j]) * bt;
      float* o = op + bh * dv;
      for (int64_t j = 0; j < dv; ++j) o[j] = 0.f;
      for (int64_t i = 0; i < dk; ++i) {
        float* row = s + i * dv;
        const float kk = kn[i], qq = qn[i];
        for (int64_t j = 0; j < dv; ++j) {
          row[j] += kk * delta[j];
          o[j] += row[j] * qq;
        }
      }
    }
  });
}

void ssd_step(at::Tensor x, at::Tensor dt, at::Tensor a, at::Tensor b, at::Tensor c,
              at::Tensor d, at::Tensor state, at::Tensor slots, at::Tensor out) {
  check_f32(x, 3, "x");
  check_f32(dt, 2, "dt");
  check_f32(a, 1, "a");
  check_f32(b, 3, "b");
  check_f32(c, 3, "c");
  check_f32(d, 1, "d");
  check_f32(state, 4, "state");
  check_f32(out, 3, "out");
  const int64_t batch = x.size(0), heads = x.size(1), hd = x.size(2);
  const int64_t groups = b.size(1), n = b.size(2);
  TORCH_CHECK(dt.size(0) == batch && dt.size(1) == heads && a.size(0) == heads &&
                  d.size(0) == heads && b.size(0) == batch && c.sizes() == b.sizes() &&
                  groups > 0 && heads % groups == 0 && out.sizes() == x.sizes(),
              "ssd_step: x, out [B,H,P], dt [B,H], a, d [H], b, c [B,G,N] expected");
  TORCH_CHECK(state.size(1) == heads && state.size(2) == hd && state.size(3) == n,
              "ssd_step: state [slots,H,P,N] expected");
  check_slots(slots, state, batch);
  const float* xp = x.data_ptr<float>();
  const float* dtp = dt.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* dp = d.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  float* st = state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t per_group = heads / groups;
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t bi = bh / heads, h = bh % heads;
      const float* bb = bp + (bi * groups + h / per_group) * n;
      const float* cc = cp + (bi * groups + h / per_group) * n;
      const float step = dtp[bh];
      const float decay = std::exp(step * ap[h]);
      const float* xi = xp + bh * hd;
      float* s = st + (sp[bi] * heads + h) * hd * n;  // [P, N]
      float* o = op + bh * hd;
      for (int64_t p = 0; p < hd; ++p) {
        float* row = s + p * n;
        const float dx = step * xi[p];
        float y = 0.f;
        for (int64_t k = 0; k < n; ++k) {
          row[k] = row[k] * decay + dx * bb[k];
          y += row[k] * cc[k];
        }
        o[p] = y + xi[p] * dp[h];
      }
    }
  });
}
