#include "trainer/train/step_timer.h"

#include <ATen/record_function.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#ifdef NNSTRAIN_CUDA
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace nnstrain::train {

namespace {
constexpr const char* kNames[] = {"data", "forward", "backward", "communication", "optimizer", "graph"};
constexpr const char* kKeys[] = {"time_data_ms", "time_forward_ms", "time_backward_ms", "time_comm_ms",
                                 "time_optimizer_ms", "time_graph_ms"};
using Clock = std::chrono::steady_clock;
}  // namespace

const char* StepTimer::name(Part p) { return kNames[p]; }
const char* StepTimer::metric_key(Part p) { return kKeys[p]; }

struct StepTimer::Impl {
  bool cuda = false;
  c10::DeviceIndex index = 0;  // the training device (which need not be the current one)
  bool timed = false;
  int current = -1;  // the part running now, -1 outside a step
  std::string step_name;
  std::optional<at::RecordFunction> step_range, part_range;

  // CPU: host time of the last boundary and the sums per part.
  Clock::time_point last;
  std::array<double, kNumParts> host_ms{};

#ifdef NNSTRAIN_CUDA
  // CUDA: one event per boundary of the timed step; parts[i] ran from events[i] to events[i + 1].
  std::vector<c10::cuda::CUDAEvent> events;
  std::vector<int> parts;
  size_t used = 0;
  void record() {
    if (used == events.size()) events.emplace_back(cudaEventDefault);  // timing enabled
    events[used++].record(c10::cuda::getCurrentCUDAStream(index));
  }
#endif

  void boundary(int next) {
    if (timed) {
#ifdef NNSTRAIN_CUDA
      if (cuda) {
        record();
        if (current >= 0) parts.push_back(current);
      } else
#endif
      {
        const auto now = Clock::now();
        if (current >= 0) host_ms[current] += std::chrono::duration<double, std::milli>(now - last).count();
        last = now;
      }
    }
    part_range.reset();
    current = next;
    if (next >= 0) {
      part_range.emplace(at::RecordScope::USER_SCOPE);
      if (part_range->isActive()) part_range->before(kNames[next]);
    }
  }
};

StepTimer::StepTimer(const c10::Device& device) : impl_(std::make_unique<Impl>()) {
  impl_->cuda = device.is_cuda();
  impl_->index = device.has_index() ? device.index() : 0;
}
StepTimer::~StepTimer() = default;

void StepTimer::begin_step(int64_t step_number, bool timed) {
  auto& m = *impl_;
  m.part_range.reset();
  m.step_range.reset();
  m.step_name = "ProfilerStep#" + std::to_string(step_number);  // the name torch.profiler gives steps
  m.step_range.emplace(at::RecordScope::USER_SCOPE);
  if (m.step_range->isActive()) m.step_range->before(m.step_name);
  m.timed = timed;
  m.current = -1;
  if (timed) {
    m.host_ms.fill(0);
#ifdef NNSTRAIN_CUDA
    m.used = 0;
    m.parts.clear();
#endif
  }
  m.boundary(kData);
}

void StepTimer::enter(Part p) {
  if (p != impl_->current) impl_->boundary(p);
}

void StepTimer::end_step() {
  impl_->boundary(-1);
  impl_->step_range.reset();
  impl_->timed = false;
}

std::array<double, StepTimer::kNumParts> StepTimer::read() {
  auto& m = *impl_;
#ifdef NNSTRAIN_CUDA
  if (m.cuda) {
    std::array<double, kNumParts> ms{};
    if (m.used == 0) return ms;
    m.events[m.used - 1].synchronize();
    for (size_t i = 0; i < m.parts.size(); ++i) ms[m.parts[i]] += m.events[i].elapsed_time(m.events[i + 1]);
    return ms;
  }
#endif
  return m.host_ms;
}

}  // namespace nnstrain::train
