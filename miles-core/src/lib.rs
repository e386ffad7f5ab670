//! The core of miles: settings, devices, the memory manager with its backup stores, and
//! everything the training backends and the rollout engine share.

#![deny(unsafe_code)]

pub mod backend;
pub mod choice;
pub mod comm;
pub mod config;
// The one room of miles allowed raw FFI: driver calls, mmap, the C ABI of the drop-in.
#[allow(unsafe_code)]
pub mod device;
pub mod memory;
pub mod metrics;
pub mod model;
pub mod ops;
pub mod orchestrator;
pub mod store;

pub use backend::{
    BackendError, Batch, Critic, DeviceWeights, EngineError, NamedTensor, OffloadStats,
    RankOffload, RolloutEngine, Sample, Sampling, StepStats, TrainBackend, WeightBucket,
    WeightSink,
};
pub use comm::{CommError, Communicator, HostGroup, LaunchEnv, LocalComm, exchange_id};
pub use config::{
    AdvantageEstimator, ConfigError, DeviceChoice, InvalidSettings, MomentDtype, OffloadTarget,
    OptimizerStream, RawSettings, RolloutOffload, RolloutOffloadLevel, Settings, SettingsError,
    Source, Sources, Task, TrainBackendKind, TrainOffload, UnknownChoice,
};
pub use device::{
    AddressRange, CpuDevice, CudaDevice, CudaOptions, Device, DeviceAddress, DeviceError,
    DeviceKind, Fence, HostAllocation, HostBuffer, HostView, MemoryInfo, PendingWork, Pod,
    ViewAccess, ViewClaim,
};
pub use memory::{
    BackupPolicy, Buffer, BufferView, BufferViewMut, DiskSettings, FreeError, ManagerSettings,
    MemoryError, MemoryManager, MemoryTag, OffloadReport, RegionState,
};
pub use metrics::{MemoryTimeline, MetricsError, MetricsWriter, Phase, StepMetrics};
pub use orchestrator::{LoopConfig, Orchestrator, OrchestratorError, RunSummary};
pub use store::{DiskBackup, DiskStore, HostPool, RankDir, StoreError};
