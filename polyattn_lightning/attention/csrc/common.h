// What the C++ attention kernels share: row-major GEMM on PyTorch's BLAS, and
// per-thread scratch memory.
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

// One scratch area per thread of the intra-op pool, allocated up front as a
// tensor so that PyTorch's allocator (and the memory profiler) sees it.
template <typename T>
struct ThreadBuffers {
  int64_t threads, size;
  at::Tensor storage;
  ThreadBuffers(int64_t size_per_thread, bool zero = false)
      : threads(at::get_num_threads()), size(size_per_thread) {
    const auto options = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
    storage = zero ? at::zeros({threads, size}, options) : at::empty({threads, size}, options);
  }
  T* get(int64_t thread) {
    TORCH_CHECK(thread < threads, "polyattn: thread ", thread, " outside a pool of ", threads);
    return storage.data_ptr<T>() + thread * size;
  }
};

}  // namespace polyattn
