#include <pybind11/pybind11.h>
namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "autopart's C++ core: pipeline schedules, validation, simulation, stage partitioning";
  m.def("version", []() { return std::string("0.1.0"); });
}
