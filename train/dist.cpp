#include "train/dist.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef KAKEYA_DIST_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#ifdef KAKEYA_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <chrono>
#include <cstdlib>
#include <thread>

#include "core/error.h"

namespace kakeya::train {

namespace {

const char* env_value(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = env_value(name);
  if (!v) return fallback;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  KAKEYA_CHECK(end && *end == '\0', "environment variable " << name << "='" << v << "': expected an integer");
  return x;
}

// The first line of a library message (Gloo and NCCL append backtraces).
std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

}  // namespace

DistEnv dist_env_from_environment() {
  DistEnv e;
  e.world = (int)env_int("KAKEYA_WORLD_SIZE", 1);
  e.rank = (int)env_int("KAKEYA_RANK", 0);
  e.local_rank = (int)env_int("KAKEYA_LOCAL_RANK", e.rank);
  e.port = (int)env_int("KAKEYA_MASTER_PORT", 0);
  if (const char* a = env_value("KAKEYA_MASTER_ADDR")) e.addr = a;
  if (const char* b = env_value("KAKEYA_DIST_BACKEND")) e.backend = b;
  if (const char* t = env_value("KAKEYA_DIST_TIMEOUT")) {
    char* end = nullptr;
    e.timeout_s = std::strtod(t, &end);
    KAKEYA_CHECK(end && *end == '\0' && e.timeout_s > 0,
                 "environment variable KAKEYA_DIST_TIMEOUT='" << t << "': expected seconds > 0");
  }
  KAKEYA_CHECK(e.world >= 1, "KAKEYA_WORLD_SIZE=" << e.world << ": expected >= 1");
  KAKEYA_CHECK(e.rank >= 0 && e.rank < e.world,
               "KAKEYA_RANK=" << e.rank << ": expected 0 .. " << e.world - 1 << " (KAKEYA_WORLD_SIZE=" << e.world << ")");
  KAKEYA_CHECK(e.world == 1 || e.port > 0,
               "KAKEYA_WORLD_SIZE=" << e.world << " without KAKEYA_MASTER_PORT: start ranks with `kakeya launch`");
  KAKEYA_CHECK(e.port >= 0 && e.port < 65536, "KAKEYA_MASTER_PORT=" << e.port << ": expected a TCP port");
  KAKEYA_CHECK(e.backend == "auto" || e.backend == "gloo" || e.backend == "nccl",
               "KAKEYA_DIST_BACKEND='" << e.backend << "': expected auto, gloo or nccl");
  return e;
}

std::vector<std::string> dist_env_variables(const DistEnv& e) {
  char timeout[64];
  std::snprintf(timeout, sizeof timeout, "%g", e.timeout_s);
  return {"KAKEYA_RANK=" + std::to_string(e.rank),
          "KAKEYA_WORLD_SIZE=" + std::to_string(e.world),
          "KAKEYA_LOCAL_RANK=" + std::to_string(e.local_rank),
          "KAKEYA_MASTER_ADDR=" + e.addr,
          "KAKEYA_MASTER_PORT=" + std::to_string(e.port),
          "KAKEYA_DIST_TIMEOUT=" + std::string(timeout),
          "KAKEYA_DIST_BACKEND=" + e.backend};
}

struct Dist::Impl {
  c10::intrusive_ptr<c10d::TCPStore> store;
  c10::intrusive_ptr<c10d::Backend> group;
};

Dist::Dist(const DistEnv& env, at::Device device) : env_(env), device_(device) {
  // A single process not started by the launcher has no store: nothing to join. Under the
  // launcher even one rank builds its group, so the NCCL/Gloo path runs with one GPU.
  if (env.port == 0) return;
  if (device.is_cuda()) {
#ifdef KAKEYA_CUDA
    const int n = (int)c10::cuda::device_count();
    KAKEYA_CHECK(n > 0, "rank " << env.rank << ": --device cuda but no GPU is visible");
    const int index = env.local_rank % n;
    c10::cuda::set_device((c10::DeviceIndex)index);
    device_ = at::Device(at::kCUDA, (c10::DeviceIndex)index);
#else
    KAKEYA_FAIL("rank " << env.rank << ": --device cuda in a build without CUDA");
#endif
  }
#ifdef KAKEYA_DIST_NCCL
  const bool have_nccl = true;
#else
  const bool have_nccl = false;
#endif
  backend_ = env.backend == "auto" ? (device_.is_cuda() && have_nccl ? "nccl" : "gloo") : env.backend;
  KAKEYA_CHECK(backend_ != "nccl" || have_nccl, "KAKEYA_DIST_BACKEND=nccl (launch --backend): this build has no NCCL");
  KAKEYA_CHECK(backend_ != "nccl" || device_.is_cuda(),
               "KAKEYA_DIST_BACKEND=nccl (launch --backend) needs --device cuda; use gloo on the CPU");
  const auto timeout = std::chrono::milliseconds((int64_t)(env.timeout_s * 1000));
  impl_ = std::make_unique<Impl>();
  try {
    c10d::TCPStoreOptions so;
    so.port = (uint16_t)env.port;
    so.isServer = false;  // the launcher hosts it, so it outlives any rank
    so.waitWorkers = false;
    so.timeout = timeout;
    impl_->store = c10::make_intrusive<c10d::TCPStore>(env.addr, so);
  } catch (const std::exception& e) {
    KAKEYA_FAIL("rank " << env.rank << ": cannot reach the launcher's store at " << env.addr << ":" << env.port << " ("
                        << first_line(e.what()) << ")");
  }
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("group", impl_->store);
  try {
    if (backend_ == "gloo") {
      auto o = c10d::ProcessGroupGloo::Options::create(timeout);
      o->devices.push_back(env.addr == "127.0.0.1" || env.addr == "localhost"
                               ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                               : c10d::ProcessGroupGloo::createDefaultDevice());
      impl_->group = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, env.rank, env.world, o);
    } else {
#ifdef KAKEYA_DIST_NCCL
      auto o = c10d::ProcessGroupNCCL::Options::create();
      o->timeout = timeout;
      impl_->group = c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, env.rank, env.world, o);
#endif
    }
  } catch (const std::exception& e) {
    fail("joining the " + backend_ + " group", e.what());
  }
  barrier("rendezvous");
}

