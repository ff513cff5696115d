// minispec's attention over a KV cache for CPUs: what kernels.attend_cache computes, in one call.
// Built with qlinear.cpp by minispec/native.
//
// Why: a decode step's attention is a handful of tiny products (a few query rows against a few hundred
// keys), and attend_cache spells it in about twenty PyTorch operations a layer, each a few microseconds
// of dispatch, more than their arithmetic. Here it is one loop per query row.
//
// The canonical order (kernels.py, KEY_BLOCK): a row's result depends only on its query and on the keys
// and values at the positions it reads, taken in position order, never on the cache slots holding them
// nor on how many rows or positions the call has. A token tree's node reads its ancestors from the
// slots `slots` names, and gets the numbers it would get decoded alone along its path. Masked positions
// (-inf) are skipped, so reading more positions than a row may see changes nothing.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// 16 floats: one AVX-512 register, two AVX2 ones (GCC and Clang vector extensions, no intrinsics)
typedef float Vector __attribute__((vector_size(64)));
typedef float Half __attribute__((vector_size(32)));
typedef float Quarter __attribute__((vector_size(16)));
constexpr int LANES = 16;

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline Vector vector_of(const T* p) {
  float f[LANES];
  for (int c = 0; c < LANES; ++c) f[c] = to_float(p[c]);
  Vector v;
  std::memcpy(&v, f, sizeof v);
  return v;
}

inline float sum(Vector v) {  // the lanes added in halves: a fixed order, in registers
  const Half a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Quarter c = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// exp of 16 floats at once (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a polynomial, times
// 2^n through the exponent's bits), within a few units in the last place of std::exp. Why: one std::exp
// a position was a fifth of a verify's attention. Each lane's result depends on its own input only, so
// a position's weight is the same in any block. Inputs below -87 (weights under 1e-38 next to the
// row's top weight of 1; masked positions, which are not read) come out as 2^-126 x exp(r).
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

// q . k over 16 x CHUNKS elements, q as vectors: the same instructions for every row and key.
template <int CHUNKS, typename T>
inline float dot_whole(const Vector* q, const T* k) {
  Vector part = {};
  for (int j = 0; j < CHUNKS; ++j) part += q[j] * vector_of(k + j * LANES);
  return sum(part);
}

// q . k over d elements, the same instructions for every row and key.
template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  Vector part = {};
  int64_t j = 0;
  for (; j + LANES <= d; j += LANES) part += vector_of(q + j) * vector_of(k + j);
  float rest = 0.f;
  for (; j < d; ++j) rest += q[j] * to_float(k[j]);
  return sum(part) + rest;
}

// acc[0, 16 x CHUNKS) = the sum over i of w[i] x from[i][...], i in order: CHUNKS independent sums in
// registers, so that one position's products do not wait on the previous position's.
template <int CHUNKS, typename T>
inline void weighted_sum(const float* w, const T* const* from, int64_t read, float* acc) {
  Vector a[CHUNKS] = {};
  for (int64_t i = 0; i < read; ++i)
    for (int j = 0; j < CHUNKS; ++j) a[j] += w[i] * vector_of(from[i] + j * LANES);
  std::memcpy(acc, a, sizeof a);
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

// out[p] = q . k at each position p < P that the mask lets the row read, 4 positions at a time: four
// independent sums in flight, where one position's sum waited on its own chain of products (dot_whole,
// the same numbers as dot). In a group of 4 with some readable, the others' products are computed too
// (and dropped by the caller).
template <int CHUNKS, typename T>
inline void products(const float* q, const T* k, const int64_t* slots, int64_t ks, const float* mask, int64_t P,
                     float* out) {
  constexpr float none = -std::numeric_limits<float>::infinity();
  Vector qv[CHUNKS];
  std::memcpy(qv, q, sizeof qv);
  int64_t p = 0;
  for (; p + 4 <= P; p += 4) {
    if (mask[p] == none && mask[p + 1] == none && mask[p + 2] == none && mask[p + 3] == none) continue;
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) out[p + u] = dot_whole<CHUNKS>(qv, k + (slots ? slots[p + u] : p + u) * ks);
  }
  for (; p < P; ++p)
    if (mask[p] != none) out[p] = dot_whole<CHUNKS>(qv, k + (slots ? slots[p] : p) * ks);
}

