// `nnstrain report RUN_DIR [--out PNG] [--no-plot]`: a run folder's summary
// (steps, losses, best val loss, tokens/s, MFU, peak memory, step-time split,
// checkpoints) on stdout, and a PNG of the loss curves against steps and tokens.
//
// The PNG is drawn by scripts/plot_run.py with matplotlib from the project's
// Python environment: Debian's C++ plotting options (PLplot, gnuplot pipes) would
// add a linked dependency and its drivers to the trainer for one picture, while
// matplotlib gives labelled axes in a few lines and is what readers of such
// curves expect. Training itself never runs Python.
#pragma once

#include <string>
#include <vector>

namespace nnstrain::cli {

// Returns the exit status: 0 done, 1 the plot could not be drawn, 2 usage or a missing/unreadable run folder.
int report_main(const std::vector<std::string>& args);

}  // namespace nnstrain::cli
