#include "zero_bubble.h"

#include <algorithm>
#include <deque>
#include <map>
#include <tuple>
#include <stdexcept>


namespace autopart {
namespace {

using Order = std::vector<Action>;

Action act(int chunk, Kind kind, int microbatch) { return {chunk, kind, microbatch}; }

// Megatron's interleaved sequence of (chunk, microbatch) on a rank: groups of pp microbatches go
// through the rank's chunks in turn (reversed for backwards). With one chunk: microbatch order.
Order virtual_microbatches(int pp, int microbatches, int virtual_stages, int rank, Kind kind) {
  Order out;
  for (int group = 0; group < microbatches; group += pp) {
    for (int j = 0; j < virtual_stages; ++j) {
      const int local = kind == Kind::F ? j : virtual_stages - 1 - j;
      for (int i = group; i < std::min(group + pp, microbatches); ++i) out.push_back(act(local * pp + rank, kind, i));
    }
  }
  return out;
}

// ZB-H1 (torch's ScheduleInterleavedZeroBubble): 1F1B with (v-1)*pp + pp-1-r warmup forwards and
// I in place of B; rank r runs each W r backwards late, so the last ranks, which finish their
// input gradients first, fill the drain with deferred Ws.
Order zb_h1_order(int pp, int microbatches, int virtual_stages, int rank) {
  const Order forwards = virtual_microbatches(pp, microbatches, virtual_stages, rank, Kind::F);
  const Order inputs = virtual_microbatches(pp, microbatches, virtual_stages, rank, Kind::I);
  const int total = static_cast<int>(forwards.size());
  const int warmup = std::min((virtual_stages - 1) * pp + pp - 1 - rank, total);
  Order out(forwards.begin(), forwards.begin() + warmup);
  std::deque<Action> deferred;
  for (int k = 0; k < total; ++k) {
    if (warmup + k < total) out.push_back(forwards[warmup + k]);
    out.push_back(inputs[k]);
    deferred.push_back(act(inputs[k].chunk, Kind::W, inputs[k].microbatch));
    if (k >= rank) out.push_back(deferred.front()), deferred.pop_front();
  }
  out.insert(out.end(), deferred.begin(), deferred.end());
  return out;
}

// Counts of each (chunk, kind) done so far: the next microbatch for it.
struct Counter {
  std::map<std::pair<int, Kind>, int> next;
  int take(int chunk, Kind kind) { return next[{chunk, kind}]++; }
};

// ZB-V (Qi et al. section 6, torch's ScheduleZBVZeroBubble). Rank r holds chunk r (down the V)
// and chunk 2pp-1-r (back up). It is written for max(m, 2pp-1) microbatches; actions of the
// microbatches beyond m are then dropped.
Order zb_v_order(int pp, int microbatches, int rank) {
  const int n = std::max(microbatches, 2 * pp - 1);
  const int down = rank, up = 2 * pp - 1 - rank;
  Order out;
  Counter c;
  auto add = [&](int chunk, Kind kind) { out.push_back(act(chunk, kind, c.take(chunk, kind))); };
  auto fiw = [&](int chunk) { add(chunk, Kind::F), add(chunk, Kind::I), add(chunk, Kind::W); };
  for (int i = 0; i < 2 * (pp - rank) - 1; ++i) add(down, Kind::F);
  for (int i = 0; i < rank; ++i) add(up, Kind::F), add(down, Kind::F);
  for (int i = 0; i < pp - rank; ++i) fiw(up);
  while (c.next[{up, Kind::F}] < c.next[{down, Kind::F}] || c.next[{down, Kind::F}] < n) {
    if (c.next[{down, Kind::F}] < n) add(down, Kind::F);
    add(down, Kind::I), add(down, Kind::W);
    fiw(up);
  }
  for (int i = 0; i < rank; ++i) add(down, Kind::I), add(up, Kind::I);
  for (int i = 0; i < pp - rank; ++i) add(down, Kind::I), add(down, Kind::W);
  while (c.next[{up, Kind::W}] < c.next[{up, Kind::I}]) add(up, Kind::W);
  while (c.next[{down, Kind::W}] < c.next[{down, Kind::I}]) add(down, Kind::W);
  out.erase(std::remove_if(out.begin(), out.end(), [&](const Action& a) { return a.microbatch >= microbatches; }),
            out.end());
  return out;
}

// DualPipeV (DeepSeek-V3's DualPipe cut in half; torch's ScheduleDualPipeV, steps as there).
// Backwards are fused (B) in the steady state; split into I with W queued in the warmup's step 3
// and for the second half of the drain, where the queued Ws fill the ramp-down.
class DualPipeV {
 public:
  DualPipeV(int pp, int microbatches, int rank) : pp_(pp), m_(microbatches), r_(rank), down_(rank), up_(2 * pp - 1 - rank) {}

