// Discrete-event simulation of a schedule under the runtime's rendezvous semantics.
#pragma once

#include <limits>
#include <vector>

#include "schedule.h"

namespace autopart {

struct Costs {
  std::vector<double> forward;   // per chunk: one forward of one microbatch
  std::vector<double> backward;  // per chunk: one full backward of one microbatch
  double latency = 0.0;          // per message, once both sides have posted
  double bandwidth = std::numeric_limits<double>::infinity();  // bytes per unit time
  double message_bytes = 0.0;    // size of every activation / gradient message
};

struct SimResult {
  double makespan = 0.0;
  double ideal = 0.0;   // the largest total compute time of any rank
  double bubble = 0.0;  // (makespan - ideal) / ideal: the paper's t_pb / t_id
  std::vector<double> busy;          // per rank: compute time
  std::vector<double> idle;          // per rank: makespan - busy (waiting or communicating)
  std::vector<int> peak_in_flight;   // per rank: most (chunk, microbatch) forwards awaiting their backward
};

// Throws ScheduleError if the schedule is invalid, std::invalid_argument on bad costs.
SimResult simulate(const Schedule& s, const Costs& costs);

// The peak of forwards done whose backward is not, per rank; depends only on the order.
std::vector<int> peak_in_flight(const Schedule& s);

}  // namespace autopart
