// What minispec's kernel files share: the operators' entry points (each file registers its own; the
// one-call layer calls the others directly) and 16-float vectors.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace minispec {

using Optional = c10::optional<at::Tensor>;

// 16 floats: one AVX-512 register, two AVX2 ones (GCC and Clang vector extensions, no intrinsics)
typedef float Vector __attribute__((vector_size(64)));
constexpr int LANES = 16;

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const Optional& offsets,
                   const Optional& steps, int64_t group);
at::Tensor flinear_pack(const at::Tensor& w);
at::Tensor flinear(const at::Tensor& x, const at::Tensor& packed, const Optional& bias, int64_t features);
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                  const Optional& slots, double scale);
void keep(at::TensorList caches, int64_t row, at::IntArrayRef slots, int64_t length);

}  // namespace minispec
