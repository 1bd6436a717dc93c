// Errors with context. Library code throws kakeya::Error naming the file,
// field/tensor and the expected vs. found value; each CLI command catches once
// (tools/kakeya.cpp) and prints the message. Never abort on bad user input.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace kakeya {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace kakeya

// KAKEYA_CHECK(cond, "file " << path << ": field 'x' expected 3, got " << x);
#define KAKEYA_CHECK(cond, msg)                      \
  do {                                               \
    if (!(cond)) {                                   \
      std::ostringstream kakeya_oss_;                \
      kakeya_oss_ << msg;                            \
      throw ::kakeya::Error(kakeya_oss_.str());      \
    }                                                \
  } while (0)

#define KAKEYA_FAIL(msg) KAKEYA_CHECK(false, msg)
