// poly1 attention in its associative form on CPU: out = q (s * k^T v), O(N d^2).
//
// Per head two (forward) or four (backward) BLAS products and no intermediate
// but the small d x dv matrices, where the PyTorch form pays a dispatch and a
// fork/join per batched product.
// s (B*H) is c(n) * t per head; key padding comes as `keep` (B*H, Nk), 1 or 0,
// and zeroes the padded keys (a masked copy of each head's k, per thread).
//
// Causal (query i attends keys j <= i + offset, offset = Nk - Nq), still exact and
// linear in N: per head, queries in chunks of C rows [i0, i0 + C). The chunk's own
// keys J = [i0 + offset, i0 + offset + C) (clipped to [0, Nk)) meet it in a small
// lower-triangular C x C tile; every key before J is summed into the running state
// k^T v (d x dv), which each key enters once. The backward runs the same sweep for
// dQ and a reverse one for dK, dV, with R = sum of q^T (s dO) over the later chunks.
// s is then per row (B*H, Nq): c(n_i) * t with n_i the keys row i may attend.
#include <torch/library.h>

#include <algorithm>
#include <utility>

#include "common.h"

namespace {

using polyattn::gemm;
using polyattn::ScratchBuffers;

// Head h's keys, padded ones zeroed into `buffer` when there is a keep mask
// (selected, not multiplied: a padded key may hold inf or NaN).
template <typename T>
const T* keys_of(const T* k, const T* keep, T* buffer, int64_t h, int64_t nk, int64_t d) {
  const T* kh = k + h * nk * d;
  if (!keep) return kh;
  for (int64_t j = 0; j < nk; ++j) {
    const bool kept = keep[h * nk + j] != T(0);
    for (int64_t e = 0; e < d; ++e) buffer[j * d + e] = kept ? kh[j * d + e] : T(0);
  }
  return buffer;
}

// body(h, scratch) for every head: heads in parallel when there are enough to
// keep every thread busy, else one after the other with BLAS using the threads.
template <typename T, typename Body>
void for_each_head(int64_t bh, int64_t scratch_size, Body body) {
  const int64_t threads = at::get_num_threads();
  const bool parallel_heads = bh >= threads;
  ScratchBuffers<T> buffers(parallel_heads ? threads : 1, scratch_size);
  if (!parallel_heads) {
    for (int64_t h = 0; h < bh; ++h) body(h, buffers.get(0));
    return;
  }
  at::parallel_for(0, bh, 1, [&](int64_t begin, int64_t end) {
    T* scratch = buffers.get(at::get_thread_num());
    for (int64_t h = begin; h < end; ++h) body(h, scratch);
  });
}

void check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& keep,
           const at::Tensor& s) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "associative_cpu: q, k, v must be (B*H, N, d)");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && s.is_contiguous(),
              "associative_cpu: operands must be contiguous");
  TORCH_CHECK(s.numel() == q.size(0), "associative_cpu: s must hold one scale per head");
  TORCH_CHECK(!keep || !keep->defined() || (keep->is_contiguous() && keep->numel() == k.size(0) * k.size(1)),
              "associative_cpu: keep must be a contiguous (B*H, Nk)");
}

const void* keep_ptr(const std::optional<at::Tensor>& keep) {
  return keep && keep->defined() ? keep->data_ptr() : nullptr;
}

// Returns (out, kv) with kv = s * k^T v (B*H, d, dv), which the backward reuses.
std::tuple<at::Tensor, at::Tensor> associative_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const std::optional<at::Tensor>& keep, const at::Tensor& s) {
  check(q, k, v, keep, s);
  const int64_t bh = q.size(0), nq = q.size(1), nk = k.size(1), d = q.size(2), dv = v.size(2);
  auto out = at::empty({bh, nq, dv}, q.options()), kv = at::empty({bh, d, dv}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "associative_forward", [&] {
    using T = scalar_t;
    const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>(), *sp = s.data_ptr<T>();
    const T* kept = static_cast<const T*>(keep_ptr(keep));
    T *op = out.data_ptr<T>(), *kvp = kv.data_ptr<T>();
    for_each_head<T>(bh, kept ? nk * d : 0, [&](int64_t h, T* buffer) {
      const T* kh = keys_of(kp, kept, buffer, h, nk, d);
      gemm<T>(true, false, d, dv, nk, sp[h], kh, d, vp + h * nk * dv, dv, T(0), kvp + h * d * dv, dv);
      gemm<T>(false, false, nq, dv, d, T(1), qp + h * nq * d, d, kvp + h * d * dv, dv, T(0), op + h * nq * dv, dv);
    });
  });
  return {out, kv};
}

