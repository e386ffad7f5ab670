//! The core of miles: settings, devices, the memory manager with its backup stores, and
//! everything the training backends and the rollout engine share.

pub mod backend;
pub mod comm;
pub mod config;
pub mod device;
pub mod memory;
pub mod metrics;
pub mod model;
pub mod ops;
pub mod orchestrator;
pub mod store;

pub use backend::{
    BackendError, Batch, DeviceWeights, NamedTensor, OffloadStats, RankOffload, StepStats,
    TrainBackend, WeightBucket, WeightSink,
};
pub use comm::{CommError, Communicator, HostGroup, LaunchEnv, LocalComm, exchange_id};
pub use config::{
    AdvantageEstimator, ConfigError, DeviceChoice, InvalidSettings, MomentDtype, OffloadTarget,
    RawSettings, RolloutOffloadLevel, Settings, SettingsError, Source, Sources, Task,
    TrainBackendKind, UnknownChoice,
};
pub use device::{
    AddressRange, CudaDevice, CudaOptions, Device, DeviceAddress, DeviceError, DeviceKind, Fence,
    HostAllocation, HostBuffer, HostDevice, HostView, MemoryInfo, PendingWork, Pod, ViewAccess,
    ViewClaim,
};
pub use memory::{
    BackupPolicy, Buffer, BufferView, BufferViewMut, DiskSettings, FreeError, ManagerSettings,
    MemoryError, MemoryManager, MemoryTag, OffloadReport, RegionState,
};
pub use metrics::{MemoryTimeline, MetricsError, MetricsWriter, Phase, StepMetrics};
pub use orchestrator::{
    Critic, EngineError, LoopConfig, Orchestrator, OrchestratorError, RolloutEngine, RunSummary,
    Sample, Sampling,
};
pub use store::{DiskBackup, DiskStore, HostPool, RankDir, StoreError};
