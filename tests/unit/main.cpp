// Catch2 v2 entry point for this test binary.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
