// splitmix64's finaliser: the counter-based hash behind the data streams
// (token_bin's window starts, the indexed datasets' permutations). The one in
// base/hash.h, named in data's namespace. Torch-free.
#pragma once

#include "base/hash.h"

namespace nnstrain::data {

using base::splitmix64;

}  // namespace nnstrain::data
