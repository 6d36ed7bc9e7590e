#include "trainer/train/cpu_memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <mutex>

namespace nnstrain::train {
namespace {

std::atomic<int64_t> g_in_use{0}, g_peak{0}, g_window_peak{0};
std::atomic<bool> g_installed{false};

void raise(std::atomic<int64_t>& peak, int64_t v) {
  int64_t p = peak.load(std::memory_order_relaxed);
  while (v > p && !peak.compare_exchange_weak(p, v, std::memory_order_relaxed)) {
  }
}

// Each allocation is [header | data]: the header keeps the size and the inner
// allocator's context and deleter, so our deleter needs only the data pointer
// (data == context, which raw_allocate and is_simple_data_ptr expect). 64
// bytes keep the data at c10's 64-byte alignment.
struct alignas(64) Header {
  size_t n;
  void* inner_ctx;
  c10::DeleterFnPtr inner_deleter;
};
static_assert(sizeof(Header) == 64, "the header must keep the data 64-byte aligned");

void counted_delete(void* data) {
  if (!data) return;
  auto* h = reinterpret_cast<Header*>(static_cast<char*>(data) - sizeof(Header));
  g_in_use.fetch_sub(static_cast<int64_t>(h->n), std::memory_order_relaxed);
  h->inner_deleter(h->inner_ctx);
}

struct CountingAllocator final : c10::Allocator {
  explicit CountingAllocator(c10::Allocator* inner) : inner(inner) {}

  c10::DataPtr allocate(size_t n) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) return {nullptr, nullptr, &counted_delete, cpu};
    auto raw = inner->allocate(n + sizeof(Header));
    auto* base = static_cast<char*>(raw.get());
    const auto deleter = raw.get_deleter();
    void* ctx = raw.release_context();
    auto* h = reinterpret_cast<Header*>(base);
    h->n = n;
    h->inner_ctx = ctx;
    h->inner_deleter = deleter;
    const int64_t now = g_in_use.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed) + int64_t(n);
    raise(g_window_peak, now);
    void* data = base + sizeof(Header);
    return {data, data, &counted_delete, cpu};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  c10::Allocator* inner;
};

}  // namespace

void install_cpu_tensor_counter() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Leaked on purpose: storages freed at exit still call its deleter.
    static auto* counter = new CountingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(counter, /*priority=*/100);
    g_installed = true;
  });
}

bool cpu_tensor_counter_installed() { return g_installed.load(); }

CpuTensorBytes cpu_tensor_bytes() {
  const int64_t window = g_window_peak.load(std::memory_order_relaxed);
  return {g_in_use.load(std::memory_order_relaxed), std::max(g_peak.load(std::memory_order_relaxed), window), window};
}

void reset_cpu_window_peak() {
  // The window's peak so far folds into the whole run's; only one atomic max
  // runs per allocation.
  raise(g_peak, g_window_peak.load(std::memory_order_relaxed));
  g_window_peak.store(g_in_use.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

}  // namespace nnstrain::train
