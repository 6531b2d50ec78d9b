// Pipeline schedules as data: one list of actions per pipeline rank.
//
// Model chunk k (0 .. pp*virtual_stages-1, in model order) lives on rank k % pp. Actions are
// the compute F (forward) and B (full backward) of one chunk on one microbatch, and the
// point-to-point communication around them. Tokens print as torch.distributed.pipelining's
// _Action does: "2F0", "2SEND_F0" (chunk 2 sends its activation for microbatch 0 to chunk 3),
// "3RECV_F0", "3SEND_B0" (chunk 3 sends the gradient w.r.t. its input to chunk 2), "2RECV_B0".
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace autopart {

// Declaration order is the wire format shared with Python (autopart.schedule.Kind).
enum class Kind : std::uint8_t { F, B, SEND_F, RECV_F, SEND_B, RECV_B };
inline constexpr int kNumKinds = 6;

struct Action {
  int chunk;
  Kind kind;
  int microbatch;
};

bool operator==(const Action& a, const Action& b);
const char* kind_name(Kind kind);
bool is_compute(Kind kind);
bool is_send(Kind kind);
std::string to_string(const Action& action);

struct Schedule {
  std::string name;
  int pp = 1;
  int microbatches = 1;
  int virtual_stages = 1;
  std::vector<std::vector<Action>> ranks;

  int num_chunks() const { return pp * virtual_stages; }
  int rank_of(int chunk) const { return chunk % pp; }
};

// A schedule that cannot be built or does not hold up; surfaces as autopart.schedule.ScheduleError.
class ScheduleError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// The send a compute issues once done, if the chunk consuming its output lives on another rank.
std::optional<Action> send_after(const Schedule& s, const Action& compute);
// The receive a compute needs first, if the chunk producing its input lives on another rank.
std::optional<Action> recv_before(const Schedule& s, const Action& compute);
// The action on the peer rank that a send or receive pairs with (2SEND_F0 <-> 3RECV_F0).
Action matching(const Action& comm);
// The compute a send or receive serves (2SEND_F0 -> 2F0, 2RECV_B0 -> 2B0).
Action compute_of(const Action& comm);

// "gpipe", "1f1b" or "interleaved-1f1b"; throws ScheduleError on arguments that cannot work.
Schedule make_schedule(const std::string& name, int pp, int microbatches, int virtual_stages);

}  // namespace autopart
