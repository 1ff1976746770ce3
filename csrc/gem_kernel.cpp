// gem_kernel.cpp - see gem_kernel.hpp. Keep this file free of pybind11 and of any
// floating-point shortcut: bit-identity of theta with the numpy reference is tested.
#include "gem_kernel.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

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

// Elements per block: the block's π and squares live in stack buffers that stay in L1, so
// the arithmetic loop vectorises and the histogram and sums are separate cheap loops.
constexpr std::size_t kBlock = 1024;

// np.clip(x, lo, hi) as numpy (2.x, as shipped) computes it for float32: x below lo
// becomes lo, then x above hi becomes hi; a zero equal to a bound keeps its own sign.
inline float clip_like_numpy(float x, float lo, float hi) noexcept {
  const float y = (x < lo) ? lo : x;
  return (y > hi) ? hi : y;
}

// Runs fn(begin, end, worker) on `threads` contiguous ranges of [0, n), cut at multiples of
// 64 elements (whole cache lines); the calling thread takes the first range.
template <class Fn>
void parallel_ranges(std::size_t n, int threads, Fn&& fn) {
  const std::size_t t = static_cast<std::size_t>(std::max(1, threads));
  if (t == 1 || n < 64 * t) {
    fn(std::size_t{0}, n, 0);
    return;
  }
  const std::size_t chunk = ((n + t - 1) / t + 63) / 64 * 64;
  std::vector<std::thread> pool;
  pool.reserve(t - 1);
  for (std::size_t w = 1; w < t; ++w) {
    const std::size_t b = std::min(n, w * chunk), e = std::min(n, (w + 1) * chunk);
    pool.emplace_back([&fn, b, e, w] { fn(b, e, static_cast<int>(w)); });
  }
  fn(std::size_t{0}, std::min(n, chunk), 0);
  for (auto& th : pool) th.join();
}

bool finite_range(const float* x, std::size_t b, std::size_t e) noexcept {
  std::uint32_t bad = 0;
  for (std::size_t i = b; i < e; ++i) {
    std::uint32_t u;
    std::memcpy(&u, x + i, sizeof u);
    bad |= static_cast<std::uint32_t>((u & 0x7f800000u) == 0x7f800000u);
  }
  return bad == 0;
}

bool all_finite_mt(const float* const* arrays, int count, std::size_t n, int threads) {
  const int t = std::max(1, threads);
  std::vector<char> ok(static_cast<std::size_t>(t), 1);
  parallel_ranges(n, t, [&](std::size_t b, std::size_t e, int w) {
    for (int k = 0; k < count; ++k) {
      if (!finite_range(arrays[k], b, e)) {
        ok[static_cast<std::size_t>(w)] = 0;
        return;
      }
    }
  });
  return std::all_of(ok.begin(), ok.end(), [](char c) { return c != 0; });
}

// The GEM step on [b, e), all inside tensor `row` of the statistics.
void gem_block_range(float* theta, const float* delta, const float* a, const float* s,
                     std::size_t b, std::size_t e, float eps, float pi_max, float inv_width,
                     std::int64_t* hist_row, double* sums_row) {
  alignas(64) float pib[kBlock];
  alignas(64) float e2[kBlock];
  alignas(64) float a2[kBlock];
  double acc_e[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  double acc_a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (std::size_t base = b; base < e; base += kBlock) {
    const std::size_t m = std::min(kBlock, e - base);
    float* th = theta + base;
    const float* d = delta + base;
    const float* aa = a + base;
    const float* ss = s + base;
    for (std::size_t k = 0; k < m; ++k) {  // the numpy reference's operations, in its order
      const float t = th[k];
      const float shift = std::fabs(t - ss[k]);
      const float denom = std::fabs(d[k]) + eps;
      const float pi = clip_like_numpy((aa[k] - shift) / denom, 0.0f, pi_max);
      const float nt = t + pi * d[k];
      th[k] = nt;
      pib[k] = pi;
      const float diff = nt - ss[k];
      e2[k] = diff * diff;
      a2[k] = aa[k] * aa[k];
    }
    std::size_t k = 0;
    for (; k + 8 <= m; k += 8) {  // eight independent chains: vectorisable, deterministic
      for (int j = 0; j < 8; ++j) {
        acc_e[j] += static_cast<double>(e2[k + j]);
        acc_a[j] += static_cast<double>(a2[k + j]);
      }
    }
    for (; k < m; ++k) {
      acc_e[0] += static_cast<double>(e2[k]);
      acc_a[0] += static_cast<double>(a2[k]);
    }
    for (std::size_t q = 0; q < m; ++q) {
      const float pi = pib[q];
      int bin;
      if (!(pi > 0.0f)) {
        bin = 0;
      } else if (pi >= pi_max) {
        bin = kHistBins + 1;
      } else {
        const int idx = static_cast<int>(pi * inv_width);
        bin = 1 + std::min(idx, kHistBins - 1);
      }
      ++hist_row[bin];
    }
  }
  double se = 0.0, sa = 0.0;
  for (int j = 0; j < 8; ++j) {
    se += acc_e[j];
    sa += acc_a[j];
  }
  sums_row[0] += se;
  sums_row[1] += sa;
}

}  // namespace

