#include "security/job_secret.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace onebit {

std::string RandomBytes(size_t n) {
  std::string out(n, '\0');
  // OpenSSL seeds from the OS; a failure here means no usable entropy.
  if (RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(n)) != 1) {
    std::abort();
  }
  return out;
}

bool SameBytes(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

absl::StatusOr<JobSecret> JobSecret::ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("job secret file ", path, ": cannot read it (", std::strerror(errno), ")"));
  }
  std::stringstream buf;
  buf << in.rdbuf();
  std::string text(absl::StripAsciiWhitespace(buf.str()));
  if (text.size() < kMinBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job secret file ", path, ": holds ", text.size(), " bytes; a job secret needs at least ",
        kMinBytes, " (e.g. 64 hex digits: openssl rand -hex 32)"));
  }
  return JobSecret(std::move(text));
}

JobSecret JobSecret::Generate() { return JobSecret(absl::BytesToHexString(RandomBytes(32))); }

absl::Status JobSecret::WriteFile(const std::string& path) const {
  const std::string tmp = absl::StrCat(path, ".tmp");
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot write the job secret to ", tmp, ": ", std::strerror(errno)));
  }
  const std::string body = absl::StrCat(text_, "\n");
  const bool ok = ::write(fd, body.data(), body.size()) == static_cast<ssize_t>(body.size()) &&
                  ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    return absl::UnavailableError(absl::StrCat("cannot write the job secret to ", path, ": ",
                                               std::strerror(ok ? errno : err)));
  }
  return absl::OkStatus();
}

std::string JobSecret::Derive(absl::string_view purpose) const {
  unsigned char out[32];
  unsigned int len = sizeof(out);
  HMAC(EVP_sha256(), text_.data(), static_cast<int>(text_.size()),
       reinterpret_cast<const unsigned char*>(purpose.data()), purpose.size(), out, &len);
  return std::string(reinterpret_cast<const char*>(out), len);
}

absl::StatusOr<Security> ResolveSecurity(const std::string& secret_file, bool insecure,
                                         absl::string_view flag) {
  std::string path = secret_file;
  const char* env = std::getenv(kSecretFileEnv);
  if (path.empty() && env != nullptr) path = env;
  Security s;
  if (insecure) {
    if (!secret_file.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, " and --insecure are both given: choose one"));
    }
    return s;  // $ONEBIT_SECRET_FILE gives way to an explicit --insecure
  }
  if (path.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "no job secret: give ", flag, " (or set ", kSecretFileEnv,
        "; onebit-launch makes one per job), or --insecure to run without authentication or "
        "encryption"));
  }
  auto secret = JobSecret::ReadFile(path);
  if (!secret.ok()) return secret.status();
  s.secret = *std::move(secret);
  s.secret_file = path;
  return s;
}

std::string SecurityNotice(const Security& security, absl::string_view who) {
  if (security.insecure()) {
    return absl::StrCat(who,
                        ": INSECURE (--insecure): neither plane is authenticated or encrypted; "
                        "anyone who reaches this process's ports can join or disrupt the job");
  }
  return absl::StrCat(
      who, ": secured by the job secret in ", security.secret_file,
      " (control plane: TLS; data plane: CURVE keys, and CURVE or AES-256-GCM as the job's "
      "--data_cipher says)");
}

}  // namespace onebit
