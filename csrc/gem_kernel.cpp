// gem_kernel.cpp - see gem_kernel.hpp. Keep this file free of pybind11 and of any
// floating-point shortcut: bit-identity of theta with the numpy reference is tested.
#include "gem_kernel.hpp"
#include "thread_pool.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <type_traits>
#include <vector>

#ifndef GEM_MPI_CXX_FLAGS
#define GEM_MPI_CXX_FLAGS "unknown"
#endif
#ifndef GEM_MPI_NATIVE
#define GEM_MPI_NATIVE 0
#endif

// No contraction of a * b + c into a fused multiply-add anywhere here: CMakeLists.txt passes
// -ffp-contract=off (GCC has no pragma for it); Clang also gets its pragma.
#if defined(__clang__)
#pragma clang fp contract(off)
#endif

#if defined(__FAST_MATH__)
#error "gem_kernel.cpp must not be compiled with -ffast-math: results must match numpy bit for bit"
#endif

// The hot loops are compiled twice on x86-64 with GCC, for the generic target and for
// x86-64-v3 (AVX2), and the loader picks the clone the CPU supports (ifunc): portable
// binaries, wider vectors where they exist. Same IEEE operations, no FMA contraction
// (-ffp-contract=off), so both clones give the same bits. GEM_MPI_NATIVE builds for the
// build machine's CPU instead.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__) && \
    !GEM_MPI_NATIVE
#define GEM_MPI_CLONES __attribute__((target_clones("default", "arch=x86-64-v3")))
#define GEM_MPI_CLONED 1
#else
#define GEM_MPI_CLONES
#define GEM_MPI_CLONED 0
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

