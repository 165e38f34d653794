// Fused CPU attention for elementwise activations:
//     out = c(n) * mask(f(S + b(n) + bias)) @ v,   S = q k^T (q arrives pre-multiplied by t).
//
// Why C++: the PyTorch-level blocked kernel pays a dispatcher call, a thread
// fork/join and a pass through memory per elementwise op per tile. Here each
// thread owns a cache-resident score tile, runs the two (forward) or five
// (backward) products of a tile through BLAS and applies f, f' and the mask
// in one sweep while the tile is still in L1/L2, as SDPA's flash kernel does
// for softmax. Without softmax there is no running max, no rescaling and no
// rowsum(dO * O) term: partial products simply add.
//
// Layouts: q (BH, Nq, d), k (BH, Nk, d), v (BH, Nk, dv), all contiguous;
// row_scale / row_shift (BH, Nq); bias and the bool mask `allowed` are
// broadcastable to (B, H, Nq, Nk) and read through their strides (0 where
// they broadcast). The constant factor of f' (p for S^p) is left to the caller.
//
// Key lengths: `key_lengths` (B,) int64, optional, says that keys at or beyond
// key_lengths[b] contribute nothing to batch entry b (the caller found a key
// padding mask, see fused_cpu.py); their tiles are never computed: the key loops
// stop there, dK and dV rows beyond it stay zero. Queries are all computed.
//
// Causal: `causal` (optional int64) is the diagonal offset Nk - Nq; query i
// attends keys j <= i + causal only. Tiles wholly above the diagonal are never
// computed (the forward's key loop of a query block stops at its last row's
// reach, the backward's query loop of a key block starts at its first key's
// first reader); tiles the diagonal crosses are masked from their coordinates.
//
// Dropout: see `Dropout` below; keep decisions are a pure function of
// (seed, offset, flattened head, query, key), so the backward regenerates the
// forward's mask tile by tile and nothing of size N x N is ever stored.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "common.h"

namespace {

using polyattn::gemm;
using polyattn::ScratchBuffers;

// Activation forms, as in registry.Activation.kernel.
enum Form : int64_t { POLY = 0, RELU = 1, SOFTPLUS = 2, SIGMOID = 3 };

template <typename T>
inline T ipow(T x, int64_t p) {
  T r = x;
  for (int64_t i = 1; i < p; ++i) r *= x;
  return r;
}

// exp, log1p, |x| and max on a scalar or an at::vec::Vectorized (SIMD exp and log1p from
// PyTorch's Sleef build, by the CPU_CAPABILITY this file is compiled for).
template <typename T>
inline T exp_(T x) { return std::exp(x); }
template <typename T>
inline at::vec::Vectorized<T> exp_(at::vec::Vectorized<T> x) { return x.exp(); }
template <typename T>
inline T log1p_(T x) { return std::log1p(x); }
template <typename T>
inline at::vec::Vectorized<T> log1p_(at::vec::Vectorized<T> x) { return x.log1p(); }
template <typename T>
inline T abs_(T x) { return std::abs(x); }
template <typename T>
inline at::vec::Vectorized<T> abs_(at::vec::Vectorized<T> x) { return x.abs(); }
template <typename T>
inline T max_(T a, T b) { return a > b ? a : b; }
template <typename T>
inline at::vec::Vectorized<T> max_(at::vec::Vectorized<T> a, at::vec::Vectorized<T> b) {
  return at::vec::maximum(a, b);
}
// a where z >= 0, else b
template <typename T>
inline T if_nonnegative(T z, T a, T b) { return z >= T(0) ? a : b; }
template <typename T>
inline at::vec::Vectorized<T> if_nonnegative(at::vec::Vectorized<T> z, at::vec::Vectorized<T> a,
                                             at::vec::Vectorized<T> b) {
  return at::vec::Vectorized<T>::blendv(b, a, z >= at::vec::Vectorized<T>(0));
}

template <typename V>
inline V sigmoid(V z) {
  return V(1) / (V(1) + exp_(V(0) - z));
}

template <typename V>
inline V softplus(V z) {  // max(z, 0) + log(1 + e^-|z|): never overflows
  return max_(z, V(0)) + log1p_(exp_(V(0) - abs_(z)));
}

// (softplus(z), sigmoid(z)) from one exp: with e = e^-|z|, sigmoid is 1 / (1 + e) for z >= 0, else e / (1 + e).
template <typename V>
inline std::pair<V, V> softplus_and_grad(V z) {
  const V e = exp_(V(0) - abs_(z)), r = V(1) / (V(1) + e);
  return {max_(z, V(0)) + log1p_(e), if_nonnegative(z, r, e * r)};
}

template <typename V>
inline std::pair<V, V> sigmoid_and_grad(V z) {
  const V s = sigmoid(z);
  return {s, s - s * s};
}

// z[j] = op(z[j]) for j < n, a SIMD vector at a time, then the tail one by one.
template <typename T, typename Op>
inline void map_inplace(T* z, int64_t n, Op op) {
  using Vec = at::vec::Vectorized<T>;
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) op(Vec::loadu(z + j)).store(z + j);
  for (; j < n; ++j) z[j] = op(z[j]);
}

// (f[j], z[j]) = op(z[j]) for j < n, op returning a pair; as map_inplace.
template <typename T, typename Op>
inline void map_pair(T* z, T* f, int64_t n, Op op) {
  using Vec = at::vec::Vectorized<T>;
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    const auto [value, grad] = op(Vec::loadu(z + j));
    value.store(f + j);
    grad.store(z + j);
  }
  for (; j < n; ++j) std::tie(f[j], z[j]) = op(z[j]);
}

