// Pipeline schedules as data: one list of actions per pipeline rank.
//
// Model chunk k (0 .. pp*virtual_stages-1, in model order) lives on the rank its schedule's
// placement says: k % pp, or in a V for zb-v and dualpipe-v. Actions are the compute F (forward),
// B (full backward) or its two halves I (input gradient, what the previous chunk waits for) and
// W (weight gradient, needed only by the optimizer step), of one chunk on one microbatch, and the
// point-to-point communication around them. Tokens print as torch.distributed.pipelining's
// _Action does: "2F0", "2I0", "2W0", "2SEND_F0" (chunk 2 sends its activation for microbatch 0 to
// chunk 3), "3RECV_F0", "3SEND_B0" (chunk 3 sends the gradient w.r.t. its input to chunk 2), "2RECV_B0".
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace autopart {

// Declaration order is the wire format shared with Python (autopart.schedule.Kind); I and W come
// last so the older codes keep their values.
enum class Kind : std::uint8_t { F, B, SEND_F, RECV_F, SEND_B, RECV_B, I, W };
inline constexpr int kNumKinds = 8;

// Where chunks live. Loop: chunk k on rank k % pp. V: chunk k on rank k for k < pp and on rank
// 2pp-1-k after, so each rank holds one chunk going down and one coming back (two chunks per rank);
// the last chunk (the loss) then sits on rank 0 beside the first.
enum class Placement : std::uint8_t { Loop, V };

struct Action {
  int chunk;
  Kind kind;
  int microbatch;
};

bool operator==(const Action& a, const Action& b);
const char* kind_name(Kind kind);
bool is_compute(Kind kind);
bool is_send(Kind kind);
bool is_backward(Kind kind);  // B or I: what produces the gradient sent to the previous chunk
// Within a batch (the position of a transfer in one batch_isend_irecv): sends before receives, forward activations before gradients. Two ranks that
// exchange several messages in one batch then post them in the same order, which NCCL needs
// (it matches point-to-point messages between a pair of ranks by posting order, not by tag).
int order_in_batch(Kind kind);
std::string to_string(const Action& action);

struct Schedule {
  std::string name;
  int pp = 1;
  int microbatches = 1;
  int virtual_stages = 1;
  std::vector<std::vector<Action>> ranks;
  Placement placement = Placement::Loop;

  int num_chunks() const { return pp * virtual_stages; }
  int rank_of(int chunk) const {
    return placement == Placement::V && chunk >= pp ? 2 * pp - 1 - chunk : chunk % pp;
  }
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

// Every schedule make_schedule builds, in the order users see them. The one list of names.
const std::vector<std::string>& schedule_names();
// The placement a schedule name implies (V for zb-v and dualpipe-v; Loop for any other name,
// hand-made lists included).
Placement placement_of(const std::string& name);
// Rank holding `chunk` under `name`'s placement; throws ScheduleError if chunk is out of range.
int chunk_rank(const std::string& name, int pp, int virtual_stages, int chunk);
// "chunk k on rank k % 4" or "chunk k on rank k for k < 4, else 7 - k": for messages and reports.
std::string placement_text(Placement placement, int pp);

// Refuse to build more actions than this (Python holds each as an object).
inline constexpr double kMaxActions = 5e6;  // about 3 GB of Python objects, a minute to build

// One of schedule_names(); throws ScheduleError on arguments that cannot work.
Schedule make_schedule(const std::string& name, int pp, int microbatches, int virtual_stages);

}  // namespace autopart
