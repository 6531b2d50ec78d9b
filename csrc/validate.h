// Proving an action list complete, correctly ordered and deadlock-free.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "schedule.h"

namespace autopart {

struct Problem {
  std::string message;
  std::vector<std::pair<int, int>> marks;  // (rank, step) of the offending actions
};

// The first problem found, checking in this order:
//   shape         pp lists; every action names a chunk, microbatch and the rank holding the chunk
//   coverage      every chunk runs F once per microbatch and its backward once: B, or I and W
//                 (never both); a send and a receive for exactly the data that crosses ranks
//   dependencies  on each rank, F(c,i) after F(c-1,i) or its receive; B(c,i) or I(c,i) after
//                 F(c,i) and after the backward (B or I) of c+1 or its receive; W(c,i) after
//                 I(c,i); a send after the compute producing its data
//   deadlock      a dry run with rendezvous semantics (see rendezvous.h) where every rank finishes
//                 (sends_wait=false: with Gloo's, where a post never waits)
//   order         messages between two ranks are posted in the same order on both sides, since
//                 NCCL (and Gloo) match them by order
std::optional<Problem> find_problem(const Schedule& s, bool sends_wait = true);

}  // namespace autopart
