// What every target in fuzz/ shares: its seeds (meaningful inputs: valid
// messages of each kind and the edges of each check, kept in
// fuzz/corpus/<target>/) and the CHECK that makes a broken property a crash
// libFuzzer reports.
#ifndef ONEBIT_FUZZ_FUZZ_TARGET_H_
#define ONEBIT_FUZZ_FUZZ_TARGET_H_

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace onebit::fuzz {

struct Seed {
  std::string name;  // the file name in the corpus folder
  std::string data;
};

// A target's LLVMFuzzerInitialize: with `-write_seeds=DIR` among the
// arguments (tools/fuzz --seeds) writes seeds() into DIR, one file each,
// and exits; otherwise returns 0 and libFuzzer goes on.
int Initialize(int* argc, char*** argv, std::vector<Seed> (*seeds)());

}  // namespace onebit::fuzz

// A property of the code under test that does not hold: abort, so that
// libFuzzer keeps the input.
#define FUZZ_CHECK(cond)                                                                 \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)

#endif  // ONEBIT_FUZZ_FUZZ_TARGET_H_
