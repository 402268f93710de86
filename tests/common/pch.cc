// The precompiled headers of the tests (tests/CMakeLists.txt) are built
// with this empty source; no test links it.
