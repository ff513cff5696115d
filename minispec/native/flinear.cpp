// minispec's float32 matmul for CPUs: y = x @ w.T + bias for 1 to a few dozen rows of x, on a weight packed
// once by flinear_pack. Built at first use by minispec/native and cached.
//
// Why not oneDNN: its packed matmul costs a quarter more from its 7th row on, and tens of microseconds a
// call. Here a weight tile is read from memory once for all rows, which go through it in blocks of up to
// ROWS_AT_ONCE, their accumulators in registers, the tile staying in L2 for the next block.
//
// Row invariance: every output is one chain of fused multiply-adds over k = 0..K-1 in order, then + bias,
// whatever the row count, the threads (they split the tiles, never K) or the instruction set.
//
// Layout: tile t holds packed[t][k][c] = w[t * TILE + c][k], the last tile's missing columns zero.

#include "native.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace minispec {
namespace {

#if defined(__AVX512F__)
// 32 columns: two 16-float vectors; 12 rows: 24 accumulators, two weight vectors and a broadcast row
// value in 27 of the 32 registers.
constexpr int64_t TILE = 32, ROWS_AT_ONCE = 12, VECTORS = 2;
typedef __m512 Lanes;
inline Lanes zero() { return _mm512_setzero_ps(); }
inline Lanes load(const float* p) { return _mm512_loadu_ps(p); }
inline Lanes broadcast(float v) { return _mm512_set1_ps(v); }
inline Lanes fma(Lanes a, Lanes b, Lanes c) { return _mm512_fmadd_ps(a, b, c); }
inline void store(float* p, Lanes v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__)
// 16 columns: two 8-float vectors; 6 rows: 12 accumulators of the 16 registers.
constexpr int64_t TILE = 16, ROWS_AT_ONCE = 6, VECTORS = 2;
typedef __m256 Lanes;
inline Lanes zero() { return _mm256_setzero_ps(); }
inline Lanes load(const float* p) { return _mm256_loadu_ps(p); }
inline Lanes broadcast(float v) { return _mm256_set1_ps(v); }
inline Lanes fma(Lanes a, Lanes b, Lanes c) { return _mm256_fmadd_ps(a, b, c); }
inline void store(float* p, Lanes v) { _mm256_storeu_ps(p, v); }
#else
// One float a lane: std::fma rounds once, as the vector instructions do.
constexpr int64_t TILE = 16, ROWS_AT_ONCE = 4, VECTORS = 16;
typedef float Lanes;
inline Lanes zero() { return 0.f; }
inline Lanes load(const float* p) { return *p; }
inline Lanes broadcast(float v) { return v; }
inline Lanes fma(Lanes a, Lanes b, Lanes c) { return std::fma(a, b, c); }
inline void store(float* p, Lanes v) { *p = v; }
#endif
constexpr int64_t WIDTH = TILE / VECTORS;  // floats a vector
// Inputs (rows of a tile) prefetched ahead of the one read, about 4 KiB: the hardware's own left a step waiting.
constexpr int64_t AHEAD_INPUTS = 4096 / (TILE * 4);

// R rows of x (row stride K) through one tile: y[r][0..columns) = the rows' sums, + bias.
template <int R>
void tile_rows(const float* __restrict w, const float* __restrict x, int64_t K, const float* bias, int64_t columns,
               float* __restrict y, int64_t N) {
  Lanes acc[R][VECTORS];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < VECTORS; ++v) acc[r][v] = zero();
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t line = 0; line < TILE; line += 16) __builtin_prefetch(w + (k + AHEAD_INPUTS) * TILE + line);
    Lanes weight[VECTORS];
#pragma GCC unroll 16
    for (int v = 0; v < VECTORS; ++v) weight[v] = load(w + k * TILE + v * WIDTH);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const Lanes row = broadcast(x[r * K + k]);
#pragma GCC unroll 16
      for (int v = 0; v < VECTORS; ++v) acc[r][v] = fma(row, weight[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float sums[TILE];
    for (int v = 0; v < VECTORS; ++v) store(sums + v * WIDTH, acc[r][v]);
    for (int64_t c = 0; c < columns; ++c) y[r * N + c] = bias != nullptr ? sums[c] + bias[c] : sums[c];
  }
}

template <int R>
void rows_through(const float* w, const float* x, int64_t K, const float* bias, int64_t columns, float* y, int64_t N,
                  int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) return rows_through<R - 1>(w, x, K, bias, columns, y, N, rows);
  }
  tile_rows<R>(w, x, K, bias, columns, y, N);
}

}  // namespace

// w [N, K] float32 -> [ceil(N / TILE), K, TILE], the layout above.
at::Tensor flinear_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "flinear_pack: w must be float32 [N, K]");
  const int64_t N = w.size(0), K = w.size(1), tiles = (N + TILE - 1) / TILE;
  const at::Tensor padded = at::constant_pad_nd(w, {0, 0, 0, tiles * TILE - N});
  return padded.view({tiles, TILE, K}).transpose(1, 2).contiguous();
}

// x [M, K] float32, contiguous; packed from flinear_pack of a weight with N = features rows; bias [N] or
// none -> y [M, N].
at::Tensor flinear(const at::Tensor& x, const at::Tensor& packed, const Optional& bias, int64_t features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "flinear: x must be float32 [M, K], contiguous");
  const int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() && packed.size(1) == K &&
                  packed.size(2) == TILE && tiles == (features + TILE - 1) / TILE,
              "flinear: the packed weight does not match x and features");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == features,
                "flinear: bias must be float32 [N]");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, features}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  float* out = y.data_ptr<float>();
  // tiles split between threads, a few at least per thread so that a wake-up is worth it
  at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t columns = std::min(TILE, features - t * TILE);
      for (int64_t m = 0; m < M; m += ROWS_AT_ONCE)
        rows_through<ROWS_AT_ONCE>(w + t * K * TILE, xs + m * K, K, b == nullptr ? nullptr : b + t * TILE, columns,
                                   out + m * features + t * TILE, features, std::min(ROWS_AT_ONCE, M - m));
    }
  });
  return y;
}

}  // namespace minispec

TORCH_LIBRARY_FRAGMENT(minispec_native, m) {
  m.def("flinear_pack(Tensor w) -> Tensor");
  m.def("flinear(Tensor x, Tensor packed, Tensor? bias, int features) -> Tensor");
}

TORCH_LIBRARY_IMPL(minispec_native, CPU, m) {
  m.impl("flinear_pack", &minispec::flinear_pack);
  m.impl("flinear", &minispec::flinear);
}
