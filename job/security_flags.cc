#include "job/security_flags.h"

#include <cstdlib>

#include "absl/flags/flag.h"
#include "job/flags.h"
#include "security/job_secret.h"

ABSL_FLAG(std::string, secret_file, "",
          "file holding the job secret (at least 32 bytes, e.g. 64 hex digits; every process of "
          "the job needs the same): both planes are authenticated and encrypted with keys made "
          "from it; default: $ONEBIT_SECRET_FILE");
ABSL_FLAG(bool, insecure, false,
          "run without a job secret: neither plane is authenticated or encrypted (trusted "
          "networks only)");

namespace onebit {

SecurityFlags SecurityFlagsOrExit() {
  SecurityFlags f;
  f.secret_file = absl::GetFlag(FLAGS_secret_file);
  f.insecure = absl::GetFlag(FLAGS_insecure);
  auto s = ResolveSecurity(f.secret_file, f.insecure, "--secret_file");
  if (!s.ok()) ExitFlagError(f.insecure ? "insecure" : "secret_file", s.status().message());
  if (!f.insecure) f.secret_file = s->secret_file;
  return f;
}

SecurityFlags LauncherSecurityFlagsOrExit() {
  SecurityFlags f;
  f.insecure = absl::GetFlag(FLAGS_insecure);
  f.secret_file = absl::GetFlag(FLAGS_secret_file);
  const char* env = std::getenv(kSecretFileEnv);
  if (f.insecure || (f.secret_file.empty() && (env == nullptr || *env == '\0'))) {
    if (f.insecure && !f.secret_file.empty()) {
      ExitFlagError("insecure", "--secret_file and --insecure are both given: choose one");
    }
    return f;
  }
  return SecurityFlagsOrExit();  // checks the file
}

}  // namespace onebit
