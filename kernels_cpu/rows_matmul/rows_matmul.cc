// The rows kernel: y[M, N] = x[M, K] @ t[K, N] in float32 for a few rows M, t input-major (`TransposedWeight.t`),
// as an XLA FFI handler for the CPU (`MetraleRowsMatmul`, registered by `api.py`).
//
// Loop order: the rows in groups of at most 8; for each group, k in blocks of `kBlockRows`, and in each block the
// output columns in tiles of `kTileVectors` vectors held in registers for every row of the group while the block's
// weight rows stream through them (the last columns short of a vector: one masked vector). Each weight vector is
// loaded once and used by all rows of the group; y is loaded and stored once per block. y[m, n] is the sum over k
// in increasing order, one multiply-add at a time (FMA where the core has it), whatever M is and whichever group or
// tile holds it: a row's result does not depend on the rows run with it, and the AVX-512 and AVX2 builds give the
// same bits (checked at 1-32 rows on six shapes, -march=native and haswell).
// NOTE: a column panel kept in L2 while every group passes over it (for prefill's 1024 rows) measured no quicker
// at the 45 M model's [512, 1552] weight (the loop is bound by the multiply-adds, ~70 GFLOP/s on one core).
// NOTE: the software prefetch. A block reads `kBlockRows` weight rows side by side, one tile of each at a time;
// without a prefetch 4 rows read a [512, 1552] weight out of L2 at ~0.8x the rate of one row (the loads wait on
// memory between the multiply-adds), with it at ~0.98x (a C++ loop over 256 MiB of distinct weights, one core).
// The last tiles prefetch past the end of their row or of the weight: harmless, a prefetch never faults.
// Built by `build.py` with -march=native (AVX-512 or AVX2 + FMA where the core has them, else scalar loops).
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

constexpr int64_t kBlockRows = 16;   // weight rows (k) of a block
constexpr int64_t kGroupRows = 8;    // rows of x run together
constexpr int64_t kPrefetchTiles = 2;  // how many tiles ahead each weight row is prefetched

