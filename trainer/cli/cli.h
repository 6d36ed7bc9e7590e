#pragma once

namespace nnstrain::cli {
// Dispatches `nnstrain [train|launch|prepare|tokenize|env|plan|merge|generate|report] ...` and
// `nnstrain --version`; returns the exit status.
int main(int argc, char** argv);
}
