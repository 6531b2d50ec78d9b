// Splitting a sequence of segment costs into contiguous pipeline stages.
#pragma once

#include <vector>

namespace autopart {

// Splits n >= k non-negative costs into k contiguous non-empty parts minimizing the largest
// part's sum, ties broken by the smaller sum of squared part sums (the more even split).
// Returns the k-1 cut indices; cut j is the boundary between segment j-1 and segment j.
// Throws std::invalid_argument on bad input.
std::vector<int> balanced_partition(const std::vector<double>& costs, int k);

}  // namespace autopart