#if METRALE_ROWS_VECTORISED
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kLanes = 16;
constexpr int kTileVectors = 4;  // accumulators: 4 rows x 4 vectors or 8 x 2; with the weights' at most 20 of 32 registers
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec broadcast(const float* p) { return _mm512_set1_ps(*p); }
using Mask = __mmask16;
inline Mask first_lanes(int64_t count) { return static_cast<Mask>((1u << count) - 1u); }
inline Vec load_masked(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
inline void store_masked(float* p, Vec v, Mask m) { _mm512_mask_storeu_ps(p, m, v); }
#else
using Vec = __m256;
constexpr int64_t kLanes = 8;
constexpr int kTileVectors = 2;  // accumulators: 4 rows x 2 vectors or 8 x 1; with the weights' at most 11 of 16 registers
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec broadcast(const float* p) { return _mm256_broadcast_ss(p); }
using Mask = __m256i;
inline Mask first_lanes(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Vec load_masked(const float* p, Mask m) { return _mm256_maskload_ps(p, m); }
inline void store_masked(float* p, Vec v, Mask m) { _mm256_maskstore_ps(p, m, v); }
#endif

// Rows 0..M-1, block rows k0..k1-1, columns n..n + V * kLanes - 1.
template <int M, int V>
inline void tile(int64_t k0, int64_t k1, int64_t k_dim, int64_t n_dim, const float* x, const float* t, float* y,
                 int64_t n) {
  Vec acc[M][V];
  for (int m = 0; m < M; m++)
    for (int v = 0; v < V; v++) acc[m][v] = load(y + m * n_dim + n + v * kLanes);
  for (int64_t k = k0; k < k1; k++) {
    const float* tk = t + k * n_dim + n;
    Vec w[V];
    for (int v = 0; v < V; v++) w[v] = load(tk + v * kLanes);
    for (int v = 0; v < V; v++) _mm_prefetch(reinterpret_cast<const char*>(tk + (kPrefetchTiles * V + v) * kLanes), _MM_HINT_T0);
    for (int m = 0; m < M; m++) {
      const Vec b = broadcast(x + m * k_dim + k);
      for (int v = 0; v < V; v++) acc[m][v] = fma(b, w[v], acc[m][v]);
    }
  }
  for (int m = 0; m < M; m++)
    for (int v = 0; v < V; v++) store(y + m * n_dim + n + v * kLanes, acc[m][v]);
}

// Rows 0..M-1, block rows k0..k1-1, the last `count` (< kLanes) columns from n: `tile<M, 1>` on the lanes a mask
// keeps (the others load zeros and are not stored), the same multiply-adds per element as the full tiles.
template <int M>
inline void tail_tile(int64_t k0, int64_t k1, int64_t k_dim, int64_t n_dim, const float* x, const float* t, float* y,
                      int64_t n, int64_t count) {
  const Mask keep = first_lanes(count);
  Vec acc[M];
  for (int m = 0; m < M; m++) acc[m] = load_masked(y + m * n_dim + n, keep);
  for (int64_t k = k0; k < k1; k++) {
    const Vec w = load_masked(t + k * n_dim + n, keep);
    for (int m = 0; m < M; m++) acc[m] = fma(broadcast(x + m * k_dim + k), w, acc[m]);
  }
  for (int m = 0; m < M; m++) store_masked(y + m * n_dim + n, acc[m], keep);
}
#endif

// Rows 0..M-1 of a group, columns n_begin..n_end - 1: V vectors a tile where every row's accumulators fit the
// registers.
template <int M>
void group_product(int64_t k_dim, int64_t n_dim, const float* x, const float* t, float* y, int64_t n_begin,
                   int64_t n_end) {
#if METRALE_ROWS_VECTORISED
  constexpr int V = M <= 4 ? kTileVectors : kTileVectors / 2;
#endif
  for (int64_t k0 = 0; k0 < k_dim; k0 += kBlockRows) {
    const int64_t k1 = k0 + kBlockRows < k_dim ? k0 + kBlockRows : k_dim;
    int64_t n = n_begin;
#if METRALE_ROWS_VECTORISED
    for (; n + V * kLanes <= n_end; n += V * kLanes) tile<M, V>(k0, k1, k_dim, n_dim, x, t, y, n);
    for (; n + kLanes <= n_end; n += kLanes) tile<M, 1>(k0, k1, k_dim, n_dim, x, t, y, n);
    if (n < n_end) tail_tile<M>(k0, k1, k_dim, n_dim, x, t, y, n, n_end - n);
#else
    for (; n < n_end; n++)
      for (int64_t m = 0; m < M; m++) {
        float acc = y[m * n_dim + n];
        for (int64_t k = k0; k < k1; k++) acc = mul_add(x[m * k_dim + k], t[k * n_dim + n], acc);
        y[m * n_dim + n] = acc;
      }
#endif
  }
}

template <int... Ms>
void dispatch(int64_t m, int64_t k_dim, int64_t n_dim, const float* x, const float* t, float* y, int64_t n_begin,
              int64_t n_end) {
  ((m == Ms ? (group_product<Ms>(k_dim, n_dim, x, t, y, n_begin, n_end), true) : false) || ...);
}

void rows_product(int64_t m_rows, int64_t k_dim, int64_t n_dim, const float* x, const float* t, float* y) {
  std::memset(y, 0, sizeof(float) * static_cast<size_t>(m_rows * n_dim));
  for (int64_t m0 = 0; m0 < m_rows; m0 += kGroupRows) {
    const int64_t m = m_rows - m0 < kGroupRows ? m_rows - m0 : kGroupRows;
    dispatch<1, 2, 3, 4, 5, 6, 7, 8>(m, k_dim, n_dim, x + m0 * k_dim, t, y + m0 * n_dim, 0, n_dim);
  }
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
