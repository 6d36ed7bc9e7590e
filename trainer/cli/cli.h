#pragma once

namespace nnstrain::cli {
// Dispatches `nnstrain [train|merge|plan|launch|prepare|report|env] ...`; returns the exit status.
int main(int argc, char** argv);
}
