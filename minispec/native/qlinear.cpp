// minispec's quantized matmul for CPUs: y = x @ w.T with w int4, 5-bit, 6-bit or int8 in groups, for 1 to a
// few dozen rows of x. Built at first use by minispec/native and cached.
//
// As llama.cpp does, each row of x is quantized to int8 in blocks of 32 inputs (a float scale a block),
// and meets the weight's integers in exact integer dot products (AVX-512 VNNI, AVX2, or from 16 rows on
// AMX: all give the same sums); floats come in once a block: acc += sum * (weight scale x row scale). A
// weight is read from memory once for all rows. Output columns go in tiles of 16, one per 32-bit lane:
// a 64-byte weight vector holds 4 consecutive inputs of each column, so the row's side is those 4 inputs
// broadcast (no shuffle, no horizontal sums). A block's first 16 and last 16 inputs go to two integer
// sums, one when the groups are 32 or more inputs wide, two when they are 16 (GGUF's Q6_K).
//
// Row invariance: a row's quantization, integer sums and float accumulation are the same instructions
// whether it is decoded alone or among others.
//
// The weight's layout (minispec/native packs it): tile after tile, block after block, the vectors
// k = 0..7 of 64 bytes whose byte 4c + j is column c's input 4k + j (int8); or four vectors holding k in
// their low nibbles and k + 4 in their high ones (int4, 0..15), with one more holding each value's fifth
// bit, vector k's at bit k (5-bit: -16..15 stored + 16, or with offsets 0..31), or two more holding the
// top two bits, vector 4p + i's at bits 2i of the p-th (6-bit: -32..31 stored + 32); the rows' sums times
// -bias take a stored bias back out, bit for bit. scales, offsets: float32 or float16 [tiles, G, 16] over
// groups of `group` inputs (16, or a multiple of 32); or as GGUF's K-quants store them, int8 multipliers
// of float16 steps [tiles, K / 256, S, 16] (S = 2 with offsets, else 1), each product exactly the float32
// value it replaces (checked when packed).

#include <c10/util/Half.h>

