// Capture of f_θ training data (`kakeya capture`): per sequence, what the
// verifier's forward taps see (raw query, raw K/V, attention output after
// o_proj, every layer) and the drafter's raw context K/V at every position,
// written to HDF5 shards (schema: checkpoints/FORMATS-capture.md).
//
// Per sequence: greedy generation by the verifier (infer/generate.h), then ONE
// verifier forward over prompt + generation with taps on (Tap::QProj, KProj,
// VProj, AttnOut) plus TargetFeatureCapture, whose features give the drafter's
// context (Drafter::project_context + context_kv with taps on KProj/VProj):
// nothing forks the forward.
//
// Output directory:
//   capture.json          manifest: format, verifier/drafter identity (sha256 of config.json
//                         and of the safetensors headers), dims, layer types, options, inputs,
//                         complete shards with their counts. Rewritten atomically after each shard.
//   shard-00000.h5 ...    seqs_per_shard sequences each; written as *.h5.tmp and renamed when
//                         complete, so a *.h5 file is always whole. Each shard also carries the
//                         manifest's identity as a root attribute, so a lone shard is self-describing.
// Resume: a rerun with the same models, inputs and options skips the complete
// shards (the prompt list is deterministic) and rewrites the shard it was in;
// anything else in the manifest differing is an error naming the field.
// Data-parallel (`kakeya launch --nproc N -- capture`, rank/world in the options): rank r
// writes shards s ≡ r (mod N), skipping those whose file is already there with this
// identity (so a run resumes on any number of ranks); no rank writes the manifest while
// shards are missing, and the rank that finds every shard on disk when it finishes writes
// the complete one. No collective is involved: ranks may finish minutes apart.
#pragma once
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/model/config.h"
#include "core/model/drafter.h"
#include "core/model/model.h"

namespace kakeya::data {

constexpr const char* kCaptureFormat = "kakeya-capture/1";

// Identity of a model directory as recorded in a manifest: its path, sha256 of
// config.json and sha256 of the concatenated safetensors headers (8-byte length
// + JSON, every *.safetensors file in name order: names, dtypes, shapes and offsets,
// not the weights themselves, which would cost a full read of the file).
nlohmann::json model_dir_identity(const std::string& dir);
// Throws naming `what` (e.g. "capture.json verifier"), the field and both values
// when `recorded` (a model_dir_identity) does not describe `dir`'s model.
void check_model_dir_identity(const nlohmann::json& recorded, const std::string& dir, const std::string& what);

// sha256 of a byte string / a file, lowercase hex.
std::string sha256_hex(const std::string& bytes);
std::string sha256_file(const std::string& path);

// ---------------------------------------------------------------- reading

// One captured sequence. Shapes use T = sequence length (prompt + generation).
struct CaptureSequence {
  int64_t index = 0;              // position in the capture's prompt list
  std::string source;             // "corpus" | "niah"
  int64_t prompt_len = 0;         // first prompt_len tokens are the prompt
  at::Tensor tokens;              // [T] int64
  at::Tensor positions;           // [T] int64 absolute positions (RoPE; = 0..T-1)
  std::vector<at::Tensor> q;      // per verifier layer [T, H_q, D_l]    after q_proj (raw)
  std::vector<at::Tensor> k;      // per verifier layer [T, H_kv_l, D_l] after k_proj (raw, before k_norm/RoPE)
  std::vector<at::Tensor> v;      // per verifier layer [T, H_kv_l, D_l] after v_proj (raw; = k on K=V layers)
  std::vector<at::Tensor> o;      // per verifier layer [T, hidden]      attention output after o_proj
  at::Tensor dk;                  // [T, L_d, H_d, D_d] drafter context K after k_proj (raw)
  at::Tensor dv;                  // [T, L_d, H_d, D_d] drafter context V after v_proj (raw)
  at::Tensor feats;               // [T, n·H] target features the drafter reads (capture_sequence only; not stored)
  int64_t length() const { return tokens.defined() ? tokens.size(0) : 0; }
};

// Which tensors read() loads (skipping unneeded ones saves I/O and decompression).
struct CaptureFields {
  bool q = true, kv = true, o = true, drafter = true;
};

// Reads a capture directory (its capture.json and complete shards) or a single
// shard file. Not thread-safe (the HDF5 library is the serial build): one reader
// per thread, or serialize calls.
class CaptureReader {
 public:
  explicit CaptureReader(const std::string& dir_or_file);
  ~CaptureReader();
  CaptureReader(CaptureReader&&) noexcept;
  CaptureReader& operator=(CaptureReader&&) noexcept;

