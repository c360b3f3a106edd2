// expertqmm._core: the Python module. The ops live in bind_*.cpp; this file holds the tensor type,
// the exception type and the module itself. The user-facing API is the Python package around it
// (python/expertqmm), which converts framework arrays and picks the output framework.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bind.h"
#include "bridge.h"
#include "expertqmm/error.h"

namespace nb = nanobind;
using namespace expertqmm;
using expertqmm::python::PyTensor;

namespace {

// expertqmm.Error: a RuntimeError carrying the op's message, with the op's name as `.op`.
nb::object& error_type() {
  static nb::object* type = nullptr;  // leaked on purpose: the interpreter may outlive static destructors
  if (!type) type = new nb::object();
  return *type;
}

void bind_tensor(nb::module_& m) {
  nb::class_<PyTensor>(m, "Tensor",
                       "An expertqmm tensor: a zero-copy view of a Python array, or memory the library "
                       "allocated. Exports itself through DLPack (``torch.from_dlpack(t)``, ``np.from_dlpack(t)``).")
      .def_static("wrap", &PyTensor::wrap, nb::arg("obj"), nb::arg("dtype") = nb::none(),
                  nb::arg("writable") = false,
                  "View ``obj`` (an object with ``__dlpack__``, a DLPack capsule or a buffer) without copying. "
                  "``dtype`` reinterprets elements of the same size: 'bfloat16' for uint16 bits, 'uint32' / "
                  "'int32' for each other. ``writable``: refuse read-only arrays (for outputs).")
      .def_prop_ro("shape", [](const PyTensor& p) {
        const Shape& s = p.tensor.shape();
        return nb::tuple(nb::cast(std::vector<int64_t>(s.begin(), s.end())));
      }, "The shape, a tuple of ints.")
      .def_prop_ro("dtype", [](const PyTensor& p) { return std::string(dtype_name(p.tensor.dtype())); },
                   "The element type: 'bfloat16', 'float16', 'float32', 'uint32' or 'int32'.")
      .def_prop_ro("device", [](const PyTensor& p) { return std::string(device_name(p.tensor.device())); },
                   "'cpu' or 'cuda'.")
      .def_prop_ro("device_id", [](const PyTensor& p) { return p.device_id; }, "The CUDA device ordinal (0 on the CPU).")
      .def_prop_ro("nbytes", [](const PyTensor& p) { return p.tensor.nbytes(); }, "Bytes of the elements.")
      .def("ndarray", &python::to_ndarray, nb::arg("bits_only") = false,
           "A DLPack-exportable array over this tensor's memory (kept alive by it). ``bits_only``: bfloat16 "
           "as uint16, for numpy.")
      .def("__dlpack__", [](nb::handle self, nb::kwargs kwargs) {
        return python::to_ndarray(self, false).cast().attr("__dlpack__")(**kwargs);
      }, "DLPack export (the stream argument is accepted and ignored: nothing to wait for).")
      .def("__dlpack_device__", [](nb::handle self) {
        return python::to_ndarray(self, false).cast().attr("__dlpack_device__")();
      }, "DLPack device (type, id).")
      .def("__repr__", [](const PyTensor& p) { return "expertqmm.Tensor(" + p.tensor.describe() + ")"; });
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "expertqmm's C++ library (MLX-semantics quantized MoE ops on CUDA and the CPU); use the "
            "`expertqmm` package, which wraps this module.";
  error_type() = nb::steal(PyErr_NewExceptionWithDoc(
      "expertqmm.Error", "An expertqmm op refused its inputs or failed; the message names the op (also `.op`).",
      PyExc_RuntimeError, nullptr));
  m.attr("Error") = error_type();
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      nb::object exc = error_type()(nb::str(e.what()));
      exc.attr("op") = nb::str(e.op().c_str());
      PyErr_SetObject(error_type().ptr(), exc.ptr());
    }
  });
  bind_tensor(m);
  python::bind_ops(m);
  python::bind_gemma4(m);
  python::bind_settings(m);
}
