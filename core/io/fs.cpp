#include "core/io/fs.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace kakeya::fs {

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string parent(const std::string& path) {
  auto p = path.find_last_of('/');
  if (p == std::string::npos) return ".";
  return p == 0 ? "/" : path.substr(0, p);
}

void make_dirs(const std::string& path) {
  if (path.empty() || is_directory(path)) return;
  make_dirs(parent(path));
  KAKEYA_CHECK(::mkdir(path.c_str(), 0755) == 0 || errno == EEXIST,
               path << ": cannot create directory: " << std::strerror(errno));
}

std::string temp_dir() {
  const char* t = std::getenv("TMPDIR");
  return t && *t ? t : "/tmp";
}

void write_atomic(const std::string& path, const std::string& content) {
  make_dirs(parent(path));
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  KAKEYA_CHECK(fd >= 0, tmp << ": cannot write: " << std::strerror(errno));
  size_t done = 0;
  while (done < content.size()) {
    ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      KAKEYA_FAIL(tmp << ": write failed: " << std::strerror(e) << " (disk full?)");
    }
    done += (size_t)n;
  }
  bool ok = ::fsync(fd) == 0;
  ok = ::close(fd) == 0 && ok;
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    KAKEYA_FAIL(path << ": cannot replace atomically: " << std::strerror(e));
  }
}

nlohmann::json read_json(const std::string& path, const std::string& expected) {
  std::ifstream f(path);
  KAKEYA_CHECK(f.good(), path << ": cannot open (expected " << expected << ")");
  try {
    return nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    KAKEYA_FAIL(path << ": not valid JSON (expected " << expected << "): " << e.what());
  }
}

void write_json_atomic(const std::string& path, const nlohmann::json& j) { write_atomic(path, j.dump(2) + "\n"); }

}  // namespace kakeya::fs
