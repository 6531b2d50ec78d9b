// Executing action lists the way the runtime does, with NCCL-like rendezvous semantics. Shared by
// the validator (a dry run with zero costs: does every rank finish?) and the simulator (times).
#pragma once

#include <functional>
#include <vector>

#include "schedule.h"

namespace autopart {

struct Pos {
  int rank = -1;
  int step = -1;
  bool found() const { return rank >= 0; }
};

// Where each (chunk, kind, microbatch) sits in the lists; a dense table, one entry per action.
class ActionIndex {
 public:
  explicit ActionIndex(const Schedule& s);
  Pos& operator[](const Action& a) { return pos_[offset(a)]; }
  const Pos& operator[](const Action& a) const { return pos_[offset(a)]; }

 private:
  size_t offset(const Action& a) const {
    return (static_cast<size_t>(a.kind) * chunks_ + a.chunk) * microbatches_ + a.microbatch;
  }
  size_t chunks_, microbatches_;
  std::vector<Pos> pos_;
};

// The runtime posts a maximal run of consecutive communication actions as one batch
// (batch_isend_irecv, then wait).
struct Batching {
  std::vector<std::vector<int>> batch_of;  // [rank][step] -> batch id, or -1 for a compute
  std::vector<std::vector<int>> begin;     // [rank][batch] -> its first step
  std::vector<std::vector<int>> end;       // [rank][batch] -> one past its last step
};
Batching batch_actions(const Schedule& s);

struct RunResult {
  bool finished = true;
  std::vector<int> next_step;  // per rank: where it stopped; the list's size once finished
  std::vector<double> clock;   // per rank: time when it stopped
  std::vector<double> busy;    // per rank: total compute time
  // Per rank and step, when the action ran (filled only if asked): a compute from its start to
  // its end; a send or receive while its message moves, from the later of the two posts.
  std::vector<std::vector<std::pair<double, double>>> times;
};

// A rank runs its list in order. Computes take compute_cost(action). A batch is posted when the
// rank reaches it; each message takes `transfer` after both sides have posted, messages of one
// batch in parallel. With sends_wait (NCCL's order, what the validator proves), the rank waits
// for its whole batch: it completes once every peer holding a matching action has posted too.
// Without (Gloo: a post never waits), a rank waits for nothing at a batch: the compute that reads
// a received tensor (F its RECV_F, B or I its RECV_B) waits for it and for every receive posted
// before it (the runtime waits in posting order), the end of the list for all the rest and for
// its sends' messages. Requires a complete index (every send has its receive and vice versa).
RunResult run_rendezvous(const Schedule& s, const ActionIndex& index, const Batching& batches,
                         const std::function<double(const Action&)>& compute_cost, double transfer,
                         bool record_times = false, bool sends_wait = true);

// Whether rank's batch holding `step` has been posted when the run stopped.
bool posted(const RunResult& run, const Batching& batches, Pos pos);

}  // namespace autopart
