//! The core of miles: settings, devices, the memory manager with its backup stores, and
//! everything the training backends and the rollout engine share.

pub mod config;
pub mod device;
pub mod memory;
pub mod model;
pub mod ops;
pub mod store;

pub use config::{
    AdvantageEstimator, ConfigError, DeviceChoice, InvalidSettings, MomentDtype, OffloadTarget,
    RawSettings, RolloutOffloadLevel, Settings, SettingsError, Source, Sources, TrainBackend,
    UnknownChoice,
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
pub use store::{DiskBackup, DiskStore, HostPool, StoreError};
