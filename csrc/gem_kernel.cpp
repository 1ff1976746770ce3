// gem_kernel.cpp - see gem_kernel.hpp. Keep this file free of pybind11 and of any
// floating-point shortcut: bit-identity with the numpy reference is tested.
#include "gem_kernel.hpp"

#include <cmath>

#ifndef GEM_MPI_CXX_FLAGS
#define GEM_MPI_CXX_FLAGS "unknown"
#endif
#ifndef GEM_MPI_NATIVE
#define GEM_MPI_NATIVE 0
#endif

#if defined(__FAST_MATH__)
#error "gem_kernel.cpp must not be compiled with -ffast-math: results must match numpy bit for bit"
#endif

namespace gem_mpi {

namespace {

// np.clip(x, lo, hi) as numpy (2.x, as shipped) computes it for float32: x below lo
// becomes lo, then x above hi becomes hi; NaN fails both tests and stays NaN, and a zero
// equal to a bound keeps its own sign (clip(-0.0, 0, 1) is -0.0). Tested bit for bit.
inline float clip_like_numpy(float x, float lo, float hi) noexcept {
  const float y = (x < lo) ? lo : x;
  return (y > hi) ? hi : y;
}

}  // namespace

void gem_apply(float* theta, const float* delta, const float* a, const float* s,
               float* pi_out, std::size_t n, float eps, float pi_max) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const float t = theta[i];
    const float d = delta[i];
    const float diff = t - s[i];
    const float shift = std::fabs(diff);
    const float denom = std::fabs(d) + eps;
    float pi = (a[i] - shift) / denom;
    pi = clip_like_numpy(pi, 0.0f, pi_max);
    const float step = pi * d;
    theta[i] = t + step;
    pi_out[i] = pi;
  }
}

void scaled_apply(float* theta, const float* delta, std::size_t n, float scale) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    const float step = scale * delta[i];
    theta[i] = theta[i] + step;
  }
}

const char* compile_flags() noexcept { return GEM_MPI_CXX_FLAGS; }

bool built_native() noexcept { return GEM_MPI_NATIVE != 0; }

}  // namespace gem_mpi