// f(z) over n values in place.
template <typename T>
void apply_f(T* z, int64_t n, Form form, int64_t p) {
  switch (form) {
    case POLY:
      if (p == 2) {
        for (int64_t j = 0; j < n; ++j) z[j] = z[j] * z[j];
      } else if (p == 3) {
        for (int64_t j = 0; j < n; ++j) z[j] = z[j] * z[j] * z[j];
      } else if (p > 3) {
        for (int64_t j = 0; j < n; ++j) z[j] = ipow(z[j], p);
      }
      break;
    case RELU:
      for (int64_t j = 0; j < n; ++j) z[j] = z[j] > T(0) ? z[j] : T(0);
      break;
    case SOFTPLUS:
      map_inplace(z, n, [](auto x) { return softplus(x); });
      break;
    case SIGMOID:
      map_inplace(z, n, [](auto x) { return sigmoid(x); });
      break;
  }
}

// f(z) into f and f'(z) / gain into z (gain = p for z^p, folded into the final
// gradients), over n values. For poly1 f' is 1 and z keeps S: callers skip it.
template <typename T>
void apply_f_and_grad(T* z, T* f, int64_t n, Form form, int64_t p) {
  switch (form) {
    case POLY:
      if (p == 1) {
        std::copy(z, z + n, f);
      } else if (p == 2) {
        for (int64_t j = 0; j < n; ++j) f[j] = z[j] * z[j];
      } else if (p == 3) {
        for (int64_t j = 0; j < n; ++j) {
          const T s = z[j], s2 = s * s;
          f[j] = s2 * s;
          z[j] = s2;
        }
      } else {
        for (int64_t j = 0; j < n; ++j) {
          const T g = ipow(z[j], p - 1);
          f[j] = g * z[j];
          z[j] = g;
        }
      }
      break;
    case RELU:
      for (int64_t j = 0; j < n; ++j) {
        const bool on = z[j] > T(0);
        f[j] = on ? z[j] : T(0);
        z[j] = on ? T(1) : T(0);
      }
      break;
    case SOFTPLUS:
      map_pair(z, f, n, [](auto x) { return softplus_and_grad(x); });
      break;
    case SIGMOID:
      map_pair(z, f, n, [](auto x) { return sigmoid_and_grad(x); });
      break;
  }
}

// A broadcastable 4-D (B, H, Nq, Nk) tensor read through its strides (0 where it broadcasts).
template <typename E>
struct Strided4 {
  const E* data = nullptr;
  int64_t stride[4] = {0, 0, 0, 0};
  int64_t span = 0;  // elements of the underlying storage

  Strided4(const std::optional<at::Tensor>& t, at::ScalarType dtype, const char* what) {
    if (!t || !t->defined()) return;
    TORCH_CHECK(t->dim() == 4 && t->scalar_type() == dtype, "fused_cpu: ", what, " must be a 4-D ", dtype, " tensor");
    data = t->data_ptr<E>();
    span = 1;
    for (int i = 0; i < 4; ++i) {
      stride[i] = t->stride(i);
      span += (t->size(i) - 1) * stride[i];
    }
  }
  explicit operator bool() const { return data != nullptr; }
  // Whether flattened heads of different (batch, head) read the same elements.
  bool shared_across_heads(int64_t batch, int64_t heads) const {
    return (stride[0] == 0 && batch > 1) || (stride[1] == 0 && heads > 1);
  }
  // Offset of tile row i0 (and key j0) of flattened head `bh` = b * heads + h.
  int64_t offset(int64_t bh, int64_t heads, int64_t i, int64_t j) const {
    return (bh / heads) * stride[0] + (bh % heads) * stride[1] + i * stride[2] + j * stride[3];
  }
};

// Philox4x32-10 (Salmon et al., SC'11; Random123), the same function as
// triton.language.philox(seed, c0, c1, c2, c3): key (k0, k1) = the low and high
// 32 bits of the 64-bit seed.
constexpr uint32_t PHILOX_M0 = 0xD2511F53u, PHILOX_M1 = 0xCD9E8D57u;
constexpr uint32_t PHILOX_W0 = 0x9E3779B9u, PHILOX_W1 = 0xBB67AE85u;
constexpr int PHILOX_ROUNDS = 10;
constexpr int64_t PHILOX_LANES = 64;  // counters generated per batch

inline void philox(uint32_t& c0, uint32_t& c1, uint32_t& c2, uint32_t& c3, uint32_t k0, uint32_t k1) {
  for (int r = 0; r < PHILOX_ROUNDS; ++r, k0 += PHILOX_W0, k1 += PHILOX_W1) {
    const uint64_t p0 = static_cast<uint64_t>(PHILOX_M0) * c0, p1 = static_cast<uint64_t>(PHILOX_M1) * c2;
    c0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    c1 = static_cast<uint32_t>(p1);
    c2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c3 = static_cast<uint32_t>(p0);
  }
}

