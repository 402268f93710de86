#include "fuzz/fuzz_target.h"

#include <cstring>
#include <fstream>

namespace onebit::fuzz {

int Initialize(int* argc, char*** argv, std::vector<Seed> (*seeds)()) {
  constexpr char kFlag[] = "-write_seeds=";
  for (int i = 1; i < *argc; ++i) {
    const char* arg = (*argv)[i];
    if (std::strncmp(arg, kFlag, sizeof(kFlag) - 1) != 0) continue;
    const std::string dir = arg + sizeof(kFlag) - 1;
    for (const Seed& s : seeds()) {
      std::ofstream out(dir + "/" + s.name, std::ios::binary | std::ios::trunc);
      out << s.data;
      if (!out.good()) {
        std::fprintf(stderr, "cannot write %s/%s\n", dir.c_str(), s.name.c_str());
        std::exit(1);
      }
    }
    std::exit(0);
  }
  return 0;
}

}  // namespace onebit::fuzz
