// --secret_file and --insecure, for the programs that join a job
// (onebit-coordinator, -server, -worker) and onebit-launch. Linked only by
// them (onebit_security_flags), so the others do not take the flags.
#ifndef ONEBIT_JOB_SECURITY_FLAGS_H_
#define ONEBIT_JOB_SECURITY_FLAGS_H_

#include <string>

namespace onebit {

struct SecurityFlags {
  std::string secret_file;  // as given, or $ONEBIT_SECRET_FILE
  bool insecure = false;
};

// The flags' values once checked (ResolveSecurity, security/job_secret.h):
// exits 2 naming the flag when neither or both are given, or the secret
// file cannot be used. Call after ParseFlagsOrExit.
SecurityFlags SecurityFlagsOrExit();

// onebit-launch's reading of them: neither given (nor $ONEBIT_SECRET_FILE
// set) is fine, it makes a secret per job; both is a flag error (exit 2).
SecurityFlags LauncherSecurityFlagsOrExit();

}  // namespace onebit

#endif  // ONEBIT_JOB_SECURITY_FLAGS_H_
