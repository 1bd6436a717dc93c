// `kakeya bench chain` (infer/bench_chain.h) refuses what it cannot time, naming the option, before
// it touches a device: on this machine (no GPU) and on the GPU machine alike. Its timings run on the
// GPU machine only (the chains' outputs are checked bit for bit there, inside the bench).
#include <gtest/gtest.h>

#include "core/error.h"
#include "infer/bench_chain.h"
#include "tests/test_util.h"

using namespace kakeya;

TEST(BenchChain, RefusesWhatItCannotTimeNamingTheOption) {
  BenchChainOptions o;
  o.device = at::Device(at::kCPU);
  test::expect_error([&] { bench_chain(o); }, "--device cuda expected");
  o = {};
  o.hidden = 100;
  test::expect_error([&] { bench_chain(o); }, "--hidden expected a multiple of 16");
  o = {};
  o.intermediate = 0;
  test::expect_error([&] { bench_chain(o); }, "--intermediate expected");
  o = {};
  o.intermediate = 512;  // below --hidden 640: a link's next row is the first H values of its output
  test::expect_error([&] { bench_chain(o); }, "--intermediate expected a multiple of 16 in [--hidden 640");
  o = {};
  o.qkv = 100;
  test::expect_error([&] { bench_chain(o); }, "--qkv expected a multiple of 16 in [--hidden 640");
  o = {};
  o.links = 1001;  // the longer MLP chain would pass the persistent program's 4,096 instructions
  test::expect_error([&] { bench_chain(o); }, "--links expected in [8, 1000]");
  o = {};
  o.repeats = 2;
  test::expect_error([&] { bench_chain(o); }, "--repeats expected at least 3");
  o = {};
  o.vocab = 1000;
  test::expect_error([&] { bench_chain(o); }, "--vocab expected in [1024, 1048576], got 1000");
}
