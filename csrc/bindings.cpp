// The Python face of the C++ core. Schedules cross the boundary "packed": per rank, a list of
// (chunk, kind code, microbatch) tuples, kind codes in Kind's declaration order.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <tuple>

#include "partition.h"
#include "schedule.h"
#include "simulate.h"
#include "validate.h"

namespace py = pybind11;
using namespace autopart;

namespace {

using Packed = std::vector<std::vector<std::tuple<int, int, int>>>;

// The name decides where chunks live (schedule.h's placement_of), so a hand-made list named
// "zb-v" is checked against the V placement.
Schedule unpack(const std::string& name, int pp, int microbatches, int virtual_stages, const Packed& ranks) {
  Schedule s{name, pp, microbatches, virtual_stages, {}, placement_of(name)};
  for (const auto& rank : ranks) {
    auto& actions = s.ranks.emplace_back();
    actions.reserve(rank.size());
    for (const auto& [chunk, kind, microbatch] : rank) {
      if (kind < 0 || kind >= kNumKinds) throw ScheduleError("unknown action kind code " + std::to_string(kind));
      actions.push_back({chunk, static_cast<Kind>(kind), microbatch});
    }
  }
  return s;
}

Packed pack(const Schedule& s) {
  Packed ranks(s.ranks.size());
  for (size_t r = 0; r < s.ranks.size(); ++r)
    for (const Action& a : s.ranks[r]) ranks[r].emplace_back(a.chunk, static_cast<int>(a.kind), a.microbatch);
  return ranks;
}

// Raised as autopart.schedule.ScheduleError, the one class users catch; plain ValueError if
// that module cannot be imported.
void translate_schedule_error(std::exception_ptr error) {
  try {
    if (error) std::rethrow_exception(error);
  } catch (const ScheduleError& e) {
    PyObject* type = PyExc_ValueError;
    py::object cls;
    try {
      cls = py::module_::import("autopart.schedule").attr("ScheduleError");
      type = cls.ptr();
    } catch (py::error_already_set&) {
    }
    PyErr_SetString(type, e.what());
  }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "autopart's C++ core: pipeline schedules, validation, simulation, stage partitioning";
  py::register_exception_translator(&translate_schedule_error);

  m.def("version", []() { return std::string("0.1.0"); });
  m.def("kind_names", []() {
    std::vector<std::string> names;
    for (int k = 0; k < kNumKinds; ++k) names.push_back(kind_name(static_cast<Kind>(k)));
    return names;
  });

  m.def("schedule_names", &schedule_names, "The schedule names make_schedule accepts, in display order.");
  m.def("chunk_rank", &chunk_rank, py::arg("name"), py::arg("pp"), py::arg("virtual_stages"), py::arg("chunk"),
        "The pipeline rank holding `chunk` under the named schedule's placement.");
  m.def(
      "placement_text", [](const std::string& name, int pp) { return placement_text(placement_of(name), pp); },
      py::arg("name"), py::arg("pp"), "Where chunks live, in words: 'chunk k on rank k % 4'.");

  m.def(
      "make_schedule",
      [](const std::string& name, int pp, int microbatches, int virtual_stages) {
        return pack(make_schedule(name, pp, microbatches, virtual_stages));
      },
      py::arg("name"), py::arg("pp"), py::arg("microbatches"), py::arg("virtual_stages"),
      "Per-rank packed action lists for a named schedule; raises ScheduleError on bad arguments.");

  m.def(
      "check",
      [](int pp, int microbatches, int virtual_stages, const Packed& ranks, const std::string& name,
         bool sends_wait) -> py::object {
        auto problem = find_problem(unpack(name, pp, microbatches, virtual_stages, ranks), sends_wait);
        if (!problem) return py::none();
        return py::make_tuple(problem->message, problem->marks);
      },
      py::arg("pp"), py::arg("microbatches"), py::arg("virtual_stages"), py::arg("ranks"), py::arg("name") = "",
      py::arg("sends_wait") = true,
      "None if the packed schedule is valid, else (message, [(rank, step), ...]); sends_wait=False: "
      "deadlock-free under Gloo's semantics (posts never wait) rather than NCCL's.");

  m.def(
      "in_flight",
      [](int pp, int microbatches, int virtual_stages, const Packed& ranks, const std::string& name) {
        const InFlight memory = in_flight(unpack(name, pp, microbatches, virtual_stages, ranks));
        return py::make_tuple(memory.peak_in_flight, memory.peak_awaiting_weight_grad, memory.peak_per_chunk);
      },
      py::arg("pp"), py::arg("microbatches"), py::arg("virtual_stages"), py::arg("ranks"), py::arg("name") = "",
      "(peak_in_flight, peak_awaiting_weight_grad) per rank and peak in flight per chunk of a packed schedule.");

  py::class_<SimResult>(m, "SimResult")
      .def_readonly("makespan", &SimResult::makespan)
      .def_readonly("ideal", &SimResult::ideal)
      .def_readonly("bubble", &SimResult::bubble)
      .def_readonly("busy", &SimResult::busy)
      .def_readonly("idle", &SimResult::idle)
      .def_readonly("peak_in_flight", &SimResult::peak_in_flight)
      .def_readonly("peak_awaiting_weight_grad", &SimResult::peak_awaiting_weight_grad)
      .def_readonly("times", &SimResult::times);

  m.def(
      "simulate",
      [](int pp, int microbatches, int virtual_stages, const Packed& ranks, std::vector<double> forward,
         std::vector<double> backward, double latency, double bandwidth, double message_bytes,
         std::vector<double> input_grad, std::vector<double> weight_grad, const std::string& name,
         bool sends_wait) {
        const Schedule s = unpack(name, pp, microbatches, virtual_stages, ranks);
        py::gil_scoped_release release;
        Costs costs{std::move(forward), std::move(backward), std::move(input_grad), std::move(weight_grad)};
        costs.latency = latency, costs.bandwidth = bandwidth, costs.message_bytes = message_bytes;
        return simulate(s, std::move(costs), sends_wait);
      },
      py::arg("pp"), py::arg("microbatches"), py::arg("virtual_stages"), py::arg("ranks"), py::arg("forward"),
      py::arg("backward"), py::arg("latency"), py::arg("bandwidth"), py::arg("message_bytes"),
      py::arg("input_grad") = std::vector<double>{}, py::arg("weight_grad") = std::vector<double>{},
      py::arg("name") = "", py::arg("sends_wait") = true,
      "Simulate a packed schedule with per-chunk costs (empty input_grad / weight_grad: backward / 2 each); "
      "sends_wait=False: Gloo's semantics (posts never wait, a compute waits for what it reads).");

  m.def("balanced_partition", &balanced_partition, py::arg("costs"), py::arg("k"),
        "Cut indices splitting costs into k contiguous parts, minimizing the largest part.");
}