// A wire element as float32 (the kernels are templates on it: --wire float32 or bf16). A
// float32 is itself; a uint16 holds bf16 bits, the top half of a float32, so the widening is
// exact (low half zero) and everything after it is the float32 kernel's arithmetic.
inline float wide(float x) noexcept { return x; }
inline float wide(std::uint16_t h) noexcept {
  const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// How the work of [0, n) is dealt out over threads.
enum class Dispatch { kPool, kSpawn };

// Runs fn(begin, end, part) on `threads` contiguous ranges of [0, n), cut at multiples of
// 64 elements (whole cache lines); the calling thread takes the first range, pool thread w
// range w (kSpawn: a thread spawned for this call, the benchmark's comparison only).
template <class Fn>
void parallel_ranges(std::size_t n, int threads, Fn&& fn, Dispatch how = Dispatch::kPool) {
  const std::size_t t = static_cast<std::size_t>(std::max(1, threads));
  if (t == 1 || n < 64 * t) {
    fn(std::size_t{0}, n, 0);
    return;
  }
  const std::size_t chunk = ((n + t - 1) / t + 63) / 64 * 64;
  auto part = [&fn, n, chunk](int w) {
    const std::size_t b = std::min(n, static_cast<std::size_t>(w) * chunk);
    fn(b, std::min(n, b + chunk), w);
  };
  if (how == Dispatch::kSpawn) {
    std::vector<std::thread> spawned;
    spawned.reserve(t - 1);
    for (std::size_t w = 1; w < t; ++w) spawned.emplace_back(part, static_cast<int>(w));
    part(0);
    for (auto& th : spawned) th.join();
    return;
  }
  using Part = decltype(part);
  ThreadPool::instance().run(
      static_cast<int>(t), [](void* ctx, int w) { (*static_cast<Part*>(ctx))(w); }, &part);
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

// x * 0 is 0 for every finite x and NaN for NaN and ±Inf, so one sum over all arrays is 0
// exactly when they are all finite: one vectorised pass that reads each array once.
// (x and y: the wire's Δθ and a; z: s, float32 on every wire.)
template <class X, class Z>
GEM_MPI_CLONES bool finite3_range(const X* x, const X* y, const Z* z, std::size_t b,
                                  std::size_t e) noexcept {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (std::size_t i = b; i < e; ++i) {
    acc += (wide(x[i]) * 0.0f + wide(y[i]) * 0.0f) + wide(z[i]) * 0.0f;
  }
  return acc == 0.0f;
}

// The global proxy's fold, |mu * m + gain * d| * kappa, in the order a GEM worker computes
// κ|μm + Δθ|: three float32 roundings, never a fused multiply-add (-ffp-contract=off), so
// that with one worker (mu = μ, gain = 1) m and a are bit for bit the worker's.
inline float fold(float m, float d, float mu, float gain) noexcept {
  const float decayed = mu * m;
  return decayed + gain * d;
}

// As finite3_range, for the global proxy: Δθ, s, and the a = κ|m_new| this update would make
// (the fold is computed here and again in the step; nothing is written).
template <class W>
GEM_MPI_CLONES bool finite_global_range(const W* d, const float* s, const float* m,
                                        float mu, float gain, float kappa, std::size_t b,
                                        std::size_t e) noexcept {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (std::size_t i = b; i < e; ++i) {
    const float dv = wide(d[i]);
    const float av = std::fabs(fold(m[i], dv, mu, gain)) * kappa;
    acc += (dv * 0.0f + s[i] * 0.0f) + av * 0.0f;
  }
  return acc == 0.0f;
}

// Whether every range of [0, n) passes check(b, e), the ranges run on the kernel's threads.
template <class Check>
bool all_ranges_mt(std::size_t n, int threads, Check&& check) {
  const int t = std::max(1, threads);
  std::vector<char> ok(static_cast<std::size_t>(t), 1);
  parallel_ranges(n, t, [&](std::size_t b, std::size_t e, int w) {
    ok[static_cast<std::size_t>(w)] = check(b, e) ? 1 : 0;
  });
  return std::all_of(ok.begin(), ok.end(), [](char c) { return c != 0; });
}

template <class X, class Z>
bool all_finite_mt(const X* x, const X* y, const Z* z, std::size_t n, int threads) {
  return all_ranges_mt(n, threads, [&](std::size_t b, std::size_t e) {
    return finite3_range(x, y, z, b, e);
  });
}

// The GEM step on [b, e), all inside one tensor that starts at element `lo`. The arithmetic
// loop is branch-free and vectorises; its float sums and clamp counts are per-block SIMD
// reductions (lane order fixed for a given build; theta is element-wise and unaffected).
// The histogram takes the elements lo, lo + stride, lo + 2 stride, ... of the tensor, in a
// second loop over four sub-histograms so that repeated bins do not serialise. Global: a is
// not read, the proxy's m is folded and a made from it (GlobalProxy, gem_kernel.hpp). W: the
// wire's element (float, or uint16 bf16 bits widened exactly as they are read).
template <class W, bool Keep, bool Global>
GEM_MPI_CLONES void gem_block_range(float* theta, const W* delta, const W* a,
                                    const float* s, float* keep, GlobalProxy px,
                                    std::size_t b, std::size_t e, std::size_t lo,
                                    std::size_t stride, float eps, float pi_max,
                                    float inv_width, std::int64_t* hist_row, double* sums_row,
                                    std::int64_t* counts_row) {
  alignas(64) float pib[kBlock];
  alignas(64) std::int32_t bins[kBlock];
  std::int32_t sub[4][kHistRow] = {};
  double se = 0.0, sa = 0.0;
  std::int64_t n_low = 0, n_high = 0, n_zero = 0;
  for (std::size_t base = b; base < e; base += kBlock) {
    const std::size_t m = std::min(kBlock, e - base);
    float* th = theta + base;
    const W* d = delta + base;
    const W* aa = Global ? nullptr : a + base;
    const float* ss = s + base;
    float* kp = Keep ? keep + base : nullptr;
    float* mm = Global ? px.m + base : nullptr;
    float se_block = 0.0f, sa_block = 0.0f;  // a block's sums in float lanes, then double
    std::int32_t low_block = 0, high_block = 0, zero_block = 0;
#pragma omp simd reduction(+ : se_block, sa_block, low_block, high_block, zero_block)
    for (std::size_t k = 0; k < m; ++k) {  // the numpy reference's operations, in its order
      const float t = th[k];
      const float sv = ss[k];  // read once: keep may be s itself
      const float dv = wide(d[k]);
      float av;
      if constexpr (Global) {
        const float mv = fold(mm[k], dv, px.mu, px.gain);
        mm[k] = mv;
        av = std::fabs(mv) * px.kappa;
      } else {
        av = wide(aa[k]);
      }
      const float shift = std::fabs(t - sv);
      const float denom = std::fabs(dv) + eps;
      const float pi = clip_like_numpy((av - shift) / denom, 0.0f, pi_max);
      const float nt = t + pi * dv;
      th[k] = nt;
      if constexpr (Keep) kp[k] = t;  // θ before this update: the worker's next s
      const float diff = nt - sv;
      se_block += diff * diff;
      sa_block += av * av;
      low_block += (pi > 0.0f) ? 0 : 1;
      high_block += (pi >= pi_max) ? 1 : 0;
      zero_block += (dv == 0.0f) ? 1 : 0;
      pib[k] = pi;
    }
    se += static_cast<double>(se_block);
    sa += static_cast<double>(sa_block);
    n_low += low_block;
    n_high += high_block;
    n_zero += zero_block;
    // first sampled element at or after base
    std::size_t k = (stride - (base - lo) % stride) % stride;
    // bins of the whole block, branch-free and vectorised; then the (sampled) increments
#pragma omp simd
    for (std::size_t q = 0; q < m; ++q) {
      const float pi = pib[q];
      const std::int32_t idx = static_cast<std::int32_t>(pi * inv_width);
      std::int32_t bin = 1 + (idx < kHistBins - 1 ? idx : kHistBins - 1);
      bin = (pi > 0.0f) ? bin : 0;
      bins[q] = (pi >= pi_max) ? kHistBins + 1 : bin;
    }
    for (; k + 3 * stride < m; k += 4 * stride) {
      ++sub[0][bins[k]];
      ++sub[1][bins[k + stride]];
      ++sub[2][bins[k + 2 * stride]];
      ++sub[3][bins[k + 3 * stride]];
    }
    for (; k < m; k += stride) ++sub[0][bins[k]];
  }
  for (int j = 0; j < kHistRow; ++j) {
    hist_row[j] += static_cast<std::int64_t>(sub[0][j]) + sub[1][j] + sub[2][j] + sub[3][j];
  }
  sums_row[0] += se;
  sums_row[1] += sa;
  counts_row[0] += n_low;
  counts_row[1] += n_high;
  counts_row[2] += n_zero;
}

// gem_step for the wire's element W (the public overloads below).
template <class W>
bool gem_step_t(float* theta, const W* delta, const W* a, const float* s, float* keep,
                std::size_t n, const std::int64_t* offsets, std::size_t n_tensors, float eps,
                float pi_max, std::int64_t* hist, double* sums, std::int64_t* counts,
                int threads, const GlobalProxy* proxy) {
  const GlobalProxy px = proxy != nullptr ? *proxy : GlobalProxy{nullptr, 0.0f, 0.0f, 0.0f};
  const bool finite =
      proxy != nullptr
          ? all_ranges_mt(n, threads, [&](std::size_t b, std::size_t e) {
              return finite_global_range(delta, s, px.m, px.mu, px.gain, px.kappa, b, e);
            })
          : all_finite_mt(delta, a, s, n, threads);
  if (!finite) return false;
  const float inv_width = static_cast<float>(kHistBins) / pi_max;
  const int t = std::max(1, threads);
  // per-thread statistics, merged below (thread 0 writes straight into the outputs)
  std::vector<std::int64_t> hist_local(static_cast<std::size_t>(t - 1) * n_tensors * kHistRow);
  std::vector<double> sums_local(static_cast<std::size_t>(t - 1) * n_tensors * 2);
  std::vector<std::int64_t> counts_local(static_cast<std::size_t>(t - 1) * n_tensors * kCounts);
  parallel_ranges(n, t, [&](std::size_t b, std::size_t e, int w) {
    std::int64_t* h = w == 0 ? hist : hist_local.data() + (w - 1) * n_tensors * kHistRow;
    double* sm = w == 0 ? sums : sums_local.data() + (w - 1) * n_tensors * 2;
    std::int64_t* cn = w == 0 ? counts : counts_local.data() + (w - 1) * n_tensors * kCounts;
    // the tensor holding element b
    std::size_t row = static_cast<std::size_t>(
        std::upper_bound(offsets, offsets + n_tensors + 1, static_cast<std::int64_t>(b)) -
        offsets - 1);
    std::size_t i = b;
    while (i < e && row < n_tensors) {
      const std::size_t seg_end = std::min(e, static_cast<std::size_t>(offsets[row + 1]));
      if (seg_end > i) {
        const auto lo = static_cast<std::size_t>(offsets[row]);
        const std::size_t size = static_cast<std::size_t>(offsets[row + 1]) - lo;
        auto run = [&](auto keep_c, auto global_c) {
          gem_block_range<W, decltype(keep_c)::value, decltype(global_c)::value>(
              theta, delta, a, s, keep, px, i, seg_end, lo, sample_stride(size), eps, pi_max,
              inv_width, h + row * kHistRow, sm + row * 2, cn + row * kCounts);
        };
        using Yes = std::true_type;
        using No = std::false_type;
        if (keep != nullptr) {
          proxy != nullptr ? run(Yes{}, Yes{}) : run(Yes{}, No{});
        } else {
          proxy != nullptr ? run(No{}, Yes{}) : run(No{}, No{});
        }
        i = seg_end;
      }
      ++row;
    }
  });
  for (int w = 1; w < t; ++w) {
    const std::int64_t* h = hist_local.data() + (w - 1) * n_tensors * kHistRow;
    const double* sm = sums_local.data() + (w - 1) * n_tensors * 2;
    const std::int64_t* cn = counts_local.data() + (w - 1) * n_tensors * kCounts;
    for (std::size_t k = 0; k < n_tensors * kHistRow; ++k) hist[k] += h[k];
    for (std::size_t k = 0; k < n_tensors * 2; ++k) sums[k] += sm[k];
    for (std::size_t k = 0; k < n_tensors * kCounts; ++k) counts[k] += cn[k];
  }
  return true;
}

// Gap-Aware's average of the squared steps, v_new = decay * v + gain * (d * d): three float32
// roundings in the numpy reference's order, never fused.
inline float ga_fold(float v, float d, float decay, float gain) noexcept {
  const float sq = d * d;
  const float decayed = decay * v;
  return decayed + gain * sq;
}

// Whether Δθ, s and every v_new of [b, e) are finite (nothing is written).
template <class W>
GEM_MPI_CLONES bool finite_gap_range(const W* d, const float* s, const float* v, float decay,
                                     float gain, std::size_t b, std::size_t e) noexcept {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (std::size_t i = b; i < e; ++i) {
    const float dv = wide(d[i]);
    acc += (dv * 0.0f + s[i] * 0.0f) + ga_fold(v[i], dv, decay, gain) * 0.0f;
  }
  return acc == 0.0f;
}

// The Gap-Aware step on [b, e); returns the sum of 1/p there (per-block float sums in double).
template <class W>
GEM_MPI_CLONES double gap_range(float* theta, const W* delta, const float* s, GapAware ga,
                                std::size_t b, std::size_t e) noexcept {
  double total = 0.0;
  for (std::size_t base = b; base < e; base += kBlock) {
    const std::size_t m = std::min(kBlock, e - base);
    float* th = theta + base;
    float* vv = ga.v + base;
    const W* d = delta + base;
    const float* ss = s + base;
    float block = 0.0f;
#pragma omp simd reduction(+ : block)
    for (std::size_t k = 0; k < m; ++k) {
      const float dv = wide(d[k]);
      const float vn = ga_fold(vv[k], dv, ga.decay, ga.gain);
      vv[k] = vn;
      const float c = std::sqrt(vn / ga.bias) + ga.eps;
      float p = std::fabs(th[k] - ss[k]) / c;
      p = p + 1.0f;
      th[k] = th[k] + dv / p;
      block += 1.0f / p;
    }
    total += static_cast<double>(block);
  }
  return total;
}

template <class W>
bool gap_step_t(float* theta, const W* delta, const float* s, std::size_t n, GapAware ga,
                double* scale_sum, int threads) {
  if (!all_ranges_mt(n, threads, [&](std::size_t b, std::size_t e) {
        return finite_gap_range(delta, s, ga.v, ga.decay, ga.gain, b, e);
      })) {
    return false;
  }
  const int t = std::max(1, threads);
  std::vector<double> part(static_cast<std::size_t>(t), 0.0);
  parallel_ranges(n, t, [&](std::size_t b, std::size_t e, int w) {
    part[static_cast<std::size_t>(w)] = gap_range(theta, delta, s, ga, b, e);
  });
  double total = 0.0;
  for (double x : part) total += x;  // in thread order
  *scale_sum = total;
  return true;
}

template <class W>
bool fixed_step_t(float* theta, const W* delta, std::size_t n, float scale, int threads) {
  if (!all_finite_mt(delta, delta, delta, n, threads)) return false;
  parallel_ranges(n, threads, [&](std::size_t b, std::size_t e, int) {
    for (std::size_t i = b; i < e; ++i) {
      const float step = scale * wide(delta[i]);
      theta[i] = theta[i] + step;
    }
  });
  return true;
}

// float32 -> bf16 bits. Nearest even: add 0x7FFF plus the kept half's lowest bit, keep the
// top half (a finite value may round up to Inf, as it must). Toward zero: keep the top half.
// A NaN is handled apart in both (the addition could carry it into Inf or wrap a -NaN to +0):
// its top half with the quiet bit set, so it stays a NaN of its sign.
template <bool NearestEven>
GEM_MPI_CLONES void to_bf16_range(const float* src, std::uint16_t* dst, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    std::uint32_t u;
    std::memcpy(&u, src + i, sizeof u);
    const std::uint32_t top = u >> 16;
    const std::uint32_t r = NearestEven ? (u + (0x7FFFu + (top & 1u))) >> 16 : top;
    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    dst[i] = static_cast<std::uint16_t>(nan ? (top | 0x0040u) : r);
  }
}

}  // namespace

