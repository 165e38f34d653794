// Exact linear-time x^p attention on CPU (p = 2..4; p = 1, the coordinates as features, for a recurrent cache):
//
//     out_i = s_i * sum_j (q_i . k_j)^p v_j = s_i * m(q_i)^T S,    S = sum_j w * m(k_j) v_j^T   (D x dv)
//
// m(x) lists the D = C(d+p-1, p) monomials x_{e1} x_{e2} ... x_{ep} (e1 <= e2 <= ... <= ep) and w the
// multinomial count p! / alpha! of each, so (q . k)^p = sum_alpha w_alpha q^alpha k^alpha. q arrives
// pre-multiplied by the temperature t and s_i = c(n_i) is the row scale (1/sqrt(n_i) for poly{p}).
//
// Layout: q (B*Hq, Nq, d), k (B*Hkv, Nk, d), v (B*Hkv, Nk, dv), contiguous; q head h reads kv head
// h / groups (grouped-query attention: the state of a kv head is built once for its `groups` query heads).
// Key padding comes as `keep` (B*Hkv, Nk), 1 or 0: a padded key's features and value are zeroed (selected,
// so an inf there gives no NaN) and its gradients are zero.
//
// Memory: nothing of size N x D. Keys and queries go through the features in chunks of C tokens: the chunk
// is transposed to (d x C) and its features built row by row, each row a product of one earlier row and one
// coordinate (a depth-first walk over e1 <= e2 <= ..., vectorised along the C tokens), into a (D x C) block
// that meets the state in one BLAS product. Per thread: that block, the state (D x dv) and small tiles.
//
// Non-causal: the state per kv head (keys split over threads when there are fewer heads than threads, the
// partial states summed), then every query chunk in parallel. Backward: dS = sum_i m(q_i) g_i^T (g = s * dO)
// over the group's queries, then dQ = J_m(q)^T (S g^T), dV = (w m(k))^T dS, dK = J_m(k)^T (w dS v^T).
//
// Causal (query i attends keys j <= i + offset, offset = Nk - Nq): per kv head, query chunks in order, as
// in associative_cpu.cpp: the chunk's own keys meet it in a small lower-triangular (q . k)^p tile, the keys
// before them are in the running state, each key entering it once. The backward runs the same sweep for dQ
// and a reverse one for dK, dV with R = sum of m(q) g^T over the later chunks. The forward can start from a
// given state and return the final one (a recurrent cache's prefill), and `power_decode` is the one-token
// step: fold the new key into the state and read it with the new query, in one pass over the state.
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "common.h"

namespace {

using polyattn::gemm;
using polyattn::ScratchBuffers;

constexpr int64_t MAX_POWER = 4;

int64_t monomial_count(int64_t d, int64_t p) {
  int64_t count = 1;  // C(d + p - 1, p), exact at every step
  for (int64_t i = 1; i <= p; ++i) count = count * (d + i - 1) / i;
  return count;
}

// The multinomial count p! / alpha! of each monomial, in the order the walks below visit them.
std::vector<double> compute_weights(int64_t d, int64_t p);

// compute_weights, once per (d, p) per process (a decoding step would otherwise recompute D of them).
template <typename T>
std::vector<T> multinomial_weights(int64_t d, int64_t p) {
  static std::mutex mutex;
  static std::map<std::pair<int64_t, int64_t>, std::vector<double>> known;
  std::lock_guard<std::mutex> lock(mutex);
  auto found = known.find({d, p});
  if (found == known.end()) found = known.emplace(std::make_pair(d, p), compute_weights(d, p)).first;
  return std::vector<T>(found->second.begin(), found->second.end());
}

std::vector<double> compute_weights(int64_t d, int64_t p) {
  std::vector<double> weights;
  weights.reserve(monomial_count(d, p));
  std::array<int64_t, MAX_POWER> index{};
  auto visit = [&](auto&& self, int64_t level, int64_t start) -> void {
    for (int64_t e = start; e < d; ++e) {
      index[level] = e;
      if (level + 1 < p) {
        self(self, level + 1, e);
        continue;
      }
      double factorial = 1, count = 1, run = 1;  // p! / prod(multiplicity!)
      for (int64_t l = 1; l <= p; ++l) factorial *= l;
      for (int64_t l = 1; l < p; ++l) {
        run = index[l] == index[l - 1] ? run + 1 : 1;
        count *= run;
      }
      weights.push_back(factorial / count);
    }
  };
  visit(visit, 0, 0);
  return weights;
}

// The features of C tokens, transposed: x is (d x C) and `out` (D x C) gets row alpha = w_alpha * x^alpha
// (w null: 1). Depth-first over e1 <= e2 <= ...; `stack` holds (p - 2) * C partial products.
template <typename T, int L>
void expand(const T* x, int64_t c, int64_t d, int64_t start, const T* prefix, T*& out, const T*& w, T* stack) {
  for (int64_t e = start; e < d; ++e) {
    const T* xe = x + e * c;
    if constexpr (L == 1) {
      const T we = w ? *w++ : T(1);
#pragma omp simd
      for (int64_t j = 0; j < c; ++j) out[j] = we * prefix[j] * xe[j];
      out += c;
    } else {
#pragma omp simd
      for (int64_t j = 0; j < c; ++j) stack[j] = prefix[j] * xe[j];
      expand<T, L - 1>(x, c, d, e, stack, out, w, stack + c);
    }
  }
}

// The features of one token (C = 1, a decoding step): the same walk, its last loop along the coordinates.
template <typename T, int L>
void expand_row(const T* x, int64_t d, int64_t start, T prefix, T*& out, const T*& w) {
  if constexpr (L == 1) {
    const int64_t n = d - start;
    if (w) {
#pragma omp simd
      for (int64_t e = 0; e < n; ++e) out[e] = w[e] * prefix * x[start + e];
      w += n;
    } else {
#pragma omp simd
      for (int64_t e = 0; e < n; ++e) out[e] = prefix * x[start + e];
    }
    out += n;
  } else {
    for (int64_t e = start; e < d; ++e) expand_row<T, L - 1>(x, d, e, prefix * x[e], out, w);
  }
}

// dx (d x C) += J_m(x)^T g for g (D x C) the gradient of the rows `expand` writes (with the same w);
// `dprefix` += the gradient of `prefix`. `stack` holds 2 (p - 2) C. `dprefix` is never a row of dx (so
// the loops vectorise): the top level sums into a buffer of its own.
template <typename T, int L>
void expand_grad(const T* x, int64_t c, int64_t d, int64_t start, const T* prefix, const T*& g, const T*& w, T* dx,
                 T* dprefix, T* stack) {
  for (int64_t e = start; e < d; ++e) {
    const T* xe = x + e * c;
    T* dxe = dx + e * c;
    if constexpr (L == 1) {
      const T we = w ? *w++ : T(1);
#pragma omp simd
      for (int64_t j = 0; j < c; ++j) {
        const T gj = we * g[j];
        dxe[j] += gj * prefix[j];
        dprefix[j] += gj * xe[j];
      }
      g += c;
    } else {
      T *next = stack, *dnext = stack + c;
#pragma omp simd
      for (int64_t j = 0; j < c; ++j) {
        next[j] = prefix[j] * xe[j];
        dnext[j] = T(0);
      }
      expand_grad<T, L - 1>(x, c, d, e, next, g, w, dx, dnext, stack + 2 * c);
#pragma omp simd
      for (int64_t j = 0; j < c; ++j) {
        dxe[j] += dnext[j] * prefix[j];
        dprefix[j] += dnext[j] * xe[j];
      }
    }
  }
}

// What every kernel of this file needs to know about the call.
template <typename T>
struct Problem {
  int64_t bhq, bhkv, groups, nq, nk, d, dv, p, D, chunk;
  const T *q, *k, *v, *keep;
  std::vector<T> weights;

