// bindings.cpp - the thin pybind11 module gem_mpi._core over gem_kernel.hpp.
//
// Arrays are validated, never converted: a float64 or strided "theta" silently
// copied to float32 would take the update in the copy and lose it. Every bad
// argument (not an ndarray, wrong dtype, not 1-D, not C-contiguous, unaligned,
// size mismatch, read-only output) raises ValueError. The loops run without the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
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

void check_size(const char* fn, const char* name, const F32& arr, py::ssize_t n) {
  if (arr.size() != n) {
    throw py::value_error(std::string(fn) + ": " + name + " has " + std::to_string(arr.size()) +
                          " elements but theta has " + std::to_string(n));
  }
}

void gem_apply(const py::object& theta_o, const py::object& delta_o, const py::object& a_o,
               const py::object& s_o, const py::object& pi_out_o, float eps, float pi_max) {
  const char* fn = "gem_apply";
  F32 theta = as_vector(fn, "theta", theta_o, true);
  F32 delta = as_vector(fn, "delta", delta_o, false);
  F32 a = as_vector(fn, "a", a_o, false);
  F32 s = as_vector(fn, "s", s_o, false);
  F32 pi_out = as_vector(fn, "pi_out", pi_out_o, true);
  const py::ssize_t n = theta.size();
  check_size(fn, "delta", delta, n);
  check_size(fn, "a", a, n);
  check_size(fn, "s", s, n);
  check_size(fn, "pi_out", pi_out, n);
  float* theta_p = theta.mutable_data();
  float* pi_p = pi_out.mutable_data();
  const float* delta_p = delta.data();
  const float* a_p = a.data();
  const float* s_p = s.data();
  py::gil_scoped_release nogil;
  gem_mpi::gem_apply(theta_p, delta_p, a_p, s_p, pi_p, static_cast<std::size_t>(n), eps, pi_max);
}

void scaled_apply(const py::object& theta_o, const py::object& delta_o, float scale) {
  const char* fn = "scaled_apply";
  F32 theta = as_vector(fn, "theta", theta_o, true);
  F32 delta = as_vector(fn, "delta", delta_o, false);
  const py::ssize_t n = theta.size();
  check_size(fn, "delta", delta, n);
  float* theta_p = theta.mutable_data();
  const float* delta_p = delta.data();
  py::gil_scoped_release nogil;
  gem_mpi::scaled_apply(theta_p, delta_p, static_cast<std::size_t>(n), scale);
}

py::dict build_info() {
  py::dict info;
  info["version"] = GEM_MPI_VERSION;
  info["compiler"] = GEM_MPI_COMPILER;
  info["build_type"] = GEM_MPI_BUILD_TYPE;
  info["flags"] = gem_mpi::compile_flags();
  info["native"] = gem_mpi::built_native();
  info["fp_contract"] = "off";
  info["pybind11"] = std::to_string(PYBIND11_VERSION_MAJOR) + "." +
                     std::to_string(PYBIND11_VERSION_MINOR) + "." +
                     std::to_string(PYBIND11_VERSION_PATCH);
  return info;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "gem_mpi._core: float32 element-wise kernels (bit-identical to the numpy reference)";
  m.attr("__version__") = GEM_MPI_VERSION;

  m.def("gem_apply", &gem_apply, py::arg("theta"), py::arg("delta"), py::arg("a"), py::arg("s"),
        py::arg("pi_out"), py::arg("eps"), py::arg("pi_max"),
        R"doc(gem_apply(theta, delta, a, s, pi_out, eps, pi_max) -> None

In place, for 1-D C-contiguous float32 arrays of one size (theta and pi_out writable):
    shift = |theta - s|
    pi = clip((a - shift) / (|delta| + eps), 0, pi_max)
    theta += pi * delta;  pi_out[:] = pi
bit-identical to numpy:
    shift = np.abs(theta - s); pi = (a - shift) / (np.abs(delta) + np.float32(eps))
    np.clip(pi, 0, pi_max, out=pi); theta += pi * delta
Raises ValueError on a wrong dtype, shape, layout or size, or a read-only output.
The GIL is released during the loop.)doc");

  m.def("scaled_apply", &scaled_apply, py::arg("theta"), py::arg("delta"), py::arg("scale"),
        R"doc(scaled_apply(theta, delta, scale) -> None

In place: theta += float32(scale) * delta, for 1-D C-contiguous float32 arrays of one
size (theta writable); bit-identical to numpy `theta += np.float32(scale) * delta`.
Raises ValueError on a wrong dtype, shape, layout or size, or a read-only theta.)doc");

  m.def("build_info", &build_info,
        "build_info() -> dict: version, compiler, build_type, flags, native, fp_contract, "
        "pybind11");
}