// The same on SIMD registers of 32-bit lanes (compilers vectorise the scalar form
// through 64-bit lanes and shuffles, at about half this speed): the high and low
// halves of the 32 x 32 -> 64-bit products come from multiplying the even and the
// odd lanes separately.
#if defined(CPU_CAPABILITY_AVX512)
using PhiloxVec = __m512i;
constexpr int64_t PHILOX_SIMD = 16;
inline PhiloxVec philox_set1(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
inline PhiloxVec philox_iota(uint32_t x) {
  return _mm512_add_epi32(philox_set1(x), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}
inline PhiloxVec xor3(PhiloxVec a, PhiloxVec b, PhiloxVec c) { return _mm512_ternarylogic_epi32(a, b, c, 0x96); }
inline void mulhilo(PhiloxVec m, PhiloxVec c, PhiloxVec& hi, PhiloxVec& lo) {
  const PhiloxVec even = _mm512_mul_epu32(c, m), odd = _mm512_mul_epu32(_mm512_srli_epi64(c, 32), m);
  lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
  hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}
inline void philox_store(uint32_t* to, PhiloxVec x) { _mm512_storeu_si512(to, x); }
#elif defined(CPU_CAPABILITY_AVX2)
using PhiloxVec = __m256i;
constexpr int64_t PHILOX_SIMD = 8;
inline PhiloxVec philox_set1(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
inline PhiloxVec philox_iota(uint32_t x) {
  return _mm256_add_epi32(philox_set1(x), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline PhiloxVec xor3(PhiloxVec a, PhiloxVec b, PhiloxVec c) { return _mm256_xor_si256(_mm256_xor_si256(a, b), c); }
inline void mulhilo(PhiloxVec m, PhiloxVec c, PhiloxVec& hi, PhiloxVec& lo) {
  const PhiloxVec even = _mm256_mul_epu32(c, m), odd = _mm256_mul_epu32(_mm256_srli_epi64(c, 32), m);
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}
inline void philox_store(uint32_t* to, PhiloxVec x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), x); }
#else
constexpr int64_t PHILOX_SIMD = 0;  // the scalar form only
#endif

// Words of PHILOX_SIMD consecutive counters (c0 + lane, c1, c2, c3) into x0..x3.
inline void philox_lanes(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1, uint32_t* x0,
                         uint32_t* x1, uint32_t* x2, uint32_t* x3) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const PhiloxVec m0 = philox_set1(PHILOX_M0), m1 = philox_set1(PHILOX_M1);
  PhiloxVec a = philox_iota(c0), b = philox_set1(c1), c = philox_set1(c2), d = philox_set1(c3);
  for (int r = 0; r < PHILOX_ROUNDS; ++r, k0 += PHILOX_W0, k1 += PHILOX_W1) {
    PhiloxVec hi0, lo0, hi1, lo1;
    mulhilo(m0, a, hi0, lo0);
    mulhilo(m1, c, hi1, lo1);
    a = xor3(hi1, b, philox_set1(k0));
    b = lo1;
    c = xor3(hi0, d, philox_set1(k1));
    d = lo0;
  }
  philox_store(x0, a);
  philox_store(x1, b);
  philox_store(x2, c);
  philox_store(x3, d);
#endif
}

// Attention dropout without a stored mask. Entry (query i, key j) of flattened head
// bh = b * H + h is kept iff
//     philox(seed, c0 = j / 4, c1 = i, c2 = bh, c3 = offset)[j % 4] >= threshold,
//     threshold = min(floor(p * 2^32), 2^32 - 1)   (all 32-bit unsigned),
// so P(keep) = 1 - threshold / 2^32 = 1 - p to within 2^-32; the caller scales
// kept values by 1 / (1 - p). One Philox call decides four neighbouring keys.
struct Dropout {
  bool on = false;
  uint32_t k0 = 0, k1 = 0, c3 = 0, threshold = 0;

  Dropout(double p, int64_t seed, int64_t offset) {
    TORCH_CHECK(p >= 0.0 && p < 1.0, "fused_cpu: dropout_p must be in [0, 1), got ", p);
    on = p > 0.0;
    const uint64_t s = static_cast<uint64_t>(seed);
    k0 = static_cast<uint32_t>(s);
    k1 = static_cast<uint32_t>(s >> 32);
    c3 = static_cast<uint32_t>(offset);
    threshold = static_cast<uint32_t>(std::min(std::floor(p * 4294967296.0), 4294967295.0));
  }
  explicit operator bool() const { return on; }

  // Philox words for keys j0 .. j0 + cols - 1 of row i: bits[j - j0] (bits holds cols + 4).
  void row_bits(uint32_t* bits, int64_t bh, int64_t i, int64_t j0, int64_t cols) const {
    const int64_t g_first = j0 / 4, g_end = (j0 + cols + 3) / 4, skip = j0 % 4;
    for (int64_t g0 = g_first; g0 < g_end; g0 += PHILOX_LANES) {
      const int64_t lanes = std::min(PHILOX_LANES, g_end - g0);
      uint32_t x0[PHILOX_LANES], x1[PHILOX_LANES], x2[PHILOX_LANES], x3[PHILOX_LANES];
      const auto row = static_cast<uint32_t>(i), head = static_cast<uint32_t>(bh);
      int64_t t = 0;
      for (; PHILOX_SIMD && t + PHILOX_SIMD <= lanes; t += PHILOX_SIMD) {
        philox_lanes(static_cast<uint32_t>(g0 + t), row, head, c3, k0, k1, x0 + t, x1 + t, x2 + t, x3 + t);
      }
      for (; t < lanes; ++t) {
        x0[t] = static_cast<uint32_t>(g0 + t), x1[t] = row, x2[t] = head, x3[t] = c3;
        philox(x0[t], x1[t], x2[t], x3[t], k0, k1);
      }
      uint32_t words[4 * PHILOX_LANES];  // key order
      for (int64_t t = 0; t < lanes; ++t) {
        words[4 * t] = x0[t];
        words[4 * t + 1] = x1[t];
        words[4 * t + 2] = x2[t];
        words[4 * t + 3] = x3[t];
      }
      const int64_t from = g0 == g_first ? skip : 0, at = (g0 - g_first) * 4 + from - skip;
      std::copy(words + from, words + from + std::min(4 * lanes - from, cols - at), bits + at);
    }
  }

  // Zero the dropped entries of a (rows x cols) tile at (i0, j0) of head bh in each of `tiles`.
  template <typename T>
  void apply(std::initializer_list<T*> tiles, uint32_t* bits, int64_t bh, int64_t i0, int64_t j0, int64_t rows,
             int64_t cols) const {
    if (!on) return;
    for (int64_t i = 0; i < rows; ++i) {
      row_bits(bits, bh, i0 + i, j0, cols);
      for (T* tile : tiles) {
        T* z = tile + i * cols;
        for (int64_t j = 0; j < cols; ++j) z[j] = bits[j] >= threshold ? z[j] : T(0);
      }
    }
  }
};

// Everything a tile needs besides the operands.
template <typename T>
struct Problem {
  int64_t bh, heads, nq, nk, d, dv;
  Form form;
  int64_t power;
  const T* row_shift;  // (BH, Nq) or nullptr
  Strided4<T> bias;
  Strided4<bool> allowed;
  const int64_t* key_lengths;  // (B,) or nullptr: keys of batch entry b end there
  Dropout dropout;
  bool causal = false;
  int64_t causal_offset = 0;  // query i attends keys j <= i + causal_offset

  // Keys that can contribute to flattened head h: the first keys(h).
  int64_t keys(int64_t h) const { return key_lengths ? key_lengths[h / heads] : nk; }
  // Keys that queries [i0, i0 + rows) of head h can attend: the first keys_for(h, i0, rows) (may be <= 0).
  int64_t keys_for(int64_t h, int64_t i0, int64_t rows) const {
    return causal ? std::min(keys(h), i0 + rows + causal_offset) : keys(h);
  }
  // The first query that attends key j0 (0 when not causal).
  int64_t first_query(int64_t j0) const { return causal ? std::max<int64_t>(0, j0 - causal_offset) : 0; }

  // S + b(n) + bias on a (rows x cols) tile at (i0, j0) of head `h`.
  void add_score_terms(T* tile, int64_t h, int64_t i0, int64_t j0, int64_t rows, int64_t cols) const {
    for (int64_t i = 0; i < rows; ++i) {
      T* z = tile + i * cols;
      if (row_shift) {
        const T b = row_shift[h * nq + i0 + i];
        for (int64_t j = 0; j < cols; ++j) z[j] += b;
      }
      if (bias) {
        const T* row = bias.data + bias.offset(h, heads, i0 + i, j0);
        for (int64_t j = 0; j < cols; ++j) z[j] += row[j * bias.stride[3]];
      }
    }
  }

  // Zero the disallowed entries of each tile in `tiles`: the boolean mask, and the causal one.
  void mask(std::initializer_list<T*> tiles, int64_t h, int64_t i0, int64_t j0, int64_t rows, int64_t cols) const {
    if (causal && j0 + cols - 1 > i0 + causal_offset) {  // the diagonal crosses this tile
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t from = std::max<int64_t>(0, std::min(cols, i0 + i + causal_offset + 1 - j0));
        for (T* t : tiles) std::fill(t + i * cols + from, t + (i + 1) * cols, T(0));
      }
    }
    if (!allowed) return;
    for (int64_t i = 0; i < rows; ++i) {
      const bool* row = allowed.data + allowed.offset(h, heads, i0 + i, j0);
      for (int64_t j = 0; j < cols; ++j) {
        if (!row[j * allowed.stride[3]]) {
          for (T* t : tiles) t[i * cols + j] = T(0);
        }
      }
    }
  }

  // dbias += dS, into a buffer laid out like the bias storage (sums over what the bias broadcasts along).
  void add_bias_grad(T* dbias, const T* ds, int64_t h, int64_t i0, int64_t j0, int64_t rows, int64_t cols) const {
    for (int64_t i = 0; i < rows; ++i) {
      T* row = dbias + bias.offset(h, heads, i0 + i, j0);
      for (int64_t j = 0; j < cols; ++j) row[j * bias.stride[3]] += ds[i * cols + j];
    }
  }
};

template <typename T>
Problem<T> make_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t heads, int64_t form,
                        int64_t power, const std::optional<at::Tensor>& row_shift,
                        const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& allowed,
                        const std::optional<at::Tensor>& key_lengths, double dropout_p, int64_t seed,
                        int64_t offset, std::optional<int64_t> causal) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "fused_cpu: q, k, v must be (B*H, N, d)");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "fused_cpu: operands must be contiguous");
  TORCH_CHECK(form >= POLY && form <= SIGMOID && power >= 1, "fused_cpu: unknown activation form ", form);
  TORCH_CHECK(heads >= 1 && q.size(0) % heads == 0, "fused_cpu: ", q.size(0), " flattened heads for ", heads, " heads");
  const auto dtype = q.scalar_type();
  Problem<T> pb{q.size(0), heads, q.size(1), k.size(1), q.size(2), v.size(2), static_cast<Form>(form), power,
                nullptr, Strided4<T>(bias, dtype, "bias"), Strided4<bool>(allowed, at::kBool, "allowed"),
                nullptr, Dropout(dropout_p, seed, offset)};
  if (causal) {
    pb.causal = true;
    pb.causal_offset = *causal;
  }
  if (row_shift && row_shift->defined()) {
    TORCH_CHECK(row_shift->is_contiguous() && row_shift->numel() == pb.bh * pb.nq,
                "fused_cpu: row_shift must be (B*H, Nq)");
    pb.row_shift = row_shift->data_ptr<T>();
  }
  if (key_lengths && key_lengths->defined()) {
    const auto& lengths = *key_lengths;
    TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() && lengths.dim() == 1 &&
                    lengths.size(0) * heads == pb.bh,
                "fused_cpu: key_lengths must be a contiguous int64 (B,) tensor");
    pb.key_lengths = lengths.data_ptr<int64_t>();
    for (int64_t b = 0; b < lengths.size(0); ++b) {
      TORCH_CHECK(pb.key_lengths[b] >= 0 && pb.key_lengths[b] <= pb.nk, "fused_cpu: key length ",
                  pb.key_lengths[b], " of batch entry ", b, " is outside [0, ", pb.nk, "]");
    }
  }
  return pb;
}