#include "native.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define MINISPEC_VNNI 1
#endif
#if defined(MINISPEC_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__)
#define MINISPEC_AVX512 1
#endif
#if defined(MINISPEC_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define MINISPEC_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace minispec {
namespace {

constexpr int64_t BLOCK = 32;    // inputs per activation block
constexpr int64_t TILE = 16;     // output columns computed together, one per 32-bit lane
// Rows sharing one unpacked weight block, their accumulators in registers (AVX-512 has 32, AVX2 16).
#ifdef MINISPEC_AVX512
constexpr int ROWS_AT_ONCE = 8;
#else
constexpr int ROWS_AT_ONCE = 4;
#endif
// Blocks a tile's loop prefetches ahead of the one it reads: the hardware's own left a step waiting on memory.
constexpr int64_t AHEAD_BLOCKS = 16;
constexpr int64_t STEP_INPUTS = 256;  // inputs sharing a step in the two-level form (a K-quant's super-block)
enum Table { FLOATS, HALVES, STEPPED };  // how scales and offsets are stored: float32, float16, two levels

// What the packed layout adds to a weight's value: 6-bit + 32, 5-bit + 16 unless it has offsets.
constexpr int32_t stored_bias(int bits, bool offsets) { return bits == 6 ? 32 : bits == 5 && !offsets ? 16 : 0; }

// What a weight's byte adds to its value in the dot products, which Rows::minus takes back out: int8 goes
// in as w + 128 where VNNI wants unsigned weights, 5- and 6-bit as stored; the portable code adds none.
constexpr int32_t weight_bias(int bits, bool offsets) {
#if defined(__AVX2__) && defined(__FMA__) && defined(MINISPEC_VNNI)
  return bits == 8 ? 128 : stored_bias(bits, offsets);
#elif defined(__AVX2__) && defined(__FMA__)
  return stored_bias(bits, offsets);
#else
  (void)bits, (void)offsets;
  return 0;
#endif
}

// The rows of x, quantized. Row m's block b is entry at(m, b): rows after rows, or for AMX the blocks of
// 16 rows side by side (zero rows filling the last).
struct Rows {
  std::vector<int8_t> q;      // [M, blocks, 32]: x ~ q * d, block by block
  std::vector<float> d;       // [M, blocks]
  std::vector<int32_t> minus; // [M, blocks, 3]: -bias x the sum of q over the block, its first 16, its last 16,
                              // bias the weights' added one (weight_bias)
  std::vector<float> sums;    // [M, G]: x's float sums per weight group, left to right (the offsets' share)
  int64_t blocks;
  bool amx;                   // the products go through AMX's tiles
  int64_t at(int64_t m, int64_t b) const { return amx ? ((m / TILE) * blocks + b) * TILE + m % TILE : m * blocks + b; }
};

// Row m of x: its blocks' int8 values and scales, their sums times -bias, its float sums per group.
void quantize_row(const float* row, int64_t m, int64_t K, int64_t group, int32_t bias, Rows& rows) {
  const int64_t blocks = K / BLOCK;
  for (int64_t b = 0; b < blocks; ++b) {
    const float* v = row + b * BLOCK;
    float amax = 0.f;
    for (int i = 0; i < BLOCK; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float d = amax / 127.f, inverse = d > 0.f ? 1.f / d : 0.f;
    rows.d[rows.at(m, b)] = d;
    int8_t* q = rows.q.data() + rows.at(m, b) * BLOCK;
    for (int i = 0; i < BLOCK; ++i) q[i] = static_cast<int8_t>(std::nearbyint(v[i] * inverse));
    if (bias) {
      int32_t half[2] = {0, 0};
      for (int i = 0; i < BLOCK; ++i) half[i / 16] += q[i];
      int32_t* minus = rows.minus.data() + rows.at(m, b) * 3;
      minus[0] = -bias * (half[0] + half[1]);
      minus[1] = -bias * half[0];
      minus[2] = -bias * half[1];
    }
  }
  const int64_t groups = K / group;
  for (int64_t g = 0; !rows.sums.empty() && g < groups; ++g) {
    float s = 0.f;
    for (int64_t i = 0; i < group; ++i) s += row[g * group + i];
    rows.sums[m * groups + g] = s;
  }
}

Rows quantize_rows(const float* x, int64_t M, int64_t K, int64_t group, int32_t bias, bool with_sums, bool amx) {
  const int64_t blocks = K / BLOCK, padded = amx ? (M + TILE - 1) / TILE * TILE : M;
  Rows rows{std::vector<int8_t>(padded * K), std::vector<float>(padded * blocks),
            std::vector<int32_t>(bias ? M * blocks * 3 : 0), std::vector<float>(with_sums ? padded * K / group : 0), blocks, amx};
  // rows split between threads: a prefill's are many
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / K), [&](int64_t first, int64_t last) {
    for (int64_t m = first; m < last; ++m) quantize_row(x + m * K, m, K, group, bias, rows);
  });
  return rows;
}

struct Weight {
  const uint8_t* q;       // the tiles
  const void* scales;     // [tiles, G, 16]: float32, float16, or int8 multipliers of `steps`
  const void* offsets;    // the same, or null
  const c10::Half* steps; // [tiles, K / 256, S, 16] (STEPPED; S = 2 with offsets, else 1) or null
  Table table;            // how scales and offsets are stored
  int64_t groups, group, kinds;  // kinds: S, the steps per span (the scales', and the offsets' if any)
  const int32_t* lo;      // the group of each block's first 16 inputs
  const int32_t* hi;      // and of its last 16

  // Where group g's values for the tile's columns start.
  int64_t at(int64_t tile, int64_t g) const { return (tile * groups + g) * TILE; }
  const c10::Half* step(int which, int64_t tile, int64_t g) const {
    const int64_t spans = groups * group / STEP_INPUTS;
    return steps + ((tile * spans + g * group / STEP_INPUTS) * kinds + which) * TILE;
  }
  // Column c's scale (which = 0) or offset (1) of group g.
  float value(int which, int64_t tile, int64_t g, int c) const {
    const void* values = which ? offsets : scales;
    if (table == HALVES) return static_cast<float>(static_cast<const c10::Half*>(values)[at(tile, g) + c]);
    if (table == FLOATS) return static_cast<const float*>(values)[at(tile, g) + c];
    return static_cast<float>(static_cast<const int8_t*>(values)[at(tile, g) + c]) * static_cast<float>(step(which, tile, g)[c]);
  }
};

