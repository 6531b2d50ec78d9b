// Schedule generation: a compute order per rank (the schedule's definition), then a lowering
// that inserts the sends and receives.
#include "schedule.h"

#include <algorithm>

#include "zero_bubble.h"

namespace autopart {

bool operator==(const Action& a, const Action& b) {
  return a.chunk == b.chunk && a.kind == b.kind && a.microbatch == b.microbatch;
}

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::F: return "F";
    case Kind::B: return "B";
    case Kind::SEND_F: return "SEND_F";
    case Kind::RECV_F: return "RECV_F";
    case Kind::SEND_B: return "SEND_B";
    case Kind::RECV_B: return "RECV_B";
    case Kind::I: return "I";
    case Kind::W: return "W";
  }
  return "?";
}

bool is_compute(Kind kind) { return kind == Kind::F || kind == Kind::B || kind == Kind::I || kind == Kind::W; }
bool is_backward(Kind kind) { return kind == Kind::B || kind == Kind::I; }
bool is_send(Kind kind) { return kind == Kind::SEND_F || kind == Kind::SEND_B; }

std::string to_string(const Action& a) {
  return std::to_string(a.chunk) + kind_name(a.kind) + std::to_string(a.microbatch);
}

std::optional<Action> send_after(const Schedule& s, const Action& c) {
  if (c.kind == Kind::F && c.chunk + 1 < s.num_chunks() && s.rank_of(c.chunk + 1) != s.rank_of(c.chunk))
    return Action{c.chunk, Kind::SEND_F, c.microbatch};
  if (is_backward(c.kind) && c.chunk > 0 && s.rank_of(c.chunk - 1) != s.rank_of(c.chunk))
    return Action{c.chunk, Kind::SEND_B, c.microbatch};
  return std::nullopt;
}

std::optional<Action> recv_before(const Schedule& s, const Action& c) {
  if (c.kind == Kind::F && c.chunk > 0 && s.rank_of(c.chunk - 1) != s.rank_of(c.chunk))
    return Action{c.chunk, Kind::RECV_F, c.microbatch};
  if (is_backward(c.kind) && c.chunk + 1 < s.num_chunks() && s.rank_of(c.chunk + 1) != s.rank_of(c.chunk))
    return Action{c.chunk, Kind::RECV_B, c.microbatch};
  return std::nullopt;
}

Action matching(const Action& a) {
  switch (a.kind) {
    case Kind::SEND_F: return {a.chunk + 1, Kind::RECV_F, a.microbatch};
    case Kind::RECV_F: return {a.chunk - 1, Kind::SEND_F, a.microbatch};
    case Kind::SEND_B: return {a.chunk - 1, Kind::RECV_B, a.microbatch};
    case Kind::RECV_B: return {a.chunk + 1, Kind::SEND_B, a.microbatch};
    default: throw std::logic_error("matching() of compute action " + to_string(a));
  }
}

Action compute_of(const Action& a) {
  const bool forward = a.kind == Kind::SEND_F || a.kind == Kind::RECV_F;
  return {a.chunk, forward ? Kind::F : Kind::B, a.microbatch};
}

namespace {

// Computes a rank runs back to back, with no communication between them.
using Slot = std::vector<Action>;
using RankOrder = std::vector<Slot>;

Action forward(int chunk, int microbatch) { return {chunk, Kind::F, microbatch}; }
Action backward(int chunk, int microbatch) { return {chunk, Kind::B, microbatch}; }

// GPipe: every forward, then every backward, both in microbatch order (as torch's ScheduleGPipe).
RankOrder gpipe_order(int microbatches, int rank) {
  RankOrder slots;
  for (int i = 0; i < microbatches; ++i) slots.push_back({forward(rank, i)});
  for (int i = 0; i < microbatches; ++i) slots.push_back({backward(rank, i)});
  return slots;
}

// 1F1B (PipeDream-Flush, Megatron's forward_backward_pipelining_without_interleaving): rank r
// runs pp-r-1 warmup forwards, so that at most pp-r microbatches are in flight, then
// alternates forward and backward, then drains the remaining backwards.
RankOrder one_f_one_b_order(int pp, int microbatches, int rank) {
  const int warmup = std::min(pp - rank - 1, microbatches);
  RankOrder slots;
  for (int i = 0; i < warmup; ++i) slots.push_back({forward(rank, i)});
  for (int i = 0; i + warmup < microbatches; ++i) {
    slots.push_back({forward(rank, i + warmup)});
    slots.push_back({backward(rank, i)});
  }
  for (int i = microbatches - warmup; i < microbatches; ++i) slots.push_back({backward(rank, i)});
  return slots;
}

// Interleaved 1F1B (Narayanan et al. 2021, Megatron's forward_backward_pipelining_with_interleaving
// with microbatch groups of pp). Every rank walks the same sequence of "virtual microbatches":
// forwards take pp microbatches through local chunk 0, the same pp through local chunk 1, ...,
// then the next pp microbatches; backwards take the local chunks in reverse order.
struct Interleaving {
  int pp, virtual_stages, rank;