// Items are (head, query block) pairs; at::parallel_for gives each thread a contiguous
// range. Head major, a thread's consecutive items reuse one head's K and V from cache;
// under key lengths the order is query block major, so that heads of different
// lengths (different work) are spread evenly over the threads. Causal, the query
// blocks run in the order first, last, second, second to last...: work grows with
// the block, so each pair of neighbours (and so each thread's range) holds about
// the same work.
template <typename T>
void forward_impl(const Problem<T>& pb, const T* q, const T* k, const T* v, const T* row_scale, T* out,
                  int64_t block_q, int64_t block_k) {
  const int64_t q_blocks = (pb.nq + block_q - 1) / block_q, tile_size = block_q * std::min(block_k, pb.nk);
  // per thread: the score tile, then one row of dropout words (uint32, no wider than T)
  ScratchBuffers<T> buffers(at::get_num_threads(), tile_size + (pb.dropout ? block_k + 4 : 0));
  at::parallel_for(0, pb.bh * q_blocks, 1, [&](int64_t begin, int64_t end) {
    T* tile = buffers.get(at::get_thread_num());
    auto* bits = reinterpret_cast<uint32_t*>(tile + tile_size);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = pb.key_lengths ? item % pb.bh : item / q_blocks;
      int64_t qb = pb.key_lengths ? item / pb.bh : item % q_blocks;
      if (pb.causal) qb = qb % 2 == 0 ? qb / 2 : q_blocks - 1 - qb / 2;
      const int64_t i0 = qb * block_q;
      const int64_t rows = std::min(block_q, pb.nq - i0), nk = pb.keys_for(h, i0, rows);
      const T* qi = q + (h * pb.nq + i0) * pb.d;
      T* oi = out + (h * pb.nq + i0) * pb.dv;
      for (int64_t j0 = 0; j0 < nk; j0 += block_k) {
        const int64_t cols = std::min(block_k, nk - j0);
        gemm<T>(false, true, rows, cols, pb.d, T(1), qi, pb.d, k + (h * pb.nk + j0) * pb.d, pb.d, T(0), tile,
                cols);
        pb.add_score_terms(tile, h, i0, j0, rows, cols);
        apply_f(tile, rows * cols, pb.form, pb.power);
        pb.mask({tile}, h, i0, j0, rows, cols);
        pb.dropout.apply({tile}, bits, h, i0, j0, rows, cols);
        gemm<T>(false, false, rows, pb.dv, cols, T(1), tile, cols, v + (h * pb.nk + j0) * pb.dv, pb.dv,
                j0 == 0 ? T(0) : T(1), oi, pb.dv);
      }
      for (int64_t i = 0; i < rows; ++i) {
        const T c = row_scale[h * pb.nq + i0 + i];
        for (int64_t e = 0; e < pb.dv; ++e) oi[i * pb.dv + e] *= c;
      }
    }
  });
}