bool all_finite(const float* x, std::size_t n) noexcept { return finite_range(x, 0, n); }

bool gem_step(float* theta, const float* delta, const float* a, const float* s, std::size_t n,
              const std::int64_t* offsets, std::size_t n_tensors, float eps, float pi_max,
              std::int64_t* hist, double* sums, int threads) {
  const float* inputs[3] = {delta, a, s};
  if (!all_finite_mt(inputs, 3, n, threads)) return false;
  const float inv_width = static_cast<float>(kHistBins) / pi_max;
  const int t = std::max(1, threads);
  // per-thread statistics, merged below (thread 0 writes straight into the outputs)
  std::vector<std::int64_t> hist_local(static_cast<std::size_t>(t - 1) * n_tensors * kHistRow);
  std::vector<double> sums_local(static_cast<std::size_t>(t - 1) * n_tensors * 2);
  parallel_ranges(n, t, [&](std::size_t b, std::size_t e, int w) {
    std::int64_t* h = w == 0 ? hist : hist_local.data() + (w - 1) * n_tensors * kHistRow;
    double* sm = w == 0 ? sums : sums_local.data() + (w - 1) * n_tensors * 2;
    // the tensor holding element b
    std::size_t row = static_cast<std::size_t>(
        std::upper_bound(offsets, offsets + n_tensors + 1, static_cast<std::int64_t>(b)) -
        offsets - 1);
    std::size_t i = b;
    while (i < e && row < n_tensors) {
      const std::size_t seg_end = std::min(e, static_cast<std::size_t>(offsets[row + 1]));
      if (seg_end > i) {
        gem_block_range(theta, delta, a, s, i, seg_end, eps, pi_max, inv_width,
                        h + row * kHistRow, sm + row * 2);
        i = seg_end;
      }
      ++row;
    }
  });
  for (int w = 1; w < t; ++w) {
    const std::int64_t* h = hist_local.data() + (w - 1) * n_tensors * kHistRow;
    const double* sm = sums_local.data() + (w - 1) * n_tensors * 2;
    for (std::size_t k = 0; k < n_tensors * kHistRow; ++k) hist[k] += h[k];
    for (std::size_t k = 0; k < n_tensors * 2; ++k) sums[k] += sm[k];
  }
  return true;
}

bool fixed_step(float* theta, const float* delta, std::size_t n, float scale, int threads) {
  const float* inputs[1] = {delta};
  if (!all_finite_mt(inputs, 1, n, threads)) return false;
  parallel_ranges(n, threads, [&](std::size_t b, std::size_t e, int) {
    for (std::size_t i = b; i < e; ++i) {
      const float step = scale * delta[i];
      theta[i] = theta[i] + step;
    }
  });
  return true;
}

void triad(float* a, const float* b, const float* c, float q, std::size_t n, int threads) {
  parallel_ranges(n, threads, [&](std::size_t lo, std::size_t hi, int) {
    for (std::size_t i = lo; i < hi; ++i) a[i] = b[i] + q * c[i];
  });
}

void copy(float* dst, const float* src, std::size_t n, int threads) {
  parallel_ranges(n, threads, [&](std::size_t lo, std::size_t hi, int) {
    std::memcpy(dst + lo, src + lo, (hi - lo) * sizeof(float));
  });
}

const char* compile_flags() noexcept { return GEM_MPI_CXX_FLAGS; }

bool built_native() noexcept { return GEM_MPI_NATIVE != 0; }

}  // namespace gem_mpi
