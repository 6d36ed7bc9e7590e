// The counting CPU allocator behind peak_tensor_mb on CPU: every storage's
// bytes counted from allocation to free, the peaks, the window reset, and
// tensors that work as ever through it.
#include <catch2/catch.hpp>
#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#include "trainer/offload/offload.h"
#include "trainer/train/cpu_memory.h"
#include "trainer/train/metrics.h"

using namespace nnstrain;

TEST_CASE("cpu memory: the counting allocator counts tensor storages", "[metrics]") {
  train::install_cpu_tensor_counter();
  train::install_cpu_tensor_counter();  // idempotent
  REQUIRE(train::cpu_tensor_counter_installed());
  const c10::Device cpu(c10::kCPU);

  train::reset_cpu_window_peak();
  const auto before = train::cpu_tensor_bytes();
  CHECK(before.window_peak == before.in_use);
  CHECK(before.peak >= before.in_use);
  {
    auto a = torch::empty({1000}, torch::kFloat32);    // 4000 bytes
    auto b = torch::zeros({250, 4}, torch::kFloat64);  // 8000 bytes
    const auto held = train::cpu_tensor_bytes();
    CHECK(held.in_use - before.in_use == 12000);
    CHECK(train::memory_in_use_bytes(cpu) == held.in_use);
    auto view = b.narrow(0, 0, 10);  // a view allocates nothing
    CHECK(train::cpu_tensor_bytes().in_use == held.in_use);
    // The data is usable and 64-byte aligned, as c10's allocator gives it.
    a.fill_(2.0f);
    CHECK(a.sum().item<float>() == 2000.0f);
    CHECK(reinterpret_cast<uintptr_t>(a.data_ptr()) % 64 == 0);
    CHECK(view.sum().item<double>() == 0.0);
  }
  // Freed: back to where it was (the reductions' scalars are gone too), the window's peak kept.
  const auto after = train::cpu_tensor_bytes();
  CHECK(after.in_use == before.in_use);
  CHECK(after.window_peak >= before.in_use + 12000);
  CHECK(train::step_peak_bytes(cpu) == after.window_peak);
  // A new window starts at what is in use; the whole run's peak remembers the old one.
  train::reset_cpu_window_peak();
  CHECK(train::cpu_tensor_bytes().window_peak == after.in_use);
  CHECK(train::peak_memory_bytes(cpu) >= before.in_use + 12000);
  // Empty tensors and raw allocations go through it too.
  auto empty = torch::empty({0});
  CHECK(empty.numel() == 0);
  auto* alloc = c10::GetCPUAllocator();
  void* raw = alloc->raw_allocate(128);
  CHECK(train::cpu_tensor_bytes().in_use == after.in_use + 128);
  alloc->raw_deallocate(raw);
  CHECK(train::cpu_tensor_bytes().in_use == after.in_use);
}

TEST_CASE("cpu memory: offload's host buffers are the host's, not the device tensors' of a CPU run", "[metrics]") {
  train::install_cpu_tensor_counter();
  const auto dev_before = train::cpu_tensor_bytes().in_use;
  const auto host_before = parallel::host_buffer_bytes().in_use;
  {
    auto h = parallel::host_zeros(1000, torch::kFloat32, /*pinned=*/false);
    CHECK(h.numel() == 1000);
    CHECK(h.sum().item<float>() == 0.0f);  // zeros, usable as any tensor
    h.fill_(1.5f);
    CHECK(h.sum().item<float>() == 1500.0f);
    CHECK(reinterpret_cast<uintptr_t>(h.data_ptr()) % 64 == 0);
    CHECK(parallel::host_buffer_bytes().in_use - host_before == 4000);
    CHECK(parallel::host_buffer_bytes().peak >= host_before + 4000);
    CHECK(train::cpu_tensor_bytes().in_use == dev_before);  // not counted on the "device"
  }
  CHECK(parallel::host_buffer_bytes().in_use == host_before);  // freed with its tensor
  // A copy through HostCopier on the CPU path is immediate.
  parallel::HostCopier copier(c10::Device(c10::kCPU), 1);
  CHECK_FALSE(copier.on_device());
  auto src = torch::arange(8, torch::kFloat32);
  auto dst = parallel::host_zeros(8, torch::kFloat32, false);
  copier.to_host(0, dst, src);
  copier.wait_to_host(0);
  CHECK(torch::equal(dst, src));
  auto back = torch::zeros({8});
  copier.to_device(back, dst);
  copier.device_wait();
  CHECK(torch::equal(back, src));
}
