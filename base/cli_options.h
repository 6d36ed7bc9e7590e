// A subcommand's `--key value` and `--key=value` arguments, in order, for the
// commands that parse their own options (prepare corpus and its formats).
#pragma once

#include <string>
#include <vector>

namespace nnstrain::util {

// Calls handle(key, value) for each option; false when -h/--help is given (the
// caller prints its usage). Error: the caller's usage-error type, thrown for a
// bare word or a key without a value.
template <typename Error, typename Handle>
bool for_each_option(const std::vector<std::string>& args, Handle&& handle) {
  for (size_t i = 0; i < args.size(); ++i) {
    std::string key = args[i], value;
    if (key == "-h" || key == "--help") return false;
    const size_t eq = key.find('=');
    if (key.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = key.substr(eq + 1);
      key = key.substr(0, eq);
    } else {
      if (key.rfind("--", 0) != 0) throw Error("unexpected argument '" + key + "'");
      if (i + 1 >= args.size()) throw Error("option " + key + " needs a value");
      value = args[++i];
    }
    handle(key, value);
  }
  return true;
}

}  // namespace nnstrain::util