  Problem(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const std::optional<at::Tensor>& keep_,
          int64_t power, int64_t groups_, int64_t chunk_)
      : bhq(q_.size(0)), bhkv(k_.size(0)), groups(groups_), nq(q_.size(1)), nk(k_.size(1)), d(q_.size(2)),
        dv(v_.size(2)), p(power), D(monomial_count(q_.size(2), power)), chunk(chunk_), q(q_.data_ptr<T>()),
        k(k_.data_ptr<T>()), v(v_.data_ptr<T>()),
        keep(keep_ && keep_->defined() ? keep_->data_ptr<T>() : nullptr), weights(multinomial_weights<T>(d, p)) {}

  // Rows [j0, j0 + c) of a token matrix (rows x width, contiguous) transposed into `out` (width x c); with
  // `keep_row` (1 or 0 per row) the dropped rows become zeros.
  static void transpose(const T* x, int64_t width, int64_t j0, int64_t c, const T* keep_row, T* out) {
    for (int64_t j = 0; j < c; ++j) {
      const bool kept = !keep_row || keep_row[j0 + j] != T(0);
      const T* row = x + (j0 + j) * width;
      for (int64_t e = 0; e < width; ++e) out[e * c + j] = kept ? row[e] : T(0);
    }
  }
  // Rows [j0, j0 + c) of a (rows x width) matrix with the dropped ones zeroed into `out` (c x width); the rows
  // themselves when nothing is dropped.
  static const T* masked_rows(const T* x, int64_t width, int64_t j0, int64_t c, const T* keep_row, T* out) {
    if (!keep_row) return x + j0 * width;
    for (int64_t j = 0; j < c; ++j) {
      const bool kept = keep_row[j0 + j] != T(0);
      const T* row = x + (j0 + j) * width;
      for (int64_t e = 0; e < width; ++e) out[j * width + e] = kept ? row[e] : T(0);
    }
    return out;
  }
  const T* keep_of(int64_t kv) const { return keep ? keep + kv * nk : nullptr; }

