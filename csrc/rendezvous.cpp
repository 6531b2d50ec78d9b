#include "rendezvous.h"

#include <algorithm>

namespace autopart {

ActionIndex::ActionIndex(const Schedule& s)
    : chunks_(static_cast<size_t>(s.num_chunks())),
      microbatches_(static_cast<size_t>(s.microbatches)),
      pos_(static_cast<size_t>(kNumKinds) * chunks_ * microbatches_) {}

Batching batch_actions(const Schedule& s) {
  Batching b;
  b.batch_of.resize(s.pp);
  b.begin.resize(s.pp);
  b.end.resize(s.pp);
  for (int r = 0; r < s.pp; ++r) {
    const auto& actions = s.ranks[r];
    b.batch_of[r].assign(actions.size(), -1);
    for (size_t step = 0; step < actions.size(); ++step) {
      if (is_compute(actions[step].kind)) continue;
      const bool starts_batch = step == 0 || is_compute(actions[step - 1].kind);
      if (starts_batch) {
        b.begin[r].push_back(static_cast<int>(step));
        b.end[r].push_back(static_cast<int>(step));
      }
      b.batch_of[r][step] = static_cast<int>(b.begin[r].size()) - 1;
      b.end[r].back() = static_cast<int>(step) + 1;
    }
  }
  return b;
}

bool posted(const RunResult& run, const Batching& batches, Pos pos) {
  const int batch = batches.batch_of[pos.rank][pos.step];
  return run.next_step[pos.rank] >= batches.begin[pos.rank][batch];
}

namespace {

// The run is a DAG evaluation: a batch's completion time depends only on when it and its peers'
// batches were posted, so ranks can be advanced in any order; a worklist wakes a rank when a
// peer posts a batch it may be waiting for.
class Runner {
 public:
  Runner(const Schedule& s, const ActionIndex& index, const Batching& batches,
         const std::function<double(const Action&)>& compute_cost, double transfer, bool record_times,
         bool sends_wait)
      : s_(s), index_(index), batches_(batches), cost_(compute_cost), transfer_(transfer), record_(record_times),
        sends_wait_(sends_wait) {
    run_.next_step.assign(s.pp, 0);
    if (record_) {
      run_.times.resize(s.pp);
      for (int r = 0; r < s.pp; ++r) run_.times[r].resize(s.ranks[r].size());
    }
    run_.clock.assign(s.pp, 0.0);
    run_.busy.assign(s.pp, 0.0);
    posted_at_.resize(s.pp);
    for (int r = 0; r < s.pp; ++r) posted_at_[r].assign(batches.begin[r].size(), -1.0);
    receives_.resize(s.pp);
    sends_.resize(s.pp);
    waited_.assign(s.pp, 0);
    sends_waited_.assign(s.pp, 0);
  }

  RunResult run() {
    std::vector<char> queued(s_.pp, 1);
    for (int r = s_.pp - 1; r >= 0; --r) work_.push_back(r);
    while (!work_.empty()) {
      const int r = work_.back();
      work_.pop_back();
      queued[r] = 0;
      advance(r);
      for (int peer : woken_) {
        if (!queued[peer]) work_.push_back(peer), queued[peer] = 1;
      }
      woken_.clear();
    }
    for (int r = 0; r < s_.pp; ++r)
      run_.finished = run_.finished && run_.next_step[r] == static_cast<int>(s_.ranks[r].size());
    return run_;
  }

