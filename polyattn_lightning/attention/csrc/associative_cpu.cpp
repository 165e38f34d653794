// poly1 attention in its associative form on CPU: out = q (s * k^T v), O(N d^2).
//
// Per head two (forward) or four (backward) BLAS products and no intermediate
// but the small d x dv matrices, where the PyTorch form pays a dispatch and a
// fork/join per batched product.
// s (B*H) is c(n) * t per head; key padding comes as `keep` (B*H, Nk), 1 or 0,
// and zeroes the padded keys (a masked copy of each head's k, per thread).
#include <torch/library.h>

#include <algorithm>

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(polyattn_cpu, m) {
  m.def("associative_forward(Tensor q, Tensor k, Tensor v, Tensor? keep, Tensor s) -> (Tensor, Tensor)");
  m.def("associative_backward(Tensor q, Tensor k, Tensor v, Tensor kv, Tensor dout, Tensor? keep, Tensor s) "
        "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(polyattn_cpu, CPU, m) {
  m.impl("associative_forward", &associative_forward);
  m.impl("associative_backward", &associative_backward);
}
