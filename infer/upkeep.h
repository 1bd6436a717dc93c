// Periodic device work between forwards (batched restoration, infer/restored.h) kept off
// the decode's critical path. A batch restores positions whose inputs the forwards before
// it produced, and is first read by a later forward; in between the decode goes on. On
// CUDA with graphs each batch is one replay of a captured graph on a side stream, started
// once the forwards before it are enqueued, and the main stream waits for it (a stream
// wait, no host sync) only before the first forward that reads it. Elsewhere (CPU, eager
// CUDA) a batch runs in place. Either way a batch computes the same values.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>

namespace kakeya {

// One batch: its first position (the argument of the device work) and the first forward
// (decode step position, or fused block start) that reads what it writes.
struct UpkeepBatch {
  int64_t from = -1;    // < 0: nothing due
  int64_t read_at = 0;
};

class UpkeepRunner {
 public:
  // arg(from): stores a batch's argument on the device (on the current stream, outside the
  // graph); work(): the batch itself, reading its argument from the device (capturable).
  // cuda: the work runs on a CUDA device (timing by events).
  UpkeepRunner(std::function<void(int64_t from)> arg, std::function<void()> work, bool cuda);
  ~UpkeepRunner();
  UpkeepRunner(const UpkeepRunner&) = delete;
  UpkeepRunner& operator=(const UpkeepRunner&) = delete;

  // CUDA: records `work` as a graph (on a capture stream: nothing runs) so that later batches
  // replay it on the side stream. Returns the capture's wall seconds. Call it where the
  // forwards are captured too (the same warm-up rules hold).
  double capture();
  bool captured() const;
  // The batch starting at `from`, first read by the forward at (block or step) position read_at.
  void run(int64_t from, int64_t read_at);
  // Before the forward at `pos`: the main stream waits for every batch with read_at <= pos.
  void wait(int64_t pos);
  // The main stream waits for every batch in flight (end of a run: the next one starts clean).
  void drain();
  // Device seconds of the batches run since the last call (timing() on: events around each
  // batch on the stream it ran on; on CPU its wall time). SYNC: waits for them to finish.
  void set_timing(bool on);
  double take_seconds();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kakeya