  // features (D x c) of the transposed tokens xt (d x c); weighted by w for keys.
  void features(const T* xt, int64_t c, bool weighted, T* out, T* stack) const {
    const T* w = weighted ? weights.data() : nullptr;
    if (p == 1) {  // the coordinates themselves (a recurrent cache of poly1)
      std::copy(xt, xt + d * c, out);
      return;
    }
    if (c == 1) {
      for (int64_t e = 0; e < d; ++e) {
        switch (p) {
          case 2: expand_row<T, 1>(xt, d, e, xt[e], out, w); break;
          case 3: expand_row<T, 2>(xt, d, e, xt[e], out, w); break;
          default: expand_row<T, 3>(xt, d, e, xt[e], out, w); break;
        }
      }
      return;
    }
    for (int64_t e = 0; e < d; ++e) {
      const T* prefix = xt + e * c;
      switch (p) {
        case 2: expand<T, 1>(xt, c, d, e, prefix, out, w, stack); break;
        case 3: expand<T, 2>(xt, c, d, e, prefix, out, w, stack); break;
        default: expand<T, 3>(xt, c, d, e, prefix, out, w, stack); break;
      }
    }
  }
  // dxt (d x c) = J^T g, g (D x c) the features' gradient.
  void features_grad(const T* xt, int64_t c, bool weighted, const T* g, T* dxt, T* stack) const {
    const T* w = weighted ? weights.data() : nullptr;
    if (p == 1) {
      std::copy(g, g + d * c, dxt);
      return;
    }
    std::fill(dxt, dxt + d * c, T(0));
    T *dprefix = stack, *rest = stack + c;
    for (int64_t e = 0; e < d; ++e) {
      const T* prefix = xt + e * c;
      std::fill(dprefix, dprefix + c, T(0));
      switch (p) {
        case 2: expand_grad<T, 1>(xt, c, d, e, prefix, g, w, dxt, dprefix, rest); break;
        case 3: expand_grad<T, 2>(xt, c, d, e, prefix, g, w, dxt, dprefix, rest); break;
        default: expand_grad<T, 3>(xt, c, d, e, prefix, g, w, dxt, dprefix, rest); break;
      }
      T* dxe = dxt + e * c;
      for (int64_t j = 0; j < c; ++j) dxe[j] += dprefix[j];
    }
  }
  int64_t stack_size() const { return 2 * MAX_POWER * chunk; }
};

// The scratch of one thread: features (D x C), a gradient block (D x C), transposed tokens and their
// gradient (d x C each), masked rows (C x max(d, dv)) twice, two C x C tiles, the feature walk's stack.
template <typename T>
struct Scratch {
  T *features, *grad, *xt, *dxt, *rows, *rows2, *tile, *tile2, *stack;
  static int64_t size(const Problem<T>& P) {
    const int64_t c = P.chunk, width = std::max(P.d, P.dv);
    return 2 * P.D * c + 2 * P.d * c + 2 * c * width + 2 * c * c + P.stack_size();
  }
  explicit Scratch(const Problem<T>& P, T* base) {
    const int64_t c = P.chunk, width = std::max(P.d, P.dv);
    features = base;
    grad = features + P.D * c;
    xt = grad + P.D * c;
    dxt = xt + P.d * c;
    rows = dxt + P.d * c;
    rows2 = rows + c * width;
    tile = rows2 + c * width;
    tile2 = tile + c * c;
    stack = tile2 + c * c;
  }
};

// body(item, scratch) for items [0, count) in parallel, each thread with its own scratch.
template <typename T, typename Body>
void parallel_items(const Problem<T>& P, int64_t count, Body body) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count));
  ScratchBuffers<T> buffers(threads, Scratch<T>::size(P));
  if (threads == 1) {
    Scratch<T> scratch(P, buffers.get(0));
    for (int64_t i = 0; i < count; ++i) body(i, scratch);
    return;
  }
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    Scratch<T> scratch(P, buffers.get(at::get_thread_num()));
    for (int64_t i = begin; i < end; ++i) body(i, scratch);
  });
}

// acc (D x width) += sum over the tokens [j0, j1) of `x` (rows x d) of  w? m(x_j) y_j^T,  y (rows x width);
// `keep` (per row, or null) drops tokens.
template <typename T>
void accumulate_state(const Problem<T>& P, Scratch<T>& s, const T* x, const T* y, int64_t width, int64_t j0,
                      int64_t j1, const T* keep, bool weighted, T* acc) {
  for (int64_t c0 = j0; c0 < j1; c0 += P.chunk) {
    const int64_t c = std::min(P.chunk, j1 - c0);
    Problem<T>::transpose(x, P.d, c0, c, keep, s.xt);
    P.features(s.xt, c, weighted, s.features, s.stack);
    const T* yc = Problem<T>::masked_rows(y, width, c0, c, keep, s.rows);
    gemm<T>(false, false, P.D, width, c, T(1), s.features, c, yc, width, T(1), acc, width);
  }
}

// States per kv head: out[kv] = sum over the kv head's tokens of w? m(x) y^T. With `grouped` the tokens are
// those of the kv head's `groups` query heads (x, y then (B*Hq, N, .)). Tokens are split over threads when
// there are fewer heads than threads; the partial states are summed.
template <typename T>
at::Tensor states(const Problem<T>& P, const T* x, const T* y, int64_t width, int64_t n, bool grouped, bool keyed,
                  bool weighted, const at::TensorOptions& options) {
  const int64_t heads = P.bhkv, members = grouped ? P.groups : 1, rows = members * n;
  const int64_t threads = at::get_num_threads();
  const int64_t segments = heads >= threads ? 1 : std::min<int64_t>((threads + heads - 1) / heads,
                                                                    std::max<int64_t>(1, rows / P.chunk));
  auto partial = at::zeros({heads * segments, P.D, width}, options);
  T* pp = partial.template data_ptr<T>();
  const int64_t per = (rows + segments - 1) / segments;
  parallel_items<T>(P, heads * segments, [&](int64_t item, Scratch<T>& s) {
    const int64_t kv = item / segments, seg = item % segments;
    const int64_t lo = seg * per, hi = std::min(rows, lo + per);
    T* acc = pp + item * P.D * width;
    for (int64_t r0 = lo; r0 < hi;) {  // the rows of one member head at a time
      const int64_t member = r0 / n, r1 = std::min(hi, (member + 1) * n);
      const int64_t head = grouped ? kv * P.groups + member : kv;
      accumulate_state(P, s, x + head * n * P.d, y + head * n * width, width, r0 - member * n, r1 - member * n,
                       keyed ? P.keep_of(kv) : nullptr, weighted, acc);
      r0 = r1;
    }
  });
  if (segments == 1) return partial;
  return partial.view({heads, segments, P.D, width}).sum(1);
}

void check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& keep,
           int64_t power, int64_t groups, int64_t chunk) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "power_cpu: q, k, v must be (B*H, N, d)");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "power_cpu: operands must be contiguous");
  TORCH_CHECK(power >= 1 && power <= MAX_POWER, "power_cpu: the power must be 1..4, got ", power);
  TORCH_CHECK(groups >= 1 && q.size(0) == k.size(0) * groups, "power_cpu: q must have groups x k's heads");
  TORCH_CHECK(k.size(0) == v.size(0) && k.size(1) == v.size(1) && q.size(2) == k.size(2),
              "power_cpu: k, v must be (B*Hkv, Nk, d / dv) and q (B*Hq, Nq, d)");
  TORCH_CHECK(!keep || !keep->defined() || (keep->is_contiguous() && keep->numel() == k.size(0) * k.size(1)),
              "power_cpu: keep must be a contiguous (B*Hkv, Nk)");
  TORCH_CHECK(chunk >= 1, "power_cpu: chunk must be positive");
}

