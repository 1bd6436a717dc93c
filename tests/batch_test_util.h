// Drives a BatchDecoder (infer/batch.h) the way a server does: while rows are free one sequence
// joins per step (so sequences enter at different steps), a sequence leaves once it has its budget
// of tokens (from the middle of the rows), and each step's tokens go to their sequences.
#pragma once
#include <algorithm>
#include <cstdint>
#include <map>
#include <vector>

#include "infer/batch.h"

namespace kakeya::test {

struct BatchRun {
  std::vector<std::vector<int64_t>> tokens;  // per sequence: its first token, then one per step
  int64_t steps = 0, rows = 0;               // steps run, and the tokens they produced
  int64_t most = 0;                          // most sequences seated at once
};

inline BatchRun run_batch(BatchDecoder& bd, const std::vector<std::vector<int64_t>>& prompts,
                          const std::vector<int64_t>& budget) {
  BatchRun r;
  r.tokens.resize(prompts.size());
  std::map<int64_t, size_t> which;  // sequence id -> index
  size_t next = 0;
  while (next < prompts.size() || bd.size() > 0) {
    if (next < prompts.size() && bd.size() < bd.max_rows()) {
      const auto [id, first] = bd.join(prompts[next], {}, budget[next]);
      which[id] = next;
      r.tokens[next].push_back(first);
      ++next;
    }
    for (auto it = which.begin(); it != which.end();) {
      if ((int64_t)r.tokens[it->second].size() >= budget[it->second]) {
        bd.leave(it->first);
        it = which.erase(it);
      } else {
        ++it;
      }
    }
    if (bd.size() == 0) continue;
    r.most = std::max(r.most, bd.size());
    for (const auto& [id, t] : bd.step()) r.tokens[which.at(id)].push_back(t);
    ++r.steps;
    r.rows += (int64_t)which.size();
  }
  return r;
}

}  // namespace kakeya::test
