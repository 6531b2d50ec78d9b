#include "simulate.h"

#include <algorithm>
#include <cmath>

#include "rendezvous.h"
#include "validate.h"

namespace autopart {
namespace {

void check_nonnegative(double value, const std::string& what) {
  if (!(value >= 0.0) || std::isinf(value))
    throw std::invalid_argument(what + " must be finite and >= 0, got " + std::to_string(value));
}

void check_costs(const Schedule& s, const Costs& c) {
  const size_t chunks = static_cast<size_t>(s.num_chunks());
  if (c.forward.size() != chunks || c.backward.size() != chunks)
    throw std::invalid_argument("need one forward and one backward cost per chunk (" + std::to_string(chunks) +
                                "), got " + std::to_string(c.forward.size()) + " and " +
                                std::to_string(c.backward.size()));
  for (size_t k = 0; k < chunks; ++k) {
    check_nonnegative(c.forward[k], "forward cost of chunk " + std::to_string(k));
    check_nonnegative(c.backward[k], "backward cost of chunk " + std::to_string(k));
  }
  check_nonnegative(c.latency, "latency");
  check_nonnegative(c.message_bytes, "message_bytes");
  if (!(c.bandwidth > 0.0)) throw std::invalid_argument("bandwidth must be > 0, got " + std::to_string(c.bandwidth));
}

}  // namespace

std::vector<int> peak_in_flight(const Schedule& s) {
  std::vector<int> peak(s.pp, 0);
  for (int r = 0; r < s.pp; ++r) {
    int live = 0;
    for (const Action& a : s.ranks[r]) {
      if (a.kind == Kind::F) peak[r] = std::max(peak[r], ++live);
      if (a.kind == Kind::B) --live;
    }
  }
  return peak;
}

SimResult simulate(const Schedule& s, const Costs& costs) {
  check_costs(s, costs);
  if (auto problem = find_problem(s)) throw ScheduleError(problem->message);
  ActionIndex index(s);
  for (int r = 0; r < s.pp; ++r)
    for (size_t step = 0; step < s.ranks[r].size(); ++step) index[s.ranks[r][step]] = {r, static_cast<int>(step)};
  const auto cost = [&costs](const Action& a) {
    return a.kind == Kind::F ? costs.forward[a.chunk] : costs.backward[a.chunk];
  };
  const double transfer = costs.latency + (costs.message_bytes > 0 ? costs.message_bytes / costs.bandwidth : 0.0);
  const RunResult run = run_rendezvous(s, index, batch_actions(s), cost, transfer);

  SimResult result;
  result.makespan = *std::max_element(run.clock.begin(), run.clock.end());
  result.ideal = *std::max_element(run.busy.begin(), run.busy.end());
  result.bubble = result.ideal > 0 ? (result.makespan - result.ideal) / result.ideal : 0.0;
  result.busy = run.busy;
  for (double busy : run.busy) result.idle.push_back(result.makespan - busy);
  result.peak_in_flight = peak_in_flight(s);
  return result;
}

}  // namespace autopart