template <typename T>
void scale_rows(T* x, int64_t rows, int64_t width, const T* s) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t e = 0; e < width; ++e) x[r * width + e] *= s[r];
  }
}

// -------------------------------------------------------------------------------------------- non-causal

// Returns (out, state): out (B*Hq, Nq, dv), state (B*Hkv, D, dv) = sum_j w m(k_j) v_j^T.
std::tuple<at::Tensor, at::Tensor> power_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const std::optional<at::Tensor>& keep, const at::Tensor& s,
                                                 int64_t power, int64_t groups, int64_t chunk) {
  check(q, k, v, keep, power, groups, chunk);
  TORCH_CHECK(s.is_contiguous() && s.numel() == q.size(0) * q.size(1), "power_cpu: s must be (B*Hq, Nq)");
  at::Tensor out, state;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "power_forward", [&] {
    using T = scalar_t;
    const Problem<T> P(q, k, v, keep, power, groups, chunk);
    state = states<T>(P, P.k, P.v, P.dv, P.nk, false, true, true, q.options());
    out = at::empty({P.bhq, P.nq, P.dv}, q.options());
    const T *sp = s.data_ptr<T>(), *st = state.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t chunks = (P.nq + P.chunk - 1) / P.chunk;
    parallel_items<T>(P, P.bhq * chunks, [&](int64_t item, Scratch<T>& sc) {
      const int64_t h = item / chunks, i0 = (item % chunks) * P.chunk, c = std::min(P.chunk, P.nq - i0);
      Problem<T>::transpose(P.q + h * P.nq * P.d, P.d, i0, c, nullptr, sc.xt);
      P.features(sc.xt, c, false, sc.features, sc.stack);
      T* oc = op + (h * P.nq + i0) * P.dv;
      gemm<T>(true, false, c, P.dv, P.D, T(1), sc.features, c, st + (h / P.groups) * P.D * P.dv, P.dv, T(0), oc,
              P.dv);
      scale_rows(oc, c, P.dv, sp + h * P.nq + i0);
    });
  });
  return {out, state};
}

// Returns (dQ, dK, dV) from g = s * dO (B*Hq, Nq, dv) and the forward's state; dQ is for the pre-scaled q.
std::tuple<at::Tensor, at::Tensor, at::Tensor> power_backward(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& v, const at::Tensor& state,
                                                              const at::Tensor& g,
                                                              const std::optional<at::Tensor>& keep, int64_t power,
                                                              int64_t groups, int64_t chunk) {
  check(q, k, v, keep, power, groups, chunk);
  TORCH_CHECK(g.is_contiguous() && g.size(0) == q.size(0) && g.size(1) == q.size(1) && g.size(2) == v.size(2),
              "power_cpu: grad_out must be contiguous (B*Hq, Nq, dv)");
  TORCH_CHECK(state.is_contiguous(), "power_cpu: state must be contiguous");
  auto dq = at::empty_like(q), dk = at::empty_like(k), dvv = at::empty_like(v);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "power_backward", [&] {
    using T = scalar_t;
    const Problem<T> P(q, k, v, keep, power, groups, chunk);
    const T *gp = g.data_ptr<T>(), *st = state.data_ptr<T>();
    const at::Tensor dstate = states<T>(P, P.q, gp, P.dv, P.nq, true, false, false, q.options());
    const T* ds = dstate.data_ptr<T>();
    T *dqp = dq.data_ptr<T>(), *dkp = dk.data_ptr<T>(), *dvp = dvv.data_ptr<T>();
    const int64_t qchunks = (P.nq + P.chunk - 1) / P.chunk, kchunks = (P.nk + P.chunk - 1) / P.chunk;
    const int64_t q_items = P.bhq * qchunks;
    parallel_items<T>(P, q_items + P.bhkv * kchunks, [&](int64_t item, Scratch<T>& sc) {
      if (item < q_items) {  // dQ of one query chunk: J^T (S g^T)
        const int64_t h = item / qchunks, i0 = (item % qchunks) * P.chunk, c = std::min(P.chunk, P.nq - i0);
        Problem<T>::transpose(P.q + h * P.nq * P.d, P.d, i0, c, nullptr, sc.xt);
        gemm<T>(false, true, P.D, c, P.dv, T(1), st + (h / P.groups) * P.D * P.dv, P.dv, gp + (h * P.nq + i0) * P.dv,
                P.dv, T(0), sc.grad, c);
        P.features_grad(sc.xt, c, false, sc.grad, sc.dxt, sc.stack);
        T* dqc = dqp + (h * P.nq + i0) * P.d;
        for (int64_t j = 0; j < c; ++j) {
          for (int64_t e = 0; e < P.d; ++e) dqc[j * P.d + e] = sc.dxt[e * c + j];
        }
        return;
      }
      // dK, dV of one key chunk: dV = (w m(k))^T dS, dK = J^T (w dS v^T)
      item -= q_items;
      const int64_t kv = item / kchunks, j0 = (item % kchunks) * P.chunk, c = std::min(P.chunk, P.nk - j0);
      const T* keep_row = P.keep_of(kv);
      Problem<T>::transpose(P.k + kv * P.nk * P.d, P.d, j0, c, keep_row, sc.xt);
      P.features(sc.xt, c, true, sc.features, sc.stack);
      const T* dsh = ds + kv * P.D * P.dv;
      T *dvc = dvp + (kv * P.nk + j0) * P.dv, *dkc = dkp + (kv * P.nk + j0) * P.d;
      gemm<T>(true, false, c, P.dv, P.D, T(1), sc.features, c, dsh, P.dv, T(0), dvc, P.dv);
      const T* vc = Problem<T>::masked_rows(P.v + kv * P.nk * P.dv, P.dv, j0, c, keep_row, sc.rows);
      gemm<T>(false, true, P.D, c, P.dv, T(1), dsh, P.dv, vc, P.dv, T(0), sc.grad, c);
      P.features_grad(sc.xt, c, true, sc.grad, sc.dxt, sc.stack);
      for (int64_t j = 0; j < c; ++j) {
        const bool kept = !keep_row || keep_row[j0 + j] != T(0);
        for (int64_t e = 0; e < P.d; ++e) dkc[j * P.d + e] = kept ? sc.dxt[e * c + j] : T(0);
        if (!kept) std::fill(dvc + j * P.dv, dvc + (j + 1) * P.dv, T(0));
      }
    });
  });
  return {dq, dk, dvv};
}