bool gem_step(float* theta, const float* delta, const float* a, const float* s, float* keep,
              std::size_t n, const std::int64_t* offsets, std::size_t n_tensors, float eps,
              float pi_max, std::int64_t* hist, double* sums, std::int64_t* counts,
              int threads, const GlobalProxy* proxy) {
  return gem_step_t(theta, delta, a, s, keep, n, offsets, n_tensors, eps, pi_max, hist, sums,
                    counts, threads, proxy);
}

bool gem_step(float* theta, const std::uint16_t* delta, const std::uint16_t* a,
              const float* s, float* keep, std::size_t n, const std::int64_t* offsets,
              std::size_t n_tensors, float eps, float pi_max, std::int64_t* hist,
              double* sums, std::int64_t* counts, int threads, const GlobalProxy* proxy) {
  return gem_step_t(theta, delta, a, s, keep, n, offsets, n_tensors, eps, pi_max, hist, sums,
                    counts, threads, proxy);
}

bool gap_step(float* theta, const float* delta, const float* s, std::size_t n, GapAware ga,
              double* scale_sum, int threads) {
  return gap_step_t(theta, delta, s, n, ga, scale_sum, threads);
}

bool gap_step(float* theta, const std::uint16_t* delta, const float* s, std::size_t n,
              GapAware ga, double* scale_sum, int threads) {
  return gap_step_t(theta, delta, s, n, ga, scale_sum, threads);
}

