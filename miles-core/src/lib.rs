//! The core of miles: settings, devices, the memory manager with its backup stores, and
//! everything the training backends and the rollout engine share.

pub mod device;
pub mod memory;
pub mod store;

pub use device::{
    AddressRange, Device, DeviceAddress, DeviceError, DeviceKind, Fence, HostAllocation,
    HostBuffer, HostDevice, HostView, MemoryInfo, PendingWork, Pod, ViewAccess, ViewClaim,
};
pub use memory::{
    BackupPolicy, Buffer, BufferView, BufferViewMut, DiskSettings, FreeError, ManagerSettings,
    MemoryError, MemoryManager, MemoryTag, OffloadReport, RegionState,
};
pub use store::{DiskBackup, DiskStore, HostPool, StoreError};