// ------------------------------------------------------------------------------------------------ causal

// One chunk of queries [i0, i0 + rows) of the causal sweep: its own keys [jlo, jhi) and the tile mask
// (local key c allowed for local row r iff c <= r + shift), as in associative_cpu.cpp.
struct CausalChunk {
  int64_t i0, rows, jlo, jhi, shift;
  CausalChunk(int64_t i0, int64_t chunk, int64_t nq, int64_t nk, int64_t offset)
      : i0(i0), rows(std::min(chunk, nq - i0)) {
    jlo = std::max<int64_t>(0, std::min(nk, i0 + offset));
    jhi = std::max(jlo, std::min(nk, i0 + offset + rows));
    shift = i0 + offset - jlo;
  }
  int64_t width() const { return jhi - jlo; }
  bool allowed(int64_t r, int64_t col) const { return col <= r + shift; }
};

template <typename T>
T ipow(T x, int64_t p) {
  T r = T(1);
  for (int64_t i = 0; i < p; ++i) r *= x;
  return r;
}

// The chunk's tile for query head h: score = qc kj^T (rows x w) into s.tile; with `powered`, tile2 gets
// score^p masked (the forward's P).
template <typename T>
void causal_tile(const Problem<T>& P, const CausalChunk& c, const T* qc, const T* kj, Scratch<T>& s) {
  const int64_t w = c.width();
  gemm<T>(false, true, c.rows, w, P.d, T(1), qc, P.d, kj, P.d, T(0), s.tile, w);
  for (int64_t r = 0; r < c.rows; ++r) {
    for (int64_t col = 0; col < w; ++col) {
      const T x = s.tile[r * w + col];
      s.tile2[r * w + col] = c.allowed(r, col) ? ipow(x, P.p) : T(0);
    }
  }
}

// The causal sweep of kv head `kv`: query chunks in order, the keys before each chunk's own folded into `state`
// (each key once), then body(chunk, its own keys, their values) (masked copies; null when it has none).
// Returns how many keys are in the state at the end.
template <typename T, typename Body>
int64_t causal_sweep(const Problem<T>& P, Scratch<T>& sc, int64_t kv, int64_t offset, T* state, Body body) {
  const T *kh = P.k + kv * P.nk * P.d, *vh = P.v + kv * P.nk * P.dv, *keep_row = P.keep_of(kv);
  int64_t absorbed = 0;  // keys [0, absorbed) are in the state
  for (int64_t i0 = 0; i0 < P.nq; i0 += P.chunk) {
    const CausalChunk c(i0, P.chunk, P.nq, P.nk, offset);
    accumulate_state(P, sc, kh, vh, P.dv, absorbed, c.jlo, keep_row, true, state);
    absorbed = std::max(absorbed, c.jlo);
    const int64_t w = c.width();
    const T* kj = w ? Problem<T>::masked_rows(kh, P.d, c.jlo, w, keep_row, sc.rows) : nullptr;
    const T* vj = w ? Problem<T>::masked_rows(vh, P.dv, c.jlo, w, keep_row, sc.rows2) : nullptr;
    body(c, kj, vj);
  }
  return absorbed;
}

// Returns (out, state): out (B*Hq, Nq, dv); state (B*Hkv, D, dv) the state after every key (with
// `final_state`; else an empty tensor). `initial` (B*Hkv, D, dv), optional, is the state of keys before these.
std::tuple<at::Tensor, at::Tensor> power_causal_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                        const std::optional<at::Tensor>& keep, const at::Tensor& s,
                                                        int64_t power, int64_t groups, int64_t offset, int64_t chunk,
                                                        const std::optional<at::Tensor>& initial, bool final_state) {
  check(q, k, v, keep, power, groups, chunk);
  TORCH_CHECK(s.is_contiguous() && s.numel() == q.size(0) * q.size(1), "power_cpu: s must be (B*Hq, Nq)");
  TORCH_CHECK(offset == k.size(1) - q.size(1), "power_cpu: the causal offset must be Nk - Nq");
  const bool has_initial = initial && initial->defined();
  at::Tensor out, state;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "power_causal_forward", [&] {
    using T = scalar_t;
    const Problem<T> P(q, k, v, keep, power, groups, chunk);
    if (has_initial) {
      TORCH_CHECK(initial->is_contiguous() && initial->numel() == P.bhkv * P.D * P.dv,
                  "power_cpu: the initial state must be a contiguous (B*Hkv, D, dv)");
      state = initial->clone();
    } else {
      state = at::zeros({P.bhkv, P.D, P.dv}, q.options());
    }
    out = at::empty({P.bhq, P.nq, P.dv}, q.options());
    const T* sp = s.data_ptr<T>();
    T *op = out.data_ptr<T>(), *stp = state.data_ptr<T>();
    parallel_items<T>(P, P.bhkv, [&](int64_t kv, Scratch<T>& sc) {
      const T *kh = P.k + kv * P.nk * P.d, *vh = P.v + kv * P.nk * P.dv, *keep_row = P.keep_of(kv);
      T* st = stp + kv * P.D * P.dv;
      const int64_t absorbed = causal_sweep(P, sc, kv, offset, st, [&](const CausalChunk& c, const T* kj, const T* vj) {
        const int64_t w = c.width(), i0 = c.i0;
        for (int64_t member = 0; member < P.groups; ++member) {
          const int64_t h = kv * P.groups + member;
          const T* qc = P.q + (h * P.nq + i0) * P.d;
          T* oc = op + (h * P.nq + i0) * P.dv;
          Problem<T>::transpose(P.q + h * P.nq * P.d, P.d, i0, c.rows, nullptr, sc.xt);
          P.features(sc.xt, c.rows, false, sc.features, sc.stack);
          gemm<T>(true, false, c.rows, P.dv, P.D, T(1), sc.features, c.rows, st, P.dv, T(0), oc, P.dv);
          if (w) {
            causal_tile(P, c, qc, kj, sc);
            gemm<T>(false, false, c.rows, P.dv, w, T(1), sc.tile2, w, vj, P.dv, T(1), oc, P.dv);
          }
          scale_rows(oc, c.rows, P.dv, sp + h * P.nq + i0);
        }
      });
      if (final_state) accumulate_state(P, sc, kh, vh, P.dv, absorbed, P.nk, keep_row, true, st);
    });
  });
  return {out, final_state ? state : at::empty({0}, q.options())};
}