#if defined(__AVX2__) && defined(__FMA__)
// The vector code, written once over V: 16 columns a vector with AVX-512, else 8 (a tile in two parts).
#ifdef MINISPEC_AVX512
struct V {
  using I = __m512i;
  using F = __m512;
  static constexpr int COLUMNS = 16;
  static I load(const void* p) { return _mm512_loadu_si512(p); }
  static I low_nibbles(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
  static I high_nibbles(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
  static I plus_128(I v) { return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80))); }
  // bits FROM .. FROM + WIDTH - 1 of every byte moved to bits 4 .. (16-bit shifts: the mask drops what
  // crosses bytes)
  template <int FROM, int WIDTH> static I top_bits(I v) {
    const I moved = FROM < 4 ? _mm512_slli_epi16(v, 4 - FROM) : FROM > 4 ? _mm512_srli_epi16(v, FROM - 4) : v;
    return _mm512_and_si512(moved, _mm512_set1_epi8(((1 << WIDTH) - 1) << 4));
  }
  static I with(I a, I b) { return _mm512_or_si512(a, b); }
  static I broadcast(int32_t v) { return _mm512_set1_epi32(v); }
  static I zero() { return _mm512_setzero_si512(); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I dot(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static F floats(I v) { return _mm512_cvtepi32_ps(v); }
  static F load_floats(const float* p) { return _mm512_loadu_ps(p); }
  static F halves_as_floats(const void* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p))); }
  static F bytes_as_floats(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }
  static F broadcast(float v) { return _mm512_set1_ps(v); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fadd(F a, F b) { return _mm512_add_ps(a, b); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#else
struct V {
  using I = __m256i;
  using F = __m256;
  static constexpr int COLUMNS = 8;
  static I load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static I low_nibbles(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
  static I high_nibbles(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
  static I plus_128(I v) { return _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))); }
  template <int FROM, int WIDTH> static I top_bits(I v) {
    const I moved = FROM < 4 ? _mm256_slli_epi16(v, 4 - FROM) : FROM > 4 ? _mm256_srli_epi16(v, FROM - 4) : v;
    return _mm256_and_si256(moved, _mm256_set1_epi8(((1 << WIDTH) - 1) << 4));
  }
  static I with(I a, I b) { return _mm256_or_si256(a, b); }
  static I broadcast(int32_t v) { return _mm256_set1_epi32(v); }
  static I zero() { return _mm256_setzero_si256(); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
#ifdef MINISPEC_VNNI
  static I dot(I acc, I u, I s) { return _mm256_dpbusd_epi32(acc, u, s); }
#else
  // u8 x s8 pairs fit an int16 here: u is at most 15 (int4), 31 (5-bit), 63 (6-bit) or |int8| <= 128, so 2 x 128 x 127 < 32767
  static I dot(I acc, I u, I s) { return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))); }