  Order order() {
    for (int i = 0; i < 2 * (pp_ - r_ - 1); ++i) add(down_, Kind::F);                   // 1: F0
    for (int i = 0; i < r_ + 1; ++i) add(down_, Kind::F), add(up_, Kind::F);           // 2: F0 F1
    for (int i = 0; i < pp_ - r_ - 1; ++i) add(up_, Kind::I), weight(), add(up_, Kind::F);  // 3: I1 W F1
    for (int i = 0; i < m_ - 2 * pp_ + r_ + 1; ++i) {                                  // 4: F0&B1 F1&B0
      if (i == 0 && r_ == pp_ - 1) add(down_, Kind::F), add(up_, Kind::B);  // not overlapped: less bubble
      else overlapped(down_, up_);
      overlapped(up_, down_);
    }
    for (int i = 0; i < pp_ - r_ - 1; ++i) add(up_, Kind::B), overlapped(up_, down_);  // 5: B1 F1&B0
    bool split = false;                                                                 // 6: B1 B0, then I1 I0
    for (int i = 0; i < r_ + 1; ++i) {
      if (i == (r_ + 1) / 2 && r_ % 2 == 1) split = true;
      add(up_, split ? Kind::I : Kind::B);
      if (i == (r_ + 1) / 2 && r_ % 2 == 0) split = true;
      add(down_, split ? Kind::I : Kind::B);
    }
    for (int i = 0; i < pp_ - r_ - 1; ++i) weight(), add(down_, split ? Kind::I : Kind::B);  // 7: W B0
    while (!queue_.empty()) weight();                                                   // 8: W
    return out_;
  }

  const std::vector<char>& held() const { return held_; }

 private:
  // B and I share one microbatch counter: a chunk's backwards go in microbatch order either way.
  void add(int chunk, Kind kind) {
    const int i = counter_.take(chunk, kind == Kind::F ? Kind::F : Kind::B);
    out_.push_back(act(chunk, kind, i));
    held_.push_back(0);
    if (kind == Kind::I) queue_.push_back(act(chunk, Kind::W, i));
  }
  void overlapped(int forward_chunk, int backward_chunk) {
    add(forward_chunk, Kind::F);
    held_.back() = 1;
    add(backward_chunk, Kind::B);
  }
  void weight() {
    if (queue_.empty()) return;
    out_.push_back(queue_.front());
    held_.push_back(0);
    queue_.pop_front();
  }

  const int pp_, m_, r_, down_, up_;
  Counter counter_;
  Order out_;
  std::vector<char> held_;
  std::deque<Action> queue_;
};

int duration(Kind kind) { return kind == Kind::B ? 2 : 1; }

// What must have finished before `a` may start: at most two actions (F needs the previous
// chunk's F; I/B their own F and the next chunk's I or B; W its I).
struct Needs {
  Action first, second;
  int count = 0;
};

struct Table {
  std::vector<std::vector<int>> start, end;  // [rank][index in order]
  std::vector<std::vector<int>> released;    // [rank][index]: when its output may leave (end, or its pair's end)
  std::vector<int> start_of;  // per (kind, chunk, microbatch), as TableBuilder::slot
  std::vector<char> split;    // per (chunk, microbatch): backward split into I and W
  int chunks = 0, microbatches = 0;