// Returns (dQ, dK, dV) from g = s * dO (B*Hq, Nq, dv); dQ is for the pre-scaled q.
std::tuple<at::Tensor, at::Tensor, at::Tensor> power_causal_backward(const at::Tensor& q, const at::Tensor& k,
                                                                     const at::Tensor& v, const at::Tensor& g,
                                                                     const std::optional<at::Tensor>& keep,
                                                                     int64_t power, int64_t groups, int64_t offset,
                                                                     int64_t chunk) {
  check(q, k, v, keep, power, groups, chunk);
  TORCH_CHECK(offset == k.size(1) - q.size(1), "power_cpu: the causal offset must be Nk - Nq");
  TORCH_CHECK(g.is_contiguous() && g.size(0) == q.size(0) && g.size(1) == q.size(1) && g.size(2) == v.size(2),
              "power_cpu: grad_out must be contiguous (B*Hq, Nq, dv)");
  auto dq = at::empty_like(q), dk = at::zeros_like(k), dvv = at::zeros_like(v);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "power_causal_backward", [&] {
    using T = scalar_t;
    const Problem<T> P(q, k, v, keep, power, groups, chunk);
    const T* gp = g.data_ptr<T>();
    T *dqp = dq.data_ptr<T>(), *dkp = dk.data_ptr<T>(), *dvp = dvv.data_ptr<T>();
    auto states_ = at::empty({at::get_num_threads(), 2, P.D, P.dv}, q.options());
    parallel_items<T>(P, P.bhkv, [&](int64_t kv, Scratch<T>& sc) {
      T* st = states_.data_ptr<T>() + at::get_thread_num() * 2 * P.D * P.dv;  // the state, then R
      T* after = st + P.D * P.dv;
      const T *kh = P.k + kv * P.nk * P.d, *vh = P.v + kv * P.nk * P.dv, *keep_row = P.keep_of(kv);
      T *dkh = dkp + kv * P.nk * P.d, *dvh = dvp + kv * P.nk * P.dv;
      // dQ: the forward's sweep
      std::fill(st, st + P.D * P.dv, T(0));
      causal_sweep(P, sc, kv, offset, st, [&](const CausalChunk& c, const T* kj, const T* vj) {
        const int64_t w = c.width(), i0 = c.i0;
        for (int64_t member = 0; member < P.groups; ++member) {
          const int64_t h = kv * P.groups + member;
          const T *qc = P.q + (h * P.nq + i0) * P.d, *gc = gp + (h * P.nq + i0) * P.dv;
          T* dqc = dqp + (h * P.nq + i0) * P.d;
          Problem<T>::transpose(P.q + h * P.nq * P.d, P.d, i0, c.rows, nullptr, sc.xt);
          gemm<T>(false, true, P.D, c.rows, P.dv, T(1), st, P.dv, gc, P.dv, T(0), sc.grad, c.rows);
          P.features_grad(sc.xt, c.rows, false, sc.grad, sc.dxt, sc.stack);
          for (int64_t r = 0; r < c.rows; ++r) {
            for (int64_t e = 0; e < P.d; ++e) dqc[r * P.d + e] = sc.dxt[e * c.rows + r];
          }
          if (w) {  // dQ += (p S^(p-1) * (g v^T)) k over the tile
            causal_tile(P, c, qc, kj, sc);
            gemm<T>(false, true, c.rows, w, P.dv, T(1), gc, P.dv, vj, P.dv, T(0), sc.tile2, w);
            for (int64_t r = 0; r < c.rows; ++r) {
              for (int64_t col = 0; col < w; ++col) {
                T& x = sc.tile2[r * w + col];
                x = c.allowed(r, col) ? T(P.p) * ipow(sc.tile[r * w + col], P.p - 1) * x : T(0);
              }
            }
            gemm<T>(false, false, c.rows, P.d, w, T(1), sc.tile2, w, kj, P.d, T(1), dqc, P.d);
          }
        }
      });
      // dK, dV: the chunks in reverse; a chunk's own keys get its tiles and R of the chunks after it
      std::fill(after, after + P.D * P.dv, T(0));
      auto from_after = [&](int64_t j0, int64_t j1) {  // dV += (w m(k))^T R, dK += J^T (w R v^T) for keys [j0, j1)
        for (int64_t c0 = j0; c0 < j1; c0 += P.chunk) {
          const int64_t n = std::min(P.chunk, j1 - c0);
          Problem<T>::transpose(kh, P.d, c0, n, keep_row, sc.xt);
          P.features(sc.xt, n, true, sc.features, sc.stack);
          gemm<T>(true, false, n, P.dv, P.D, T(1), sc.features, n, after, P.dv, T(1), dvh + c0 * P.dv, P.dv);
          const T* vc = Problem<T>::masked_rows(vh, P.dv, c0, n, keep_row, sc.rows2);
          gemm<T>(false, true, P.D, n, P.dv, T(1), after, P.dv, vc, P.dv, T(0), sc.grad, n);
          P.features_grad(sc.xt, n, true, sc.grad, sc.dxt, sc.stack);
          for (int64_t j = 0; j < n; ++j) {
            for (int64_t e = 0; e < P.d; ++e) dkh[(c0 + j) * P.d + e] += sc.dxt[e * n + j];
          }
        }
      };
      for (int64_t i0 = (P.nq - 1) / P.chunk * P.chunk; i0 >= 0; i0 -= P.chunk) {
        const CausalChunk c(i0, P.chunk, P.nq, P.nk, offset);
        const int64_t w = c.width();
        if (w) {
          from_after(c.jlo, c.jhi);
          const T* kj = Problem<T>::masked_rows(kh, P.d, c.jlo, w, keep_row, sc.rows);
          const T* vj = Problem<T>::masked_rows(vh, P.dv, c.jlo, w, keep_row, sc.rows2);
          for (int64_t member = 0; member < P.groups; ++member) {
            const int64_t h = kv * P.groups + member;
            const T *qc = P.q + (h * P.nq + i0) * P.d, *gc = gp + (h * P.nq + i0) * P.dv;
            causal_tile(P, c, qc, kj, sc);
            // dV_J += P^T g
            gemm<T>(true, false, w, P.dv, c.rows, T(1), sc.tile2, w, gc, P.dv, T(1), dvh + c.jlo * P.dv, P.dv);
            // dK_J += (p S^(p-1) * (g v^T))^T q
            gemm<T>(false, true, c.rows, w, P.dv, T(1), gc, P.dv, vj, P.dv, T(0), sc.tile2, w);
            for (int64_t r = 0; r < c.rows; ++r) {
              for (int64_t col = 0; col < w; ++col) {
                T& x = sc.tile2[r * w + col];
                x = c.allowed(r, col) ? T(P.p) * ipow(sc.tile[r * w + col], P.p - 1) * x : T(0);
              }
            }
            gemm<T>(true, false, w, P.d, c.rows, T(1), sc.tile2, w, qc, P.d, T(1), dkh + c.jlo * P.d, P.d);
          }
        }
        for (int64_t member = 0; member < P.groups; ++member) {  // R += m(q)^T g of this chunk
          const int64_t h = kv * P.groups + member;
          accumulate_state(P, sc, P.q + h * P.nq * P.d, gp + h * P.nq * P.dv, P.dv, i0, i0 + c.rows,
                           static_cast<const T*>(nullptr), false, after);
        }
      }
      // the keys before the first chunk's own (the first `offset`) are read by every query through the state
      from_after(0, std::min(P.nk, std::max<int64_t>(0, offset)));
      if (keep_row) {
        for (int64_t j = 0; j < P.nk; ++j) {
          if (keep_row[j] == T(0)) {
            std::fill(dkh + j * P.d, dkh + (j + 1) * P.d, T(0));
            std::fill(dvh + j * P.dv, dvh + (j + 1) * P.dv, T(0));
          }
        }
      }
    });
  });
  return {dq, dk, dvv};
}

