// The rows kernel: y[M, N] = x[M, K] @ t[K, N] in float32 for a few rows M, t input-major (`TransposedWeight.t`),
// as an XLA FFI handler for the CPU (`MetraleRowsMatmul`, registered by `api.py`).
//
// Loop order: k outer in blocks of 4, the output columns inner in vectors of 8, every row of x inside that: each
// weight vector is loaded from memory once and used by all M rows while y (M x N floats) stays in cache, so the
// weight streams once at every M. y[m, n] is the sum over k in increasing order, one multiply-add at a time (FMA
// where the core has it), whatever M is: a row's result does not depend on the rows run with it.
// Built by `build.py` with -march=native (AVX2 + FMA where the core has them, else the same loops in scalar code).
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define METRALE_ROWS_VECTORISED 1
#else
#define METRALE_ROWS_VECTORISED 0
#endif

namespace ffi = xla::ffi;

namespace {

inline float mul_add(float a, float b, float c) {
#if METRALE_ROWS_VECTORISED
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

void rows_product(int64_t m_rows, int64_t k_dim, int64_t n_dim, const float* x, const float* t, float* y) {
  std::memset(y, 0, sizeof(float) * static_cast<size_t>(m_rows * n_dim));
  int64_t k = 0;
  for (; k + 4 <= k_dim; k += 4) {
    const float* tk = t + k * n_dim;
    int64_t n = 0;
#if METRALE_ROWS_VECTORISED
    for (; n + 8 <= n_dim; n += 8) {
      const __m256 w0 = _mm256_loadu_ps(tk + n), w1 = _mm256_loadu_ps(tk + n_dim + n);
      const __m256 w2 = _mm256_loadu_ps(tk + 2 * n_dim + n), w3 = _mm256_loadu_ps(tk + 3 * n_dim + n);
      for (int64_t m = 0; m < m_rows; m++) {
        const float* xm = x + m * k_dim + k;
        float* ym = y + m * n_dim + n;
        __m256 acc = _mm256_loadu_ps(ym);
        acc = _mm256_fmadd_ps(_mm256_broadcast_ss(xm), w0, acc);
        acc = _mm256_fmadd_ps(_mm256_broadcast_ss(xm + 1), w1, acc);
        acc = _mm256_fmadd_ps(_mm256_broadcast_ss(xm + 2), w2, acc);
        acc = _mm256_fmadd_ps(_mm256_broadcast_ss(xm + 3), w3, acc);
        _mm256_storeu_ps(ym, acc);
      }
    }
#endif
    for (; n < n_dim; n++)
      for (int64_t m = 0; m < m_rows; m++) {
        float acc = y[m * n_dim + n];
        for (int64_t j = 0; j < 4; j++) acc = mul_add(x[m * k_dim + k + j], tk[j * n_dim + n], acc);
        y[m * n_dim + n] = acc;
      }
  }
  for (; k < k_dim; k++)
    for (int64_t m = 0; m < m_rows; m++)
      for (int64_t n = 0; n < n_dim; n++) y[m * n_dim + n] = mul_add(x[m * k_dim + k], t[k * n_dim + n], y[m * n_dim + n]);
}

ffi::Error RowsMatmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> t, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto td = t.dimensions();
  if (xd.size() != 2 || td.size() != 2 || xd[1] != td[0]) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "rows kernel: x must be [M, K] and t [K, N]");
  }
  rows_product(xd[0], xd[1], td[1], x.typed_data(), t.typed_data(), y->typed_data());
  return ffi::Error::Success();
}

}  // namespace

// The two symbols the library exports (`build.py` hides every other one).
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* MetraleRowsMatmul(XLA_FFI_CallFrame* call_frame);
extern "C" __attribute__((visibility("default"))) int MetraleRowsVectorised() { return METRALE_ROWS_VECTORISED; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(MetraleRowsMatmul, RowsMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
