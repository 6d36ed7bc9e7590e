// nnstrain: one binary, subcommands (train is the default).
#include "trainer/cli/cli.h"

int main(int argc, char** argv) { return nnstrain::cli::main(argc, argv); }
