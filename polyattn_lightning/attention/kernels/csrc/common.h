// What the C++ attention kernels share: row-major GEMM on PyTorch's BLAS, and
// scratch memory.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <type_traits>

// Fortran BLAS, exported by libtorch_cpu (MKL on x86 builds).
extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
            const int*, const float*, const int*, const float*, float*, const int*);
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*,
            const int*, const double*, const int*, const double*, double*, const int*);
}

namespace polyattn {

// Row-major C (m x n) = alpha * op(A) op(B) + beta * C, through column-major BLAS
// (a row-major matrix is its column-major transpose, so A and B swap places).
// Called from inside at::parallel_for, MKL runs single-threaded.
template <typename T>
inline void gemm(bool ta, bool tb, int m, int n, int k, T alpha, const T* a, int lda, const T* b, int ldb,
                 T beta, T* c, int ldc) {
  const char ca = tb ? 'T' : 'N', cb = ta ? 'T' : 'N';
  if constexpr (std::is_same_v<T, float>) {
    sgemm_(&ca, &cb, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
  } else {
    dgemm_(&ca, &cb, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
  }
}

// `count` scratch areas (one per thread or per chunk of work), allocated up front
// as one tensor so that PyTorch's allocator (and the memory profiler) sees them.
template <typename T>
struct ScratchBuffers {
  int64_t count, size;
  at::Tensor storage;
  ScratchBuffers(int64_t count, int64_t size, bool zero = false) : count(count), size(size) {
    const auto options = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
    storage = zero ? at::zeros({count, size}, options) : at::empty({count, size}, options);
  }
  T* get(int64_t index) {
    TORCH_CHECK(index < count, "polyattn: scratch area ", index, " of ", count);
    return storage.data_ptr<T>() + index * size;
  }
};

}  // namespace polyattn