Dist::~Dist() {
  if (!impl_ || !impl_->group) return;
  try {
    impl_->group->shutdown();  // NCCL: release communicators before the CUDA context goes
  } catch (...) {
    // Leaving the process anyway (often after a failed collective): nothing left to report.
  }
}

std::pair<int64_t, int64_t> Dist::share(int64_t n, const std::string& flag) const {
  KAKEYA_CHECK(n % env_.world == 0, flag << " " << n << " does not split over " << env_.world
                                         << " ranks: expected a multiple of " << env_.world);
  const int64_t per = n / env_.world;
  return {env_.rank * per, (env_.rank + 1) * per};
}

void Dist::fail(const std::string& what, const std::string& cause) const {
  // The launcher records a rank that exited; our collective may notice the broken connection
  // a moment before the launcher reaps the process, so give it a few seconds.
  std::string who;
  for (int i = 0; i < 50 && who.empty() && impl_ && impl_->store; ++i) {
    try {
      if (impl_->store->check({kDistFailedKey})) {
        auto v = impl_->store->get(kDistFailedKey);
        who.assign(v.begin(), v.end());
      }
    } catch (const std::exception&) {
      who = "the launcher's store is gone (the launcher exited)";
    }
    if (who.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (who.empty())
    who = "no rank has exited: a peer did not answer within the " + std::to_string((int64_t)env_.timeout_s) +
          " s timeout (KAKEYA_DIST_TIMEOUT, launch --timeout)";
  KAKEYA_FAIL("rank " << env_.rank << " of " << env_.world << ": " << what << " failed: " << who << " ["
                      << first_line(cause) << "]");
}

namespace {

// One contiguous buffer for a list of same-dtype tensors (one collective instead of one per tensor).
at::Tensor flatten(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> flat;
  for (const auto& t : ts) {
    KAKEYA_CHECK(t.scalar_type() == ts[0].scalar_type() && t.device() == ts[0].device(),
                 "distributed collective: tensors of one call must share dtype and device");
    flat.push_back(t.reshape({-1}));
  }
  return ts.size() == 1 && ts[0].is_contiguous() ? ts[0].view({-1}) : at::cat(flat);
}

void unflatten(const at::Tensor& flat, std::vector<at::Tensor>& ts) {
  if (ts.size() == 1 && ts[0].is_contiguous() && flat.data_ptr() == ts[0].data_ptr()) return;
  int64_t off = 0;
  for (auto& t : ts) {
    t.copy_(flat.narrow(0, off, t.numel()).view(t.sizes()));
    off += t.numel();
  }
}

}  // namespace

void Dist::all_reduce_sum(std::vector<at::Tensor>& ts, const std::string& what) const {
  if (!impl_ || ts.empty()) return;
  std::vector<at::Tensor> buf{flatten(ts)};
  try {
    impl_->group->allreduce(buf)->wait();
  } catch (const std::exception& e) {
    fail("all-reduce of " + what, e.what());
  }
  unflatten(buf[0], ts);
}

void Dist::broadcast(std::vector<at::Tensor>& ts, const std::string& what) const {
  if (!impl_ || ts.empty()) return;
  std::vector<at::Tensor> buf{flatten(ts)};
  try {
    c10d::BroadcastOptions o;
    o.rootRank = 0;
    impl_->group->broadcast(buf, o)->wait();
  } catch (const std::exception& e) {
    fail("broadcast of " + what, e.what());
  }
  unflatten(buf[0], ts);
}

int64_t Dist::all_reduce_min(int64_t v, const std::string& what) const {
  if (!impl_) return v;
  std::vector<at::Tensor> buf{at::full({1}, v, at::TensorOptions().dtype(at::kLong).device(device_))};
  try {
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MIN;
    impl_->group->allreduce(buf, o)->wait();
  } catch (const std::exception& e) {
    fail("all-reduce (min) of " + what, e.what());
  }
  return buf[0].item<int64_t>();  // SYNC: the caller needs the value on the host
}

bool Dist::any(bool v, const std::string& what) const {
  if (!impl_) return v;
  return -all_reduce_min(v ? -1 : 0, what) > 0;
}

void Dist::barrier(const std::string& what) const {
  if (!impl_) return;
  try {
    c10d::BarrierOptions o;
    if (device_.is_cuda()) o.device_ids = {device_.index()};
    impl_->group->barrier(o)->wait();
  } catch (const std::exception& e) {
    fail("barrier (" + what + ")", e.what());
  }
}

}  // namespace kakeya::train