// Returns (dQ, dK, dV):  dQ = dO kv^T,  dkv = s q^T dO,  dK = keep * (v dkv^T),  dV = (keep * k) dkv.
std::tuple<at::Tensor, at::Tensor, at::Tensor> associative_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv, const at::Tensor& dout,
    const std::optional<at::Tensor>& keep, const at::Tensor& s) {
  check(q, k, v, keep, s);
  TORCH_CHECK(kv.is_contiguous() && dout.is_contiguous(), "associative_cpu: kv and grad_out must be contiguous");
  const int64_t bh = q.size(0), nq = q.size(1), nk = k.size(1), d = q.size(2), dv = v.size(2);
  auto dq = at::empty_like(q), dk = at::empty_like(k), dvv = at::empty_like(v);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "associative_backward", [&] {
    using T = scalar_t;
    const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>(), *sp = s.data_ptr<T>();
    const T *kvp = kv.data_ptr<T>(), *dop = dout.data_ptr<T>();
    const T* kept = static_cast<const T*>(keep_ptr(keep));
    T *dqp = dq.data_ptr<T>(), *dkp = dk.data_ptr<T>(), *dvp = dvv.data_ptr<T>();
    for_each_head<T>(bh, d * dv + (kept ? nk * d : 0), [&](int64_t h, T* dkv) {
      const T* kh = keys_of(kp, kept, dkv + d * dv, h, nk, d);
      const T *qh = qp + h * nq * d, *doh = dop + h * nq * dv;
      T* dkh = dkp + h * nk * d;
      gemm<T>(false, true, nq, d, dv, T(1), doh, dv, kvp + h * d * dv, dv, T(0), dqp + h * nq * d, d);
      gemm<T>(true, false, d, dv, nq, sp[h], qh, d, doh, dv, T(0), dkv, dv);
      gemm<T>(false, true, nk, d, dv, T(1), vp + h * nk * dv, dv, dkv, dv, T(0), dkh, d);
      gemm<T>(false, false, nk, dv, d, T(1), kh, d, dkv, dv, T(0), dvp + h * nk * dv, dv);
      if (kept) {
        for (int64_t j = 0; j < nk; ++j) {
          if (kept[h * nk + j] == T(0)) std::fill(dkh + j * d, dkh + (j + 1) * d, T(0));
        }
      }
    });
  });
  return {dq, dk, dvv};
}

// Head h's keys and values, padded ones zeroed into `buffer` (nk * (d + dv)) when there is a keep mask.
template <typename T>
std::pair<const T*, const T*> keys_values_of(const T* k, const T* v, const T* keep, T* buffer, int64_t h, int64_t nk,
                                             int64_t d, int64_t dv) {
  if (!keep) return {k + h * nk * d, v + h * nk * dv};
  const T* kh = keys_of(k, keep, buffer, h, nk, d);
  T* vbuf = buffer + nk * d;
  const T* vh = v + h * nk * dv;
  for (int64_t j = 0; j < nk; ++j) {
    const bool kept = keep[h * nk + j] != T(0);
    for (int64_t e = 0; e < dv; ++e) vbuf[j * dv + e] = kept ? vh[j * dv + e] : T(0);
  }
  return {kh, vbuf};
}

// One chunk of queries [i0, i0 + rows) of the causal sweep: its own keys [jlo, jhi) and the
// tile mask (local key c allowed for local row r iff c <= r + shift).
struct CausalChunk {
  int64_t i0, rows, jlo, jhi, shift;
  CausalChunk(int64_t i0, int64_t chunk, int64_t nq, int64_t nk, int64_t offset)
      : i0(i0), rows(std::min(chunk, nq - i0)) {
    jlo = std::max<int64_t>(0, i0 + offset);
    jhi = std::min(nk, i0 + offset + rows);
    shift = i0 + offset - jlo;
  }
  int64_t width() const { return std::max<int64_t>(0, jhi - jlo); }
  // Zero the entries of a (rows x width) tile above the causal diagonal.
  template <typename T>
  void mask(T* tile) const {
    const int64_t w = width();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t from = std::max<int64_t>(0, std::min(w, r + shift + 1));
      std::fill(tile + r * w + from, tile + (r + 1) * w, T(0));
    }
  }
};

