// Discrete-event simulation of a schedule under the runtime's rendezvous semantics.
#pragma once

#include <limits>
#include <vector>

#include "schedule.h"

namespace autopart {

struct Costs {
  std::vector<double> forward;   // per chunk: one forward of one microbatch
  std::vector<double> backward;  // per chunk: one full backward (B) of one microbatch
  std::vector<double> input_grad;   // per chunk: its input-gradient half (I); empty: backward / 2
  std::vector<double> weight_grad;  // per chunk: its weight-gradient half (W); empty: backward / 2
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
  std::vector<int> peak_in_flight;   // per rank: most (chunk, microbatch) forwards awaiting their W or B
  std::vector<int> peak_awaiting_weight_grad;  // per rank: most I done whose W is not
  std::vector<std::vector<std::pair<double, double>>> times;  // per rank and step: (start, end)
};

// Throws ScheduleError if the schedule is invalid, std::invalid_argument on bad costs.
// sends_wait: NCCL's semantics, a rank waits for each batch it posts; false: Gloo's, where posts
// never wait and a compute waits for the receive it reads (see run_rendezvous).
SimResult simulate(const Schedule& s, Costs costs, bool sends_wait = true);

// Memory in flight, per rank; depends only on the order. An activation lives from its F until its
// B or W (after I, only what W reads is left; peak_awaiting_weight_grad counts those).
struct InFlight {
  std::vector<int> peak_in_flight;
  std::vector<int> peak_awaiting_weight_grad;
  std::vector<int> peak_per_chunk;  // per chunk: most of its microbatches awaiting their W or B
};
InFlight in_flight(const Schedule& s);
std::vector<int> peak_in_flight(const Schedule& s);

}  // namespace autopart