  size_t slot(const Action& a) const {
    return (static_cast<size_t>(a.kind) * chunks + a.chunk) * microbatches + a.microbatch;
  }
  // When the compute a receive feeds starts (the backward as this schedule runs it).
  int consumer_start(const Action& recv) const {
    Action consumer = compute_of(recv);
    if (consumer.kind == Kind::B && split[static_cast<size_t>(consumer.chunk) * microbatches + consumer.microbatch])
      consumer.kind = Kind::I;
    return start_of[slot(consumer)];
  }
  // Whether a compute of `rank` runs across time t (so the rank cannot post a batch at t).
  bool busy(int rank, int t) const {
    const auto& starts = start[rank];
    const auto next = std::lower_bound(starts.begin(), starts.end(), t) - starts.begin();
    return next > 0 && end[rank][next - 1] > t;
  }
};

class TableBuilder {
 public:
  TableBuilder(const Schedule& s, const ComputeOrder& order)
      : s_(s),
        order_(order.ranks),
        held_(order.held),
        end_(static_cast<size_t>(kNumKinds) * s.num_chunks() * s.microbatches, -1),
        split_(static_cast<size_t>(s.num_chunks()) * s.microbatches, 0),
        pos_(s.pp, 0),
        clock_(s.pp, 0) {
    table_.start.resize(s.pp);
    table_.end.resize(s.pp);
    table_.released.resize(s.pp);
    table_.start_of.assign(end_.size(), -1);
    table_.chunks = s.num_chunks();
    table_.microbatches = s.microbatches;
    for (const Order& rank : order.ranks)
      for (const Action& a : rank)
        if (a.kind == Kind::I) split_[static_cast<size_t>(a.chunk) * s.microbatches + a.microbatch] = 1;
  }

  Table build() {
    std::vector<int> work;
    std::vector<char> queued(s_.pp, 1);
    for (int r = s_.pp - 1; r >= 0; --r) work.push_back(r);
    while (!work.empty()) {
      const int r = work.back();
      work.pop_back();
      queued[r] = 0;
      for (int peer : advance(r))
        if (!queued[peer]) work.push_back(peer), queued[peer] = 1;
    }
    for (int r = 0; r < s_.pp; ++r)
      if (pos_[r] != static_cast<int>(order_[r].size()))
        throw std::logic_error(s_.name + ": compute order deadlocks on rank " + std::to_string(r) + " at " +
                               to_string(order_[r][pos_[r]]));
    table_.split = split_;
    return table_;
  }

 private:
  int& end_of(const Action& a) {
    return end_[(static_cast<size_t>(a.kind) * s_.num_chunks() + a.chunk) * s_.microbatches + a.microbatch];
  }

  // The next chunk's backward, as this schedule runs it (split into I, or fused B).
  Action backward_of(int chunk, int microbatch) const {
    const bool split = split_[static_cast<size_t>(chunk) * s_.microbatches + microbatch];
    return act(chunk, split ? Kind::I : Kind::B, microbatch);
  }

  Needs needs(const Action& a) const {
    const int c = a.chunk, i = a.microbatch;
    if (a.kind == Kind::F) return c > 0 ? Needs{act(c - 1, Kind::F, i), {}, 1} : Needs{};
    if (a.kind == Kind::W) return {act(c, Kind::I, i), {}, 1};
    if (c + 1 < s_.num_chunks()) return {act(c, Kind::F, i), backward_of(c + 1, i), 2};
    return {act(c, Kind::F, i), {}, 1};
  }

  // Runs rank r's next computes while their inputs are ready; returns the ranks to wake.
  std::vector<int> advance(int r) {
    std::vector<int> wake;
    const Order& actions = order_[r];
    while (pos_[r] < static_cast<int>(actions.size())) {
      const Action& a = actions[pos_[r]];
      const Needs need = needs(a);
      const Action deps[2] = {need.first, need.second};
      int start = clock_[r];
      for (int k = 0; k < need.count; ++k) {
        const int t = end_of(deps[k]);
        if (t < 0) return wake;
        start = std::max(start, t);
      }
      clock_[r] = start + duration(a.kind);
      table_.start[r].push_back(start);
      table_.end[r].push_back(clock_[r]);
      table_.released[r].push_back(clock_[r]);
      table_.start_of[table_.slot(a)] = start;
      const int j = pos_[r]++;
      if (held_[r][j]) continue;  // released with the next compute, below
      release(r, j, wake);
      if (j > 0 && held_[r][j - 1]) table_.released[r][j - 1] = clock_[r], release(r, j - 1, wake);
    }
    return wake;
  }