#endif
  static F floats(I v) { return _mm256_cvtepi32_ps(v); }
  static F load_floats(const float* p) { return _mm256_loadu_ps(p); }
  static F halves_as_floats(const void* p) { return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p))); }
  static F bytes_as_floats(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
  static F broadcast(float v) { return _mm256_set1_ps(v); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fadd(F a, F b) { return _mm256_add_ps(a, b); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};
#endif
constexpr int PARTS = TILE / V::COLUMNS;  // vectors across a tile

// Vector K's top W bits (5-bit: W = 1, 6-bit: 2), at bits W·K on of the extra vectors taken as one
// bit string, put above its low nibble.
template <int W, int K>
inline void add_top_bits(const V::I* extra, V::I* u) {
  u[K] = V::with(u[K], V::template top_bits<K * W % 8, W>(extra[K * W / 8]));
}

// A tile part's eight weight vectors of a block, as unsigned bytes (int8: w + 128 with VNNI, else |w|
// with w in `sign` for the rows to take its sign; 5- and 6-bit: as stored).
template <int BITS>
inline void load_block(const uint8_t* q, V::I* u, V::I* sign) {
  if (BITS != 8) {
    for (int k = 0; k < 4; ++k) {
      const V::I raw = V::load(q + k * TILE * 4);
      u[k] = V::low_nibbles(raw);
      u[k + 4] = V::high_nibbles(raw);
    }
    if (BITS == 5 || BITS == 6) {
      constexpr int W = BITS - 4;
      V::I extra[W];
      for (int p = 0; p < W; ++p) extra[p] = V::load(q + (4 + p) * TILE * 4);
      add_top_bits<W, 0>(extra, u);
      add_top_bits<W, 1>(extra, u);
      add_top_bits<W, 2>(extra, u);
      add_top_bits<W, 3>(extra, u);
      add_top_bits<W, 4>(extra, u);
      add_top_bits<W, 5>(extra, u);
      add_top_bits<W, 6>(extra, u);
      add_top_bits<W, 7>(extra, u);
    }
    return;
  }
  for (int k = 0; k < 8; ++k) {
    const V::I v = V::load(q + k * TILE * 4);
#ifdef MINISPEC_VNNI
    u[k] = V::plus_128(v);
    (void)sign;
#else
    u[k] = _mm256_sign_epi8(v, v);
    sign[k] = v;
#endif
  }
}

// The row's inputs 4k..4k+3 in every lane, signed as the weights are where w went in as |w|.
template <int BITS>
inline V::I inputs(const int8_t* block, int k, V::I sign) {
  int32_t four;
  std::memcpy(&four, block + 4 * k, 4);
  const V::I s = V::broadcast(four);
#ifndef MINISPEC_VNNI
  if (BITS == 8) return _mm256_sign_epi8(s, sign);
#endif
  (void)sign;
  return s;
}

// Weight::value for a tile part's columns at once.
template <int TABLE>
inline V::F group_values(const Weight& w, int which, int64_t tile, int64_t g, int part) {
  const void* table = which ? w.offsets : w.scales;
  const int64_t at = w.at(tile, g) + part * V::COLUMNS;
  if (TABLE == FLOATS) return V::load_floats(static_cast<const float*>(table) + at);
  if (TABLE == HALVES) return V::halves_as_floats(static_cast<const c10::Half*>(table) + at);
  return V::mul(V::bytes_as_floats(static_cast<const int8_t*>(table) + at), V::halves_as_floats(w.step(which, tile, g) + part * V::COLUMNS));
}

// The float step of a block, the same instructions for every row in every path (row invariance): acc +=
// the integer sum times (scale x the row's block scale), two such with 16-input groups.
template <bool SIXTEEN>
inline V::F accumulate(V::F acc, V::I lo, V::I hi, V::F s_lo, V::F s_hi, float d) {
  const V::F row_scale = V::broadcast(d);
  acc = V::fma(V::floats(lo), V::mul(s_lo, row_scale), acc);
  return SIXTEEN ? V::fma(V::floats(hi), V::mul(s_hi, row_scale), acc) : acc;
}

// Rows r0 .. r0 + R - 1 of a tile part's outputs, those below M stored: acc + the sum over groups of
// offset x (the row's sum over the group).
template <int TABLE, int R>
inline void finish(const Weight& w, const Rows& x, int64_t tile, int part, int64_t r0, int64_t M, V::F* acc, float* y,
                   int64_t N) {
  if (w.offsets != nullptr) {
    V::F share[R];
    for (V::F& s : share) s = V::fzero();
    for (int64_t g = 0; g < w.groups; ++g) {
      const V::F offset = group_values<TABLE>(w, 1, tile, g, part);
      for (int r = 0; r < R; ++r) share[r] = V::fma(offset, V::broadcast(x.sums[(r0 + r) * w.groups + g]), share[r]);
    }
    for (int r = 0; r < R; ++r) acc[r] = V::fadd(acc[r], share[r]);
  }
  for (int r = 0; r < R; ++r)
    if (r0 + r < M) V::store(y + (r0 + r) * N + tile * TILE + part * V::COLUMNS, acc[r]);
}

// One tile's columns for rows r0 .. r0 + R - 1.
template <int BITS, bool SIXTEEN, int TABLE, int R>
void tile_rows(const Weight& w, int64_t tile, const Rows& x, int64_t r0, int64_t K, float* y, int64_t N) {
  constexpr int64_t bytes = BITS * TILE * 4;  // per tile and block
  const int64_t blocks = K / BLOCK;
  const bool biased = !x.minus.empty();  // the weights' bytes add a bias (weight_bias)
  for (int part = 0; part < PARTS; ++part) {
    const uint8_t* q = w.q + tile * blocks * bytes + part * V::COLUMNS * 4;
    V::F acc[R];
    for (int r = 0; r < R; ++r) acc[r] = V::fzero();
    for (int64_t b = 0; b < blocks; ++b) {
      V::I u[8], sign[8];
      for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(q + (b + AHEAD_BLOCKS) * bytes + line);
      load_block<BITS>(q + b * bytes, u, sign);
      const V::F s_lo = group_values<TABLE>(w, 0, tile, w.lo[b], part);
      const V::F s_hi = SIXTEEN ? group_values<TABLE>(w, 0, tile, w.hi[b], part) : s_lo;
      for (int r = 0; r < R; ++r) {
        const int64_t row_block = x.at(r0 + r, b);
        const int8_t* xv = x.q.data() + row_block * BLOCK;
        // four short chains, then summed: one long one would wait on each product
        V::I p[4];
        for (int c = 0; c < 4; ++c) {
          p[c] = V::dot(V::zero(), u[2 * c], inputs<BITS>(xv, 2 * c, sign[2 * c]));
          p[c] = V::dot(p[c], u[2 * c + 1], inputs<BITS>(xv, 2 * c + 1, sign[2 * c + 1]));
        }
        V::I lo = V::add(p[0], p[1]), hi = V::add(p[2], p[3]);
        if (!SIXTEEN) lo = V::add(lo, hi);
        if (biased) {  // the weights went in as w + 128 (int8), w + 32 (6-bit) or w + 16 (5-bit)
          const int32_t* minus = x.minus.data() + row_block * 3;
          lo = V::add(lo, V::broadcast(minus[SIXTEEN ? 1 : 0]));
          if (SIXTEEN) hi = V::add(hi, V::broadcast(minus[2]));
        }
        acc[r] = accumulate<SIXTEEN>(acc[r], lo, hi, s_lo, s_hi, x.d[row_block]);
      }
    }
    finish<TABLE, R>(w, x, tile, part, r0, r0 + R, acc, y, N);
  }
}
#else
// Portable: per column and block half, the integer sum, then acc += sum x scale, as the vector code.
template <int BITS, bool SIXTEEN, int TABLE, int R>
void tile_rows(const Weight& w, int64_t tile, const Rows& x, int64_t r0, int64_t K, float* y, int64_t N) {
  constexpr int64_t bytes = BITS * TILE * 4, vector = TILE * 4;
  const int64_t blocks = K / BLOCK;
  const int32_t bias = stored_bias(BITS, w.offsets != nullptr);
  const uint8_t* q = w.q + tile * blocks * bytes;
  for (int r = 0; r < R; ++r) {
    const int64_t m = r0 + r;
    for (int c = 0; c < TILE; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t half[2] = {0, 0};
        for (int k = 0; k < 8; ++k)
          for (int j = 0; j < 4; ++j) {
            const int64_t at = 4 * c + j;
            int32_t v = BITS == 8 ? static_cast<int8_t>(q[b * bytes + k * vector + at])
                                  : (q[b * bytes + (k % 4) * vector + at] >> (4 * (k / 4))) & 0x0F;
            if (BITS == 5 || BITS == 6) {  // vector k's top W bits at bits W·k on of the extra vectors
              constexpr int W = BITS - 4;
              v = (v | ((q[b * bytes + (4 + k * W / 8) * vector + at] >> (k * W % 8)) & ((1 << W) - 1)) << 4) - bias;
            }
            half[k / 4] += v * x.q[m * K + b * BLOCK + 4 * k + j];
          }
        const float d = x.d[m * blocks + b];
        if (SIXTEEN) {
          acc = std::fma(static_cast<float>(half[0]), w.value(0, tile, w.lo[b], c) * d, acc);
          acc = std::fma(static_cast<float>(half[1]), w.value(0, tile, w.hi[b], c) * d, acc);
        } else {
          acc = std::fma(static_cast<float>(half[0] + half[1]), w.value(0, tile, w.lo[b], c) * d, acc);
        }
      }
      float share = 0.f;
      for (int64_t g = 0; w.offsets != nullptr && g < w.groups; ++g)
        share = std::fma(w.value(1, tile, g, c), x.sums[m * w.groups + g], share);
      y[m * N + tile * TILE + c] = acc + share;
    }
  }
}
#endif

#ifdef MINISPEC_AMX
// Many rows (a prefill) through AMX: one TDPBSSD gives the integer sums of 16 rows x 16 columns over a
// block (exact, as VNNI's), the float steps following through the same accumulate and finish. A block's
// packed vectors already are AMX's B layout for int8; narrower weights are unpacked to int8.
constexpr int64_t AMX_ROWS = 16;              // fewer rows take VNNI
constexpr int64_t UNPACKED_BYTES = 1 << 20;   // weights unpacked at once (half an L2), shared by all row tiles

// Linux lends AMX's tile registers to a process that asks (once); where it refuses, VNNI serves.
bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

// Tiles 0, 1: sums (16 rows x 16 int32); 2, 3: 16 rows of x, `inputs` each; 4, 5: the weights' vectors for them.
void configure_tiles(int inputs) {
  struct alignas(64) {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes[16];  // a row's
    uint8_t rows[16];
  } config{};
  config.palette = 1;
  for (int t = 0; t < 6; ++t) {
    config.rows[t] = t < 4 ? 16 : inputs / 4;
    config.bytes[t] = t == 2 || t == 3 ? inputs : 64;
  }
  _tile_loadconfig(&config);
}

// A tile's weights as their int8 values, in the packed vectors' order.
template <int BITS>
void unpack_tile(const uint8_t* q, int64_t blocks, int32_t bias, int8_t* out) {
  const V::I stored = _mm512_set1_epi8(static_cast<char>(bias));
  for (int64_t b = 0; b < blocks; ++b) {
    V::I u[8];
    load_block<BITS>(q + b * BITS * TILE * 4, u, nullptr);
    for (int k = 0; k < 8; ++k) _mm512_storeu_si512(out + (b * 8 + k) * TILE * 4, _mm512_sub_epi8(u[k], stored));
  }
}

// A block's integer sums of 16 rows of x (a tile of Rows) into sums [16, 16] (SIXTEEN: its first 16
// inputs', and its last 16's into sums + 256).
template <bool SIXTEEN>
inline void block_sums(const int8_t* rows, const int8_t* weights, int32_t* sums) {
  _tile_zero(0);
  _tile_loadd(2, rows, BLOCK);
  _tile_loadd(4, weights, TILE * 4);
  _tile_dpbssd(0, 2, 4);
  _tile_stored(0, sums, TILE * 4);
  if (SIXTEEN) {
    _tile_zero(1);
    _tile_loadd(3, rows + 16, BLOCK);
    _tile_loadd(5, weights + 4 * TILE * 4, TILE * 4);
    _tile_dpbssd(1, 3, 5);
    _tile_stored(1, sums + TILE * TILE, TILE * 4);
  }
}

// A tile's columns for rows r0 .. r0 + 15 (those below M stored), from its weights' int8 values, the next
// few blocks' sums under way while a block's go into the floats (a tile's store takes a while).
template <bool SIXTEEN, int TABLE>
void amx_rows(const Weight& w, int64_t tile, const int8_t* weights, const Rows& x, int64_t r0, int64_t M, int64_t K,
              float* y, int64_t N) {
  constexpr int AHEAD = 3;
  const int64_t blocks = K / BLOCK;
  alignas(64) int32_t sums[AHEAD + 1][2 * TILE * TILE];
  const auto start = [&](int64_t b) {
    if (b < blocks) block_sums<SIXTEEN>(x.q.data() + x.at(r0, b) * BLOCK, weights + b * BLOCK * TILE, sums[b % (AHEAD + 1)]);
  };
  V::F acc[TILE];
  for (V::F& a : acc) a = V::fzero();
  for (int64_t b = 0; b < AHEAD; ++b) start(b);
  for (int64_t b = 0; b < blocks; ++b) {
    start(b + AHEAD);
    const int32_t* block = sums[b % (AHEAD + 1)];
    const float* d = x.d.data() + x.at(r0, b);
    const V::F s_lo = group_values<TABLE>(w, 0, tile, w.lo[b], 0);
    const V::F s_hi = SIXTEEN ? group_values<TABLE>(w, 0, tile, w.hi[b], 0) : s_lo;
#pragma GCC unroll 16
    for (int r = 0; r < TILE; ++r) {
      const V::I hi = SIXTEEN ? V::load(block + TILE * TILE + TILE * r) : V::zero();
      acc[r] = accumulate<SIXTEEN>(acc[r], V::load(block + TILE * r), hi, s_lo, s_hi, d[r]);
    }
  }
  finish<TABLE, TILE>(w, x, tile, 0, r0, M, acc, y, N);
}

// Tiles t0 .. t1 - 1 for all rows: a few tiles' weights unpacked at once, then read by every row tile.
template <int BITS, bool SIXTEEN, int TABLE>
void amx_tiles(const Weight& w, const Rows& x, int64_t M, int64_t K, int64_t N, int64_t t0, int64_t t1, float* y) {
  const int64_t values = K * TILE, at_once = std::max<int64_t>(1, UNPACKED_BYTES / values);
  std::vector<int8_t> unpacked(BITS == 8 ? 0 : std::min(at_once, t1 - t0) * values);
  configure_tiles(SIXTEEN ? 16 : 32);
  for (int64_t first = t0; first < t1; first += at_once) {
    const int64_t last = std::min(t1, first + at_once);
    const int8_t* weights = BITS == 8 ? reinterpret_cast<const int8_t*>(w.q) + first * values : unpacked.data();
    for (int64_t t = first; BITS != 8 && t < last; ++t)
      unpack_tile<BITS>(w.q + t * values * BITS / 8, K / BLOCK, stored_bias(BITS, w.offsets != nullptr),
                        unpacked.data() + (t - first) * values);
    for (int64_t r0 = 0; r0 < M; r0 += TILE)
      for (int64_t t = first; t < last; ++t)
        amx_rows<SIXTEEN, TABLE>(w, t, weights + (t - first) * values, x, r0, M, K, y, N);
  }
  _tile_release();
}
#endif

// tile_rows for `rows` (1 .. R) rows from r0.
template <int BITS, bool SIXTEEN, int TABLE, int R>
void rows_through(const Weight& w, int64_t tile, const Rows& x, int64_t r0, int64_t K, float* y, int64_t N, int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) return rows_through<BITS, SIXTEEN, TABLE, R - 1>(w, tile, x, r0, K, y, N, rows);
  }
  tile_rows<BITS, SIXTEEN, TABLE, R>(w, tile, x, r0, K, y, N);
}

