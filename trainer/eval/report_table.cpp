#include "trainer/eval/report_table.h"

#include <cstdio>

namespace nnstrain::eval {

void print_results(std::ostream& out, const std::vector<TaskResult>& results) {
  char line[256];
  std::snprintf(line, sizeof line, "%-24s %-22s %6s %-16s %12s %9s\n", "task", "kind", "docs", "metric", "value",
                "docs/s");
  out << line;
  for (const auto& r : results)
    for (const auto& [m, v] : r.metrics) {
      std::snprintf(line, sizeof line, "%-24s %-22s %6lld %-16s %12.6f %9.1f\n", r.name.c_str(), r.kind.c_str(),
                    static_cast<long long>(r.docs), m.c_str(), v, r.seconds > 0 ? r.docs / r.seconds : 0.0);
      out << line;
    }
}

}  // namespace nnstrain::eval
