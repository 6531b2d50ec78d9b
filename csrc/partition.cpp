#include "partition.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace autopart {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// best[i]: the smallest possible largest part when splitting the first i segments into j parts.
// With j-1 parts before cut l, a split costs max(best_prev[l], P[i] - P[l]); the first term
// grows with l and the second shrinks, so the optimum sits where they cross (binary search).
// O(k n log n).
double min_largest_part(const std::vector<double>& prefix, int k) {
  const int n = static_cast<int>(prefix.size()) - 1;
  std::vector<double> best(prefix.begin(), prefix.end()), next(n + 1, kInf);
  for (int j = 2; j <= k; ++j) {
    std::fill(next.begin(), next.end(), kInf);
    for (int i = j; i <= n; ++i) {
      // Smallest l in [j-1, i-1] with best[l] >= P[i] - P[l]; check it and its left neighbour.
      int lo = j - 1, hi = i - 1;
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (best[mid] >= prefix[i] - prefix[mid]) hi = mid;
        else lo = mid + 1;
      }
      for (int l = std::max(j - 1, lo - 1); l <= lo; ++l)
        next[i] = std::min(next[i], std::max(best[l], prefix[i] - prefix[l]));
    }
    std::swap(best, next);
  }
  return best[n];
}

// Among splits whose parts all stay <= limit, the one with the smallest sum of squares. The
// parts ending at i may start at any l with P[i] - P[l] <= limit, a window that is short when
// the limit is near total/k, so this is about O(n^2) in practice and O(k n^2) at worst.
std::vector<int> min_squares_cuts(const std::vector<double>& prefix, int k, double limit) {
  const int n = static_cast<int>(prefix.size()) - 1;
  std::vector<std::vector<double>> best(k + 1, std::vector<double>(n + 1, kInf));
  std::vector<std::vector<int>> cut(k + 1, std::vector<int>(n + 1, -1));
  best[0][0] = 0.0;
  for (int j = 1; j <= k; ++j) {
    for (int i = j; i <= n - (k - j); ++i) {
      for (int l = i - 1; l >= j - 1 && prefix[i] - prefix[l] <= limit; --l) {
        if (best[j - 1][l] == kInf) continue;
        const double part = prefix[i] - prefix[l];
        const double total = best[j - 1][l] + part * part;
        if (total <= best[j][i]) best[j][i] = total, cut[j][i] = l;
      }
    }
  }
  std::vector<int> cuts(k - 1);
  for (int j = k, i = n; j > 1; --j) i = cuts[j - 2] = cut[j][i];
  return cuts;
}

}  // namespace

std::vector<int> balanced_partition(const std::vector<double>& costs, int k) {
  const int n = static_cast<int>(costs.size());
  if (k < 1) throw std::invalid_argument("k must be >= 1, got " + std::to_string(k));
  if (n < k)
    throw std::invalid_argument("cannot split " + std::to_string(n) + " segments into " + std::to_string(k) +
                                " non-empty parts; need at least k segments");
  std::vector<double> prefix(n + 1, 0.0);
  for (int i = 0; i < n; ++i) {
    if (!(costs[i] >= 0.0) || std::isinf(costs[i]))
      throw std::invalid_argument("costs must be finite and >= 0, got costs[" + std::to_string(i) +
                                  "] = " + std::to_string(costs[i]));
    prefix[i + 1] = prefix[i] + costs[i];
  }
  return min_squares_cuts(prefix, k, min_largest_part(prefix, k));
}

}  // namespace autopart
