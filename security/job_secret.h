// The job secret: what every process of one job holds and nobody else does.
// Both planes derive their keys from it (security/tls.h, security/curve.h),
// so an operator provides one file per job and nothing else.
#ifndef ONEBIT_SECURITY_JOB_SECRET_H_
#define ONEBIT_SECURITY_JOB_SECRET_H_

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace onebit {

// Immutable once made; thread-safe.
class JobSecret {
 public:
  // The secret file's contents must have at least this many bytes (after
  // whitespace at both ends is dropped): 64 hex digits, as onebit-launch
  // writes and `openssl rand -hex 32` prints, are 32 random bytes.
  static constexpr size_t kMinBytes = 32;

  // Reads `path`. Errors name the file and what is wrong with it (missing,
  // unreadable, too short).
  static absl::StatusOr<JobSecret> ReadFile(const std::string& path);
  // 32 fresh random bytes from the OS, as 64 hex digits.
  static JobSecret Generate();
  // Writes it to `path` readable by its owner only (mode 0600), atomically.
  absl::Status WriteFile(const std::string& path) const;

  // A 32-byte key for one use, e.g. Derive("control tls key"):
  // HMAC-SHA256(secret, purpose). Keys for different purposes are unrelated.
  std::string Derive(absl::string_view purpose) const;

  const std::string& text() const { return text_; }

 private:
  explicit JobSecret(std::string text) : text_(std::move(text)) {}
  std::string text_;
};

// How a process secures its planes: with the job's secret, or not at all.
struct Security {
  std::optional<JobSecret> secret;  // nullopt: --insecure
  std::string secret_file;          // where it came from, for messages
  bool insecure() const { return !secret.has_value(); }
};

// The environment variable a secret file's path may come from (Kubernetes
// manifests set it to the mounted Secret).
inline constexpr char kSecretFileEnv[] = "ONEBIT_SECRET_FILE";

// Resolves --secret_file / --insecure. An empty `secret_file` falls back to
// $ONEBIT_SECRET_FILE. Exactly one of a secret file and `insecure` must be
// given; the error says how to give one. `flag` names the option in
// messages ("--secret_file", "WorkerOptions.secret_file").
absl::StatusOr<Security> ResolveSecurity(const std::string& secret_file, bool insecure,
                                         absl::string_view flag);

// What a process prints at start about its security, e.g. "secured by the
// job secret in /run/s" or "INSECURE: ...". One line, no newline.
std::string SecurityNotice(const Security& security, absl::string_view who);

// Constant-time comparison (no early exit on the first differing byte), for
// credentials.
bool SameBytes(absl::string_view a, absl::string_view b);

// `n` random bytes from the OS's generator.
std::string RandomBytes(size_t n);

}  // namespace onebit

#endif  // ONEBIT_SECURITY_JOB_SECRET_H_