  int64_t size() const;                      // sequences available (complete shards only)
  int64_t total_tokens() const;
  const nlohmann::json& manifest() const;    // capture.json (or the shard's embedded manifest)
  bool complete() const;                     // every planned sequence was captured
  // Verifier layer layout, for rebuilding RoPE tables and masks.
  const std::vector<LayerType>& layer_types() const;
  int64_t num_layers() const;
  int64_t drafter_layers() const;
  // Refuses data captured from other models (see check_model_dir_identity).
  void check_models(const std::string& verifier_dir, const std::string& drafter_dir) const;

  // Sequence i in [0, size()), tensors converted to `dtype` on `device`
  // (stored bf16 converts to f32 exactly). tokens/positions stay int64.
  CaptureSequence read(int64_t i, at::ScalarType dtype = at::kFloat, at::Device device = at::kCPU,
                       const CaptureFields& fields = {}) const;
  int64_t length(int64_t i) const;           // T of sequence i without reading it

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// ---------------------------------------------------------------- writing

struct CapturePrompt {
  std::vector<int64_t> ids;  // [P] prompt token ids (BOS/template included)
  std::string source;        // "corpus" | "niah"
};

struct CaptureOptions {
  std::string out_dir;
  int64_t gen_len = 128;                // greedy tokens per prompt (fewer if a stop id comes first)
  std::vector<int64_t> stop_ids;        // usually the verifier's eos ids
  int64_t seqs_per_shard = 8;
  // Storage dtype of the float tensors: kBFloat16 (as uint16 bit patterns, attribute
  // dtype=bfloat16) or kFloat. Default: the verifier's dtype, so nothing is rounded.
  std::optional<at::ScalarType> store_dtype;
  int deflate = 1;                      // gzip level 0..9 (with byte shuffle); 0 = uncompressed
  int64_t bench_seqs = 1;               // also time the verifier alone on this many sequences (report)
  // What made the prompt list (files and their sha256, NIAH options, seeds): part
  // of the manifest identity, so a resume with other inputs is refused.
  nlohmann::json inputs = nlohmann::json::object();
  std::string command_line;             // recorded in the manifest
  int rank = 0, world = 1;              // data-parallel: this rank's shards are s ≡ rank (mod world)
};

struct CaptureProgress {
  int64_t done_seqs = 0, total_seqs = 0;
  int64_t done_tokens = 0;              // captured this run
  double seconds = 0;                   // this run
};

struct CaptureReport {
  int64_t sequences = 0, tokens = 0;    // in the directory when done
  int64_t resumed_sequences = 0;        // complete before this run (skipped)
  double seconds = 0;                   // this run
  int64_t bytes = 0;                    // shard bytes on disk
  // Cost of capture vs the verifier alone on the first bench_seqs sequences of this run:
  // verifier alone = greedy generation + one plain forward over the sequence;
  // capture = greedy generation + tapped forward + drafter context + copies + HDF5 write.
  double bench_verifier_seconds = 0, bench_capture_seconds = 0;
  double bench_forward_seconds = 0, bench_tapped_seconds = 0;  // the forward parts alone
  double bench_write_seconds = 0;       // waiting for the HDF5 writer (conversion, compression, I/O run on a writer thread, overlapping the next sequence)
  double capture_cost_ratio() const { return bench_verifier_seconds > 0 ? bench_capture_seconds / bench_verifier_seconds : 0; }
  // Without the generation both sides share: (tapped forward + drafter + write) / plain forward.
  double forward_cost_ratio() const {
    return bench_forward_seconds > 0 ? (bench_tapped_seconds + bench_write_seconds) / bench_forward_seconds : 0;
  }
  nlohmann::json to_json() const;
};

// Captures `prompts` into opt.out_dir (resuming a previous run there). The
// directories are recorded in the manifest (and hashed); `verifier` and `drafter`
// must be loaded from them. Throws naming the file on any write failure (disk full).
// `progress` is called once before any work, then after every sequence.
CaptureReport run_capture(const Model& verifier, const std::string& verifier_dir, const Drafter& drafter,
                          const std::string& drafter_dir, const std::vector<CapturePrompt>& prompts,
                          const CaptureOptions& opt, const std::function<void(const CaptureProgress&)>& progress = {});

// The tensors of one sequence as the taps see them (model dtype; on the host, or on the
// model's device when on_device), without writing: what run_capture stores (tests compare
// with their own tap subscriber), plus the target features (online f_θ training).
CaptureSequence capture_sequence(const Model& verifier, const Drafter& drafter, const std::vector<int64_t>& tokens,
                                 bool on_device = false);

}  // namespace kakeya::data