void gem_summary(const std::int64_t* hist, const double* sums, const std::int64_t* counts,
                 const std::int64_t* sizes, std::size_t n_tensors, double pi_max,
                 float* per_tensor, double* scalars) {
  const double bin_width = pi_max / kHistBins;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> row(kHistRow, 0.0);  // the pooled histogram, each count weighed
  for (std::size_t t = 0; t < n_tensors; ++t) {
    const std::int64_t* h = hist + t * kHistRow;
    std::int64_t total = 0;
    for (int j = 0; j < kHistRow; ++j) total += h[j];
    // the lower median: the bin b holding the rank-th pi, interpolated inside it
    double median = nan;
    if (total > 0) {
      const std::int64_t rank = (total + 1) / 2;
      std::int64_t below = 0;
      int b = 0;
      while (below + h[b] < rank) below += h[b++];
      const double inside = static_cast<double>(std::max<std::int64_t>(h[b], 1));
      const double est = (static_cast<double>(b - 1) +
                          (static_cast<double>(rank - below) - 0.5) / inside) * bin_width;
      median = b == 0 ? 0.0 : (b == kHistBins + 1 ? pi_max : est);
    }
    const double size = static_cast<double>(std::max<std::int64_t>(sizes[t], 1));
    const std::int64_t* c = counts + t * kCounts;
    per_tensor[t] = static_cast<float>(median);
    per_tensor[n_tensors + t] = static_cast<float>(static_cast<double>(c[0] + c[1]) / size);
    per_tensor[2 * n_tensors + t] = static_cast<float>(static_cast<double>(c[0]) / size);
    per_tensor[3 * n_tensors + t] = static_cast<float>(static_cast<double>(c[2]) / size);
    const double weight =
        total > 0 ? static_cast<double>(sizes[t]) / static_cast<double>(total) : 0.0;
    for (int j = 0; j < kHistRow; ++j) row[j] += weight * static_cast<double>(h[j]);
  }
  std::vector<double> cum(kHistRow);
  double run = 0.0;
  for (int j = 0; j < kHistRow; ++j) cum[j] = run = run + row[j];
  double pooled = nan;
  if (run > 0.0) {
    const double half = 0.5 * run;
    int b = 0;
    while (b < kHistRow && cum[b] < half) ++b;
    if (b == 0) {
      pooled = 0.0;
    } else if (b >= kHistBins + 1) {
      pooled = pi_max;
    } else {
      const double frac = (half - cum[b - 1]) / row[b];
      pooled = (static_cast<double>(b - 1) + frac) * bin_width;
    }
  }
  double central = 0.0, proxy = 0.0;
  for (std::size_t t = 0; t < n_tensors; ++t) {
    central += sums[2 * t];
    proxy += sums[2 * t + 1];
  }
  scalars[0] = pooled;
  scalars[1] = 0.5 * central;
  scalars[2] = 0.5 * proxy;
}

