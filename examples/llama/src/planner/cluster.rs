//! The machines a plan is made for: devices, their memory and speed, and the links between
//! them, as an alpha-beta model (a message of `n` bytes over a link costs `latency + n /
//! bandwidth`).

/// One kind of link: what a collective's ring achieves over it per device, one direction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Bytes per second each device moves over it in a ring (NCCL's bus bandwidth).
    pub bandwidth: f64,
    /// Seconds each hop of a ring adds.
    pub latency: f64,
}

impl Link {
    /// A message of `bytes` from one device to another.
    pub fn send(&self, bytes: f64) -> f64 {
        self.latency + bytes / self.bandwidth
    }

    /// An all-reduce of `bytes` over `ranks` devices (a ring: each sends `2 (n-1)/n` of it).
    pub fn all_reduce(&self, bytes: f64, ranks: usize) -> f64 {
        2.0 * self.all_gather(bytes, ranks)
    }

    /// An all-gather (or reduce-scatter) whose whole result is `bytes`, over `ranks` devices.
    pub fn all_gather(&self, bytes: f64, ranks: usize) -> f64 {
        if ranks <= 1 {
            return 0.0;
        }
        let steps = (ranks - 1) as f64;
        steps * self.latency + steps / ranks as f64 * bytes / self.bandwidth
    }
}

/// Devices in nodes, and what each can do.
#[derive(Debug, Clone, PartialEq)]
pub struct Cluster {
    /// What it is, for the printout.
    pub name: String,
    /// Machines.
    pub nodes: usize,
    /// Devices per machine.
    pub devices_per_node: usize,
    /// Bytes of memory per device.
    pub memory: u64,
    /// Dense floating-point operations per second of one device in the training dtype.
    pub peak_flops: f64,
    /// The fraction of `peak_flops` a large matrix multiplication reaches.
    pub matmul_efficiency: f64,
    /// The smallest dimension at which a multiplication reaches half of that (smaller
    /// multiplications cannot fill the device).
    pub matmul_half_dim: f64,
    /// Bytes per second an elementwise kernel streams through the device's memory.
    pub memory_bandwidth: f64,
    /// Seconds one block's forward and backward of a micro-batch costs whatever its size:
    /// the dispatch of its operations and the autodiff graph's bookkeeping (0 on a GPU,
    /// where launches hide behind the device's work; measured on a CPU).
    pub block_overhead: f64,
    /// Seconds a mixture of experts' block costs more, whatever its size: the routing's trip
    /// to the host, the sorting and exchange of its copies (0 on a GPU; measured on a CPU).
    pub routing_overhead: f64,
    /// And per expert of the block the rank holds: its gathers, scatters and small products'
    /// dispatch (0 on a GPU; measured on a CPU).
    pub expert_overhead: f64,
    /// Between devices of one machine.
    pub intra_node: Link,
    /// Between machines.
    pub inter_node: Link,
    /// The devices are threads sharing this many cores (a CPU), which also move their
    /// messages (the local transport copies on the ranks' own cores, so communication does not
    /// overlap computation); none: every device computes on its own and communicates aside.
    pub shared_cores: Option<usize>,
}

/// The presets `--cluster` accepts (besides `cpu`, measured).
pub const CLUSTER_PRESETS: [&str; 2] = ["h100", "a100"];

impl Cluster {
    /// A preset of `nodes` machines of 8 GPUs, by name. The figures are the vendors' dense
    /// bf16 peaks and memory bandwidths, and what NCCL's tests and cuBLAS reach on them as
    /// commonly reported (assumptions of the model, stated here rather than fitted per case):
    /// - `a100`: DGX A100 80 GB: 312 TFLOP/s, 2.04 TB/s HBM2e, NVLink 3 (230 GB/s ring bus
    ///   bandwidth), 8 x HDR InfiniBand 200 Gb/s (22 GB/s per GPU);
    /// - `h100`: DGX H100 80 GB: 989 TFLOP/s, 3.35 TB/s HBM3, NVLink 4 (360 GB/s), 8 x NDR
    ///   InfiniBand 400 Gb/s (45 GB/s per GPU).
    pub fn preset(name: &str, nodes: usize) -> Option<Self> {
        let gpu = |name: &str, peak: f64, hbm: f64, nvlink: f64, ib: f64, efficiency: f64| Self {
            name: name.into(),
            nodes,
            devices_per_node: 8,
            memory: 80_000_000_000,
            peak_flops: peak,
            matmul_efficiency: efficiency,
            matmul_half_dim: 64.0,
            memory_bandwidth: hbm,
            block_overhead: 0.0,
            routing_overhead: 0.0,
            expert_overhead: 0.0,
            intra_node: Link {
                bandwidth: nvlink,
                latency: 5e-6,
            },
            inter_node: Link {
                bandwidth: ib,
                latency: 10e-6,
            },
            shared_cores: None,
        };
        match name {
            "a100" => Some(gpu("DGX A100 80GB", 312e12, 2.04e12, 230e9, 22e9, 0.80)),
            "h100" => Some(gpu("DGX H100 80GB", 989e12, 3.35e12, 360e9, 45e9, 0.70)),
            _ => None,
        }
    }

    /// Bytes of a device a layout's estimate may fill: a tenth is left to what the estimate
    /// leaves out (communication buffers, gradient buckets, the allocator's fragmentation).
    pub fn usable_memory(&self) -> u64 {
        self.memory / 10 * 9
    }

    /// Devices in all.
    pub fn devices(&self) -> usize {
        self.nodes * self.devices_per_node
    }

    /// Seconds a multiplication of `[m, k] x [k, n]`, `batch` times, takes on one device.
    pub fn matmul(&self, batch: f64, m: f64, n: f64, k: f64) -> f64 {
        let smallest = m.min(n).min(k);
        if smallest <= 0.0 || batch <= 0.0 {
            return 0.0;
        }
        let efficiency = self.matmul_efficiency * smallest / (smallest + self.matmul_half_dim);
        2.0 * batch * m * n * k / (self.peak_flops * efficiency)
    }

    /// Seconds an elementwise pass that reads and writes `bytes` in all takes on one device.
    pub fn stream(&self, bytes: f64) -> f64 {
        bytes / self.memory_bandwidth
    }

    /// The link a message between ranks of a group crosses whose ranks lie `stride` apart,
    /// `size` of them, in a mesh laid out over the devices in order: within a machine when
    /// they all fit in one; else a device's own network interface.
    pub fn link(&self, stride: usize, size: usize) -> Link {
        if self.within_node(stride * size) {
            self.intra_node
        } else {
            self.inter_node
        }
    }

    /// The link a ring collective crosses over a group spanning `span` devices, at least
    /// `per_node()` of whose ranks share each machine it reaches (asked only when it spans
    /// machines). Across machines NCCL runs a ring per network interface, each entering and
    /// leaving a machine through its own, so with an interface per device, and no other
    /// group's traffic on them meanwhile, the group moves that many devices' network
    /// bandwidth, up to what the links within a machine carry.
    pub fn ring(&self, span: usize, per_node: impl FnOnce() -> usize) -> Link {
        if self.within_node(span) {
            return self.intra_node;
        }
        let bandwidth = per_node().max(1) as f64 * self.inter_node.bandwidth;
        Link {
            bandwidth: bandwidth.min(self.intra_node.bandwidth),
            ..self.inter_node
        }
    }

    /// Whether `span` devices, starting at a multiple of `span`, lie in one machine.
    fn within_node(&self, span: usize) -> bool {
        span <= self.devices_per_node && self.devices_per_node.is_multiple_of(span)
    }
}
