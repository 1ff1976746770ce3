// gem_kernel.hpp - the master's fused update kernels, on raw float32 buffers.
//
// No Python here: bindings.cpp wraps these for numpy. Every float32 operation on theta is
// done in the order of the numpy reference (gem_mpi/algorithm/kernel.py), and it is compiled
// with -ffp-contract=off, so theta comes out bit-identical to numpy's (no FMA fusion, no
// reassociation, no flush-to-zero). The statistics are sums in double and a histogram.
#pragma once

#include <cstddef>
#include <cstdint>

namespace gem_mpi {

// Interior bins of the per-tensor histogram of π over [0, π_max]. Row layout per tensor:
// [0] π <= 0 (clamped low), [1 .. kHistBins] interior, [kHistBins + 1] π >= π_max (clamped
// high). The median read off it is exact to within one bin: π_max / kHistBins.
constexpr int kHistBins = 512;
constexpr int kHistRow = kHistBins + 2;

// Per-tensor counts: [0] pi <= 0, [1] pi >= pi_max, [2] delta == 0 (an element that does not
// move whatever pi is: its pi is (a - shift) / eps, clamped, and says nothing of the rule).
constexpr int kCounts = 3;

// The histogram of a tensor of n elements takes every sample_stride(n)-th element: all of
// them up to kHistSample elements, else between kHistSample / 2 and kHistSample evenly
// spaced ones. Increments are the kernel's costliest part; the clamp counts stay exact.
constexpr std::size_t kHistSample = 8192;
inline std::size_t sample_stride(std::size_t n) noexcept {
  return n <= kHistSample ? 1 : (n + kHistSample - 1) / kHistSample;
}

// One GEM step over all tensors (offsets[0] = 0 < ... <= offsets[n_tensors] = n), unless
// delta, a or s holds a non-finite value: then nothing is written and false is returned.
// Per element i of tensor t:
//   pi = clamp((a[i] - |theta[i] - s[i]|) / (|delta[i]| + eps), 0, pi_max)
//   theta[i] += pi * delta[i]
//   hist[t * kHistRow + bin(pi)] += 1          for the sampled elements (sample_stride)
//   sums[2 t] += (theta_new[i] - s[i])^2 ;  sums[2 t + 1] += a[i]^2   (float32 squares,
//   summed in float within blocks of 1024 elements, then in double)
//   counts[3 t] += (pi <= 0) ;  counts[3 t + 1] += (pi >= pi_max) ;  counts[3 t + 2] +=
//   (delta[i] == 0)   (exact counts)
//   keep[i] = theta[i] before the update, when keep is not null (it may be s itself: the
//   paper's reading of the shift, where a worker's next s is θ just before this update)
// hist, sums and counts are accumulated into (the caller zeroes them). threads >= 1 splits the
// elements into contiguous ranges; theta and hist do not depend on it, the sums' rounding
// does (summation order).
//
// The global proxy (--gem-proxy global): when m is not null, a is not read; the master's own
// first moment m is folded and a computed here, in the same pass, as a GEM worker does it:
//   m_new = mu * m[i] ;  m_new = m_new + gain * delta[i] ;  a = |m_new| * kappa
// each a separate float32 rounding (no FMA: the file is compiled with -ffp-contract=off, and
// with one worker mu is the worker's μ and gain is 1, so m and a are the worker's bits).
// The finiteness check then covers delta, s and that a (so m_new too); a rejected update
// leaves m as well as theta untouched.
struct GlobalProxy {
  float* m;  // the master's first moment, n floats (read and written)
  float mu;  // its decay per incoming update
  float gain;  // the weight of an incoming delta
  float kappa;
};

bool gem_step(float* theta, const float* delta, const float* a, const float* s, float* keep,
              std::size_t n, const std::int64_t* offsets, std::size_t n_tensors, float eps,
              float pi_max, std::int64_t* hist, double* sums, std::int64_t* counts,
              int threads, const GlobalProxy* proxy = nullptr);

// The same step with --wire bf16: delta and a are bf16 bits (uint16), widened exactly to
// float32 as they are read; every operation after is the float32 step's, in its order, so
// theta is what the float32 step gives on the widened arrays (and the statistics: a^2, the
// delta == 0 count, from the widened values).
bool gem_step(float* theta, const std::uint16_t* delta, const std::uint16_t* a,
              const float* s, float* keep, std::size_t n, const std::int64_t* offsets,
              std::size_t n_tensors, float eps, float pi_max, std::int64_t* hist,
              double* sums, std::int64_t* counts, int threads,
              const GlobalProxy* proxy = nullptr);

// What the metrics record of one GEM step, read off its hist, sums and counts (T tensors of
// sizes[t] elements), in the numpy reference's double operations and order
// (gem_mpi/algorithm/kernel.py: hist_median, pooled_median, Kernel.gem_step), so the values
// are its bits. per_tensor (float32, 4 rows of T): the lower median of pi (NaN for a tensor
// with nothing counted), the clamped share (pi <= 0 or >= pi_max), the share clamped low,
// the share with delta == 0. scalars: the median of pi over all parameters (each tensor's
// counts weighed by size / sampled; NaN when nothing was counted), 1/2 sum of
// (theta_new - s)^2 and 1/2 sum of a^2 (summed over tensors in order).
void gem_summary(const std::int64_t* hist, const double* sums, const std::int64_t* counts,
                 const std::int64_t* sizes, std::size_t n_tensors, double pi_max,
                 float* per_tensor, double* scalars);

// theta[i] += scale * delta[i] (DOWNPOUR: scale 1; adaptive staleness: 1 / (tau + 1)),
// unless delta holds a non-finite value: then nothing is written and false is returned.
bool fixed_step(float* theta, const float* delta, std::size_t n, float scale, int threads);
// The same with --wire bf16: delta is bf16 bits, widened exactly.
bool fixed_step(float* theta, const std::uint16_t* delta, std::size_t n, float scale,
                int threads);

// Gap-Aware (--method gap-aware) for the master's t-th applied update: v is the master's
// moving average of the squared incoming steps (n floats, read and written); bias is
// float32(1 - decay^t), computed by the caller. Per element, each a float32 rounding in this
// order (the numpy reference gap_step_numpy's):
//   v_new = decay * v[i] ;  v_new = v_new + gain * (delta[i] * delta[i])
//   c = sqrt(v_new / bias) + eps ;  p = |theta[i] - s[i]| / c ;  p = p + 1
//   theta[i] = theta[i] + delta[i] / p
// unless delta, s or some v_new is not finite: then nothing is written and false is
// returned. *scale_sum receives the sum of 1 / p (float32 terms, per-block float sums added
// in double: its rounding depends on threads; theta and v do not).
struct GapAware {
  float* v;
  float decay;
  float gain;  // float32(1 - decay)
  float bias;
  float eps;
};
bool gap_step(float* theta, const float* delta, const float* s, std::size_t n, GapAware ga,
              double* scale_sum, int threads);
// The same with --wire bf16: delta is bf16 bits, widened exactly.
bool gap_step(float* theta, const std::uint16_t* delta, const float* s, std::size_t n,
              GapAware ga, double* scale_sum, int threads);

// A worker's --wire bf16 conversion, on one thread (a worker's core is its own):
// dst[i] = the bf16 bits of src[i], rounded to nearest even (Δθ) or toward zero (κ|m|: never
// above it, so the energy budget never exceeds the proxy's). A NaN stays a NaN (its sign
// kept, the quiet bit set); a finite value may round to ±Inf (nearest even) and is then
// rejected by the master like any non-finite update.
enum class Bf16Round : int { kNearestEven = 0, kTowardZero = 1 };
void to_bf16(const float* src, std::uint16_t* dst, std::size_t n, Bf16Round mode);

// A GEM worker's proxy momentum, folded in one pass (its --gem-proxy local payload):
//   m_out[i] = mu * m_in[i] ;  m_out[i] = m_out[i] + delta[i] ;  a[i] = |m_out[i]| * kappa
// each a float32 rounding, as the numpy/torch fold (gem_mpi.algorithm.rule.Momentum) does it
// in three passes. m_out may be m_in (in place). On one thread: a worker's core is its own.
void worker_fold(const float* m_in, const float* delta, float* m_out, float* a, std::size_t n,
                 float mu, float kappa);

// Every kernel with threads > 1 cuts [0, n) into `threads` contiguous ranges of a multiple
// of 64 elements each (fewer when n < 64 threads: then one); the caller runs range 0 and
// the process's persistent pool thread w range w (thread_pool.hpp).

// dst[i] = value, range w written by pool thread w: called on fresh memory with the
// threads and length of the kernel that will stream it, it places each page where its
// thread runs (first touch).
void fill(float* dst, float value, std::size_t n, int threads);

// Bandwidth references for the benchmark, on the same threads: a[i] = b[i] + q * c[i]
// (STREAM triad) and dst = src (memcpy). spawn: on threads spawned for this call instead
// of the pool's (the benchmark's measure of what the pool saves; nothing else spawns).
void triad(float* a, const float* b, const float* c, float q, std::size_t n, int threads,
           bool spawn = false);
void copy(float* dst, const float* src, std::size_t n, int threads);

// Threads the persistent pool has started so far (the callers' own not counted).
int pool_threads();

// Flags the library was compiled with, and whether -march=native was among them.
const char* compile_flags() noexcept;
bool built_native() noexcept;
// Whether the hot loops carry a generic and an AVX2 clone chosen at load time.
bool built_clones() noexcept;

}  // namespace gem_mpi