 private:
  // Runs rank r until it finishes or blocks on a batch whose peers have not all posted.
  void advance(int r) {
    const auto& actions = s_.ranks[r];
    int& step = run_.next_step[r];
    double& clock = run_.clock[r];
    while (step < static_cast<int>(actions.size())) {
      if (is_compute(actions[step].kind)) {
        if (!sends_wait_ && !wait_for_input(r, actions[step])) return;
        const double cost = cost_(actions[step]);
        if (record_) run_.times[r][step] = {clock, clock + cost};
        clock += cost;
        run_.busy[r] += cost;
        ++step;
        continue;
      }
      const int batch = batches_.batch_of[r][step];
      const int end = batches_.end[r][batch];
      if (posted_at_[r][batch] < 0) post(r, batch);
      if (!sends_wait_) {               // nothing waited here: receives queue, sends move alone
        for (int i = step; i < end; ++i) (is_send(actions[i].kind) ? sends_ : receives_)[r].push_back(i);
        step = end;
        continue;
      }
      double done = clock;
      for (int i = step; i < end; ++i) {
        const double moves = message_moves(r, i);
        if (moves < 0) return;
        done = std::max(done, moves + transfer_);
      }
      clock = done;
      step = end;
    }
    if (!sends_wait_) {               // the step's end: every receive, then every send
      if (!wait_for(r, receives_[r], waited_[r], receives_[r].size())) return;
      if (!wait_for(r, sends_[r], sends_waited_[r], sends_[r].size())) return;
    }
  }

  // When the message of rank r's comm action at `step` starts to move (both sides posted, and
  // not before the rank's clock under sends_wait), recorded as its time; -1 if the peer has not
  // posted yet.
  double message_moves(int r, int step) {
    const Pos peer = index_[matching(s_.ranks[r][step])];
    const double peer_posted = posted_at_[peer.rank][batches_.batch_of[peer.rank][peer.step]];
    if (peer_posted < 0) return -1.0;
    const double mine = sends_wait_ ? run_.clock[r] : posted_at_[r][batches_.batch_of[r][step]];
    const double moves = std::max(mine, peer_posted);
    if (record_) run_.times[r][step] = {moves, moves + transfer_};
    return moves;
  }

  // sends_wait=false: before a compute, wait for the receive it reads (if this rank posted one)
  // and every receive posted before it. False if one of those messages' sender has not posted.
  bool wait_for_input(int r, const Action& a) {
    Kind recv;
    if (a.kind == Kind::F) recv = Kind::RECV_F;
    else if (a.kind == Kind::B || a.kind == Kind::I) recv = Kind::RECV_B;
    else return true;
    const Pos at = index_[Action{a.chunk, recv, a.microbatch}];
    if (!at.found() || at.rank != r) return true;    // fed on this rank (V's turn) or an input
    const auto& queue = receives_[r];
    for (size_t k = waited_[r]; k < queue.size(); ++k)
      if (queue[k] == at.step) return wait_for(r, queue, waited_[r], k + 1);
    return true;                                       // waited for already
  }

  // Wait for rank r's messages queue[from, upto) (in that order), moving `from` to `upto`; false,
  // with `from` where it stopped, if a sender or receiver of one has not posted yet.
  bool wait_for(int r, const std::vector<int>& queue, size_t& from, size_t upto) {
    for (; from < upto; ++from) {
      const double moves = message_moves(r, queue[from]);
      if (moves < 0) return false;
      run_.clock[r] = std::max(run_.clock[r], moves + transfer_);
    }
    return true;
  }

  void post(int r, int batch) {
    posted_at_[r][batch] = run_.clock[r];
    const auto& actions = s_.ranks[r];
    for (int i = batches_.begin[r][batch]; i < batches_.end[r][batch]; ++i)
      woken_.push_back(index_[matching(actions[i])].rank);
  }

  const Schedule& s_;
  const ActionIndex& index_;
  const Batching& batches_;
  const std::function<double(const Action&)>& cost_;
  const double transfer_;
  const bool record_;
  const bool sends_wait_;
  RunResult run_;
  std::vector<std::vector<double>> posted_at_;  // [rank][batch] -> time posted, -1 if not yet
  std::vector<int> work_, woken_;
  // sends_wait=false, per rank: the steps of its posted receives and sends, in posting order,
  // and how many of each it has waited for
  std::vector<std::vector<int>> receives_, sends_;
  std::vector<size_t> waited_, sends_waited_;
};

}  // namespace

RunResult run_rendezvous(const Schedule& s, const ActionIndex& index, const Batching& batches,
                         const std::function<double(const Action&)>& compute_cost, double transfer,
                         bool record_times, bool sends_wait) {
  return Runner(s, index, batches, compute_cost, transfer, record_times, sends_wait).run();
}

}  // namespace autopart