// Work is split over items, one contiguous run of items per chunk (a chunk per
// thread), the runs cut where they hold equal numbers of keys (heads differ in
// length under key padding). An item is one head's key blocks and owns their
// rows of dK and dV. When there are fewer heads than threads (long sequences)
// an item is a single key block, so a head's blocks spread over chunks, and each
// chunk sums dQ for the few heads it touches in a buffer of its own; a bias
// broadcast over batch or heads (Swin's) is shared by heads, so its gradient is
// summed per chunk too. The chunks' buffers are added up at the end.
template <typename T>
void backward_impl(const Problem<T>& pb, const T* q, const T* k, const T* v, const T* dout, T* dq, T* dk, T* dv,
                   T* dbias, int64_t block_q, int64_t block_k) {
  const auto divup = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  const int64_t threads = at::get_num_threads();
  int64_t most_blocks = 0;
  for (int64_t h = 0; h < pb.bh; ++h) most_blocks = std::max(most_blocks, divup(pb.keys(h), block_k));
  const bool split_keys = pb.bh < 2 * threads && most_blocks > 1;
  struct Item {
    int64_t h, first, last;  // key blocks [first, last) of head h
  };
  std::vector<Item> items;
  std::vector<int64_t> work_before{0};  // tile area (keys x queries reached) of the items before item i
  for (int64_t h = 0; h < pb.bh; ++h) {
    const int64_t blocks = divup(pb.keys(h), block_k);
    for (int64_t kb = 0; kb < blocks; kb += split_keys ? 1 : blocks) {
      const int64_t last = split_keys ? kb + 1 : blocks;
      items.push_back({h, kb, last});
      int64_t work = 0;
      for (int64_t b = kb; b < last; ++b) {
        work += (std::min((b + 1) * block_k, pb.keys(h)) - b * block_k) * (pb.nq - pb.first_query(b * block_k));
      }
      work_before.push_back(work_before.back() + work);
    }
  }
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t chunks = std::max<int64_t>(1, std::min(n_items, threads));
  std::vector<int64_t> chunk_start(chunks + 1, n_items);  // chunk c runs items [chunk_start[c], chunk_start[c + 1])
  for (int64_t c = 0, i = 0; c < chunks; ++c) {  // cut at the item boundary nearest to c / chunks of the work
    const int64_t target = work_before[n_items] * c;
    while (i < n_items && work_before[i + 1] * chunks <= target) ++i;
    if (i < n_items && (work_before[i + 1] * chunks - target) < (target - work_before[i] * chunks)) ++i;
    chunk_start[c] = i;
  }
  const int64_t head_dq = pb.nq * pb.d;
  int64_t chunk_heads = 0;  // heads a chunk's dQ buffer holds
  if (split_keys) {
    for (int64_t c = 0; c < chunks; ++c) {
      if (chunk_start[c] < chunk_start[c + 1]) {
        chunk_heads = std::max(chunk_heads, items[chunk_start[c + 1] - 1].h - items[chunk_start[c]].h + 1);
      }
    }
  }
  // several items add into the same dbias elements: heads sharing the bias, or one head's key blocks
  // on different chunks when the bias broadcasts along keys
  const bool shared_bias = dbias && (pb.bias.shared_across_heads(pb.bh / pb.heads, pb.heads) ||
                                     (split_keys && pb.bias.stride[3] == 0));
  const int64_t tile_size = block_q * std::min(block_k, pb.nk);
  const int64_t dq_size = chunk_heads * head_dq, dbias_size = shared_bias ? pb.bias.span : 0;
  const int64_t bits_size = pb.dropout ? block_k + 4 : 0;  // a row of dropout words (uint32, no wider than T)
  ScratchBuffers<T> buffers(chunks, 3 * tile_size + dq_size + dbias_size + bits_size,
                            /*zero=*/dq_size + dbias_size > 0);
  // f' = 1 for poly1: S is not needed after f, dS is only masked. Under dropout
  // s is set to 1 instead and masked along with f, so dS *= s applies both masks.
  const bool poly1 = pb.form == POLY && pb.power == 1, linear = poly1 && !pb.dropout;
  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
      T* s = buffers.get(chunk);
      T *f = s + tile_size, *ds = f + tile_size;
      T* dbias_out = shared_bias ? ds + tile_size + dq_size : dbias;
      auto* bits = reinterpret_cast<uint32_t*>(ds + tile_size + dq_size + dbias_size);
      const int64_t begin = chunk_start[chunk], end = chunk_start[chunk + 1];
      for (int64_t index = begin; index < end; ++index) {
        const Item& item = items[index];
        const int64_t h = item.h, nk = pb.keys(h);
        // this head's dQ rows: its own in dq, or the chunk's buffer slot for it
        T* dq_h = split_keys ? ds + tile_size + (h - items[begin].h) * head_dq : dq + h * head_dq;
        for (int64_t kb = item.first; kb < item.last; ++kb) {
          const int64_t j0 = kb * block_k, cols = std::min(block_k, nk - j0);
          const T* kj = k + (h * pb.nk + j0) * pb.d;
          const T* vj = v + (h * pb.nk + j0) * pb.dv;
          T* dkj = dk + (h * pb.nk + j0) * pb.d;
          T* dvj = dv + (h * pb.nk + j0) * pb.dv;
          // causal: the query blocks before the first one that reads key j0 are skipped
          const int64_t i_first = pb.first_query(j0) / block_q * block_q;
          for (int64_t i0 = i_first; i0 < pb.nq; i0 += block_q) {
            const int64_t rows = std::min(block_q, pb.nq - i0);
            const T* qi = q + (h * pb.nq + i0) * pb.d;
            const T* doi = dout + (h * pb.nq + i0) * pb.dv;
            const T beta = i0 == i_first ? T(0) : T(1);  // dK, dV rows start at zero
            gemm<T>(false, true, rows, cols, pb.d, T(1), qi, pb.d, kj, pb.d, T(0), s, cols);
            pb.add_score_terms(s, h, i0, j0, rows, cols);
            apply_f_and_grad(s, f, rows * cols, pb.form, pb.power);
            if (poly1 && pb.dropout) std::fill(s, s + rows * cols, T(1));
            pb.mask({f, s}, h, i0, j0, rows, cols);
            pb.dropout.apply({f, s}, bits, h, i0, j0, rows, cols);
            // dV_j += f^T dO_i ;  dP = dO_i V_j^T ;  dS = dP * f'
            gemm<T>(true, false, cols, pb.dv, rows, T(1), f, cols, doi, pb.dv, beta, dvj, pb.dv);
            gemm<T>(false, true, rows, cols, pb.dv, T(1), doi, pb.dv, vj, pb.dv, T(0), ds, cols);
            if (linear) {
              pb.mask({ds}, h, i0, j0, rows, cols);
            } else {
              for (int64_t e = 0; e < rows * cols; ++e) ds[e] *= s[e];
            }
            if (dbias) pb.add_bias_grad(dbias_out, ds, h, i0, j0, rows, cols);
            // dQ_i += dS K_j ;  dK_j += dS^T Q_i
            gemm<T>(false, false, rows, pb.d, cols, T(1), ds, cols, kj, pb.d, T(1), dq_h + i0 * pb.d, pb.d);
            gemm<T>(true, false, cols, pb.d, rows, T(1), ds, cols, qi, pb.d, beta, dkj, pb.d);
          }
        }
      }
    }
  });
  if (split_keys) {  // dQ of head h = the sum over the chunks that touched it
    at::parallel_for(0, pb.bh, 1, [&](int64_t head_begin, int64_t head_end) {
      for (int64_t h = head_begin; h < head_end; ++h) {
        T* into = dq + h * head_dq;
        for (int64_t c = 0; c < chunks; ++c) {
          if (chunk_start[c] == chunk_start[c + 1]) continue;
          const int64_t first = items[chunk_start[c]].h, last = items[chunk_start[c + 1] - 1].h;
          if (h < first || h > last) continue;
          const T* part = buffers.get(c) + 3 * tile_size + (h - first) * head_dq;
          for (int64_t e = 0; e < head_dq; ++e) into[e] += part[e];
        }
      }
    });
  }
  if (shared_bias) {
    at::parallel_for(0, dbias_size, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t c = 0; c < chunks; ++c) {
        const T* part = buffers.get(c) + 3 * tile_size + dq_size;
        for (int64_t e = begin; e < end; ++e) dbias[e] += part[e];
      }
    });
  }
}

