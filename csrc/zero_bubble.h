// Zero-bubble schedules (Qi et al. 2024): the backward split into I (input gradient) and W (weight
// gradient), W deferred into what would be bubbles. zb-h1 (and its interleaved form), zb-v and
// dualpipe-v, with the compute orders of torch.distributed.pipelining's ScheduleInterleavedZeroBubble,
// ScheduleZBVZeroBubble and ScheduleDualPipeV.
#pragma once

#include <string>
#include <vector>

#include "schedule.h"

namespace autopart {

bool is_zero_bubble(const std::string& name);

// Per rank, the computes in run order (no communication yet). held[r][j] marks a forward run
// overlapped with the backward right after it (DualPipe's "F&B" chunk): its output leaves only
// once the pair is done.
struct ComputeOrder {
  std::vector<std::vector<Action>> ranks;
  std::vector<std::vector<char>> held;
};
ComputeOrder zero_bubble_orders(const Schedule& s);

// Inserts the sends and receives. Runs the compute orders on a unit-time table (F, I, W one
// step, B two) as early as dependencies allow; a message produced at time t is sent right after
// its producer and received in the receiver's first gap at or after t. Every wait then points at
// a batch no later in the table than the waiting one, so no rank can wait forever, whatever the
// real costs; with unit costs the runtime follows the table exactly.
std::vector<std::vector<Action>> lower_timed(const Schedule& s, const ComputeOrder& order);

}  // namespace autopart
