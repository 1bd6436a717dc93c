// Small file-system helpers on POSIX calls. Not std::filesystem: the PyPI
// libtorch.so exports its own std::filesystem symbols, built against a newer
// libstdc++, and some of them crash when called from code built with GCC 12.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <string>

namespace kakeya::fs {

bool exists(const std::string& path);
bool is_directory(const std::string& path);
void make_dirs(const std::string& path);  // mkdir -p; throws kakeya::Error naming the path
std::string parent(const std::string& path);
std::string temp_dir();                   // $TMPDIR or /tmp
// Writes `content` to a temp file beside `path`, fsyncs it and renames it over
// `path`: readers see the old file or the new one, never half of one.
void write_atomic(const std::string& path, const std::string& content);
// A JSON file, or an error naming the path and `expected` (what the file should be,
// e.g. "an HF config.json"): missing files and parse errors read the same everywhere.
nlohmann::json read_json(const std::string& path, const std::string& expected);
void write_json_atomic(const std::string& path, const nlohmann::json& j);  // pretty, atomic

}  // namespace kakeya::fs