// The keep mask (BH, Nq, Nk) that Dropout draws, for tests and debugging of small shapes.
at::Tensor dropout_keep_mask(int64_t batch_heads, int64_t nq, int64_t nk, double dropout_p, int64_t seed,
                             int64_t offset) {
  const Dropout dropout(dropout_p, seed, offset);
  auto keep = at::empty({batch_heads, nq, nk}, at::kBool);
  std::vector<uint32_t> bits(nk + 4);
  bool* out = keep.data_ptr<bool>();
  for (int64_t h = 0; h < batch_heads; ++h) {
    for (int64_t i = 0; i < nq; ++i, out += nk) {
      dropout.row_bits(bits.data(), h, i, 0, nk);
      for (int64_t j = 0; j < nk; ++j) out[j] = !dropout || bits[j] >= dropout.threshold;
    }
  }
  return keep;
}

at::Tensor fused_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& row_scale,
                         const std::optional<at::Tensor>& row_shift, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& allowed, const std::optional<at::Tensor>& key_lengths,
                         int64_t heads, int64_t form, int64_t power, double dropout_p, int64_t seed, int64_t offset,
                         int64_t block_q, int64_t block_k, std::optional<int64_t> causal) {
  auto out = at::zeros({q.size(0), q.size(1), v.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "fused_forward", [&] {
    const auto pb = make_problem<scalar_t>(q, k, v, heads, form, power, row_shift, bias, allowed, key_lengths,
                                           dropout_p, seed, offset, causal);
    TORCH_CHECK(row_scale.is_contiguous() && row_scale.numel() == pb.bh * pb.nq,
                "fused_cpu: row_scale must be (B*H, Nq)");
    forward_impl<scalar_t>(pb, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                           row_scale.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), block_q, block_k);
  });
  return out;
}