  // Output of rank r's j-th compute available to its consumers from table_.released[r][j].
  void release(int r, int j, std::vector<int>& wake) {
    const Action& a = order_[r][j];
    end_of(a) = table_.released[r][j];
    if (a.kind == Kind::F && a.chunk + 1 < s_.num_chunks()) wake.push_back(s_.rank_of(a.chunk + 1));
    if (is_backward(a.kind) && a.chunk > 0) wake.push_back(s_.rank_of(a.chunk - 1));
  }

  const Schedule& s_;
  const std::vector<Order>& order_;
  const std::vector<std::vector<char>>& held_;
  std::vector<int> end_;      // per (kind, chunk, microbatch): table time its output is out, -1 before
  std::vector<char> split_;   // per (chunk, microbatch): backward split into I and W
  std::vector<int> pos_, clock_;
  Table table_;
};

// A message end tagged with the table time both sides meet. Both ends sort their messages by
// (time, direction, sending chunk, microbatch), so between two ranks the n-th send is the n-th
// receive, as NCCL's by-order matching needs.
struct Message {
  int time;
  Action action;
  auto key() const {
    const Action send = is_send(action.kind) ? action : matching(action);
    return std::make_tuple(time, send.kind == Kind::SEND_B, send.chunk, send.microbatch, order_in_batch(action.kind));
  }
  bool operator<(const Message& o) const { return key() < o.key(); }
};

// The first time from `sent` on at which neither rank is inside a compute, so both post the
// message's batch at once and neither waits for the other (a fused B takes two table steps and
// would otherwise hold its peer up). No later than the consumer's start; if there is no such
// time, the sent time (the receiver then posts at its next gap).
int meeting_time(const Table& table, int sender, int receiver, int sent, int deadline) {
  for (int t = sent; t <= deadline; ++t)
    if (!table.busy(sender, t) && !table.busy(receiver, t)) return t;
  return sent;
}

size_t gap_at(const Table& table, int rank, int time) {
  const auto& starts = table.start[rank];
  return std::lower_bound(starts.begin(), starts.end(), time) - starts.begin();
}

}  // namespace

bool is_zero_bubble(const std::string& name) { return name == "zb-h1" || name == "zb-v" || name == "dualpipe-v"; }

ComputeOrder zero_bubble_orders(const Schedule& s) {
  ComputeOrder order;
  for (int r = 0; r < s.pp; ++r) {
    if (s.name == "dualpipe-v") {
      DualPipeV dual(s.pp, s.microbatches, r);
      order.ranks.push_back(dual.order());
      order.held.push_back(dual.held());
      continue;
    }
    if (s.name == "zb-h1") order.ranks.push_back(zb_h1_order(s.pp, s.microbatches, s.virtual_stages, r));
    else order.ranks.push_back(zb_v_order(s.pp, s.microbatches, r));
    order.held.emplace_back(order.ranks.back().size(), 0);
  }
  return order;
}

std::vector<Order> lower_timed(const Schedule& s, const ComputeOrder& compute) {
  const std::vector<Order>& order = compute.ranks;
  const Table table = TableBuilder(s, compute).build();
  // gaps[r][j]: the messages rank r posts right before its j-th compute (j = size: after the last).
  std::vector<std::vector<std::vector<Message>>> gaps(s.pp);
  for (int r = 0; r < s.pp; ++r) gaps[r].resize(order[r].size() + 1);
  for (int r = 0; r < s.pp; ++r) {
    for (size_t j = 0; j < order[r].size(); ++j) {
      const auto send = send_after(s, order[r][j]);
      if (!send) continue;
      const Action recv = matching(*send);
      const int peer = s.rank_of(recv.chunk);
      const int time = meeting_time(table, r, peer, table.released[r][j], table.consumer_start(recv));
      gaps[r][gap_at(table, r, time)].push_back({time, *send});
      gaps[peer][gap_at(table, peer, time)].push_back({time, recv});
    }
  }
  std::vector<Order> ranks(s.pp);
  for (int r = 0; r < s.pp; ++r) {
    for (size_t j = 0; j <= order[r].size(); ++j) {
      std::sort(gaps[r][j].begin(), gaps[r][j].end());
      for (const Message& m : gaps[r][j]) ranks[r].push_back(m.action);
      if (j < order[r].size()) ranks[r].push_back(order[r][j]);
    }
  }
  return ranks;
}

}  // namespace autopart