template <typename T>
void row(const Call& c, int64_t index, std::vector<float>& scores, std::vector<float>& sums,
         std::vector<const T*>& from) {
  const int64_t r = index % c.R, h = index / c.R % c.H, b = index / c.R / c.H;
  const float* q = c.q + index * c.d;
  const float* mask = c.mask + b * c.mb + h * c.mh + r * c.mr;
  const int64_t* slots = c.slots ? c.slots + (b * c.n + r % c.n) * c.P : nullptr;
  const T* k = static_cast<const T*>(c.k) + b * c.kb + h * c.kh;
  const T* v = static_cast<const T*>(c.v) + b * c.kb + h * c.kh;
  constexpr float none = -std::numeric_limits<float>::infinity();
  switch (c.d % LANES ? 0 : c.d / LANES) {  // head dims of 16 x 1..8: products of 4 keys at a time
    case 8: products<8>(q, k, slots, c.ks, mask, c.P, scores.data()); break;
    case 4: products<4>(q, k, slots, c.ks, mask, c.P, scores.data()); break;
    case 2: products<2>(q, k, slots, c.ks, mask, c.P, scores.data()); break;
    case 1: products<1>(q, k, slots, c.ks, mask, c.P, scores.data()); break;
    default:
      for (int64_t p = 0; p < c.P; ++p)
        if (mask[p] != none) scores[p] = dot(q, k + (slots ? slots[p] : p) * c.ks, c.d);
  }
  float top = none;
  for (int64_t p = 0; p < c.P; ++p) {
    float s = none;
    if (mask[p] != none) {
      s = (c.scale != 1.f ? scores[p] * c.scale : scores[p]) + mask[p];
      top = std::max(top, s);
    }
    scores[p] = s;
  }
  float* y = c.out + index * c.d;
  float* acc = sums.data();  // the row's weighted sum of values [d]
  const int64_t whole = c.d / LANES * LANES;
  std::fill(sums.begin(), sums.begin() + c.d, 0.f);
  if (top == none) {  // a row that may read nothing (a padded batch row): zeros, not NaN
    std::copy(acc, acc + c.d, y);
    return;
  }
  // The weights, in position order; then each 16 of the d sums at a time over every position, so that
  // they stay in a register (kept in memory across positions, each waited on its own store). Each sum
  // still adds the positions in order: the same numbers either way.
  float* weights = sums.data() + c.d;  // exp(score - top) at every position (masked ones unread)
  for (int64_t p = 0; p < c.P; p += LANES) {
    Vector x;
    std::memcpy(&x, scores.data() + p, sizeof x);  // whole vectors: scores' last one is padded
    const Vector w = exp16(x - top);
    std::memcpy(weights + p, &w, sizeof w);
  }
  float total = 0.f;
  int64_t read = 0;  // positions not masked, their weights in scores[0, read) and value rows in `from`
  for (int64_t p = 0; p < c.P; ++p) {
    if (scores[p] == none) continue;
    total += weights[p];
    scores[read] = weights[p];
    from[read++] = v + (slots ? slots[p] : p) * c.ks;
  }
  switch (whole / LANES) {  // head dims of 16 x 1..8 (64 and 128 most), the sums unrolled
    case 8: weighted_sum<8>(scores.data(), from.data(), read, acc); break;
    case 4: weighted_sum<4>(scores.data(), from.data(), read, acc); break;
    case 2: weighted_sum<2>(scores.data(), from.data(), read, acc); break;
    case 1: weighted_sum<1>(scores.data(), from.data(), read, acc); break;
    default:
      for (int64_t j = 0; j < whole; j += LANES) {
        Vector a = {};
        for (int64_t i = 0; i < read; ++i) a += scores[i] * vector_of(from[i] + j);
        std::memcpy(acc + j, &a, sizeof a);
      }
  }
  for (int64_t i = 0; i < read; ++i)
    for (int64_t j = whole; j < c.d; ++j) acc[j] += scores[i] * to_float(from[i][j]);
  for (int64_t j = 0; j < c.d; ++j) y[j] = acc[j] / total;
}

template <typename T>
void rows(const Call& c, int64_t first, int64_t last) {
  const int64_t padded = (c.P + LANES - 1) / LANES * LANES;
  std::vector<float> scores(padded, 0.f), sums(c.d + padded);  // sums: a row's d sums, then its weights
  std::vector<const T*> from(c.P);
  for (int64_t i = first; i < last; ++i) row<T>(c, i, scores, sums, from);
}

// q [B, H, R, d] float32; k, v [B, H, S, d] float32, bfloat16 or float16; mask [B, H, R, P] float32
// (additive: 0 or -inf, or a bias), P <= S; slots int64 [B, n, P] with R a multiple of n (query row r
// is token r % n: grouped-query heads' rows group-major), or none.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                  const c10::optional<at::Tensor>& slots, double scale) {
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
  // rows split between threads where each share is worth a thread's wake-up (tens of thousands of
  // multiply-adds)
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, P * d));
  at::parallel_for(0, B * H * R, grain, [&](int64_t first, int64_t last) {
    if (type == at::kFloat) rows<float>(c, first, last);
    else if (type == at::kBFloat16) rows<c10::BFloat16>(c, first, last);
    else rows<c10::Half>(c, first, last);
  });
  return y;
}

// caches: every layer's k and v [rows, H, S, d] (any dtype); the keys and values of cache row `row` at
// slots (increasing, each at or after its destination) moved to positions length, length + 1, ...: a
// token tree's accepted path laid out as a chain (CachedLM.keep). One call for every layer, where PyTorch
// operations take two per cache.
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(minispec_native, m) {
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor mask, Tensor? slots, float scale) -> Tensor");
  m.def("keep(Tensor(a!)[] caches, int row, int[] slots, int length) -> ()");
}

TORCH_LIBRARY_IMPL(minispec_native, CPU, m) {
  m.impl("attend", &attend);
  m.impl("keep", &keep);
}