// Returns (dQ, dK, dV, dbias); dbias is laid out like the bias storage and empty unless bias_grad.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout,
    const std::optional<at::Tensor>& row_shift, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& allowed, const std::optional<at::Tensor>& key_lengths, bool bias_grad,
    int64_t heads, int64_t form, int64_t power, double dropout_p, int64_t seed, int64_t offset, int64_t block_q,
    int64_t block_k, std::optional<int64_t> causal) {
  TORCH_CHECK(dout.is_contiguous() && dout.sizes() == at::IntArrayRef({q.size(0), q.size(1), v.size(2)}),
              "fused_cpu: grad_out must be contiguous (B*H, Nq, dv)");
  auto dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  at::Tensor dbias;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "fused_backward", [&] {
    const auto pb = make_problem<scalar_t>(q, k, v, heads, form, power, row_shift, bias, allowed, key_lengths,
                                           dropout_p, seed, offset, causal);
    TORCH_CHECK(!bias_grad || pb.bias, "fused_cpu: bias_grad without a bias");
    dbias = at::zeros({bias_grad ? pb.bias.span : 0}, q.options());
    backward_impl<scalar_t>(pb, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                            dout.data_ptr<scalar_t>(), dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
                            dv.data_ptr<scalar_t>(), bias_grad ? dbias.data_ptr<scalar_t>() : nullptr, block_q,
                            block_k);
  });
  return {dq, dk, dv, dbias};
}