  int local_chunk(int k, bool is_forward) const {
    const int j = (k % (pp * virtual_stages)) / pp;
    return is_forward ? j : virtual_stages - 1 - j;
  }
  int microbatch(int k) const { return (k / (pp * virtual_stages)) * pp + k % pp; }
  Action forward_at(int k) const { return forward(local_chunk(k, true) * pp + rank, microbatch(k)); }
  Action backward_at(int k) const { return backward(local_chunk(k, false) * pp + rank, microbatch(k)); }
};

RankOrder interleaved_order(int pp, int microbatches, int virtual_stages, int rank) {
  const Interleaving order{pp, virtual_stages, rank};
  const int total = microbatches * virtual_stages;
  // Megatron's get_pp_rank_microbatches: the first backward (last chunk, microbatch 0) needs the
  // forwards of the (v-1)*pp earlier virtual microbatches, plus a round trip to the last rank and
  // back during which this rank keeps running forwards, one slot per hop each way.
  const int warmup = 2 * (pp - rank - 1) + (virtual_stages - 1) * pp;
  // Slot t runs forward t and backward t - warmup: warmup forwards, steady (F, B) pairs, cooldown
  // backwards. When warmup > total (microbatches == pp on the first ranks) Megatron runs all
  // forwards, then all backwards; the slots in between stay empty so the rank keeps its place
  // in the lock-step below (it waits for its first gradient in one merged batch).
  RankOrder slots(total + warmup);
  for (int t = 0; t < total + warmup; ++t) {
    if (t < total) slots[t].push_back(order.forward_at(t));
    if (t >= warmup) slots[t].push_back(order.backward_at(t - warmup));
  }
  return slots;
}

// Sends right after the compute producing them, receives right before the compute consuming
// them. Adjacent communication forms one batch, so 1F1B's steady state becomes Megatron's
// send_forward_recv_backward / send_backward_recv_forward pairs.
std::vector<Action> lower_adjacent(const Schedule& s, const RankOrder& slots) {
  std::vector<Action> out;
  for (const Slot& slot : slots) {
    for (const Action& compute : slot) {
      if (auto recv = recv_before(s, compute)) out.push_back(*recv);
      out.push_back(compute);
      if (auto send = send_after(s, compute)) out.push_back(*send);
    }
  }
  return out;
}

// Megatron's interleaved schedule communicates once after every slot, in lock-step: rank r's
// t-th batch (t = 0 is before its first slot) runs at global step t + r. A message leaves in the
// batch right after the slot that produced it and arrives in the receiver's batch of the same
// step, possibly well before it is used (rank 0 takes chunk pp's input from rank pp-1 while
// still busy with earlier work: "the first stage is ahead of the last stage by pp-1").
// Matched operations always sit in batches of the same step, so by induction over steps no
// rank can wait forever, whatever the compute costs.
std::vector<std::vector<Action>> lower_lockstep(const Schedule& s, const std::vector<RankOrder>& order) {
  std::vector<std::vector<std::vector<Action>>> batches(s.pp);
  for (int r = 0; r < s.pp; ++r) batches[r].resize(order[r].size() + 1);
  for (int r = 0; r < s.pp; ++r) {
    for (size_t t = 0; t < order[r].size(); ++t) {
      for (const Action& compute : order[r][t]) {
        auto send = send_after(s, compute);
        if (!send) continue;
        const int step = static_cast<int>(t) + 1 + r;
        const Action recv = matching(*send);
        const int peer = s.rank_of(recv.chunk);
        const int peer_batch = step - peer;
        if (peer_batch < 0 || peer_batch >= static_cast<int>(batches[peer].size()))
          throw std::logic_error("lock-step lowering found no batch on rank " + std::to_string(peer) +
                                 " for " + to_string(recv));
        batches[r][t + 1].push_back(*send);
        batches[peer][peer_batch].push_back(recv);
      }
    }
  }
  std::vector<std::vector<Action>> ranks(s.pp);
  for (int r = 0; r < s.pp; ++r) {
    for (size_t t = 0; t <= order[r].size(); ++t) {
      ranks[r].insert(ranks[r].end(), batches[r][t].begin(), batches[r][t].end());
      if (t < order[r].size()) ranks[r].insert(ranks[r].end(), order[r][t].begin(), order[r][t].end());
    }
  }
  return ranks;
}

void sort_batches(std::vector<Action>& actions) {
  auto begin = actions.begin();
  while (begin != actions.end()) {
    auto end = std::find_if(begin, actions.end(), [](const Action& a) { return is_compute(a.kind); });
    std::stable_sort(begin, end, [](const Action& a, const Action& b) {
      return order_in_batch(a.kind) < order_in_batch(b.kind);
    });
    begin = end == actions.end() ? end : end + 1;
  }
}

std::string nearest_multiples(int value, int of) {
  const int below = value / of * of;
  if (below == 0) return std::to_string(of);
  return std::to_string(below) + " or " + std::to_string(below + of);
}

std::string join_names() {
  std::string text;
  for (const std::string& name : schedule_names()) text += (text.empty() ? "" : ", ") + name;
  return text;
}

void check_positive(int value, const std::string& what) {
  if (value < 1) throw ScheduleError(what + " must be >= 1, got " + std::to_string(value));
}

// Several chunks per rank in a loop: interleaved-1f1b, and zb-h1 with virtual_stages >= 2.
void check_interleaved(const std::string& name, int pp, int microbatches, int virtual_stages) {
  const std::string one_chunk = name == "zb-h1" ? "zb-h1 with virtual_stages=1" : "'1f1b'";
  if (pp < 2)
    throw ScheduleError(name + " needs pp >= 2 (its chunks alternate between ranks), got pp=" + std::to_string(pp) +
                        "; on one rank use " + (name == "zb-h1" ? one_chunk : "'1f1b' (plain gradient accumulation)"));
  if (virtual_stages < 2)
    throw ScheduleError(name + " needs virtual_stages >= 2, got " + std::to_string(virtual_stages) + "; use " +
                        one_chunk + " for one chunk per rank");
  if (microbatches % pp != 0)
    throw ScheduleError(name + " needs microbatches divisible by pp=" + std::to_string(pp) +
                        " (it runs them in groups of pp), got " + std::to_string(microbatches) +
                        "; nearest valid: " + nearest_multiples(microbatches, pp));
}

void check_v_shape(const std::string& name, int pp, int microbatches, int virtual_stages) {
  if (virtual_stages != 2)
    throw ScheduleError(name + " places two chunks per rank in a V (virtual_stages=2), got virtual_stages=" +
                        std::to_string(virtual_stages) + "; use 'zb-h1' for one chunk or several in a loop");
  if (name == "dualpipe-v" && microbatches < 2 * pp)
    throw ScheduleError("dualpipe-v needs microbatches >= 2*pp = " + std::to_string(2 * pp) + " (every chunk busy "
                        "before the first backward), got " + std::to_string(microbatches) +
                        "; use more microbatches or 'zb-v'");
}

// Computes plus a send and a receive for every message crossing ranks.
double action_count(const std::string& name, int pp, int microbatches, int virtual_stages) {
  const double chunks = static_cast<double>(pp) * virtual_stages;
  const double per_chunk = name.rfind("zb", 0) == 0 || name == "dualpipe-v" ? 3.0 : 2.0;
  const double crossings = pp == 1 ? 0.0 : (placement_of(name) == Placement::V ? 2.0 * (pp - 1) : chunks - 1);
  return chunks * microbatches * per_chunk + 4.0 * crossings * microbatches;
}

void check_size(const std::string& name, int pp, int microbatches, int virtual_stages) {
  const double actions = action_count(name, pp, microbatches, virtual_stages);
  if (actions <= kMaxActions) return;
  throw ScheduleError(name + " with pp=" + std::to_string(pp) + ", microbatches=" + std::to_string(microbatches) +
                      ", virtual_stages=" + std::to_string(virtual_stages) + " has about " +
                      std::to_string(static_cast<long long>(actions / 1e6)) + " million actions, more than the " +
                      std::to_string(static_cast<long long>(kMaxActions / 1e6)) +
                      " million this builds; use fewer microbatches (the bubble fraction of a larger m follows "
                      "from the closed forms)");
}

void check_arguments(const std::string& name, int pp, int microbatches, int virtual_stages) {
  const auto& names = schedule_names();
  if (std::find(names.begin(), names.end(), name) == names.end())
    throw ScheduleError("unknown schedule '" + name + "'; choose one of: " + join_names());
  check_positive(pp, "pp");
  check_positive(microbatches, "microbatches");
  check_positive(virtual_stages, "virtual_stages");
  if (name == "interleaved-1f1b" || (name == "zb-h1" && virtual_stages > 1)) {
    check_interleaved(name, pp, microbatches, virtual_stages);
  } else if (placement_of(name) == Placement::V) {
    check_v_shape(name, pp, microbatches, virtual_stages);
  } else if (virtual_stages != 1) {
    throw ScheduleError(name + " runs one model chunk per rank (virtual_stages=1), got virtual_stages=" +
                        std::to_string(virtual_stages) + "; use 'interleaved-1f1b' for several chunks per rank");
  }
  check_size(name, pp, microbatches, virtual_stages);
}

}  // namespace