template <int BITS, bool SIXTEEN, int TABLE>
void tiles(const Weight& w, const Rows& x, int64_t M, int64_t K, int64_t N, int64_t t0, int64_t t1, float* y) {
#ifdef MINISPEC_AMX
  if (x.amx) return amx_tiles<BITS, SIXTEEN, TABLE>(w, x, M, K, N, t0, t1, y);
#endif
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t m = 0; m < M; m += ROWS_AT_ONCE)
      rows_through<BITS, SIXTEEN, TABLE, ROWS_AT_ONCE>(w, t, x, m, K, y, N, std::min<int64_t>(ROWS_AT_ONCE, M - m));
}

template <int BITS, bool SIXTEEN>
void tiles_of(const Weight& w, const Rows& x, int64_t M, int64_t K, int64_t N, int64_t t0, int64_t t1, float* y) {
  if (w.table == STEPPED) tiles<BITS, SIXTEEN, STEPPED>(w, x, M, K, N, t0, t1, y);
  else if (w.table == HALVES) tiles<BITS, SIXTEEN, HALVES>(w, x, M, K, N, t0, t1, y);
  else tiles<BITS, SIXTEEN, FLOATS>(w, x, M, K, N, t0, t1, y);
}

template <int BITS>
void tiles_by_group(const Weight& w, const Rows& x, int64_t M, int64_t K, int64_t N, int64_t t0, int64_t t1, float* y) {
  if (w.group == 16) tiles_of<BITS, true>(w, x, M, K, N, t0, t1, y);
  else tiles_of<BITS, false>(w, x, M, K, N, t0, t1, y);
}

}  // namespace

