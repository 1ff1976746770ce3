// gem_kernel.hpp - element-wise kernels of gem_mpi, on raw float32 buffers.
//
// No Python here: bindings.cpp wraps these for numpy. Every operation is done in
// float32, in the order of the numpy reference given with each function, and the
// library is compiled with -ffp-contract=off, so the results are bit-identical to
// numpy's (no FMA fusion, no reassociation, no flush-to-zero).
#pragma once

#include <cstddef>

namespace gem_mpi {

// Gradient Energy Matching update, for i in [0, n):
//   shift    = |theta[i] - s[i]|
//   pi       = (a[i] - shift) / (|delta[i]| + eps)
//   pi       = clamp(pi, 0, pi_max)          (NaN stays NaN, a zero keeps its sign, as np.clip)
//   theta[i] += pi * delta[i]
//   pi_out[i] = pi
// numpy reference:
//   shift = np.abs(theta - s); pi = (a - shift) / (np.abs(delta) + np.float32(eps))
//   np.clip(pi, 0, pi_max, out=pi); theta += pi * delta
// Buffers may alias each other only as whole arrays (element i reads index i only).
void gem_apply(float* theta, const float* delta, const float* a, const float* s,
               float* pi_out, std::size_t n, float eps, float pi_max) noexcept;

// theta[i] += scale * delta[i]   (numpy: theta += np.float32(scale) * delta)
void scaled_apply(float* theta, const float* delta, std::size_t n, float scale) noexcept;

// Flags the library was compiled with, and whether -march=native was among them.
const char* compile_flags() noexcept;
bool built_native() noexcept;

}  // namespace gem_mpi
