// Offload (compute_config.offload): the optimizer state (and ZeRO-3's
// parameter chunks) a rank moves to host memory or NVMe files, and the time
// the host step, the copies and the disk add to the step.
#include <algorithm>

#include "trainer/plan/cost/terms.h"

namespace nnstrain::parallel::cost {

// Offload's memory: the host's share of the optimizer state
// (st.host_elements, whole buckets) leaves the device; the host keeps its
// weights (fp32 masters, or a copy of the parameters), moments, a copy of its
// reduced gradient and a compute-dtype staging copy. Parameter offload moves
// ZeRO-3's chunks there too.
void offload_memory_term(const Setting& x, Interim&, PlanEstimate& e) {
  const auto& pb = x.pb;
  const double H = x.st.host_elements;
  // The host's moments are the optimizer's state there: one slot for Muon's matrices (state_scale).
  e.optim_bytes -= H * (pb.master + pb.moments * x.ow.state_scale);
  e.host_bytes = H * (update_bytes(pb) + pb.moments * x.ow.state_scale + pb.grad + pb.param);
  if (x.c.offload_params) {
    e.host_bytes += e.param_bytes;
    e.param_bytes = 0;
  }
  // The NVMe tier: the weights, moments (and ZeRO-3's chunks) in files; the
  // host keeps the gradient copy and the bounded buffer the files stream through.
  if (x.c.offload_nvme) {
    e.nvme_bytes = e.host_bytes - H * (pb.grad + pb.param);
    e.host_bytes = H * pb.grad + x.a.compute_config.offload.nvme_buffer_mb * 1048576.0;
  }
}

// Offload's time: the host step reads and writes weights and moments and
// reads the gradient; it waits for the global norm, so it is exposed in full.
// Reads the step's compute and communication (e.compute_s, e.comm_s): what a
// delayed update hides behind.
void offload_time_term(const Setting& x, Interim&, PlanEstimate& e) {
  const double H = x.st.host_elements;
  if (H <= 0 && !x.c.offload_params) return;
  const auto& pb = x.pb;
  const double link = x.req.device.host_link_bw, micro_steps = x.micro_steps;
  const double Sz = x.st.shard;
  e.host_step_s = H * (6 * update_bytes(pb) + pb.grad) / x.req.device.host_adam_bytes_per_s;
  const double d2h = H * pb.grad / link, h2d = H * pb.param / link;
  // ZeRO-3 parameter offload: every unit's chunk to the device per gather,
  // issued ahead with the gathers (hidden behind compute where it can be).
  const double unit_copies = x.c.offload_params ? micro_steps * 2 * Sz * pb.param / link : 0.0;
  e.copy_s = d2h + h2d + unit_copies;
  // Gradients leave bucket by bucket as they are reduced during the last
  // micro-batch's backward (with dp; at one rank without ZeRO-2/3 and under
  // HSDP after it); weights return while the next bucket steps, all but the last.
  const double backward = 2.0 / 3.0 * e.compute_s / micro_steps;
  const double last = H > 0 ? x.st.last_host_bucket / H : 0.0;
  const bool hsdp = x.c.zero_stage > 0 && reduce_group(x.c) / x.st.z > 1;
  const bool during_backward = (x.c.zero_stage >= 2 || x.c.dp > 1) && !hsdp;
  const double d2h_exposed = during_backward ? std::max(d2h * last, d2h - backward) : d2h;
  e.offload_s = e.host_step_s + d2h_exposed + h2d * last + std::max(0.0, unit_copies - e.compute_s);
  // Delayed update: the host step and the weights' return run during the next step's forward and backward.
  if (x.a.compute_config.offload.delayed_update && x.c.offload_ratio >= 1.0)
    e.offload_s = std::max(0.0, e.host_step_s + h2d - e.compute_s - e.comm_s) + d2h_exposed +
                  std::max(0.0, unit_copies - e.compute_s);
  // The NVMe tier: each step reads and writes the files once (ZeRO-3's
  // chunks: read per gather, written once), the node's ranks sharing the
  // disk; reads run ahead of the host step and writes behind it, so only
  // what the disk takes beyond the host step is exposed.
  if (x.c.offload_nvme) {
    const auto& d = x.req.device;
    const double ranks = std::max(1, std::min(x.req.world_size, d.ranks_per_node));
    const double reads = e.nvme_bytes + (x.c.offload_params ? (2 * micro_steps - 1) * Sz * pb.param : 0.0);
    // Rates unknown (no --probe-disk): the disk is not counted.
    e.nvme_s = d.disk_read_bw > 0 && d.disk_write_bw > 0 ? reads * ranks / d.disk_read_bw + e.nvme_bytes * ranks / d.disk_write_bw
                                                         : 0.0;
    e.offload_s += std::max(0.0, e.nvme_s - e.host_step_s);
  }
}

}  // namespace nnstrain::parallel::cost
