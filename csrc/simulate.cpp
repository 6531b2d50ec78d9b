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

// Empty halves split the full backward evenly.
void default_halves(Costs& c) {
  if (c.input_grad.empty()) for (double b : c.backward) c.input_grad.push_back(b / 2);
  if (c.weight_grad.empty()) for (double b : c.backward) c.weight_grad.push_back(b / 2);
}

void check_costs(const Schedule& s, const Costs& c) {
  const size_t chunks = static_cast<size_t>(s.num_chunks());
  if (c.input_grad.size() != chunks || c.weight_grad.size() != chunks)
    throw std::invalid_argument("need one input-gradient and one weight-gradient cost per chunk (" +
                                std::to_string(chunks) + "), got " + std::to_string(c.input_grad.size()) + " and " +
                                std::to_string(c.weight_grad.size()));
  if (c.forward.size() != chunks || c.backward.size() != chunks)
    throw std::invalid_argument("need one forward and one backward cost per chunk (" + std::to_string(chunks) +
                                "), got " + std::to_string(c.forward.size()) + " and " +
                                std::to_string(c.backward.size()));
  for (size_t k = 0; k < chunks; ++k) {
    check_nonnegative(c.forward[k], "forward cost of chunk " + std::to_string(k));
    check_nonnegative(c.backward[k], "backward cost of chunk " + std::to_string(k));
    check_nonnegative(c.input_grad[k], "input-gradient cost of chunk " + std::to_string(k));
    check_nonnegative(c.weight_grad[k], "weight-gradient cost of chunk " + std::to_string(k));
  }
  check_nonnegative(c.latency, "latency");
  check_nonnegative(c.message_bytes, "message_bytes");
  if (!(c.bandwidth > 0.0)) throw std::invalid_argument("bandwidth must be > 0, got " + std::to_string(c.bandwidth));
}

}  // namespace

InFlight in_flight(const Schedule& s) {
  InFlight result{std::vector<int>(s.pp, 0), std::vector<int>(s.pp, 0),
                  std::vector<int>(s.num_chunks(), 0)};
  std::vector<int> chunk_live(s.num_chunks(), 0);
  for (int r = 0; r < s.pp; ++r) {
    int live = 0, awaiting_w = 0;
    for (const Action& a : s.ranks[r]) {
      if (a.kind == Kind::F) {
        result.peak_in_flight[r] = std::max(result.peak_in_flight[r], ++live);
        result.peak_per_chunk[a.chunk] = std::max(result.peak_per_chunk[a.chunk], ++chunk_live[a.chunk]);
      }
      if (a.kind == Kind::B || a.kind == Kind::W) {
        --live;
        --chunk_live[a.chunk];
      }
      if (a.kind == Kind::I) result.peak_awaiting_weight_grad[r] = std::max(result.peak_awaiting_weight_grad[r], ++awaiting_w);
      if (a.kind == Kind::W) --awaiting_w;
    }
  }
  return result;
}

std::vector<int> peak_in_flight(const Schedule& s) { return in_flight(s).peak_in_flight; }

SimResult simulate(const Schedule& s, Costs costs, bool sends_wait) {
  default_halves(costs);
  check_costs(s, costs);
  if (auto problem = find_problem(s, sends_wait)) throw ScheduleError(problem->message);
  ActionIndex index(s);
  for (int r = 0; r < s.pp; ++r)
    for (size_t step = 0; step < s.ranks[r].size(); ++step) index[s.ranks[r][step]] = {r, static_cast<int>(step)};
  const auto cost = [&costs](const Action& a) {
    switch (a.kind) {
      case Kind::F: return costs.forward[a.chunk];
      case Kind::I: return costs.input_grad[a.chunk];
      case Kind::W: return costs.weight_grad[a.chunk];
      default: return costs.backward[a.chunk];
    }
  };
  const double transfer = costs.latency + (costs.message_bytes > 0 ? costs.message_bytes / costs.bandwidth : 0.0);
  RunResult run = run_rendezvous(s, index, batch_actions(s), cost, transfer, true, sends_wait);

  SimResult result;
  result.makespan = *std::max_element(run.clock.begin(), run.clock.end());
  result.ideal = *std::max_element(run.busy.begin(), run.busy.end());
  result.bubble = result.ideal > 0 ? (result.makespan - result.ideal) / result.ideal : 0.0;
  result.busy = run.busy;
  for (double busy : run.busy) result.idle.push_back(result.makespan - busy);
  InFlight memory = in_flight(s);
  result.peak_in_flight = std::move(memory.peak_in_flight);
  result.peak_awaiting_weight_grad = std::move(memory.peak_awaiting_weight_grad);
  result.times = std::move(run.times);
  return result;
}

}  // namespace autopart