void check_causal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& keep,
                  const at::Tensor& s, int64_t offset, int64_t chunk) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "associative_cpu: q, k, v must be (B*H, N, d)");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && s.is_contiguous(),
              "associative_cpu: operands must be contiguous");
  TORCH_CHECK(s.numel() == q.size(0) * q.size(1), "associative_cpu: causal s must hold one scale per query row");
  TORCH_CHECK(!keep || !keep->defined() || (keep->is_contiguous() && keep->numel() == k.size(0) * k.size(1)),
              "associative_cpu: keep must be a contiguous (B*H, Nk)");
  TORCH_CHECK(offset == k.size(1) - q.size(1), "associative_cpu: the causal offset must be Nk - Nq");
  TORCH_CHECK(chunk >= 1, "associative_cpu: chunk must be positive");
}

at::Tensor associative_causal_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const std::optional<at::Tensor>& keep, const at::Tensor& s, int64_t offset,
                                      int64_t chunk) {
  check_causal(q, k, v, keep, s, offset, chunk);
  const int64_t bh = q.size(0), nq = q.size(1), nk = k.size(1), d = q.size(2), dv = v.size(2);
  auto out = at::empty({bh, nq, dv}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "associative_causal_forward", [&] {
    using T = scalar_t;
    const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>(), *sp = s.data_ptr<T>();
    const T* kept = static_cast<const T*>(keep_ptr(keep));
    T* op = out.data_ptr<T>();
    for_each_head<T>(bh, d * dv + chunk * chunk + (kept ? nk * (d + dv) : 0), [&](int64_t h, T* scratch) {
      T *state = scratch, *tile = scratch + d * dv;
      const auto [kh, vh] = keys_values_of(kp, vp, kept, tile + chunk * chunk, h, nk, d, dv);
      std::fill(state, state + d * dv, T(0));
      int64_t absorbed = 0;  // keys [0, absorbed) are in the state
      for (int64_t i0 = 0; i0 < nq; i0 += chunk) {
        const CausalChunk c(i0, chunk, nq, nk, offset);
        const T* qc = qp + (h * nq + i0) * d;
        T* oc = op + (h * nq + i0) * dv;
        if (c.jlo > absorbed) {
          gemm<T>(true, false, d, dv, c.jlo - absorbed, T(1), kh + absorbed * d, d, vh + absorbed * dv, dv, T(1),
                  state, dv);
          absorbed = c.jlo;
        }
        gemm<T>(false, false, c.rows, dv, d, T(1), qc, d, state, dv, T(0), oc, dv);
        if (const int64_t w = c.width()) {
          gemm<T>(false, true, c.rows, w, d, T(1), qc, d, kh + c.jlo * d, d, T(0), tile, w);
          c.mask(tile);
          gemm<T>(false, false, c.rows, dv, w, T(1), tile, w, vh + c.jlo * dv, dv, T(1), oc, dv);
        }
        for (int64_t r = 0; r < c.rows; ++r) {
          const T scale = sp[h * nq + i0 + r];
          for (int64_t e = 0; e < dv; ++e) oc[r * dv + e] *= scale;
        }
      }
    });
  });
  return out;
}