// A KV-cache step (fused_cpu.py's `kv_step`): a few query rows attending the keys of the cache, no
// mask. Not causal: every row attends all Nk keys. Causal: the rows are the last R positions, so row r attends
// the first Nk - R + r + 1 keys (bottom-right, as everywhere here; a short prompt's prefill). c(n), b(n) are
// one number each (not causal) or one per row (causal), computed by the caller. q (B, H, R, d) and k, v
// (B, H_kv, Nk, d / dv) as Hugging Face hands them over (any strides, the last one 1); query head h reads kv
// head h / (H / H_kv), so a grouped cache is never repeated. Returns attention()'s (B, H, R, dv) in v's dtype,
// laid out in memory as HF's output (B, R, H, dv): the interface's transpose back costs no copy. Items are (batch, kv head, query row): the G = H / H_kv heads of a group form one G x n score
// block between two BLAS products, t folded into the first and c(n) into the second. The point is the call,
// not the arithmetic: one dispatcher call instead of the dozen tensor ops of the PyTorch path, which cost the
// tiny Llama's step (1 query row, some 72 keys) 3x HF's SDPA call (docs/benchmarks/generation.md). Half types run in fp32.
template <typename T>
void decode_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, Form form,
                 int64_t power, T temperature, at::ArrayRef<double> row_scale, at::ArrayRef<double> row_shift,
                 bool causal) {
  const int64_t batch = q.size(0), heads = q.size(1), rows = q.size(2), d = q.size(3);
  const int64_t kv_heads = k.size(1), nk = k.size(2), dv = v.size(3), group = heads / kv_heads;
  // BLAS wants a leading dimension of at least a row's length; a lone row's stride is never read
  const auto lead = [](const at::Tensor& t, int dim, int64_t count) {
    return static_cast<int>(count > 1 ? t.stride(dim) : std::max<int64_t>(1, t.size(3)));
  };
  const int lq = lead(q, 1, group), lk = lead(k, 2, nk), lv = lead(v, 2, nk);
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t items = batch * kv_heads * rows, work = group * nk * (d + dv);
  ScratchBuffers<T> buffers(at::get_num_threads(), group * nk);
  // threads only for long caches: below some 64 k multiply-adds an item, a fork costs more than it saves
  at::parallel_for(0, items, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, work)), [&](int64_t begin,
                                                                                            int64_t end) {
    T* scores = buffers.get(at::get_thread_num());
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (kv_heads * rows), g = item / rows % kv_heads, r = item % rows;
      const T* qi = qp + b * q.stride(0) + g * group * q.stride(1) + r * q.stride(2);
      T* oi = op + ((b * rows + r) * heads + g * group) * dv;
      const int64_t n = causal ? nk - rows + r + 1 : nk;
      const T scale = static_cast<T>(row_scale[causal ? r : 0]), shift = static_cast<T>(row_shift[causal ? r : 0]);
      if (n <= 0) {  // a causal row before the first key attends nothing
        std::fill(oi, oi + group * dv, T(0));
        continue;
      }
      gemm<T>(false, true, group, n, d, temperature, qi, lq, kp + b * k.stride(0) + g * k.stride(1), lk, T(0),
              scores, n);
      if (shift != T(0)) {
        for (int64_t j = 0; j < group * n; ++j) scores[j] += shift;
      }
      apply_f(scores, group * n, form, power);
      gemm<T>(false, false, group, dv, n, scale, scores, n, vp + b * v.stride(0) + g * v.stride(1), lv, T(0), oi,
              dv);
    }
  });
}

at::Tensor decode_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t form,
                          int64_t power, double temperature, at::ArrayRef<double> row_scale,
                          at::ArrayRef<double> row_shift, bool causal) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4,
              "decode: q, k, v must be (B, H, R, d), (B, H_kv, Nk, d), (B, H_kv, Nk, dv)");
  const int64_t batch = query.size(0), heads = query.size(1), kv_heads = key.size(1), nk = key.size(2);
  TORCH_CHECK(key.size(0) == batch && value.size(0) == batch && value.size(1) == kv_heads && value.size(2) == nk &&
                  key.size(3) == query.size(3),
              "decode: shapes ", query.sizes(), ", ", key.sizes(), ", ", value.sizes(), " do not match");
  TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0, "decode: ", heads, " query heads for ", kv_heads, " kv heads");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type(),
              "decode: q, k, v must share a dtype");
  TORCH_CHECK(form >= POLY && form <= SIGMOID && power >= 1, "decode: unknown activation form ", form);
  const size_t constants = causal ? static_cast<size_t>(query.size(2)) : 1;
  TORCH_CHECK(row_scale.size() == constants && row_shift.size() == constants, "decode: ", constants,
              " row constant(s) expected (one per row when causal, else one), got ", row_scale.size(), " and ",
              row_shift.size());
  // the compute layout: fp32 for half types; a unit last stride and rows at least a row apart (else a copy)
  const auto operand = [](const at::Tensor& t, int rows_dim) {
    at::Tensor x = at::isReducedFloatingType(t.scalar_type()) ? t.to(at::kFloat) : t;
    const bool unit = x.stride(3) == 1 || x.size(3) == 1;
    const bool apart = x.size(rows_dim) == 1 || x.stride(rows_dim) >= x.size(3);
    return unit && apart ? x : x.clone(at::MemoryFormat::Contiguous);
  };
  const at::Tensor q = operand(query, 1), k = operand(key, 2), v = operand(value, 2);
  auto out = at::empty({batch, query.size(2), heads, value.size(3)}, q.options());
  if (nk == 0 || out.numel() == 0) {
    out.zero_();
  } else {
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "decode", [&] {
      decode_impl<scalar_t>(q, k, v, out, static_cast<Form>(form), power, static_cast<scalar_t>(temperature),
                            row_scale, row_shift, causal);
    });
  }
  return (out.scalar_type() == value.scalar_type() ? out : out.to(value.scalar_type())).transpose(1, 2);
}

}  // namespace

TORCH_LIBRARY(polyattn_cpu, m) {
  m.def("forward(Tensor q, Tensor k, Tensor v, Tensor row_scale, Tensor? row_shift, Tensor? bias, Tensor? allowed, "
        "Tensor? key_lengths, int heads, int form, int power, float dropout_p, int seed, int offset, int block_q, "
        "int block_k, int? causal) -> Tensor");
  m.def("backward(Tensor q, Tensor k, Tensor v, Tensor dout, Tensor? row_shift, Tensor? bias, Tensor? allowed, "
        "Tensor? key_lengths, bool bias_grad, int heads, int form, int power, float dropout_p, int seed, int offset, "
        "int block_q, int block_k, int? causal) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("dropout_keep_mask(int batch_heads, int nq, int nk, float dropout_p, int seed, int offset) -> Tensor",
        &dropout_keep_mask);
  m.def("decode(Tensor q, Tensor k, Tensor v, int form, int power, float temperature, float[] row_scale, "
        "float[] row_shift, bool causal) -> Tensor");
}

TORCH_LIBRARY_IMPL(polyattn_cpu, CPU, m) {
  m.impl("forward", &fused_forward);
  m.impl("backward", &fused_backward);
  m.impl("decode", &decode_forward);
}