bool fixed_step(float* theta, const float* delta, std::size_t n, float scale, int threads) {
  return fixed_step_t(theta, delta, n, scale, threads);
}

bool fixed_step(float* theta, const std::uint16_t* delta, std::size_t n, float scale,
                int threads) {
  return fixed_step_t(theta, delta, n, scale, threads);
}

void to_bf16(const float* src, std::uint16_t* dst, std::size_t n, Bf16Round mode) {
  if (mode == Bf16Round::kNearestEven) {
    to_bf16_range<true>(src, dst, n);
  } else {
    to_bf16_range<false>(src, dst, n);
  }
}

GEM_MPI_CLONES void worker_fold(const float* m_in, const float* delta, float* m_out, float* a,
                                std::size_t n, float mu, float kappa) {
  for (std::size_t i = 0; i < n; ++i) {
    float m = mu * m_in[i];
    m = m + delta[i];
    m_out[i] = m;
    a[i] = std::fabs(m) * kappa;
  }
}

namespace {
// cloned like the GEM loops, so the reference gets the same vector width
GEM_MPI_CLONES void triad_range(float* a, const float* b, const float* c, float q,
                                std::size_t lo, std::size_t hi) noexcept {
  for (std::size_t i = lo; i < hi; ++i) a[i] = b[i] + q * c[i];
}
}  // namespace

void triad(float* a, const float* b, const float* c, float q, std::size_t n, int threads,
           bool spawn) {
  parallel_ranges(
      n, threads, [&](std::size_t lo, std::size_t hi, int) { triad_range(a, b, c, q, lo, hi); },
      spawn ? Dispatch::kSpawn : Dispatch::kPool);
}

void copy(float* dst, const float* src, std::size_t n, int threads) {
  parallel_ranges(n, threads, [&](std::size_t lo, std::size_t hi, int) {
    std::memcpy(dst + lo, src + lo, (hi - lo) * sizeof(float));
  });
}

void fill(float* dst, float value, std::size_t n, int threads) {
  parallel_ranges(n, threads, [&](std::size_t lo, std::size_t hi, int) {
    std::fill(dst + lo, dst + hi, value);
  });
}

int pool_threads() { return ThreadPool::instance().size(); }

const char* compile_flags() noexcept { return GEM_MPI_CXX_FLAGS; }

bool built_native() noexcept { return GEM_MPI_NATIVE != 0; }

bool built_clones() noexcept { return GEM_MPI_CLONED != 0; }

}  // namespace gem_mpi