// Returns (dQ, dK, dV) from g = s * dO (B*H, Nq, dv), the row scale already applied.
std::tuple<at::Tensor, at::Tensor, at::Tensor> associative_causal_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const std::optional<at::Tensor>& keep, int64_t offset, int64_t chunk) {
  check_causal(q, k, v, keep, at::empty({q.size(0) * q.size(1)}, q.options()), offset, chunk);
  TORCH_CHECK(g.is_contiguous() && g.size(0) == q.size(0) && g.size(1) == q.size(1) && g.size(2) == v.size(2),
              "associative_cpu: grad_out must be contiguous (B*H, Nq, dv)");
  const int64_t bh = q.size(0), nq = q.size(1), nk = k.size(1), d = q.size(2), dv = v.size(2);
  auto dq = at::empty_like(q), dk = at::empty_like(k), dvv = at::empty_like(v);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "associative_causal_backward", [&] {
    using T = scalar_t;
    const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>(), *gp = g.data_ptr<T>();
    const T* kept = static_cast<const T*>(keep_ptr(keep));
    T *dqp = dq.data_ptr<T>(), *dkp = dk.data_ptr<T>(), *dvp = dvv.data_ptr<T>();
    for_each_head<T>(bh, 2 * d * dv + 2 * chunk * chunk + (kept ? nk * (d + dv) : 0), [&](int64_t h, T* scratch) {
      T *state = scratch, *tile = scratch + d * dv, *grad_tile = tile + chunk * chunk;
      T* after = grad_tile + chunk * chunk;  // R: q^T g summed over the later chunks
      const auto [kh, vh] = keys_values_of(kp, vp, kept, after + d * dv, h, nk, d, dv);
      T *dkh = dkp + h * nk * d, *dvh = dvp + h * nk * dv;
      // dQ: the forward's sweep
      std::fill(state, state + d * dv, T(0));
      int64_t absorbed = 0;
      for (int64_t i0 = 0; i0 < nq; i0 += chunk) {
        const CausalChunk c(i0, chunk, nq, nk, offset);
        const T* gc = gp + (h * nq + i0) * dv;
        T* dqc = dqp + (h * nq + i0) * d;
        if (c.jlo > absorbed) {
          gemm<T>(true, false, d, dv, c.jlo - absorbed, T(1), kh + absorbed * d, d, vh + absorbed * dv, dv, T(1),
                  state, dv);
          absorbed = c.jlo;
        }
        gemm<T>(false, true, c.rows, d, dv, T(1), gc, dv, state, dv, T(0), dqc, d);
        if (const int64_t w = c.width()) {
          gemm<T>(false, true, c.rows, w, dv, T(1), gc, dv, vh + c.jlo * dv, dv, T(0), grad_tile, w);
          c.mask(grad_tile);
          gemm<T>(false, false, c.rows, d, w, T(1), grad_tile, w, kh + c.jlo * d, d, T(1), dqc, d);
        }
      }
      // dK, dV: the chunks in reverse; each chunk's own keys J get its tile and R of the chunks after it
      std::fill(after, after + d * dv, T(0));
      for (int64_t i0 = (nq - 1) / chunk * chunk; i0 >= 0; i0 -= chunk) {
        const CausalChunk c(i0, chunk, nq, nk, offset);
        const T *qc = qp + (h * nq + i0) * d, *gc = gp + (h * nq + i0) * dv;
        if (const int64_t w = c.width()) {
          const T *kj = kh + c.jlo * d, *vj = vh + c.jlo * dv;
          gemm<T>(false, true, c.rows, w, d, T(1), qc, d, kj, d, T(0), tile, w);
          gemm<T>(false, true, c.rows, w, dv, T(1), gc, dv, vj, dv, T(0), grad_tile, w);
          c.mask(tile);
          c.mask(grad_tile);
          gemm<T>(true, false, w, d, c.rows, T(1), grad_tile, w, qc, d, T(0), dkh + c.jlo * d, d);
          gemm<T>(false, true, w, d, dv, T(1), vj, dv, after, dv, T(1), dkh + c.jlo * d, d);
          gemm<T>(true, false, w, dv, c.rows, T(1), tile, w, gc, dv, T(0), dvh + c.jlo * dv, dv);
          gemm<T>(false, false, w, dv, d, T(1), kj, d, after, dv, T(1), dvh + c.jlo * dv, dv);
        }
        gemm<T>(true, false, d, dv, c.rows, T(1), qc, d, gc, dv, T(1), after, dv);
      }
      // the keys before the first chunk's own (the first `offset`) are read by every query
      if (const int64_t prefix = std::min(nk, std::max<int64_t>(0, offset))) {
        gemm<T>(false, true, prefix, d, dv, T(1), vh, dv, after, dv, T(0), dkh, d);
        gemm<T>(false, false, prefix, dv, d, T(1), kh, d, after, dv, T(0), dvh, dv);
      }
      if (kept) {
        for (int64_t j = 0; j < nk; ++j) {
          if (kept[h * nk + j] == T(0)) {
            std::fill(dkh + j * d, dkh + (j + 1) * d, T(0));
            std::fill(dvh + j * dv, dvh + (j + 1) * dv, T(0));
          }
        }
      }
    });
  });
  return {dq, dk, dvv};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(polyattn_cpu, m) {
  m.def("associative_forward(Tensor q, Tensor k, Tensor v, Tensor? keep, Tensor s) -> (Tensor, Tensor)");
  m.def("associative_backward(Tensor q, Tensor k, Tensor v, Tensor kv, Tensor dout, Tensor? keep, Tensor s) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("associative_causal_forward(Tensor q, Tensor k, Tensor v, Tensor? keep, Tensor s, int offset, int chunk) "
        "-> Tensor");
  m.def("associative_causal_backward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor? keep, int offset, int chunk) "
        "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(polyattn_cpu, CPU, m) {
  m.impl("associative_forward", &associative_forward);
  m.impl("associative_backward", &associative_backward);
  m.impl("associative_causal_forward", &associative_causal_forward);
  m.impl("associative_causal_backward", &associative_causal_backward);
}
