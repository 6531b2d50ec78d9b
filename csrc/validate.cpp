#include "validate.h"

#include <map>
#include <sstream>

#include "rendezvous.h"

namespace autopart {
namespace {

using Problems = std::optional<Problem>;

std::string at(Pos pos) { return "rank " + std::to_string(pos.rank) + " step " + std::to_string(pos.step); }

Problem problem(std::string message, std::vector<Pos> marks = {}) {
  Problem p{std::move(message), {}};
  for (Pos pos : marks)
    if (pos.found()) p.marks.emplace_back(pos.rank, pos.step);
  return p;
}

std::string placement_reason(const Schedule& s) {
  if (s.placement == Placement::Loop) return "chunk k lives on rank k % pp";
  return "in a V: chunk k lives on rank k for k < pp, else on rank 2pp-1-k";
}

Problems check_shape(const Schedule& s) {
  if (s.pp < 1 || s.microbatches < 1 || s.virtual_stages < 1)
    return problem("pp, microbatches and virtual_stages must be >= 1, got " + std::to_string(s.pp) + ", " +
                   std::to_string(s.microbatches) + ", " + std::to_string(s.virtual_stages));
  if (s.placement == Placement::V && s.virtual_stages != 2)
    return problem(s.name + " places two chunks per rank in a V and needs virtual_stages=2, got " +
                   std::to_string(s.virtual_stages));
  if (static_cast<int>(s.ranks.size()) != s.pp)
    return problem("the schedule has " + std::to_string(s.ranks.size()) + " rank lists but pp=" + std::to_string(s.pp));
  for (int r = 0; r < s.pp; ++r) {
    for (size_t step = 0; step < s.ranks[r].size(); ++step) {
      const Action& a = s.ranks[r][step];
      const Pos pos{r, static_cast<int>(step)};
      if (a.chunk < 0 || a.chunk >= s.num_chunks())
        return problem(at(pos) + ": " + to_string(a) + " names chunk " + std::to_string(a.chunk) + " but there are " +
                       std::to_string(s.num_chunks()) + " chunks (pp * virtual_stages)", {pos});
      if (a.microbatch < 0 || a.microbatch >= s.microbatches)
        return problem(at(pos) + ": " + to_string(a) + " names microbatch " + std::to_string(a.microbatch) +
                       " but there are " + std::to_string(s.microbatches), {pos});
      if (s.rank_of(a.chunk) != r)
        return problem(at(pos) + ": " + to_string(a) + " belongs on rank " + std::to_string(s.rank_of(a.chunk)) +
                       " (" + placement_reason(s) + ")", {pos});
    }
  }
  return std::nullopt;
}

Problems fill_index(const Schedule& s, ActionIndex& index) {
  for (int r = 0; r < s.pp; ++r) {
    for (size_t step = 0; step < s.ranks[r].size(); ++step) {
      const Pos pos{r, static_cast<int>(step)};
      Pos& seen = index[s.ranks[r][step]];
      if (seen.found())
        return problem(to_string(s.ranks[r][step]) + " appears twice on rank " + std::to_string(r) + " (steps " +
                       std::to_string(seen.step) + " and " + std::to_string(step) + ")", {seen, pos});
      seen = pos;
    }
  }
  return std::nullopt;
}

// Communication exists exactly where data crosses ranks.
bool needed(const Schedule& s, const Action& a) {
  if (is_compute(a.kind)) return true;
  const auto expected = is_send(a.kind) ? send_after(s, compute_of(a)) : recv_before(s, compute_of(a));
  return expected && *expected == a;
}

std::string why_not_needed(const Schedule& s, const Action& a) {
  const int peer = matching(a).chunk;
  if (peer < 0) return "chunk 0 is the first chunk: it reads the microbatch itself and sends no gradient back";
  if (peer >= s.num_chunks())
    return "chunk " + std::to_string(a.chunk) + " is the last chunk: it computes the loss, nothing comes after it";
  return "chunks " + std::to_string(a.chunk) + " and " + std::to_string(peer) + " are both on rank " +
         std::to_string(s.rank_of(a.chunk)) + ", nothing crosses ranks";
}

std::string why_needed(const Action& a) {
  const std::string mb = "microbatch " + std::to_string(a.microbatch);
  const std::string chunk = "chunk " + std::to_string(a.chunk);
  switch (a.kind) {
    case Kind::F: return mb + " never runs forward through " + chunk;
    case Kind::B: return mb + " never runs backward through " + chunk;
    case Kind::I: return to_string({a.chunk, Kind::W, a.microbatch}) + " needs the input gradient first";
    case Kind::W: return mb + "'s weight gradient of " + chunk + " is never computed (its I ran, its W did not)";
    case Kind::SEND_F:
    case Kind::SEND_B: return to_string(matching(a)) + " would wait forever";
    default: return to_string(matching(a)) + " has no matching receive";
  }
}

// The action best shown next to a missing one: its forward/backward twin, the other half of a
// split backward, or its peer.
Action counterpart(const Action& a) {
  switch (a.kind) {
    case Kind::F: return {a.chunk, Kind::B, a.microbatch};
    case Kind::B: return {a.chunk, Kind::F, a.microbatch};
    case Kind::I: return {a.chunk, Kind::W, a.microbatch};
    case Kind::W: return {a.chunk, Kind::I, a.microbatch};
    default: return matching(a);
  }
}

// The computes one (chunk, microbatch) lacks: F, and a backward run once, fused (B) or split
// (I and W), never both.
Problems check_computes(const Schedule& s, const ActionIndex& index, int c, int i) {
  const auto found = [&](Kind kind) { return index[Action{c, kind, i}].found(); };
  const std::string where = " on rank " + std::to_string(s.rank_of(c));
  const auto missing = [&](Kind kind) {
    const Action a{c, kind, i};
    return problem("missing " + to_string(a) + where + ": " + why_needed(a), {index[counterpart(a)]});
  };
  if (!found(Kind::F)) return missing(Kind::F);
  if (found(Kind::B) && (found(Kind::I) || found(Kind::W))) {
    const Action fused{c, Kind::B, i}, split{c, found(Kind::I) ? Kind::I : Kind::W, i};
    return problem(to_string(fused) + " and " + to_string(split) + where + ": a backward runs once, fused (B) or "
                   "split into I then W, not both", {index[fused], index[split]});
  }
  if (found(Kind::B)) return std::nullopt;
  if (found(Kind::I) && !found(Kind::W)) return missing(Kind::W);
  if (found(Kind::W) && !found(Kind::I)) return missing(Kind::I);
  if (!found(Kind::I)) return missing(Kind::B);
  return std::nullopt;
}

Problems check_coverage(const Schedule& s, const ActionIndex& index) {
  for (int r = 0; r < s.pp; ++r) {
    for (size_t step = 0; step < s.ranks[r].size(); ++step) {
      const Action& a = s.ranks[r][step];
      if (!needed(s, a))
        return problem(at({r, static_cast<int>(step)}) + ": " + to_string(a) + " is not needed: " + why_not_needed(s, a),
                       {{r, static_cast<int>(step)}});
    }
  }
  for (int c = 0; c < s.num_chunks(); ++c) {
    for (int i = 0; i < s.microbatches; ++i) {
      if (auto p = check_computes(s, index, c, i)) return p;
      for (int k = 0; k < kNumKinds; ++k) {
        const Action a{c, static_cast<Kind>(k), i};
        if (is_compute(a.kind) || !needed(s, a) || index[a].found()) continue;
        return problem("missing " + to_string(a) + " on rank " + std::to_string(s.rank_of(c)) + ": " + why_needed(a),
                       {index[counterpart(a)]});
      }
    }
  }
  return std::nullopt;
}

// What must come earlier in the same rank's list, with why.
std::vector<std::pair<Action, std::string>> prerequisites(const Schedule& s, const ActionIndex& index,
                                                         const Action& a) {
  const int c = a.chunk, i = a.microbatch;
  // A split backward's gradient comes from its I; a fused one's from B.
  const auto backward = [&](int chunk) {
    const Action split{chunk, Kind::I, i};
    return index[split].found() ? split : Action{chunk, Kind::B, i};
  };
  switch (a.kind) {
    case Kind::F:
      if (auto recv = recv_before(s, a)) return {{*recv, "its input arrives"}};
      if (c > 0) return {{{c - 1, Kind::F, i}, "the previous chunk's forward"}};
      return {};
    case Kind::B:
    case Kind::I: {
      std::vector<std::pair<Action, std::string>> before{{{c, Kind::F, i}, "its forward"}};
      if (auto recv = recv_before(s, a)) before.push_back({*recv, "its output gradient arrives"});
      else if (c + 1 < s.num_chunks()) before.push_back({backward(c + 1), "the next chunk's backward"});
      return before;
    }
    case Kind::W: return {{{c, Kind::I, i}, "its input gradient (I)"}};
    case Kind::SEND_F: return {{{c, Kind::F, i}, "the forward producing it"}};
    case Kind::SEND_B: return {{backward(c), "the backward producing it"}};
    default: return {};
  }
}

Problems check_dependencies(const Schedule& s, const ActionIndex& index) {
  for (int r = 0; r < s.pp; ++r) {
    for (size_t step = 0; step < s.ranks[r].size(); ++step) {
      const Action& a = s.ranks[r][step];
      for (const auto& [before, what] : prerequisites(s, index, a)) {
        const Pos pos = index[before];
        if (pos.step < static_cast<int>(step)) continue;
        return problem(at({r, static_cast<int>(step)}) + ": " + to_string(a) + " runs before " + what + " (" +
                           to_string(before) + " at step " + std::to_string(pos.step) + ")",
                       {{r, static_cast<int>(step)}, pos});
      }
    }
  }
  return std::nullopt;
}

std::string batch_text(const Schedule& s, const Batching& batches, Pos pos) {
  const int batch = batches.batch_of[pos.rank][pos.step];
  std::string text;
  for (int i = batches.begin[pos.rank][batch]; i < batches.end[pos.rank][batch]; ++i)
    text += (text.empty() ? "" : " ") + to_string(s.ranks[pos.rank][i]);
  return "[" + text + "]";
}

// Gloo's semantics: a rank stops only at a compute whose received input, or at the list's end
// whose messages, a peer never posted.
Problems posted_deadlock(const Schedule& s, const RunResult& run) {
  std::ostringstream msg;
  msg << "deadlock: posting never waits, but a compute waits for the data it reads and these "
         "ranks wait for messages their peers never post:";
  std::vector<Pos> marks;
  for (int r = 0; r < s.pp; ++r) {
    const int step = run.next_step[r];
    if (step < static_cast<int>(s.ranks[r].size())) {
      msg << "\n  rank " << r << " is blocked at step " << step << " (" << to_string(s.ranks[r][step])
          << ") waiting for a message";
      marks.push_back({r, step});
    }
  }
  return problem(msg.str(), marks);
}

// Names, for each blocked rank, the first operation of its batch whose peer has not posted.
Problems check_deadlock(const Schedule& s, const ActionIndex& index, bool sends_wait) {
  const Batching batches = batch_actions(s);
  const RunResult run = run_rendezvous(s, index, batches, [](const Action&) { return 0.0; }, 0.0, false, sends_wait);
  if (run.finished) return std::nullopt;
  if (!sends_wait) return posted_deadlock(s, run);
  std::ostringstream msg;
  msg << "deadlock: a batch of sends/receives completes only once every peer has posted the batch "
         "holding the matching operation, and these ranks wait on each other:";
  std::vector<Pos> marks;
  for (int r = 0; r < s.pp; ++r) {
    const int step = run.next_step[r];
    if (step == static_cast<int>(s.ranks[r].size())) continue;
    const int batch = batches.batch_of[r][step];
    for (int i = step; i < batches.end[r][batch]; ++i) {
      const Action& a = s.ranks[r][i];
      const Pos peer = index[matching(a)];
      if (posted(run, batches, peer)) continue;
      msg << "\n  rank " << r << " is blocked at step " << step << " in batch " << batch_text(s, batches, {r, step})
          << ": " << to_string(a) << " waits for rank " << peer.rank << " to post " << to_string(matching(a))
          << " (its step " << peer.step << "), but rank " << peer.rank << " is stuck at step "
          << run.next_step[peer.rank];
      marks.push_back({r, i});
      break;
    }
  }
  return problem(msg.str(), marks);
}

// NCCL matches the n-th send from rank a to rank b with the n-th receive posted on b from a.
Problems check_message_order(const Schedule& s, const ActionIndex& index) {
  std::map<std::pair<int, int>, std::vector<Action>> sent, received;  // (from, to) -> sends
  for (int r = 0; r < s.pp; ++r) {
    for (const Action& a : s.ranks[r]) {
      if (is_compute(a.kind)) continue;
      const int peer = s.rank_of(matching(a).chunk);
      if (is_send(a.kind)) sent[{r, peer}].push_back(a);
      else received[{peer, r}].push_back(matching(a));
    }
  }
  for (const auto& [pair, sends] : sent) {
    const auto& recvs = received[pair];
    for (size_t n = 0; n < sends.size() && n < recvs.size(); ++n) {
      if (sends[n] == recvs[n]) continue;
      const Pos send = index[sends[n]], recv = index[matching(recvs[n])];
      return problem("rank " + std::to_string(pair.first) + "'s message #" + std::to_string(n) + " to rank " +
                         std::to_string(pair.second) + " is " + to_string(sends[n]) + " (step " +
                         std::to_string(send.step) + "), but rank " + std::to_string(pair.second) + "'s receive #" +
                         std::to_string(n) + " from it is " + to_string(matching(recvs[n])) + " (step " +
                         std::to_string(recv.step) +
                         "); NCCL matches messages between two ranks by posting order, so both sides must agree",
                     {send, recv});
    }
  }
  return std::nullopt;
}

}  // namespace

std::optional<Problem> find_problem(const Schedule& s, bool sends_wait) {
  if (auto p = check_shape(s)) return p;
  ActionIndex index(s);
  if (auto p = fill_index(s, index)) return p;
  if (auto p = check_coverage(s, index)) return p;
  if (auto p = check_dependencies(s, index)) return p;
  if (auto p = check_deadlock(s, index, sends_wait)) return p;
  return check_message_order(s, index);
}

}  // namespace autopart