int order_in_batch(Kind kind) {
  switch (kind) {
    case Kind::SEND_F: return 0;
    case Kind::SEND_B: return 1;
    case Kind::RECV_F: return 2;
    default: return 3;
  }
}

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names{"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v"};
  return names;
}

Placement placement_of(const std::string& name) {
  return name == "zb-v" || name == "dualpipe-v" ? Placement::V : Placement::Loop;
}

int chunk_rank(const std::string& name, int pp, int virtual_stages, int chunk) {
  check_positive(pp, "pp");
  check_positive(virtual_stages, "virtual_stages");
  Schedule s{name, pp, 1, virtual_stages, {}, placement_of(name)};
  if (s.placement == Placement::V && virtual_stages != 2)
    throw ScheduleError(name + " places two chunks per rank in a V (virtual_stages=2), got virtual_stages=" +
                        std::to_string(virtual_stages));
  if (chunk < 0 || chunk >= s.num_chunks())
    throw ScheduleError("chunk " + std::to_string(chunk) + " out of range: there are " +
                        std::to_string(s.num_chunks()) + " chunks (pp * virtual_stages)");
  return s.rank_of(chunk);
}

std::string placement_text(Placement placement, int pp) {
  if (placement == Placement::Loop) return "chunk k on rank k % " + std::to_string(pp);
  return "chunk k on rank k for k < " + std::to_string(pp) + ", else " + std::to_string(2 * pp - 1) + " - k";
}

Schedule make_schedule(const std::string& name, int pp, int microbatches, int virtual_stages) {
  check_arguments(name, pp, microbatches, virtual_stages);
  Schedule s{name, pp, microbatches, virtual_stages, {}, placement_of(name)};
  if (is_zero_bubble(name)) {
    s.ranks = lower_timed(s, zero_bubble_orders(s));
    return s;  // lower_timed orders each batch itself
  }
  if (name == "interleaved-1f1b") {
    std::vector<RankOrder> order;
    for (int r = 0; r < pp; ++r) order.push_back(interleaved_order(pp, microbatches, virtual_stages, r));
    s.ranks = lower_lockstep(s, order);
  } else {
    for (int r = 0; r < pp; ++r)
      s.ranks.push_back(lower_adjacent(s, name == "gpipe" ? gpipe_order(microbatches, r)
                                                           : one_f_one_b_order(pp, microbatches, r)));
  }
  for (auto& actions : s.ranks) sort_batches(actions);
  return s;
}

}  // namespace autopart