// x [M, K] float32; qweight int8, or uint8 of K / 2 (int4), 5K / 8 (5-bit) or 3K / 4 (6-bit) bytes a column,
// N / 16 tiles; scales, offsets [N / 16, G, 16] float32 or float16, or int8 with steps (above).
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const Optional& offsets,
                   const Optional& steps, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "qlinear: x must be float32 [M, K], contiguous");
  const auto table_type = steps.has_value() ? at::kChar : scales.scalar_type() == at::kHalf ? at::kHalf : at::kFloat;
  TORCH_CHECK(scales.dim() == 3 && scales.size(2) == TILE && scales.scalar_type() == table_type && scales.is_contiguous(),
              "qlinear: scales must be [N / 16, G, 16], float32 or float16 (int8 with steps)");
  const bool sixteen = group == 16;
  const int64_t M = x.size(0), K = x.size(1), tiles_n = scales.size(0), groups = scales.size(1), N = tiles_n * TILE;
  const int bits = qweight.scalar_type() != at::kByte ? 8 : qweight.numel() == N * K / 2 ? 4 : qweight.numel() == N * K * 5 / 8 ? 5 : 6;
  TORCH_CHECK(K % BLOCK == 0 && (sixteen || group % BLOCK == 0) && K % group == 0 && K / group == groups,
              "qlinear: K must be a multiple of 32 and of the group (16 or a multiple of 32)");
  TORCH_CHECK(qweight.numel() == N * K * bits / 8 && qweight.is_contiguous(), "qlinear: qweight does not match x and scales");
  const void* off = nullptr;
  if (offsets.has_value()) {
    TORCH_CHECK(offsets->sizes() == scales.sizes() && offsets->scalar_type() == table_type && offsets->is_contiguous(),
                "qlinear: offsets do not match scales");
    off = offsets->data_ptr();
  }
  const c10::Half* step = nullptr;
  const int64_t kinds = off != nullptr ? 2 : 1;
  if (steps.has_value()) {
    TORCH_CHECK(K % STEP_INPUTS == 0 && STEP_INPUTS % group == 0 && steps->scalar_type() == at::kHalf && steps->is_contiguous() &&
                    steps->sizes() == at::IntArrayRef({tiles_n, K / STEP_INPUTS, kinds, TILE}),
                "qlinear: steps must be float16 [N / 16, K / 256, 2 with offsets else 1, 16], the group dividing 256");
    step = steps->data_ptr<at::Half>();
  }
  const int64_t blocks = K / BLOCK;