// ------------------------------------------------------------------------------------------------ decode

// One pass over a kv head's state (D x dv): row a += fk[a] v (fk null: no update), then every query of the
// group reads it, acc (groups x dv) += fq[member, a] * row a. DV > 0: dv fixed at compile time, so a row is a
// few straight vector instructions and the accumulators stay in registers (a row is only 16-128 numbers:
// a loop per row costs more than its arithmetic); DV = 0: any dv.
template <typename T, int DV, int GROUPS>
void decode_pass(T* state, const T* fk, const T* v, const T* fq, T* acc, int64_t D, int64_t dv_, int64_t groups_) {
  const int64_t dv = DV ? DV : dv_, groups = GROUPS ? GROUPS : groups_;
  constexpr int64_t WIDTH = DV ? DV : 1;
  constexpr int64_t MEMBERS = GROUPS ? GROUPS : 1;
  if constexpr (DV > 0 && GROUPS > 0) {
    T sum[MEMBERS][WIDTH] = {};
    T vk[WIDTH];
    for (int64_t e = 0; e < WIDTH; ++e) vk[e] = v[e];
    for (int64_t a = 0; a < D; ++a) {
      T* row = state + a * WIDTH;
      if (fk) {
        const T f = fk[a];
#pragma omp simd
        for (int64_t e = 0; e < WIDTH; ++e) row[e] += f * vk[e];
      }
      for (int64_t member = 0; member < MEMBERS; ++member) {
        const T f = fq[member * D + a];
#pragma omp simd
        for (int64_t e = 0; e < WIDTH; ++e) sum[member][e] += f * row[e];
      }
    }
    for (int64_t member = 0; member < MEMBERS; ++member) {
      for (int64_t e = 0; e < WIDTH; ++e) acc[member * WIDTH + e] = sum[member][e];
    }
  } else {
    std::fill(acc, acc + groups * dv, T(0));
    for (int64_t a = 0; a < D; ++a) {
      T* row = state + a * dv;
      if (fk) {
        const T f = fk[a];
        for (int64_t e = 0; e < dv; ++e) row[e] += f * v[e];
      }
      for (int64_t member = 0; member < groups; ++member) {
        const T f = fq[member * D + a];
        T* o = acc + member * dv;
        for (int64_t e = 0; e < dv; ++e) o[e] += f * row[e];
      }
    }
  }
}

