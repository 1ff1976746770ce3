// bindings.cpp - the thin pybind11 module gem_mpi.algorithm._core over gem_kernel.hpp.
//
// Arrays are validated, never converted: a float64 or strided "theta" silently
// copied to float32 would take the update in the copy and lose it. Every bad
// argument (not an ndarray, wrong dtype, not 1-D, not C-contiguous, unaligned,
// size mismatch, read-only output) raises ValueError. The loops run without the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "gem_kernel.hpp"

namespace py = pybind11;

#ifndef GEM_MPI_VERSION
#define GEM_MPI_VERSION "unknown"
#endif
#ifndef GEM_MPI_COMPILER
#if defined(__clang__)
#define GEM_MPI_COMPILER "Clang " __clang_version__
#elif defined(__GNUC__)
#define GEM_MPI_COMPILER "GNU " __VERSION__
#else
#define GEM_MPI_COMPILER "unknown"
#endif
#endif
#ifndef GEM_MPI_BUILD_TYPE
#define GEM_MPI_BUILD_TYPE "unknown"
#endif

namespace {

using F32 = py::array_t<float, py::array::c_style>;

std::string describe(const py::handle& obj) {
  return std::string(py::str(py::type::handle_of(obj).attr("__name__")));
}

// Returns obj as a 1-D C-contiguous aligned float32 array, or raises ValueError.
F32 as_vector(const char* fn, const char* name, const py::object& obj, bool output) {
  const std::string where = std::string(fn) + ": " + name;
  if (!py::isinstance<py::array>(obj)) {
    throw py::value_error(where + " must be a 1-D float32 numpy array, got " + describe(obj));
  }
  auto arr = py::reinterpret_borrow<py::array>(obj);
  if (!py::isinstance<py::array_t<float>>(arr)) {
    throw py::value_error(where + " must have dtype float32 (native byte order), got " +
                          std::string(py::str(arr.dtype())));
  }
  if (arr.ndim() != 1) {
    throw py::value_error(where + " must be 1-D, got " + std::to_string(arr.ndim()) +
                          " dimensions (pass a flat view, e.g. x.reshape(-1))");
  }
  if (!(arr.flags() & py::array::c_style)) {
    throw py::value_error(where + " must be contiguous (use np.ascontiguousarray)");
  }
  if (!(arr.flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_)) {
    throw py::value_error(where + " is not aligned to float32 (copy it first)");
  }
  if (output && !arr.writeable()) {
    throw py::value_error(where + " is an output but the array is read-only");
  }
  return py::reinterpret_borrow<F32>(arr);
}

using U16 = py::array_t<std::uint16_t, py::array::c_style>;

// Whether obj is a uint16 numpy array: bf16 bits (--wire bf16), where float32 is the default.
bool is_bits(const py::object& obj) {
  return py::isinstance<py::array>(obj) && py::isinstance<py::array_t<std::uint16_t>>(obj);
}

// Returns obj as a 1-D C-contiguous uint16 array (bf16 bits), or raises ValueError.
U16 as_bits(const char* fn, const char* name, const py::object& obj, bool output) {
  const std::string where = std::string(fn) + ": " + name;
  if (!is_bits(obj)) {
    throw py::value_error(where + " must be a 1-D uint16 numpy array (bf16 bits), got " +
                          (py::isinstance<py::array>(obj)
                               ? std::string(py::str(py::reinterpret_borrow<py::array>(obj)
                                                         .dtype()))
                               : describe(obj)));
  }
  auto arr = py::reinterpret_borrow<py::array>(obj);
  if (arr.ndim() != 1 || !(arr.flags() & py::array::c_style) ||
      !(arr.flags() & py::detail::npy_api::NPY_ARRAY_ALIGNED_)) {
    throw py::value_error(where + " must be 1-D, contiguous and aligned");
  }
  if (output && !arr.writeable()) {
    throw py::value_error(where + " is an output but the array is read-only");
  }
  return py::reinterpret_borrow<U16>(arr);
}

template <class A>
void check_size(const char* fn, const char* name, const A& arr, py::ssize_t n) {
  if (arr.size() != n) {
    throw py::value_error(std::string(fn) + ": " + name + " has " + std::to_string(arr.size()) +
                          " elements but theta has " + std::to_string(n));
  }
}

template <class T>
py::array_t<T, py::array::c_style> as_typed(const char* fn, const char* name,
                                            const py::object& obj, int ndim, bool output) {
  const std::string where = std::string(fn) + ": " + name;
  if (!py::isinstance<py::array_t<T>>(obj) ||
      !(py::reinterpret_borrow<py::array>(obj).flags() & py::array::c_style)) {
    throw py::value_error(where + " must be a C-contiguous numpy array of the right dtype");
  }
  auto arr = py::reinterpret_borrow<py::array_t<T, py::array::c_style>>(obj);
  if (arr.ndim() != ndim) {
    throw py::value_error(where + " must have " + std::to_string(ndim) + " dimension(s)");
  }
  if (output && !arr.writeable()) {
    throw py::value_error(where + " is an output but the array is read-only");
  }
  return arr;
}

bool gem_step(const py::object& theta_o, const py::object& delta_o, const py::object& a_o,
              const py::object& s_o, const py::object& offsets_o, float eps, float pi_max,
              const py::object& hist_o, const py::object& sums_o, const py::object& counts_o,
              int threads, const py::object& keep_o, const py::object& m_o, float mu,
              float gain, float kappa) {
  const char* fn = "gem_step";
  F32 theta = as_vector(fn, "theta", theta_o, true);
  // the wire: delta (and a) float32, or uint16 bf16 bits (--wire bf16), widened exactly
  const bool bits = is_bits(delta_o);
  F32 delta, a;
  U16 delta16, a16;
  F32 s = as_vector(fn, "s", s_o, false);
  const py::ssize_t n = theta.size();
  if (bits) {
    delta16 = as_bits(fn, "delta", delta_o, false);
    check_size(fn, "delta", delta16, n);
  } else {
    delta = as_vector(fn, "delta", delta_o, false);
    check_size(fn, "delta", delta, n);
  }
  check_size(fn, "s", s, n);
  // the global proxy: the master's m instead of the worker's a (exactly one of them)
  const bool global = !m_o.is_none();
  if (global == !a_o.is_none()) {
    throw py::value_error("gem_step: give either a (local proxy) or m (global proxy)");
  }
  F32 m;
  gem_mpi::GlobalProxy proxy{nullptr, mu, gain, kappa};
  if (global) {
    m = as_vector(fn, "m", m_o, true);
    check_size(fn, "m", m, n);
    proxy.m = m.mutable_data();
  } else if (bits) {
    a16 = as_bits(fn, "a (as delta)", a_o, false);
    check_size(fn, "a", a16, n);
  } else {
    a = as_vector(fn, "a", a_o, false);
    check_size(fn, "a", a, n);
  }
  float* keep_p = nullptr;
  F32 keep;
  if (!keep_o.is_none()) {
    keep = as_vector(fn, "keep", keep_o, true);
    check_size(fn, "keep", keep, n);
    keep_p = keep.mutable_data();
  }
  auto offsets = as_typed<std::int64_t>(fn, "offsets", offsets_o, 1, false);
  auto hist = as_typed<std::int64_t>(fn, "hist", hist_o, 2, true);
  auto sums = as_typed<double>(fn, "sums", sums_o, 2, true);
  auto counts = as_typed<std::int64_t>(fn, "counts", counts_o, 2, true);
  const py::ssize_t t = offsets.size() - 1;
  if (t < 1) throw py::value_error("gem_step: offsets needs at least 2 entries");
  const std::int64_t* off = offsets.data();
  if (off[0] != 0 || off[t] != n) {
    throw py::value_error("gem_step: offsets must start at 0 and end at theta's size");
  }
  for (py::ssize_t k = 0; k < t; ++k) {
    if (off[k + 1] < off[k]) throw py::value_error("gem_step: offsets must not decrease");
  }
  if (hist.shape(0) != t || hist.shape(1) != gem_mpi::kHistRow) {
    throw py::value_error("gem_step: hist must have shape (n_tensors, HIST_BINS + 2)");
  }
  if (sums.shape(0) != t || sums.shape(1) != 2) {
    throw py::value_error("gem_step: sums must have shape (n_tensors, 2)");
  }
  if (counts.shape(0) != t || counts.shape(1) != gem_mpi::kCounts) {
    throw py::value_error("gem_step: counts must have shape (n_tensors, COUNTS)");
  }
  if (!(pi_max > 0.0f) || !(eps > 0.0f) || threads < 1) {
    throw py::value_error("gem_step: needs pi_max > 0, eps > 0 and threads >= 1");
  }
  float* theta_p = theta.mutable_data();
  std::int64_t* hist_p = hist.mutable_data();
  double* sums_p = sums.mutable_data();
  std::int64_t* counts_p = counts.mutable_data();
  py::gil_scoped_release nogil;
  if (bits) {
    return gem_mpi::gem_step(theta_p, delta16.data(), global ? nullptr : a16.data(), s.data(),
                             keep_p, static_cast<std::size_t>(n), off,
                             static_cast<std::size_t>(t), eps, pi_max, hist_p, sums_p,
                             counts_p, threads, global ? &proxy : nullptr);
  }
  return gem_mpi::gem_step(theta_p, delta.data(), global ? nullptr : a.data(), s.data(),
                           keep_p, static_cast<std::size_t>(n), off,
                           static_cast<std::size_t>(t), eps, pi_max, hist_p, sums_p, counts_p,
                           threads, global ? &proxy : nullptr);
}

void gem_summary(const py::object& hist_o, const py::object& sums_o, const py::object& counts_o,
                 const py::object& sizes_o, double pi_max, const py::object& per_tensor_o,
                 const py::object& scalars_o) {
  const char* fn = "gem_summary";
  auto hist = as_typed<std::int64_t>(fn, "hist", hist_o, 2, false);
  auto sums = as_typed<double>(fn, "sums", sums_o, 2, false);
  auto counts = as_typed<std::int64_t>(fn, "counts", counts_o, 2, false);
  auto sizes = as_typed<std::int64_t>(fn, "sizes", sizes_o, 1, false);
  auto per_tensor = as_typed<float>(fn, "per_tensor", per_tensor_o, 2, true);
  auto scalars = as_typed<double>(fn, "scalars", scalars_o, 1, true);
  const py::ssize_t t = sizes.size();
  if (hist.shape(0) != t || hist.shape(1) != gem_mpi::kHistRow || sums.shape(0) != t ||
      sums.shape(1) != 2 || counts.shape(0) != t || counts.shape(1) != gem_mpi::kCounts ||
      per_tensor.shape(0) != 4 || per_tensor.shape(1) != t || scalars.size() != 3) {
    throw py::value_error("gem_summary: needs hist (T, HIST_BINS + 2), sums (T, 2), counts "
                          "(T, COUNTS), sizes (T,), per_tensor (4, T) and scalars (3,)");
  }
  if (!(pi_max > 0.0)) throw py::value_error("gem_summary: needs pi_max > 0");
  gem_mpi::gem_summary(hist.data(), sums.data(), counts.data(), sizes.data(),
                       static_cast<std::size_t>(t), pi_max, per_tensor.mutable_data(),
                       scalars.mutable_data());
}

bool fixed_step(const py::object& theta_o, const py::object& delta_o, float scale,
                int threads) {
  const char* fn = "fixed_step";
  F32 theta = as_vector(fn, "theta", theta_o, true);
  const py::ssize_t n = theta.size();
  if (threads < 1) throw py::value_error("fixed_step: threads must be >= 1");
  float* theta_p = theta.mutable_data();
  if (is_bits(delta_o)) {  // --wire bf16
    U16 delta = as_bits(fn, "delta", delta_o, false);
    check_size(fn, "delta", delta, n);
    py::gil_scoped_release nogil;
    return gem_mpi::fixed_step(theta_p, delta.data(), static_cast<std::size_t>(n), scale,
                               threads);
  }
  F32 delta = as_vector(fn, "delta", delta_o, false);
  check_size(fn, "delta", delta, n);
  py::gil_scoped_release nogil;
  return gem_mpi::fixed_step(theta_p, delta.data(), static_cast<std::size_t>(n), scale,
                             threads);
}

// Returns the mean of 1/p over the elements, or None when the update was rejected.
py::object gap_step(const py::object& theta_o, const py::object& delta_o, const py::object& s_o,
                    const py::object& v_o, float decay, float gain, float bias, float eps,
                    int threads) {
  const char* fn = "gap_step";
  F32 theta = as_vector(fn, "theta", theta_o, true);
  const py::ssize_t n = theta.size();
  F32 s = as_vector(fn, "s", s_o, false);
  check_size(fn, "s", s, n);
  F32 v = as_vector(fn, "v", v_o, true);
  check_size(fn, "v", v, n);
  if (threads < 1 || !(bias > 0.0f) || !(eps > 0.0f) || !(decay >= 0.0f && decay < 1.0f)) {
    throw py::value_error("gap_step: needs 0 <= decay < 1, bias > 0, eps > 0, threads >= 1");
  }
  float* theta_p = theta.mutable_data();
  const gem_mpi::GapAware ga{v.mutable_data(), decay, gain, bias, eps};
  double sum = 0.0;
  bool ok;
  if (is_bits(delta_o)) {  // --wire bf16
    U16 delta = as_bits(fn, "delta", delta_o, false);
    check_size(fn, "delta", delta, n);
    py::gil_scoped_release nogil;
    ok = gem_mpi::gap_step(theta_p, delta.data(), s.data(), static_cast<std::size_t>(n), ga,
                           &sum, threads);
  } else {
    F32 delta = as_vector(fn, "delta", delta_o, false);
    check_size(fn, "delta", delta, n);
    py::gil_scoped_release nogil;
    ok = gem_mpi::gap_step(theta_p, delta.data(), s.data(), static_cast<std::size_t>(n), ga,
                           &sum, threads);
  }
  if (!ok) return py::none();
  return py::float_(n > 0 ? sum / static_cast<double>(n) : 0.0);
}

// The bf16 rounding modes, as _core.BF16_NEAREST_EVEN / BF16_TOWARD_ZERO.
void to_bf16(const py::object& src_o, const py::object& dst_o, int mode) {
  const char* fn = "to_bf16";
  F32 src = as_vector(fn, "src", src_o, false);
  U16 dst = as_bits(fn, "dst", dst_o, true);
  check_size(fn, "dst", dst, src.size());
  if (mode != static_cast<int>(gem_mpi::Bf16Round::kNearestEven) &&
      mode != static_cast<int>(gem_mpi::Bf16Round::kTowardZero)) {
    throw py::value_error("to_bf16: mode must be BF16_NEAREST_EVEN or BF16_TOWARD_ZERO");
  }
  std::uint16_t* dp = dst.mutable_data();
  py::gil_scoped_release nogil;
  gem_mpi::to_bf16(src.data(), dp, static_cast<std::size_t>(src.size()),
                   static_cast<gem_mpi::Bf16Round>(mode));
}

void worker_fold(const py::object& m_in_o, const py::object& delta_o, const py::object& m_out_o,
                 const py::object& a_o, float mu, float kappa) {
  const char* fn = "worker_fold";
  F32 m_in = as_vector(fn, "m_in", m_in_o, false);
  F32 delta = as_vector(fn, "delta", delta_o, false);
  F32 m_out = as_vector(fn, "m_out", m_out_o, true);
  F32 a = as_vector(fn, "a", a_o, true);
  const py::ssize_t n = m_in.size();
  check_size(fn, "delta", delta, n);
  check_size(fn, "m_out", m_out, n);
  check_size(fn, "a", a, n);
  float* m_out_p = m_out.mutable_data();
  float* a_p = a.mutable_data();
  py::gil_scoped_release nogil;
  gem_mpi::worker_fold(m_in.data(), delta.data(), m_out_p, a_p, static_cast<std::size_t>(n),
                       mu, kappa);
}

void triad(const py::object& a_o, const py::object& b_o, const py::object& c_o, float q,
           int threads, bool spawn) {
  F32 a = as_vector("triad", "a", a_o, true);
  F32 b = as_vector("triad", "b", b_o, false);
  F32 c = as_vector("triad", "c", c_o, false);
  check_size("triad", "b", b, a.size());
  check_size("triad", "c", c, a.size());
  float* ap = a.mutable_data();
  py::gil_scoped_release nogil;
  gem_mpi::triad(ap, b.data(), c.data(), q, static_cast<std::size_t>(a.size()),
                 std::max(1, threads), spawn);
}

void fill(const py::object& dst_o, float value, int threads) {
  F32 dst = as_vector("fill", "dst", dst_o, true);
  if (threads < 1) throw py::value_error("fill: threads must be >= 1");
  float* dp = dst.mutable_data();
  py::gil_scoped_release nogil;
  gem_mpi::fill(dp, value, static_cast<std::size_t>(dst.size()), threads);
}

void copy(const py::object& dst_o, const py::object& src_o, int threads) {
  F32 dst = as_vector("copy", "dst", dst_o, true);
  F32 src = as_vector("copy", "src", src_o, false);
  check_size("copy", "src", src, dst.size());
  float* dp = dst.mutable_data();
  py::gil_scoped_release nogil;
  gem_mpi::copy(dp, src.data(), static_cast<std::size_t>(dst.size()), std::max(1, threads));
}

py::dict build_info() {
  py::dict info;
  info["version"] = GEM_MPI_VERSION;
  info["compiler"] = GEM_MPI_COMPILER;
  info["build_type"] = GEM_MPI_BUILD_TYPE;
  info["flags"] = gem_mpi::compile_flags();
  info["native"] = gem_mpi::built_native();
  info["avx2_clone"] = gem_mpi::built_clones();
  info["fp_contract"] = "off";
  info["pybind11"] = std::to_string(PYBIND11_VERSION_MAJOR) + "." +
                     std::to_string(PYBIND11_VERSION_MINOR) + "." +
                     std::to_string(PYBIND11_VERSION_PATCH);
  return info;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "gem_mpi.algorithm._core: float32 element-wise kernels (bit-identical to the numpy reference)";
  m.attr("__version__") = GEM_MPI_VERSION;

  m.attr("HIST_BINS") = gem_mpi::kHistBins;
  m.attr("HIST_SAMPLE") = static_cast<int>(gem_mpi::kHistSample);
  m.attr("COUNTS") = gem_mpi::kCounts;
  m.attr("BF16_NEAREST_EVEN") = static_cast<int>(gem_mpi::Bf16Round::kNearestEven);
  m.attr("BF16_TOWARD_ZERO") = static_cast<int>(gem_mpi::Bf16Round::kTowardZero);

  m.def("gem_step", &gem_step, py::arg("theta"), py::arg("delta"), py::arg("a"), py::arg("s"),
        py::arg("offsets"), py::arg("eps"), py::arg("pi_max"), py::arg("hist"),
        py::arg("sums"), py::arg("counts"), py::arg("threads") = 1,
        py::arg("keep") = py::none(), py::arg("m") = py::none(), py::arg("mu") = 0.0f,
        py::arg("gain") = 1.0f, py::arg("kappa") = 1.0f,
        R"doc(gem_step(theta, delta, a, s, offsets, eps, pi_max, hist, sums, counts, threads=1, keep=None, m=None, mu=0, gain=1, kappa=1) -> bool

One fused GEM step in place on theta (1-D float32; delta, a, s of the same size; delta and a
float32, or both uint16 bf16 bits (--wire bf16), widened exactly), with
per-tensor statistics accumulated into hist (int64, (T, HIST_BINS + 2); a tensor of n
elements contributes every sample_stride(n)-th one), sums (float64, (T, 2): sum of
(theta_new - s)^2 and of a^2) and counts (int64, (T, COUNTS): elements with pi <= 0, with
pi >= pi_max and with delta == 0), T = len(offsets) - 1.
Returns False, writing nothing, when delta, a or s holds a NaN or Inf. theta is
bit-identical to gem_mpi.algorithm.kernel.gem_step_numpy. keep (float32, same size, may be
s itself): receives theta before the update. The global proxy: a is None and m (float32,
same size, written) is the master's first moment: m = mu*m + gain*delta and
a = |m|*kappa are computed in the same pass, each a float32 rounding; a rejected update
leaves m untouched too. The GIL is released.)doc");

  m.def("gem_summary", &gem_summary, py::arg("hist"), py::arg("sums"), py::arg("counts"),
        py::arg("sizes"), py::arg("pi_max"), py::arg("per_tensor"), py::arg("scalars"),
        "gem_summary(hist, sums, counts, sizes, pi_max, per_tensor, scalars): what the "
        "metrics record of one gem_step, read off its statistics, with the numpy reference's "
        "bits: per_tensor (float32, (4, T)) gets each tensor's median pi, clamped share, "
        "share clamped low and share with delta == 0; scalars (float64, (3,)) the pooled "
        "median pi, 1/2 sum (theta_new - s)^2 and 1/2 sum a^2");

  m.def("fixed_step", &fixed_step, py::arg("theta"), py::arg("delta"), py::arg("scale"),
        py::arg("threads") = 1,
        R"doc(fixed_step(theta, delta, scale, threads=1) -> bool

theta += float32(scale) * delta in place (DOWNPOUR, adaptive staleness; delta float32 or
uint16 bf16 bits, widened exactly), bit-identical to
numpy; returns False, writing nothing, when delta holds a NaN or Inf.)doc");

  m.def("gap_step", &gap_step, py::arg("theta"), py::arg("delta"), py::arg("s"), py::arg("v"),
        py::arg("decay"), py::arg("gain"), py::arg("bias"), py::arg("eps"),
        py::arg("threads") = 1,
        R"doc(gap_step(theta, delta, s, v, decay, gain, bias, eps, threads=1) -> float | None

One Gap-Aware step in place on theta and v (1-D float32 of one size; delta float32 or uint16
bf16 bits, widened exactly): v = decay*v + gain*delta^2, c = sqrt(v/bias) + eps,
p = |theta - s|/c + 1, theta += delta/p, each a float32 rounding in that order, bit-identical
to gem_mpi.algorithm.kernel.gap_step_numpy for every thread count. Returns the mean of 1/p,
or None, writing nothing, when delta, s or the new v holds a NaN or Inf. The GIL is
released.)doc");

  m.def("to_bf16", &to_bf16, py::arg("src"), py::arg("dst"), py::arg("mode"),
        "to_bf16(src, dst, mode): dst (uint16, same size) = the bf16 bits of src (float32), "
        "rounded to nearest even (BF16_NEAREST_EVEN) or toward zero (BF16_TOWARD_ZERO); a "
        "NaN stays a NaN (--wire bf16, a worker's conversion; one thread, the GIL released; "
        "bit-identical to gem_mpi.algorithm.kernel.to_bf16_numpy)");
  m.def("worker_fold", &worker_fold, py::arg("m_in"), py::arg("delta"), py::arg("m_out"),
        py::arg("a"), py::arg("mu"), py::arg("kappa"),
        "worker_fold(m_in, delta, m_out, a, mu, kappa): a GEM worker's fold in one pass, "
        "m_out = mu*m_in + delta, a = |m_out|*kappa, each a float32 rounding (bit-identical "
        "to gem_mpi.algorithm.rule.Momentum's numpy fold; m_out may be m_in)");
  m.def("triad", &triad, py::arg("a"), py::arg("b"), py::arg("c"), py::arg("q"),
        py::arg("threads") = 1, py::arg("spawn") = false,
        "triad(a, b, c, q, threads=1, spawn=False): a = b + q * c, each a float32 rounding "
        "(the benchmarks' STREAM triad and a worker's gradient point); spawn: on threads "
        "spawned for this call, not the pool's");
  m.def("fill", &fill, py::arg("dst"), py::arg("value"), py::arg("threads") = 1,
        "fill(dst, value, threads=1): dst[:] = value, each thread its own range of the "
        "kernels' split (first touch of memory the kernels will stream)");
  m.def("pool_threads", &gem_mpi::pool_threads,
        "pool_threads() -> int: the kernels' persistent threads started so far");
  m.def("copy", &copy, py::arg("dst"), py::arg("src"), py::arg("threads") = 1,
        "copy(dst, src, threads=1): memcpy (benchmark)");

  m.def("build_info", &build_info,
        "build_info() -> dict: version, compiler, build_type, flags, native, fp_contract, "
        "pybind11");
}
