#pragma once

namespace nnstrain::cli {
// Dispatches `nnstrain [train|merge|plan|launch|prepare|env] ...`; returns the exit status.
int main(int argc, char** argv);
}
