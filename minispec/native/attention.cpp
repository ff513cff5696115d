// minispec's attention over a KV cache for CPUs: what kernels.attend_cache computes, in one call where it
// takes about twenty PyTorch operations a layer, whose dispatch costs more than their arithmetic. One loop
// per tile of query rows, each key and value loaded once for the tile.
//
// The canonical order (kernels.py, KEY_BLOCK): a row's result depends only on its query and on the keys
// and values at the positions it reads, in position order, never on the slots holding them (a tree's
// node reads its ancestors from the slots `slots` names) nor on how many rows or positions the call has.
// Masked positions (-inf) are skipped.

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <limits>

#include "native.h"

namespace minispec {
namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

template <typename T>
inline Vector vector_of(const T* p) {
  float f[LANES];
  for (int c = 0; c < LANES; ++c) f[c] = to_float(p[c]);
  Vector v;
  std::memcpy(&v, f, sizeof v);
  return v;
}

// The scores of 16 positions from their products by lane part[u] (lane u: position u's): each position's
// 16 lanes added in a fixed tree (the canonical order), the 16 positions' at once, a stage a vector add.
inline Vector sums(const Vector* part) {
  Vector a[8], c[4], e[2];
  for (int u = 0; u < 8; ++u)  // v[i] + v[i + 8]: positions 2u and 2u + 1, 8 lanes each
    a[u] = __builtin_shufflevector(part[2 * u], part[2 * u + 1],
                                   0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(part[2 * u], part[2 * u + 1],
                                   8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int u = 0; u < 4; ++u)  // a[j] + a[j + 4]: positions 4u..4u + 3, 4 lanes each
    c[u] = __builtin_shufflevector(a[2 * u], a[2 * u + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * u], a[2 * u + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int u = 0; u < 2; ++u)  // c0 + c2, c1 + c3: positions 8u..8u + 7, 2 lanes each
    e[u] = __builtin_shufflevector(c[2 * u], c[2 * u + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(c[2 * u], c[2 * u + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// exp of 16 floats at once (Cephes' expf: x = n ln2 + r, exp(r) by a polynomial, times 2^n through the
// exponent's bits), within a few units in the last place of std::exp, which was a fifth of a verify's
// attention. Each lane depends on its own input only. Inputs below -87 come out as 2^-126 x exp(r).
inline Vector exp16(Vector x) {
  typedef int32_t Ints __attribute__((vector_size(64)));
  const Vector low = Vector{} - 87.f, high = Vector{} + 88.f;
  x = x < low ? low : x;  // lane by lane (GCC's and Clang's vector extensions)
  x = x > high ? high : x;
  const Vector magic = Vector{} + 12582912.f;  // adding and taking away 1.5 x 2^23 rounds to an integer
  const Vector n = (x * 1.44269504088896341f + magic) - magic;
  const Vector r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  // ln2 in two parts
  Vector p = Vector{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const Ints bits = (__builtin_convertvector(n, Ints) + 127) << 23;  // 2^n, n in [-126, 127]
  Vector two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// q . k over d elements: whole vectors' products added by lane into `part` (then added by `sums`), those
// past the last one into `rest`, the same instructions for every row and key.
template <typename T>
inline void products(const float* q, const T* k, int64_t d, Vector& part, float& rest) {
  int64_t j = 0;
  for (; j + LANES <= d; j += LANES) part += vector_of(q + j) * vector_of(k + j);
  for (; j < d; ++j) rest += q[j] * to_float(k[j]);
}

struct Call {
  const float* q;        // [B, H, R, d] contiguous
  const void* k;         // [B, H, S, d], the last dimension contiguous
  const void* v;
  int64_t kb, kh, ks;    // k's and v's strides (the same layout)
  const float* mask;     // [B, H, R, P] additive, any strides but the last
  int64_t mb, mh, mr;
  const int64_t* slots;  // [B, n, P]: the cache slot of each position for token r % n (null: slot = position)
  int64_t n;
  int64_t H, R, d, P;
  float scale;           // 1: scores used as they are (T5)
  float* out;            // [B, H, R, d]
};

constexpr float none = -std::numeric_limits<float>::infinity();

struct Scratch {
  int64_t padded;             // P rounded up to whole vectors
  std::vector<float> scores;  // a row's scores, then weights, at each position: padded floats a row
  std::vector<uint8_t> read;  // the rows of a tile that read each position, one bit a row
};

typedef uint8_t Bytes __attribute__((vector_size(16)));

// A row's scores from its products at the positions its mask lets it read, turned into weights
// exp(score - top) in place, 0 elsewhere (the padding past P too). Bit `bit` of read[p] set where it reads p.
inline void weights(const Call& c, const float* mask, float* scores, uint8_t* read, int bit) {
  const Vector nothing = Vector{} + none;
  Vector top = nothing;
  for (int64_t p = 0; p < c.P; p += LANES) {  // 16 positions at a time (the scores are padded)
    const int64_t n = std::min<int64_t>(LANES, c.P - p);
    Vector m = nothing, x;
    std::memcpy(&m, mask + p, n * sizeof(float));
    std::memcpy(&x, scores + p, sizeof x);
    Vector s = (c.scale != 1.f ? x * c.scale : x) + m;
    s = m != nothing ? s : nothing;
    top = s > top ? s : top;
    std::memcpy(scores + p, &s, sizeof s);
    const Bytes reads = __builtin_convertvector((s != nothing) & (1 << bit), Bytes);
    uint8_t r[LANES];
    std::memcpy(r, read + p, n);
    for (int u = 0; u < n; ++u) r[u] |= reads[u];
    std::memcpy(read + p, r, n);
  }
  float most = none;
  for (int u = 0; u < LANES; ++u) most = top[u] > most ? top[u] : most;
  for (int64_t p = 0; p < c.P; p += LANES) {
    Vector x;
    std::memcpy(&x, scores + p, sizeof x);
    const Vector w = most == none ? Vector{} : exp16(x - most);
    x = x != nothing ? w : Vector{};
    std::memcpy(scores + p, &x, sizeof x);
  }
}

// The totals of TILE rows' weights, each row's added in position order (a weight is 0 where it reads
// nothing), the rows' additions interleaved (one row after another waited on each add).
template <int TILE>
inline void totals(float* const* weights, int64_t P, float* total) {
  for (int i = 0; i < TILE; ++i) total[i] = 0.f;
  for (int64_t p = 0; p < P; ++p)
    for (int i = 0; i < TILE; ++i) total[i] += weights[i][p];
}

// TILE rows of one (b, h) that read the same slots (a short tile repeats its last row), head dim 16 x
// CHUNKS: each key and value loaded once for all of them, each row's numbers its own alone (a position it
// does not read is skipped: its value may hold anything, even NaN).
template <int CHUNKS, int TILE, typename T>
void tile(const Call& c, int64_t b, int64_t h, const int64_t* rows, int64_t count, Scratch& s) {
  const int64_t* slots = c.slots ? c.slots + (b * c.n + rows[0] % c.n) * c.P : nullptr;
  const T* k = static_cast<const T*>(c.k) + b * c.kb + h * c.kh;
  const T* v = static_cast<const T*>(c.v) + b * c.kb + h * c.kh;
  const float* mask[TILE];
  Vector q[TILE][CHUNKS];
  float* scores[TILE];
  uint8_t* read = s.read.data();
  std::fill(read, read + c.P, 0);
  for (int i = 0; i < TILE; ++i) {
    mask[i] = c.mask + b * c.mb + h * c.mh + rows[i] * c.mr;
    std::memcpy(q[i], c.q + ((b * c.H + h) * c.R + rows[i]) * c.d, sizeof q[i]);
    scores[i] = s.scores.data() + i * s.padded;
    for (int64_t p = 0; p < c.P; ++p) read[p] |= (mask[i][p] != none);
  }
  for (int64_t p = 0; p < c.P; p += LANES) {  // 16 positions at a time (a tile's scores are padded)
    const int64_t end = std::min(p + LANES, c.P);
    if (std::none_of(read + p, read + end, [](uint8_t r) { return r; })) continue;
    Vector keys[LANES][CHUNKS];  // as float32 once for the tile; zeros where no row reads
    for (int64_t u = p; u < p + LANES; ++u) {
      const T* key = u < end && read[u] ? k + (slots ? slots[u] : u) * c.ks : nullptr;
      for (int j = 0; j < CHUNKS; ++j) keys[u - p][j] = key ? vector_of(key + j * LANES) : Vector{};
    }
    for (int i = 0; i < TILE; ++i) {  // a row at a time: its 16 sums stay in registers
      Vector part[LANES];
      for (int u = 0; u < LANES; ++u) {
        part[u] = Vector{};
        for (int j = 0; j < CHUNKS; ++j) part[u] += q[i][j] * keys[u][j];
      }
      const Vector y = sums(part);
      std::memcpy(scores[i] + p, &y, sizeof y);
    }
  }
  std::fill(read, read + c.P, 0);
  for (int i = 0; i < TILE; ++i) weights(c, mask[i], scores[i], read, i);
  float total[TILE];
  totals<TILE>(scores, c.P, total);
  Vector a[TILE][CHUNKS];
  // WIDTH chunks of the values at a time, over every position: 16 sums in registers, where all of them at
  // once spilled
  constexpr int WIDTH = std::min(CHUNKS, 16 / TILE);
  constexpr unsigned all = (1u << TILE) - 1;
  for (int first = 0; first < CHUNKS; first += WIDTH) {
    Vector sum[TILE][WIDTH] = {};
    for (int64_t p = 0; p < c.P; ++p) {
      const unsigned readers = read[p];
      if (!readers) continue;
      const T* value = v + (slots ? slots[p] : p) * c.ks + first * LANES;
      Vector vv[WIDTH];
      for (int j = 0; j < WIDTH; ++j) vv[j] = vector_of(value + j * LANES);
      if (readers == all) {
        for (int i = 0; i < TILE; ++i)
          for (int j = 0; j < WIDTH; ++j) sum[i][j] += scores[i][p] * vv[j];
      } else {
        for (int i = 0; i < TILE; ++i)
          if (readers >> i & 1)
            for (int j = 0; j < WIDTH; ++j) sum[i][j] += scores[i][p] * vv[j];
      }
    }
    for (int i = 0; i < TILE; ++i)
      for (int j = 0; j < WIDTH; ++j) a[i][first + j] = sum[i][j];
  }
  for (int i = 0; i < count; ++i) {
    float* y = c.out + ((b * c.H + h) * c.R + rows[i]) * c.d;
    std::memcpy(y, a[i], sizeof a[i]);
    if (total[i] == 0.f) {  // a row that may read nothing (a padded batch row): zeros, not NaN
      std::fill(y, y + c.d, 0.f);
      continue;
    }
    for (int64_t j = 0; j < c.d; ++j) y[j] /= total[i];
  }
}

// One row, any head dim (those of whole vectors go through `tile`).
template <typename T>
void row(const Call& c, int64_t b, int64_t h, int64_t r, Scratch& s) {
  const int64_t* slots = c.slots ? c.slots + (b * c.n + r % c.n) * c.P : nullptr;
  const T* k = static_cast<const T*>(c.k) + b * c.kb + h * c.kh;
  const T* v = static_cast<const T*>(c.v) + b * c.kb + h * c.kh;
  const float* q = c.q + ((b * c.H + h) * c.R + r) * c.d;
  const float* mask = c.mask + b * c.mb + h * c.mh + r * c.mr;
  float* scores = s.scores.data();
  uint8_t* read = s.read.data();
  std::fill(read, read + c.P, 0);
  for (int64_t p = 0; p < c.P; p += LANES) {  // 16 positions at a time (the scores are padded)
    Vector part[LANES] = {}, rest;
    float tail[LANES] = {};
    for (int64_t u = p; u < std::min(p + LANES, c.P); ++u)
      if (mask[u] != none) products(q, k + (slots ? slots[u] : u) * c.ks, c.d, part[u - p], tail[u - p]);
    std::memcpy(&rest, tail, sizeof rest);
    const Vector y = sums(part) + rest;
    std::memcpy(scores + p, &y, sizeof y);
  }
  weights(c, mask, scores, read, 0);
  float total;
  totals<1>(&scores, c.P, &total);
  float* y = c.out + ((b * c.H + h) * c.R + r) * c.d;
  std::fill(y, y + c.d, 0.f);
  if (total == 0.f) return;  // a row that may read nothing: zeros
  const int64_t whole = c.d / LANES * LANES;
  for (int64_t j = 0; j < whole; j += LANES) {  // 16 sums at a time over every position, in a register
    Vector a = {};
    for (int64_t p = 0; p < c.P; ++p)
      if (read[p]) a += scores[p] * vector_of(v + (slots ? slots[p] : p) * c.ks + j);
    std::memcpy(y + j, &a, sizeof a);
  }
  for (int64_t p = 0; p < c.P; ++p)
    if (read[p])
      for (int64_t j = whole; j < c.d; ++j) y[j] += scores[p] * to_float(v[(slots ? slots[p] : p) * c.ks + j]);
  for (int64_t j = 0; j < c.d; ++j) y[j] /= total;
}

// The rows of each (b, h) in tiles of TILE that read the same slots: rows t, t + n, t + 2n, ... of
// token t (grouped-query heads' rows; every row when n is 1). Tiles numbered (b, h, t, part).
template <int CHUNKS, int TILE, typename T>
void tiles(const Call& c, int64_t first, int64_t last) {
  Scratch s{(c.P + LANES - 1) / LANES * LANES, {}, std::vector<uint8_t>(c.P)};
  s.scores.assign(TILE * s.padded, 0.f);
  const int64_t group = c.R / c.n, parts = (group + TILE - 1) / TILE;
  for (int64_t index = first; index < last; ++index) {
    const int64_t part = index % parts, t = index / parts % c.n, bh = index / parts / c.n;
    int64_t rows[TILE];
    const int64_t count = std::min<int64_t>(TILE, group - part * TILE);
    for (int i = 0; i < TILE; ++i) rows[i] = t + c.n * (part * TILE + std::min<int64_t>(i, count - 1));
    if constexpr (CHUNKS == 0) row<T>(c, bh / c.H, bh % c.H, rows[0], s);
    else tile<CHUNKS, TILE, T>(c, bh / c.H, bh % c.H, rows, count, s);
  }
}

struct Plan {
  void (*run)(const Call&, int64_t first, int64_t last);  // `tiles`
  int64_t rows;                                           // a tile's
};

// The tile for head dim 16 x CHUNKS and `group` rows reading the same slots: the fewest of 1, 2, 4 or 8
// rows that hold them, at most 4 of d = 128.
template <int CHUNKS, typename T>
Plan plan_for(int64_t group) {
  constexpr int most = CHUNKS == 8 ? 4 : 8;
  if (group <= 1) return {tiles<CHUNKS, 1, T>, 1};
  if (group <= 2) return {tiles<CHUNKS, 2, T>, 2};
  if (group <= 4) return {tiles<CHUNKS, 4, T>, 4};
  return {tiles<CHUNKS, most, T>, most};
}

template <typename T>
Plan plan_of(int64_t d, int64_t group) {
  switch (d % LANES ? 0 : d / LANES) {  // head dims of 16 x 1, 2, 4 or 8 (64 and 128 most) in tiles
    case 8: return plan_for<8, T>(group);
    case 4: return plan_for<4, T>(group);
    case 2: return plan_for<2, T>(group);
    case 1: return plan_for<1, T>(group);
    default: return {tiles<0, 1, T>, 1};
  }
}

}  // namespace

// q [B, H, R, d] float32; k, v [B, H, S, d] float32, bfloat16 or float16; mask [B, H, R, P] float32
// (additive: 0 or -inf, or a bias), P <= S; slots int64 [B, n, P] with R a multiple of n (query row r
// is token r % n: grouped-query heads' rows group-major), or none.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                  const Optional& slots, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.is_contiguous(), "attend: q must be float32 [B, H, R, d], contiguous");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), d = q.size(3);
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.strides() == v.strides() && k.scalar_type() == v.scalar_type() &&
                  k.size(0) == B && k.size(1) == H && k.size(3) == d && k.stride(3) == 1,
              "attend: k and v must be [B, H, S, d] alike, the last dimension contiguous");
  TORCH_CHECK(mask.dim() == 4 && mask.scalar_type() == at::kFloat && mask.size(0) == B && mask.size(1) == H &&
                  mask.size(2) == R && mask.size(3) <= k.size(2) && mask.stride(3) == 1,
              "attend: mask must be float32 [B, H, R, P], P at most the cache's length");
  const int64_t P = mask.size(3);
  const int64_t* slot = nullptr;
  int64_t n = 1;
  if (slots.has_value()) {
    TORCH_CHECK(slots->dim() == 3 && slots->scalar_type() == at::kLong && slots->is_contiguous() && slots->size(0) == B &&
                    slots->size(2) == P && R % slots->size(1) == 0,
                "attend: slots must be int64 [B, n, P], contiguous, n dividing the rows");
    n = slots->size(1);
    slot = slots->data_ptr<int64_t>();
    const int64_t S = k.size(2);
    TORCH_CHECK(std::all_of(slot, slot + slots->numel(), [S](int64_t s) { return 0 <= s && s < S; }),
                "attend: a slot outside the cache");
  }
  const auto type = k.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf, "attend: k and v must be float32, bfloat16 or float16");
  at::Tensor y = at::empty({B, H, R, d}, q.options());
  const Call c{q.data_ptr<float>(), k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
               mask.data_ptr<float>(), mask.stride(0), mask.stride(1), mask.stride(2), slot, n, H, R, d, P,
               static_cast<float>(scale), y.data_ptr<float>()};
  const Plan plan = type == at::kFloat ? plan_of<float>(d, R / n)
                    : type == at::kBFloat16 ? plan_of<c10::BFloat16>(d, R / n) : plan_of<c10::Half>(d, R / n);
  // tiles split between threads where each share is worth a wake-up (tens of thousands of multiply-adds)
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, P * d * plan.rows));
  at::parallel_for(0, B * H * n * ((R / n + plan.rows - 1) / plan.rows), grain,
                   [&](int64_t first, int64_t last) { plan.run(c, first, last); });
  return y;
}

// CachedLM.keep for every layer's k and v [rows, H, S, d] (any dtype) in one call: the keys and values of
// cache row `row` at slots (increasing, each at or after its destination) moved to positions length, ....
void keep(at::TensorList caches, int64_t row, at::IntArrayRef slots, int64_t length) {
  for (size_t i = 0; i < slots.size(); ++i)
    TORCH_CHECK(length + static_cast<int64_t>(i) <= slots[i] && (i == 0 || slots[i - 1] < slots[i]),
                "keep: slots must increase, each at or after its destination");
  for (const at::Tensor& cache : caches) {
    TORCH_CHECK(cache.dim() == 4 && cache.stride(3) == 1 && cache.stride(2) == cache.size(3) && 0 <= row &&
                    row < cache.size(0) && (slots.empty() || slots.back() < cache.size(2)),
                "keep: a cache must be [rows, H, S, d], each position's d values contiguous, the slots inside it");
    const int64_t bytes = cache.size(3) * cache.element_size();
    char* base = static_cast<char*>(cache.data_ptr());
    for (int64_t h = 0; h < cache.size(1); ++h) {
      char* head = base + (row * cache.stride(0) + h * cache.stride(1)) * cache.element_size();
      // in increasing order: a slot is read before any later destination can overwrite it
      for (size_t i = 0; i < slots.size(); ++i)
        std::memmove(head + (length + static_cast<int64_t>(i)) * bytes, head + slots[i] * bytes, bytes);
    }
  }
}

}  // namespace minispec

TORCH_LIBRARY_FRAGMENT(minispec_native, m) {
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor mask, Tensor? slots, float scale) -> Tensor");
  m.def("keep(Tensor(a!)[] caches, int row, int[] slots, int length) -> ()");
}

TORCH_LIBRARY_IMPL(minispec_native, CPU, m) {
  m.impl("attend", &minispec::attend);
  m.impl("keep", &minispec::keep);
}