// decode_pass at the compiled width and group count, if there is one for (dv, groups).
template <typename T>
void decode_pass_any(T* state, const T* fk, const T* v, const T* fq, T* acc, int64_t D, int64_t dv, int64_t groups) {
#define POLYATTN_DECODE(W, G)                                             \
  if (dv == W && groups == G) {                                           \
    decode_pass<T, W, G>(state, fk, v, fq, acc, D, dv, groups);           \
    return;                                                               \
  }
  POLYATTN_DECODE(16, 1) POLYATTN_DECODE(32, 1) POLYATTN_DECODE(64, 1) POLYATTN_DECODE(128, 1)
  POLYATTN_DECODE(16, 2) POLYATTN_DECODE(32, 2) POLYATTN_DECODE(64, 2) POLYATTN_DECODE(128, 2)
  POLYATTN_DECODE(16, 4) POLYATTN_DECODE(32, 4) POLYATTN_DECODE(64, 4) POLYATTN_DECODE(128, 4)
#undef POLYATTN_DECODE
  decode_pass<T, 0, 0>(state, fk, v, fq, acc, D, dv, groups);
}

// One generation step, in place: state (B*Hkv, D, dv) += keep * w m(k) v^T and count (B*Hkv) += keep, then
// out (B*Hq, 1, dv) = c(count) * m(q)^T state, c = count^(-1/2) (`length_scale` 1), 1 / count (2) or the
// fixed `scale` (0). q (pre-multiplied by t), k, v
// are (B*H, 1, d / dv); keep (B*Hkv) is 1 or 0 (a padding token enters neither the state nor the count).
at::Tensor power_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& keep,
                        at::Tensor state, at::Tensor count, int64_t power, int64_t groups, int64_t length_scale,
                        double scale) {
  check(q, k, v, keep, power, groups, 1);
  TORCH_CHECK(q.size(1) == 1 && k.size(1) == 1, "power_decode: one token per step");
  TORCH_CHECK(state.is_contiguous() && count.is_contiguous() && count.numel() == k.size(0),
              "power_decode: state (B*Hkv, D, dv) and count (B*Hkv) must be contiguous");
  auto out = at::empty({q.size(0), 1, v.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "power_decode", [&] {
    using T = scalar_t;
    const Problem<T> P(q, k, v, keep, power, groups, 1);
    TORCH_CHECK(state.numel() == P.bhkv * P.D * P.dv, "power_decode: state must be (B*Hkv, D, dv)");
    T *stp = state.data_ptr<T>(), *cp = count.data_ptr<T>(), *op = out.data_ptr<T>();
    const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), P.bhkv));
    // per thread: the key's features (D), the group's query features (groups x D), a walk stack, the outputs
    ScratchBuffers<T> buffers(threads, (P.groups + 1) * P.D + 2 * MAX_POWER + P.groups * P.dv);
    auto head = [&](int64_t kv, T* scratch) {
      T *fk = scratch, *fq = scratch + P.D, *stack = fq + P.groups * P.D;
      const bool kept = P.keep[kv] != T(0);
      cp[kv] += kept ? T(1) : T(0);
      if (kept) P.features(P.k + kv * P.d, 1, true, fk, stack);
      for (int64_t member = 0; member < P.groups; ++member) {
        P.features(P.q + (kv * P.groups + member) * P.d, 1, false, fq + member * P.D, stack);
      }
      T* st = stp + kv * P.D * P.dv;
      const T* vk = P.v + kv * P.dv;
      T* acc = stack + 2 * MAX_POWER;
      decode_pass_any(st, kept ? fk : nullptr, vk, fq, acc, P.D, P.dv, P.groups);
      const T n = cp[kv] < T(1) ? T(1) : cp[kv];
      const T c = length_scale == 1 ? T(1) / std::sqrt(n) : length_scale == 2 ? T(1) / n : T(scale);
      for (int64_t member = 0; member < P.groups; ++member) {
        T* o = op + (kv * P.groups + member) * P.dv;
        for (int64_t e = 0; e < P.dv; ++e) o[e] = c * acc[member * P.dv + e];
      }
    };
    if (threads == 1) {
      for (int64_t kv = 0; kv < P.bhkv; ++kv) head(kv, buffers.get(0));
    } else {
      at::parallel_for(0, P.bhkv, 1, [&](int64_t begin, int64_t end) {
        for (int64_t kv = begin; kv < end; ++kv) head(kv, buffers.get(at::get_thread_num()));
      });
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(polyattn_cpu, m) {
  m.def("power_forward(Tensor q, Tensor k, Tensor v, Tensor? keep, Tensor s, int power, int groups, int chunk) "
        "-> (Tensor, Tensor)");
  m.def("power_backward(Tensor q, Tensor k, Tensor v, Tensor state, Tensor g, Tensor? keep, int power, int groups, "
        "int chunk) -> (Tensor, Tensor, Tensor)");
  m.def("power_causal_forward(Tensor q, Tensor k, Tensor v, Tensor? keep, Tensor s, int power, int groups, "
        "int offset, int chunk, Tensor? initial, bool final_state) -> (Tensor, Tensor)");
  m.def("power_causal_backward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor? keep, int power, int groups, "
        "int offset, int chunk) -> (Tensor, Tensor, Tensor)");
  m.def("power_decode(Tensor q, Tensor k, Tensor v, Tensor keep, Tensor(a!) state, Tensor(b!) count, int power, "
        "int groups, int length_scale, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(polyattn_cpu, CPU, m) {
  m.impl("power_forward", &power_forward);
  m.impl("power_backward", &power_backward);
  m.impl("power_causal_forward", &power_causal_forward);
  m.impl("power_causal_backward", &power_causal_backward);
  m.impl("power_decode", &power_decode);
}
