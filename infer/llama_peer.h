// llama.cpp as a peer of `kakeya bench decode`: its own benchmark (llama-bench, built from the
// source vendored in PyPI's llama-cpp-python sdist: tools/device/prepare_llama.sh and
// tools/device/llama_bench.sh) on GGUF files of the same model, in the same run as our decoders.
// It measures what bench decode measures: the prefill of the prompt from an empty cache (pp, depth
// 0) and the generation of the new tokens after a cache of the prompt's length (tg, depth = prompt),
// every layer on the GPU, flash attention on.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace kakeya {

// The llama-bench command line for one GGUF file (JSON on stdout): prompt_len-token prefill at
// depth 0 and new_tokens generated at depths 0 and prompt_len, `repeats` runs of each.
std::string llama_bench_command(const std::string& bin, const std::string& gguf, int64_t prompt_len,
                                int64_t new_tokens, int64_t repeats);

// llama-bench's JSON output (an array, one object per test) -> {gguf, model_type, model_size,
// gpu_info, build_commit, prefill_tps, decode_tps (after prompt_len positions), decode_stddev_tps,
// decode_tps_depth0, e2e_tps (new_tokens over prefill + decode time)}. Throws naming the test it
// cannot find or the field it cannot read (a bad or partial output).
nlohmann::json parse_llama_bench(const std::string& out, const std::string& gguf, int64_t prompt_len,
                                 int64_t new_tokens);

}  // namespace kakeya