#ifdef MINISPEC_AMX
  const bool amx = M >= AMX_ROWS && amx_granted();
#else
  const bool amx = false;
#endif
  // AMX's products take the weights' values as they are: no bias to take back out
  const int32_t bias = amx ? 0 : weight_bias(bits, off != nullptr);
  const Rows rows = quantize_rows(x.data_ptr<float>(), M, K, group, bias, off != nullptr, amx);
  std::vector<int32_t> lo(blocks), hi(blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    lo[b] = static_cast<int32_t>(b * BLOCK / group);
    hi[b] = static_cast<int32_t>((b * BLOCK + 16) / group);
  }
  const Table table = step != nullptr ? STEPPED : table_type == at::kHalf ? HALVES : FLOATS;
  const Weight w{static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr(), off, step, table, groups, group,
                 kinds, lo.data(), hi.data()};
  at::Tensor y = at::empty({M, N}, x.options());
  float* out = y.data_ptr<float>();
  // tiles split between threads, a few at least per thread so that a wake-up is worth it
  at::parallel_for(0, tiles_n, 4, [&](int64_t t0, int64_t t1) {
    if (bits == 4) tiles_by_group<4>(w, rows, M, K, N, t0, t1, out);
    else if (bits == 5) tiles_by_group<5>(w, rows, M, K, N, t0, t1, out);
    else if (bits == 6) tiles_by_group<6>(w, rows, M, K, N, t0, t1, out);
    else tiles_by_group<8>(w, rows, M, K, N, t0, t1, out);
  });
  return y;
}

}  // namespace minispec

TORCH_LIBRARY(minispec_native, m) {
  m.def("qlinear(Tensor x, Tensor qweight, Tensor scales, Tensor? offsets, Tensor? steps, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(minispec_native, CPU, m) {
  m.impl("qlinear", &minispec::qlinear);
}
